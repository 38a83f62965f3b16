"""Files every part of DARL writes the same way: whole or not at all (`write_atomically`), and
a process's ready file (`write_ready_file`)."""

from darl.files.atomic import write_atomically
from darl.files.ready import write_ready_file

__all__ = ["write_atomically", "write_ready_file"]
