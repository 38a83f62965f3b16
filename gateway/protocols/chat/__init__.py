"""OpenAI chat completions and completions: the requests the gateway checks (`protocol.py`) and
what it reads from the answers and their streams (`capture.py`)."""
