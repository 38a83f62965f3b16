"""moto's S3 emulator as a process of its own, so a benchmark can count its CPU apart from
the gateway's (a real S3 is remote: its cost is not the gateway's). Creates one bucket and
writes `{"url": ..., "bucket": ...}` to the ready file once serving.

    python -m bench.s3_emulator --ready-file F [--bucket NAME]
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

import boto3
from moto.server import ThreadedMotoServer

from darl.files import write_ready_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--bucket", default="darl-bench")
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id="emulator",
        aws_secret_access_key="emulator",
        region_name="us-east-1",
    ).create_bucket(Bucket=args.bucket)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    write_ready_file(args.ready_file, {"url": url, "bucket": args.bucket})
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
