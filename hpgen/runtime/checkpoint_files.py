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
unmaps after each parameter, so the file pages it touched (all of a tensor's pages for
columns, ``S(1)``) leave the rank's memory at once. Small slices are copied rather than
viewed because the kernel maps file pages in folios of up to a few MiB: a view of a
small slice can make the whole tensor resident.
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

__all__ = ["CheckpointFiles", "SINGLE_FILE", "INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


VIEW_MIN_BYTES = 32 * 2**20
"""Contiguous slices at least this large are views of the mapped file; smaller ones are copied."""

_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


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
            return dict(weight_map)
        if single.is_file():
            with safe_open(single, framework="pt", device="cpu") as handle:
                return dict.fromkeys(handle.keys(), SINGLE_FILE)
        found = sorted(p.name for p in self.folder.iterdir()) if self.folder.is_dir() else None
        raise ParallelizeError(
            f"{self.folder} is not a safetensors checkpoint folder: it has neither {SINGLE_FILE} nor {INDEX_FILE}"
            + (f" (it holds {', '.join(found[:8])}{'...' if len(found) > 8 else ''})" if found else " (no such folder)")
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
            handle = handles[name] = safe_open(self.folder / name, framework="pt", device="cpu")
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
        return torch.empty(view.shape, dtype=view.dtype).copy_(view)

    def drop_copies(self) -> None:
        """Unmap the files that copies were read from (their touched pages stop counting as ours)."""
        for handle in self._copying.values():
            handle.__exit__(None, None, None)
        self._copying.clear()

    def close(self) -> None:
        self.drop_copies()
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)
