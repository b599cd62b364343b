"""Replacing a checkpoint folder so that at every instant it holds the complete old or the complete new one.

The new checkpoint is written into a sibling folder ``.<name>.hpgen-new-<random>``, every
file and folder of it flushed to disk, and swapped with the target in one step
(``renameat2(RENAME_EXCHANGE)``, :func:`hpgen.core.durable.exchange`); the old contents, now
under the temporary name, are deleted after. Where the system cannot exchange two folders
(not Linux, some network file systems) the swap is two renames: the target to
``.<name>.hpgen-old-<random>``, then the new folder to the target. A crash between those
two leaves the target missing and the complete old checkpoint beside it, which
:func:`recover` renames back; the next save and ``from_pretrained`` call it. Whatever an
interrupted save left beside the target (a half-written new folder, an old one not yet
deleted) the next save deletes.

One saver at a time per folder: two jobs saving into the same folder at once would delete
each other's temporary folders.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hpgen.core import durable

__all__ = ["clean_leftovers", "leftovers", "recover", "replacing"]

NEW = "hpgen-new"
OLD = "hpgen-old"


def _siblings(target: Path, kind: str) -> list[Path]:
    found = list(target.parent.glob(f".{target.name}.{kind}-*")) if target.parent.is_dir() else []
    return sorted(found, key=lambda path: path.lstat().st_mtime_ns)


def leftovers(target: str | os.PathLike[str]) -> list[Path]:
    """What interrupted saves of ``target`` left beside it (temporary new folders, displaced old ones)."""
    target = Path(target)
    return _siblings(target, NEW) + _siblings(target, OLD)


def recover(target: str | os.PathLike[str]) -> bool:
    """Put the displaced old checkpoint back where a save crashed between its two renames; True if it did.

    Only when ``target`` is missing: otherwise the swap finished and what is beside it is a leftover.
    """
    target = Path(target)
    if target.exists() or target.is_symlink():
        return False
    displaced = _siblings(target, OLD)
    if not displaced:
        return False
    try:
        os.rename(displaced[-1], target)  # the newest: the one the crashed save displaced
    except OSError:
        if target.is_dir():  # another rank of the job recovered it first
            return False
        raise
    durable.fsync_path(target.parent)
    return True


def clean_leftovers(target: str | os.PathLike[str]) -> None:
    """Delete what interrupted saves of ``target`` left beside it (after :func:`recover`)."""
    for path in leftovers(target):
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def replacing(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty folder beside ``target``; on a clean exit it becomes ``target``, atomically.

    ``target`` that is a symbolic link is resolved: the folder it points at is replaced.
    On an error nothing changes but the temporary folder, which is deleted.
    """
    target = Path(os.path.realpath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    clean_leftovers(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{NEW}-", dir=target.parent))
    try:
        os.chmod(staging, _folder_mode(target))
        yield staging
        durable.fsync_tree(staging)
        _swap(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # after a swap: the old contents, or nothing


def _folder_mode(target: Path) -> int:
    """The target's permissions, or a new folder's (``mkdtemp`` makes private ones)."""
    if target.is_dir():
        return target.stat().st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _swap(staging: Path, target: Path) -> None:
    """Make ``staging`` the target; the old contents end under ``staging``'s name (or nowhere)."""
    if not target.exists():
        os.rename(staging, target)
    elif not durable.exchange(staging, target):
        displaced = target.parent / f".{target.name}.{OLD}-{staging.name.rsplit('-', 1)[-1]}"
        os.rename(target, displaced)
        durable.fsync_path(target.parent)  # the old checkpoint is findable under its new name first
        os.rename(staging, target)
        durable.fsync_path(target.parent)
        shutil.rmtree(displaced)
        return
    durable.fsync_path(target.parent)
