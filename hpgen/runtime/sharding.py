"""A rank's chunk of a parameter as a tensor: the torch side of :mod:`hpgen.shards`.

The placements' arithmetic (``S``, ``SS``, ``RS`` over several mesh axes, docs/plan-format.md)
is the core's, re-exported here for the runtime's callers; this module cuts tensors and
ranges with it. No communication.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from hpgen.shards import (
    AxisShare,
    chunks_and_index,
    local_shape,
    normalize_dim,
    placement_problem,
    split_bounds,
    split_sizes,
)

__all__ = [
    "AxisShare",
    "chunks_and_index",
    "local_chunk",
    "local_range",
    "local_shape",
    "normalize_dim",
    "placement_problem",
    "split_sizes",
]


def local_chunk(tensor: Tensor, shares: Iterable[AxisShare]) -> Tensor:
    """This rank's chunk of ``tensor``: a view for ``S`` and ``RS``, a new tensor for ``SS``."""
    for placement, rank, size in shares:
        if placement.kind in ("S", "RS"):
            dim = normalize_dim(placement.dim, tensor.dim())
            start, stop = split_bounds(tensor.size(dim), *chunks_and_index(placement, rank, size))
            tensor = tensor.narrow(dim, start, stop - start)
        elif placement.kind == "SS":
            dim = normalize_dim(placement.dim, tensor.dim())
            blocks = tensor.chunk(placement.blocks, dim)
            pieces = []
            for block in blocks:
                start, stop = split_bounds(block.size(dim), size, rank)
                pieces.append(block.narrow(dim, start, stop - start))
            tensor = torch.cat(pieces, dim)
    return tensor


def local_range(n: int, shares: Iterable[AxisShare], dim: int, ndim: int) -> tuple[int, int]:
    """``[start, stop)`` of the global indices of dim ``dim`` (size ``n``) that this rank holds.

    Only ``S`` and ``RS`` placements on ``dim`` move the range; it is what a vocab-parallel
    embedding needs to know which token ids are its own.
    """
    start, stop = 0, n
    for placement, rank, size in shares:
        if placement.kind in ("S", "RS") and normalize_dim(placement.dim, ndim) == dim:
            lo, hi = split_bounds(stop - start, *chunks_and_index(placement, rank, size))
            start, stop = start + lo, start + hi
        elif placement.kind == "SS" and normalize_dim(placement.dim, ndim) == dim:
            raise ValueError("a strided shard (SS) holds several ranges, not one")
    return start, stop
