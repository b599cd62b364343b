"""Writing results: the one file writer, unified diffs, and the report that owns exit codes.

Every file hpgen writes (``hpgen lower -o``, ``hpgen plan -o``, ``[tool.hpgen]`` targets)
goes through :func:`write_file`, which respects what stands at the path: a regular file
is replaced atomically, a symbolic link is followed (its target replaced, the link kept),
and a character device or FIFO (``/dev/stdout``, a named pipe) is written through, as
``cat >`` does, never replaced by a rename.

As in black, one report object counts what happened to each file, and only its
``return_code`` decides the exit status: 0 success or up to date, 1 a ``--check`` found
a difference (or, with ``--exit-non-zero-on-write``, a file was written), 2 bad input.
"""

from __future__ import annotations

import difflib
import errno
import glob
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hpgen.core import durable
from hpgen.core.errors import HpgenError

EXIT_OK = 0
EXIT_STALE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 123  # an hpgen bug, as black reports one


@dataclass
class Report:
    """What one run did to its targets."""

    check: bool = False
    fail_on_write: bool = False  # a written file is exit 1 (``--exit-non-zero-on-write``, for pre-commit)
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    internal_errors: list[str] = field(default_factory=list)

    @property
    def return_code(self) -> int:
        if self.internal_errors:
            return EXIT_INTERNAL
        if self.failed:
            return EXIT_BAD_INPUT
        if (self.check and self.stale) or (self.fail_on_write and self.written):
            return EXIT_STALE
        return EXIT_OK

    def summary(self) -> str:
        """One line: ``2 written, 3 unchanged`` or ``1 stale, 4 up to date, 1 failed``."""
        counts = (
            [(self.stale, "stale"), (self.unchanged, "up to date")]
            if self.check
            else [(self.written, "written"), (self.unchanged, "unchanged")]
        )
        counts += [(self.failed, "failed"), (self.internal_errors, "internal errors")]
        return ", ".join(f"{len(names)} {what}" for names, what in counts if names) or "nothing to do"


def read_existing(path: str | os.PathLike[str]) -> bytes | None:
    """The current bytes of ``path``, or ``None`` when there is no such file."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def write_file(path: str | os.PathLike[str], data: bytes) -> bool:
    """Write ``data`` at ``path``; False (nothing touched) when a regular file already holds it.

    - a regular file, or nothing yet: replaced atomically (a temporary file and a rename);
    - a symbolic link: followed, and the file it leads to replaced atomically (a dangling
      link's target is created); the link stays a link;
    - a character device or a FIFO (``/dev/null``, ``/dev/stdout``, ``mkfifo``): written
      through, as ``cat >`` writes, since a rename would put a regular file in its place;
      a FIFO waits for its reader, as ``cat`` does;
    - anything else (a block device, a socket): an ``HpgenError``, nothing written.
    """
    target = Path(path)
    try:
        found = os.stat(target)  # follows links: what a write would reach
    except FileNotFoundError:
        found = None
    if found is not None and not stat.S_ISREG(found.st_mode):
        if stat.S_ISCHR(found.st_mode) or stat.S_ISFIFO(found.st_mode):
            _write_through(target, data)
            return True
        if stat.S_ISDIR(found.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
        kind = "a block device" if stat.S_ISBLK(found.st_mode) else "a socket" if stat.S_ISSOCK(found.st_mode) else "not a file"
        raise HpgenError(
            f"is {kind}; hpgen replaces regular files and writes through character devices and FIFOs",
            file=str(target),
        )
    if target.is_symlink():
        resolved = Path(os.path.realpath(target))
        if found is not None and not _is_file(resolved, found):
            # a link the kernel resolves otherwise than its text says (/proc/self/fd/N of a deleted file)
            _write_through(target, data)
            return True
        target = resolved
    return _atomic_replace(target, data)


def _is_file(path: Path, found: os.stat_result) -> bool:
    try:
        return os.path.samestat(os.stat(path), found)
    except OSError:
        return False


def _write_through(target: Path, data: bytes) -> None:
    """Write into what is already there, without creating, truncating or renaming anything."""
    fd = os.open(target, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _atomic_replace(path: str | os.PathLike[str], data: bytes) -> bool:
    """Write ``data`` through a temporary file in the target folder and a rename.

    Returns False (and leaves the file and its mtime alone) when the bytes are already
    there. Missing parent folders are created; a failure at any point leaves the previous
    file intact and removes the folders this call created. The bytes and the rename are
    flushed to disk (the file, then its folder), and temporary files that a killed run
    left for this target are deleted. ``path`` is a regular file or nothing
    (:func:`write_file` sees to it).
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    _remove_leftovers(target, folder)
    if read_existing(target) == data:
        return False
    created = _make_parents(folder)
    try:
        _write_through_temporary(target, folder, data)
    except BaseException:
        for made in created:  # deepest first; only folders this call made, and only if still empty
            try:
                made.rmdir()
            except OSError:
                break
        raise
    return True


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing ancestors; return the ones created, deepest first."""
    missing = []
    current = folder
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    created = []
    for made in reversed(missing):
        try:
            made.mkdir()
        except FileExistsError:  # made meanwhile by another writer: not ours to remove
            continue
        except BaseException:
            for ours in reversed(created):
                ours.rmdir()
            raise
        created.append(made)
    return list(reversed(created))


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}."


_TEMPORARY_SUFFIX = ".hpgen-tmp"


def _remove_leftovers(target: Path, folder: Path) -> None:
    """Delete the temporary files of ``target`` that an interrupted (killed) write left behind."""
    if not folder.is_dir():
        return
    # mkstemp's names: the prefix, 8 random characters, the suffix
    for leftover in folder.glob(f"{glob.escape(_temporary_prefix(target))}{'?' * 8}{_TEMPORARY_SUFFIX}"):
        try:
            leftover.unlink()
        except OSError:
            pass


def _write_through_temporary(target: Path, folder: Path, data: bytes) -> None:
    fd, temporary = tempfile.mkstemp(prefix=_temporary_prefix(target), suffix=_TEMPORARY_SUFFIX, dir=folder)
    try:
        try:
            stream = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            raise
        with stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        if target.exists():
            os.chmod(temporary, target.stat().st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, target)
        durable.fsync_path(folder)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


def unified_diff(before: str, after: str, before_name: str, after_name: str) -> str:
    """A unified diff of two texts, line endings kept, empty when they are equal."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=before_name,
        tofile=after_name,
    )
    text = ""
    for line in lines:
        text += line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n"
    return text
