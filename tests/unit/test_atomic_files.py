"""`write_atomically` (files/atomic.py): a reader sees the old content or the new, whole, while
threads and processes write one path at once; a write that fails leaves the old content and no
temporary file; the file gets the permissions the umask gives a new file."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from darl.files import write_atomically, write_ready_file

# Large enough that a write in place is seen half-done by a reader polling the file.
PAD = "x" * 256 * 1024
WRITES = 40

# A process that writes the same path over and over, each content valid JSON of known length.
WRITER = """
import json, sys
from pathlib import Path
from darl.files import write_atomically
path, name, writes, pad = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), "x" * int(sys.argv[4])
for n in range(writes):
    write_atomically(path, json.dumps({"writer": name, "n": n, "pad": pad}))
"""


def _content(writer: str, n: int) -> str:
    return json.dumps({"writer": writer, "n": n, "pad": PAD})


def _leftovers(directory: Path, keep: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != keep)


def test_concurrent_writers_never_show_a_reader_half_a_file(tmp_path: Path):
    path = tmp_path / "state.json"
    write_atomically(path, _content("first", 0))
    done = threading.Event()
    seen: list[tuple[str, int]] = []
    torn: list[str] = []

    def read_until_done() -> None:
        while not done.is_set():
            text = path.read_text()
            try:
                record = json.loads(text)
            except ValueError:
                torn.append(text[:40])
                continue
            if record["pad"] != PAD:
                torn.append(f"{record['writer']} {record['n']}: pad of {len(record['pad'])}")
            seen.append((record["writer"], record["n"]))

    def write_in_thread(name: str) -> None:
        for n in range(WRITES):
            write_atomically(path, _content(name, n))

    reader = threading.Thread(target=read_until_done)
    reader.start()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), f"process-{i}", str(WRITES), str(len(PAD))]
        )
        for i in range(2)
    ]
    threads = [threading.Thread(target=write_in_thread, args=(f"thread-{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for process in processes:
        assert process.wait(timeout=120) == 0
    done.set()
    reader.join()

    assert torn == []
    assert len(seen) > 1
    final = json.loads(path.read_text())
    assert final["n"] == WRITES - 1 and final["pad"] == PAD
    assert _leftovers(tmp_path, keep=path.name) == []


def test_a_write_the_filesystem_refuses_half_way_keeps_the_old_content(tmp_path: Path):
    """A file-size limit makes the write fail after its first bytes are on disk (EFBIG)."""
    path = tmp_path / "state.json"
    path.write_text("old")
    script = """
import resource, signal, sys
from pathlib import Path
from darl.files import write_atomically
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    write_atomically(Path(sys.argv[1]), b"new" * 100_000)
except OSError as err:
    print(err.errno)
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == str(errno.EFBIG), done.stderr
    assert path.read_text() == "old"
    assert _leftovers(tmp_path, keep=path.name) == []


def test_a_failed_rename_or_unencodable_text_keeps_the_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "state.json"
    path.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_atomically(path, "half \ud800 a surrogate")

    def refuse(src: object, dst: object) -> None:
        raise OSError("rename refused")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="rename refused"):
        write_atomically(path, "new")
    assert path.read_text() == "old"
    assert _leftovers(tmp_path, keep=path.name) == []


def test_a_missing_directory_is_an_error_not_created(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "absent" / "state.json", "new")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o027])
def test_the_file_gets_the_permissions_the_umask_gives(tmp_path: Path, umask: int):
    path = tmp_path / "state.json"
    path.write_text("old")
    path.chmod(0o600)
    old = os.umask(umask)
    try:
        write_atomically(path, b"new")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert path.read_bytes() == b"new"


def test_text_is_utf8_and_durable_syncs_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "state.txt"
    order: list[str] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (order.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append("replace"), replace(a, b))[1])
    write_atomically(path, "ünïcode")
    assert order == ["replace"]
    assert path.read_bytes() == "ünïcode".encode()
    write_atomically(path, "again", durable=True)
    assert order == ["replace", "fsync", "replace"]


def test_a_ready_file_carries_the_writers_pid_and_makes_its_directory(tmp_path: Path):
    path = tmp_path / "run" / "ready" / "gateway.json"
    write_ready_file(path, {"url": "http://127.0.0.1:1"})
    assert json.loads(path.read_text()) == {"url": "http://127.0.0.1:1", "pid": os.getpid()}
