"""The trajectory store: the interface (`base.py`), the call record (`record.py`), a directory
(`directory.py`) or S3 (`s3.py`), the prompt-delta codec both write (`codec.py`), and the URL
that picks one (`url.py`)."""
