"""The gateway's journal of its own state (admin state, lifecycle, outages): the logic
(`base.py`) over a directory (`directory.py`) or the S3 store's bucket (`s3.py`)."""
