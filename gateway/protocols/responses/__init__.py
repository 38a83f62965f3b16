"""The OpenAI Responses API: its requests (`protocol.py`), the Response a chat answer becomes
(`answer.py`), their translation to and from a chat completion (`translation.py`), and the
event stream (`stream.py`), which reads the answer module, never the translation."""
