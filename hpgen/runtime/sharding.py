"""Where a rank's chunk of a parameter lies: the shard arithmetic of docs/plan-format.md.

``S(d)`` splits dim ``d`` like ``torch.tensor_split`` (the first ``n % k`` ranks hold one
more element); ``SS(d,k)`` cuts dim ``d`` into ``k`` equal packed blocks (a fused
``gate_up_proj``) and gives each rank its ``S(d)`` chunk of every block, concatenated in
block order; ``RS(d,r)`` cuts dim ``d`` into ``size / r`` chunks (``tensor_split`` again)
and gives rank ``i`` chunk ``i // r``, so ``r`` consecutive ranks hold each chunk. A
layout over several mesh axes applies them in mesh order, each axis splitting what the
previous ones left.

Pure functions on shapes and tensors; no communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from hpgen.placement import Placement

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

AxisShare = tuple[Placement, int, int]
"""One mesh axis as a parameter sees it: (placement, this rank's index, axis size)."""


def split_sizes(n: int, k: int) -> tuple[int, ...]:
    """Sizes of ``torch.tensor_split`` of ``n`` elements into ``k`` parts."""
    return tuple(n // k + (i < n % k) for i in range(k))


def _bounds(n: int, k: int, rank: int) -> tuple[int, int]:
    sizes = split_sizes(n, k)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def normalize_dim(dim: int, ndim: int) -> int | None:
    """``dim`` counted from the front, or ``None`` when a tensor of ``ndim`` dims has no such dim."""
    return dim % ndim if -ndim <= dim < ndim else None


def placement_problem(shape: Sequence[int], placement: Placement, size: int) -> str | None:
    """Why a parameter of ``shape`` cannot take ``placement`` on an axis of ``size`` ranks, or None."""
    if placement.is_partial:
        return f"a parameter cannot be partial ({placement}): parameters hold values, not sums"
    if placement.kind in ("S", "SS", "RS"):
        dim = normalize_dim(placement.dim, len(shape))
        if dim is None:
            return f"{placement} names dim {placement.dim}, but the parameter has shape {tuple(shape)}"
        if placement.kind == "SS" and shape[dim] % placement.blocks:
            return (
                f"{placement} cuts dim {dim} of size {shape[dim]} into {placement.blocks} packed blocks, "
                "which does not divide"
            )
        if placement.kind == "RS" and size % placement.replicas:
            return (
                f"{placement} puts each chunk on {placement.replicas} ranks, which does not divide the axis "
                f"size {size}"
            )
    return None


def chunks_and_index(placement: Placement, rank: int, size: int) -> tuple[int, int]:
    """``(number of chunks, the chunk this rank holds)`` of an ``S`` or ``RS`` placement."""
    if placement.kind == "RS":
        return size // placement.replicas, rank // placement.replicas
    return size, rank


def local_shape(shape: Sequence[int], shares: Iterable[AxisShare]) -> tuple[int, ...]:
    """The shape of this rank's chunk of a tensor of ``shape`` (placements already checked)."""
    result = list(shape)
    for placement, rank, size in shares:
        if placement.kind in ("S", "RS"):
            dim = normalize_dim(placement.dim, len(result))
            chunks, index = chunks_and_index(placement, rank, size)
            result[dim] = split_sizes(result[dim], chunks)[index]
        elif placement.kind == "SS":
            dim = normalize_dim(placement.dim, len(result))
            block = result[dim] // placement.blocks
            result[dim] = placement.blocks * split_sizes(block, size)[rank]
    return tuple(result)


def local_chunk(tensor: Tensor, shares: Iterable[AxisShare]) -> Tensor:
    """This rank's chunk of ``tensor``: a view for ``S`` and ``RS``, a new tensor for ``SS``."""
    for placement, rank, size in shares:
        if placement.kind in ("S", "RS"):
            dim = normalize_dim(placement.dim, tensor.dim())
            start, stop = _bounds(tensor.size(dim), *chunks_and_index(placement, rank, size))
            tensor = tensor.narrow(dim, start, stop - start)
        elif placement.kind == "SS":
            dim = normalize_dim(placement.dim, tensor.dim())
            blocks = tensor.chunk(placement.blocks, dim)
            pieces = []
            for block in blocks:
                start, stop = _bounds(block.size(dim), size, rank)
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
            lo, hi = _bounds(stop - start, *chunks_and_index(placement, rank, size))
            start, stop = start + lo, start + hi
        elif placement.kind == "SS" and normalize_dim(placement.dim, ndim) == dim:
            raise ValueError("a strided shard (SS) holds several ranges, not one")
    return start, stop
