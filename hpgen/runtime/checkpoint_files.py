"""A transformers checkpoint folder's safetensors files, opened for slice reads.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> file), as ``save_pretrained(..., max_shard_size=...)``
writes them. :class:`CheckpointFiles` opens each file once with ``safetensors.safe_open``
and hands out ``get_slice`` handles: indexing one (``handle[0:64, :]``) reads only those
elements, which is how every rank reads just its shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import safe_open

from hpgen.runtime.errors import ParallelizeError

__all__ = ["CheckpointFiles", "SINGLE_FILE", "INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFiles:
    """Tensor name -> lazy slice handle over the safetensors files of a checkpoint folder.

    Use as a context manager (or call :meth:`close`) so the files are closed after loading.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self._where = self._weight_map()
        self._open: dict[str, Any] = {}

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

    def slice(self, key: str) -> Any:
        """The ``get_slice`` handle of ``key`` (``.get_shape()``, ``.get_dtype()``, ``[...]``)."""
        name = self._where[key]
        handle = self._open.get(name)
        if handle is None:
            handle = self._open[name] = safe_open(self.folder / name, framework="pt", device="cpu")
        return handle.get_slice(key)

    def close(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)
