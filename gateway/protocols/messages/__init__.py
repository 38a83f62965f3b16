"""The Anthropic Messages API: its requests (`protocol.py`), their translation to and from a chat
completion (`translation.py`), and the event stream (`stream.py`)."""
