"""Durable file-system steps shared by the generator's writes and the runtime's checkpoint saves.

A rename is atomic but not durable until the folder that holds it is flushed, and a file's
bytes are not on disk until the file is; :func:`fsync_path` and :func:`fsync_tree` do
both. :func:`exchange` swaps two folders in one step (Linux ``renameat2`` with
``RENAME_EXCHANGE``), which is how a checkpoint folder is replaced without any instant at
which it is missing or mixed. No torch, no libcst: the generator and the runtime both use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

__all__ = ["exchange", "fsync_path", "fsync_tree"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# The answers of a kernel, C library or file system without RENAME_EXCHANGE: the caller falls back.
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush ``path`` (a file's bytes, or a folder's entries) to disk.

    Windows cannot open a folder for flushing (nor needs to: its renames are recorded with
    the files): there a folder is skipped.
    """
    folder = Path(path).is_dir()
    if folder and os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if folder else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike[str]) -> None:
    """Flush every file under ``folder``, then every folder, deepest first, ``folder`` last."""
    folders = []
    for root, _, files in os.walk(folder):
        folders.append(root)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                fsync_path(path)
    for root in reversed(folders):
        fsync_path(root)


def _renameat2() -> object | None:
    """glibc's ``renameat2`` (2.28 and newer), or None on other C libraries and systems."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _renameat2()


def exchange(first: str | os.PathLike[str], second: str | os.PathLike[str]) -> bool:
    """Swap the entries ``first`` and ``second`` atomically; False when this system cannot.

    Both must exist, on one file system. Any other failure is an ``OSError``.
    """
    if _RENAMEAT2 is None:
        return False
    a, b = os.fsencode(os.fspath(first)), os.fsencode(os.fspath(second))
    if _RENAMEAT2(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), os.fspath(first), None, os.fspath(second))
