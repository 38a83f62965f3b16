"""Files every part of DARL writes the same way: whole or not at all (`write_atomically`)."""

from darl.files.atomic import write_atomically

__all__ = ["write_atomically"]
