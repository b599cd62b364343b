"""A transformers checkpoint folder's safetensors files, read box by box.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> file), as ``save_pretrained(..., max_shard_size=...)``
writes them. :class:`CheckpointFiles` reads each file's header once and hands out boxes
of a tensor (``tensor[a0:b0, a1:b1]``), each a view of a mapping of just the bytes it
spans (:mod:`hpgen.runtime.checkpoint.file_maps`): this rank's rows, columns or experts, nothing else.

:meth:`CheckpointFiles.view` gives a box to keep as it is (a parameter on the CPU in the
file's dtype), as transformers' own loader leaves its CPU parameters: nothing is copied,
the mapping is copy-on-write, and only pages that are used become resident (an
embedding's rows that no token looks up never do). :meth:`CheckpointFiles.read` gives
any box (strided for columns) to copy into a tensor of any dtype and device, casting on
the way; its mapping is unmapped once the copy is made, so the file pages it touched (all
of a tensor's pages for columns, ``S(1)``) leave the process at once.

Every file is opened (its header read) when the folder is, so a truncated file, a file
that is not safetensors, a shard the index names but the folder lacks, or a tensor the
index places in a file that does not hold it is a :class:`ParallelizeError` naming the
file and what is wrong before any tensor is read; each rank reads the files itself, so
each raises it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hpgen.runtime.checkpoint.file_maps import StoredTensor, box_view, read_header
from hpgen.runtime.errors import ParallelizeError

__all__ = ["CheckpointFiles", "INDEX_FILE", "Index", "SINGLE_FILE", "describe_unreadable", "open_safetensors"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

Index = tuple[tuple[int, int], ...]
"""A box of a tensor: ``[start, stop)`` per dim (``()``: all of it)."""

VIEW_MIN_BYTES = 2**16
"""Contiguous boxes at least this large are kept as views of the file; smaller ones are copied.

A view costs a mapping (a kernel object, and the two file pages it starts and ends in);
below 64 KiB (norm weights, biases) a copy costs less."""


def describe_unreadable(path: Path, error: Exception) -> str:
    """Why safetensors cannot open ``path``, in words: truncated, not a safetensors file, or its own reason."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as stream:
            head = stream.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            header = stream.read(length) if length is not None and length <= min(size - 8, 100 * 2**20) else None
    except OSError as failure:
        return f"cannot be read: {failure.strerror or failure}"
    if length is None:
        return f"is not a safetensors file: {size} bytes, too short for a header"
    if length > 100 * 2**20:
        return "is not a safetensors file: its first 8 bytes are no header length"
    if header is None:
        return f"is truncated: its header alone needs {length + 8} bytes and the file has {size}"
    try:
        described = json.loads(header)
        ends = [entry["data_offsets"][1] for key, entry in described.items() if key != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return "is not a safetensors file: its header is not safetensors' JSON"
    data, needed = size - 8 - length, max(ends, default=0)
    if data < needed:
        return f"is truncated: its tensors need {needed} bytes of data and the file holds {data}"
    if data > needed:
        return f"has {data - needed} bytes after the last tensor its header describes"
    return f"cannot be opened by safetensors: {error}"


def open_safetensors(path: Path) -> Any:
    """``safe_open(path)``, or a :class:`ParallelizeError` naming the file and what is wrong with it."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except FileNotFoundError:
        raise ParallelizeError(f"{path}: no such file") from None
    except Exception as error:  # safetensors' own SafetensorError, an OSError...
        raise ParallelizeError(f"{path} {describe_unreadable(path, error)}") from None


class CheckpointFiles:
    """Tensor name -> boxes of it, over the safetensors files of a checkpoint folder.

    Use as a context manager (or call :meth:`close`) so the files are closed after loading;
    the views handed out stay valid.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self._where = self._weight_map()
        # file -> descriptor the mappings are made from (opened here: reading threads share them)
        self._fds = {name: os.open(self.folder / name, os.O_RDONLY) for name in sorted(set(self._where.values()))}
        self._stored: dict[str, StoredTensor] = {}
        for name, fd in self._fds.items():
            stored = read_header(fd)
            self._stored.update((key, stored[key]) for key, file in self._where.items() if file == name)

    def _weight_map(self) -> dict[str, str]:
        single, index = self.folder / SINGLE_FILE, self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as error:
                raise ParallelizeError(f"{index}: not a safetensors index (no weight_map): {error}") from None
            missing = sorted({f for f in weight_map.values() if not (self.folder / f).is_file()})
            if missing:
                raise ParallelizeError(f"{index} names shard files that are not in {self.folder}: {', '.join(missing)}")
            self._check_shards(index, weight_map)
            return dict(weight_map)
        if single.is_file():
            with open_safetensors(single) as handle:
                return dict.fromkeys(handle.keys(), SINGLE_FILE)
        found = sorted(p.name for p in self.folder.iterdir()) if self.folder.is_dir() else None
        raise ParallelizeError(
            f"{self.folder} is not a safetensors checkpoint folder: it has neither {SINGLE_FILE} nor {INDEX_FILE}"
            + (f" (it holds {', '.join(found[:8])}{'...' if len(found) > 8 else ''})" if found else " (no such folder)")
        )

    def _check_shards(self, index: Path, weight_map: dict[str, str]) -> None:
        """Open every shard's header: each readable, and holding the tensors the index puts in it."""
        for name in sorted(set(weight_map.values())):
            with open_safetensors(self.folder / name) as handle:
                held = set(handle.keys())
            absent = sorted(key for key, file in weight_map.items() if file == name and key not in held)
            if absent:
                raise ParallelizeError(
                    f"{index} places {len(absent)} tensor(s) in {self.folder / name}, which does not hold them: "
                    f"{', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''}"
                )

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._stored[key].shape

    def dtype(self, key: str) -> torch.dtype | None:
        """The torch dtype ``key`` is stored in (None for a safetensors dtype torch lacks)."""
        return self._stored[key].dtype

    def read(self, key: str, index: Index = ()) -> torch.Tensor:
        """The box ``index`` of ``key``: a view of the file, strided unless the box is one run of
        bytes; to keep it, copy it (or take :meth:`view`)."""
        stored, name = self._stored[key], self._where[key]
        if stored.dtype is None:
            raise ParallelizeError(f"{self.folder / name}: {key} is stored as {stored.dtype_name}, which torch lacks")
        return box_view(self._fds[name], stored, index)

    def view(self, key: str, index: Index = ()) -> torch.Tensor | None:
        """The box as a tensor to keep (a contiguous view of the file), or None when it is not one
        run of bytes or is under ``VIEW_MIN_BYTES``: then copy :meth:`read`'s."""
        box = self.read(key, index)
        if box.is_contiguous() and box.numel() * box.element_size() >= VIEW_MIN_BYTES:
            return box
        return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)  # the views' mappings outlive it
        self._fds.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
