"""A transformers checkpoint folder's safetensors files, opened for slice reads.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> file), as ``save_pretrained(..., max_shard_size=...)``
writes them. :class:`CheckpointFiles` opens each file once with ``safetensors.safe_open``
and hands out ``get_slice`` handles: indexing one (``handle[0:64, :]``) reads only those
elements, which is how every rank reads just its shard.

A large slice that is one contiguous run of bytes (a whole tensor, or rows of it:
``S(0)``) is a view of the file mapped with ``mmap``, as transformers' own loader leaves
its CPU parameters: nothing is copied, the mapping is copy-on-write, and only pages that
are used become resident (an embedding's rows that no token looks up never do). Every
other slice is copied out of a second mapping of the file that :meth:`CheckpointFiles.drop_copies`
unmaps once the tensors copied out of it since the last unmapping reach ``COPY_WINDOW_BYTES``,
so the file pages it touched (all of a tensor's pages for columns, ``S(1)``) leave the
rank's memory soon, without reopening every file after every parameter (a header parsed
again each time). Small slices are copied rather than viewed because the kernel maps file
pages in folios of up to a few MiB: a view of a small slice can make a much larger part
of the tensor resident.

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

from hpgen.runtime.errors import ParallelizeError

__all__ = ["CheckpointFiles", "INDEX_FILE", "SINGLE_FILE", "describe_unreadable", "open_safetensors"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


VIEW_MIN_BYTES = 4 * 2**20
"""Contiguous slices at least this large are views of the mapped file; smaller ones are copied.

4 MiB: a few folios, so the pages a view makes resident beyond its own are a few percent
of it. Against 32 MiB, on a 40-layer Llama at tp 2 (``benchmarks/checkpoint_memory.py``):
peak memory +6%, CPU time of loading -35% (together with the copy window below)."""

COPY_WINDOW_BYTES = 32 * 2**20
"""Tensor bytes copied out of the copying mappings after which :meth:`CheckpointFiles.drop_copies` unmaps them."""

_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


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


def _range(s: slice, n: int) -> tuple[int, int]:
    return (s.start or 0, n if s.stop is None else s.stop)


def _contiguous(shape: list[int], index: tuple[slice, ...]) -> bool:
    """Whether ``tensor[index]`` is one run of bytes: leading dims of size 1, one cut dim, then whole dims."""
    if not index:
        return True
    cut = next((d for d, (s, n) in enumerate(zip(index, shape)) if _range(s, n) != (0, n)), None)
    if cut is None:
        return True
    before = all(n == 1 for n in shape[:cut])
    return before and all(_range(s, n) == (0, n) for s, n in zip(index[cut + 1 :], shape[cut + 1 :]))


def _nbytes(shape: list[int], index: tuple[slice, ...], dtype: str) -> int:
    count = 1
    for d, n in enumerate(shape):
        a, b = _range(index[d], n) if index else (0, n)
        count *= b - a
    return count * _ITEM_BYTES.get(dtype, 1)


class CheckpointFiles:
    """Tensor name -> lazy slice handle over the safetensors files of a checkpoint folder.

    Use as a context manager (or call :meth:`close`) so the files are closed after loading.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self._where = self._weight_map()
        self.views = True  # False: copy every slice (a parameter going to another device or dtype)
        self._open: dict[str, Any] = {}  # file -> handle that views are taken from
        self._copying: dict[str, Any] = {}  # file -> handle that copies are read from
        self._touched = 0  # tensor bytes copied out of ``_copying`` since it was last unmapped

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

    def _handle(self, key: str, kind: str) -> Any:
        name = self._where[key]
        handles = self._open if kind == "view" else self._copying
        handle = handles.get(name)
        if handle is None:
            handle = handles[name] = open_safetensors(self.folder / name)
        return handle

    def slice(self, key: str) -> Any:
        """The ``get_slice`` handle of ``key`` (``.get_shape()``, ``.get_dtype()``, ``[...]``)."""
        return self._handle(key, "view").get_slice(key)

    def read(self, key: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """The elements ``index`` (one slice per dim; all of them for ``()``) of tensor ``key``."""
        mapped = self.slice(key)
        shape = mapped.get_shape()
        large = _nbytes(shape, index, mapped.get_dtype()) >= VIEW_MIN_BYTES
        if self.views and large and _contiguous(shape, index):
            return mapped[index] if index else mapped[...]
        source = self._handle(key, "copy").get_slice(key)
        view = source[index] if index else source[...]
        # the pages touched: the slice's for rows, every page of the tensor for columns
        self._touched += _nbytes(shape, index if _contiguous(shape, index) else (), mapped.get_dtype())
        return torch.empty(view.shape, dtype=view.dtype).copy_(view)

    def drop_copies(self, *, now: bool = False) -> None:
        """Unmap the files copies were read from (their touched pages stop counting as ours), once
        ``COPY_WINDOW_BYTES`` were copied since the last time, or ``now``."""
        if not now and self._touched < COPY_WINDOW_BYTES:
            return
        for handle in self._copying.values():
            handle.__exit__(None, None, None)
        self._copying.clear()
        self._touched = 0

    def close(self) -> None:
        self.drop_copies(now=True)
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)
