"""Opening a path a user gave (a shard, a manifest, a medium): regular files only.

A FIFO blocks `open()` until some writer comes (forever, and a signal handler
that only sets a flag does not end the wait: the open is retried); a device can
be endless or block the same way. So a path is opened without blocking
(O_NONBLOCK: an open of a FIFO for reading returns at once) and what was opened
is checked with fstat: anything but a regular file is closed again unread and
refused. The check is of the open file itself, not of a stat before the open,
so a name swapped in between cannot get past it.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFile(OSError):
    """A path that names something other than a regular file (a FIFO, a device, a socket, a
    folder). An OSError, so the callers' handlers of unreadable files report it."""

    def __init__(self, path: str, kind: str):
        super().__init__(errno.EINVAL, f"is {kind}, not a regular file; only regular files are read", path)

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def file_kind(mode: int) -> str:
    """'a FIFO (named pipe)', 'a folder', ... of an st_mode."""
    if stat.S_ISDIR(mode):
        return "a folder"
    return next((name for test, name in _KINDS if test(mode)), f"of file type {stat.S_IFMT(mode):#o}")


def check_regular(path: str, mode: int) -> None:
    """Raise NotRegularFile unless `mode` (an st_mode of `path`) is a regular file's."""
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, file_kind(mode))


def _opener(path: str, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))


def open_regular(path: str) -> BinaryIO:
    """`open(path, "rb")` of a regular file (symbolic links followed); without blocking,
    anything else (a folder included) raises NotRegularFile, an OSError naming the path."""
    try:
        fh = open(path, "rb", opener=_opener)
    except IsADirectoryError:
        raise NotRegularFile(path, "a folder") from None
    try:
        check_regular(path, os.fstat(fh.fileno()).st_mode)
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fh.fileno(), True)  # O_NONBLOCK means nothing to a regular file; cleared all the same
    except BaseException:
        fh.close()
        raise
    return fh
