"""One wording for cut-short input files: which file, which part of it, how many bytes were expected
and how many are present. Used by the GGUF and safetensors readers (their own error classes)."""
from __future__ import annotations

import os


class TruncatedFileError(ValueError):
    """A read ran past the end of a file (it shrank, or was cut short, after it was opened)."""


def cut_message(path: str, section: str, what: str, offset: int, need: int, size: int) -> str:
    """'{path}: truncated in the {section}: {what} needs {need} bytes at offset {offset}, but the file
    ends at {size} bytes ({have} of {need} present)'."""
    have = max(0, min(need, size - offset))
    return (f"{path}: truncated in the {section}: {what} needs {need} bytes at offset {offset}, but the file "
            f"ends at {size} bytes ({have} of {need} present)")


def file_kind(path: str) -> str:
    """'a directory', 'a FIFO', 'a character device', ... for messages refusing non-regular files (no open:
    opening a FIFO would block)."""
    import stat
    m = os.stat(path).st_mode
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(m):
            return name
    return "not a regular file"
