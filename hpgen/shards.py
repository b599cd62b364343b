"""Shard arithmetic of the plan's placements, shared by the planner and the runtime.

``S(d)`` splits dim ``d`` like ``torch.tensor_split`` (the first ``n % k`` ranks hold one
more element); ``SS(d,k)`` cuts dim ``d`` into ``k`` equal packed blocks (a fused
``gate_up_proj``) and gives each rank its ``S(d)`` chunk of every block, concatenated in
block order; ``RS(d,r)`` cuts dim ``d`` into ``size / r`` chunks (``tensor_split`` again)
and gives rank ``i`` chunk ``i // r``, so ``r`` consecutive ranks hold each chunk. A
layout over several mesh axes applies them in mesh order, each axis splitting what the
previous ones left. DTensor's ``Shard`` and FSDP2 follow ``torch.chunk`` instead (pieces
of ``ceil(n / k)``, trailing ranks may get nothing): :func:`chunk_bounds` is that one.

Pure integer functions (no torch at import time), so the planner's sizing report and the
runtime's sharding compute the same sizes from one place (docs/plan-format.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hpgen.placement import Placement

__all__ = [
    "AxisShare",
    "chunk_bounds",
    "chunk_sizes",
    "chunks_and_index",
    "local_shape",
    "normalize_dim",
    "piece_sizes",
    "placement_problem",
    "row_heads",
    "split_bounds",
    "split_sizes",
]

AxisShare = tuple[Placement, int, int]
"""One mesh axis as a parameter sees it: (placement, this rank's index, axis size)."""


def split_sizes(n: Any, k: int) -> tuple[Any, ...]:
    """Sizes of ``torch.tensor_split`` of ``n`` elements into ``k`` parts: the first ``n % k`` get one more.

    ``ceil((n - i) / k)``, written without a comparison, so that a symbolic ``n``
    (torch.compile with dynamic shapes) gives symbolic sizes instead of a guard on ``n % k``.
    """
    return tuple((n + k - 1 - i) // k for i in range(k))


def split_bounds(n: int, k: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``rank`` of ``torch.tensor_split`` of ``n`` into ``k``."""
    sizes = split_sizes(n, k)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def chunk_bounds(n: int, k: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of piece ``rank`` of ``torch.chunk`` of ``n`` into ``k`` (DTensor's ``Shard``,
    FSDP2's ``_chunk_with_empty``): pieces of ``ceil(n / k)``, ranks past the end get nothing."""
    step = -(-n // k) if n else 0
    return min(rank * step, n), min((rank + 1) * step, n)


def chunk_sizes(n: int, k: int) -> tuple[int, ...]:
    """Sizes of ``torch.chunk`` of ``n`` into ``k``, zero for the ranks past the end."""
    return tuple(hi - lo for lo, hi in (chunk_bounds(n, k, rank) for rank in range(k)))


def normalize_dim(dim: int, ndim: int) -> int | None:
    """``dim`` counted from the front, or ``None`` when a tensor of ``ndim`` dims has no such dim."""
    return dim % ndim if -ndim <= dim < ndim else None


def chunks_and_index(placement: Placement, rank: int, size: int) -> tuple[int, int]:
    """``(number of chunks, the chunk this rank holds)`` of an ``S`` or ``RS`` placement."""
    if placement.kind == "RS":
        return size // placement.replicas, rank // placement.replicas
    return size, rank


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


def piece_sizes(placement: Placement, n: int, size: int) -> tuple[int, ...]:
    """The length of each rank's piece of a dim of ``n`` under ``placement`` on ``size`` ranks."""
    if placement.kind == "SS":
        return tuple(placement.blocks * s for s in split_sizes(n // placement.blocks, size))
    pieces = []
    for rank in range(size):
        chunks, index = chunks_and_index(placement, rank, size)
        pieces.append(split_sizes(n, chunks)[index])
    return tuple(pieces)


def row_heads(block: Any, linear_path: str, rows: int, head_dim: int) -> int:
    """How many heads the ``rows`` output features of the ``nn.Linear`` at ``linear_path`` in ``block`` hold.

    ``rows / head_dim``, unless a module inside the block holds the linear and declares its own
    ``num_heads`` that cuts the rows into heads of another size (a relative-position projection
    of ``num_heads * d_rel`` features): then that many. The block's own ``num_heads`` says
    nothing of this linear (a key projection's rows are its key/value heads).
    """
    parent_path = linear_path.rpartition(".")[0]
    if parent_path:
        heads = getattr(block.get_submodule(parent_path), "num_heads", None)
        if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 and rows % heads == 0:
            if rows // heads != head_dim:
                return heads
    return rows // head_dim
