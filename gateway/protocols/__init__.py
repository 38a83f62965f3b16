"""The model APIs agents speak, each translated to one chat completion (`translation.py`), so the
record and the trainer stay protocol-blind: `chat/` (OpenAI chat and completions, the record's
own shape), `responses/` (OpenAI Responses), `messages/` (Anthropic Messages). What their
streams share sits below them all (`stream.py`)."""
