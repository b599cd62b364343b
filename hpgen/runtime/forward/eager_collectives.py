"""The collectives of :mod:`hpgen.runtime.forward.collectives` run eagerly: one function per op.

Each is ``(axis, tensor, move) -> tensor`` and never works in place: torch.distributed's
in-place collectives run into buffers allocated here, uneven shards padded to the largest.
The form ``torch.compile`` traces is :mod:`hpgen.runtime.forward.traced_collectives`; the
axis object, which picks one form or the other and adds the autograd node, stays in
``collectives``, and so do the native single-tensor collectives (``_gather_into``,
``_reduce_scatter_into`` and ``_native``, which asks ``native_ops`` whether the backend has them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .handback import call
from .moves import Axis, Move, received_shapes

__all__ = ["OPS", "EagerAxis"]


class EagerAxis(Axis, Protocol):
    """What the eager ops need of their axis (an ``AxisCollectives``) beyond its rank and size."""

    def _gather_into(self, out: Tensor, inp: Tensor) -> None: ...

    def _reduce_scatter_into(self, out: Tensor, blocks: Tensor) -> None: ...

    def _native(self, collective: Callable[..., object], out: Tensor, *args: object) -> bool: ...


def _pad_to(x: Tensor, dim: int, size: int) -> Tensor:
    """``x`` grown with zeros to ``size`` along ``dim`` (zeros, not garbage: NaN checks stay quiet)."""
    missing = size - x.size(dim)
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _identity(ax: EagerAxis, x: Tensor, move: Move) -> Tensor:
    return x


def _all_reduce(ax: EagerAxis, x: Tensor, move: Move) -> Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    op = "SUM" if move.reduce == "avg" else move.reduce.upper()  # avg: sum then divide, as gloo lacks AVG
    call(dist.all_reduce, out, op=getattr(dist.ReduceOp, op), group=ax.group)
    if move.reduce == "avg":
        out.div_(ax.size)
    return out


def _all_gather(ax: EagerAxis, x: Tensor, move: Move) -> Tensor:
    d, sizes = move.src
    most = max(sizes)
    if most == 0:  # every rank holds nothing (known alike on every rank): nothing to send
        return x.new_empty(x.shape)
    even = min(sizes) == most
    local = _pad_to(x, d, most).contiguous()  # uneven: every rank sends the largest shard size
    if even and math.prod(x.shape[:d]) == 1:  # the rank blocks, in order, are the result
        shape = list(x.shape)
        shape[d] *= ax.size
        out = x.new_empty(shape)
        ax._gather_into(out, local)
        return out
    blocks = x.new_empty((ax.size, *local.shape))
    ax._gather_into(blocks, local)
    if even:  # [k, ..., m, ...] -> [..., k * m, ...]
        return blocks.movedim(0, d).flatten(d, d + 1)
    return torch.cat([block.narrow(d, 0, n) for block, n in zip(blocks, sizes, strict=True)], dim=d)


def _reduce_scatter(ax: EagerAxis, x: Tensor, move: Move) -> Tensor:
    d, sizes = move.dst
    most = max(sizes)
    if most == 0:  # an empty dim (known alike on every rank): nothing to reduce
        return x.new_zeros(x.shape)
    even = min(sizes) == most
    if even:  # rank i's chunk is block i of [k, ..., m, ...]
        blocks = x.unflatten(d, (ax.size, most)).movedim(d, 0).contiguous()
    else:  # uneven: each chunk zero-padded to the largest
        shape = list(x.shape)
        shape[d] = most
        blocks = x.new_zeros((ax.size, *shape))
        for block, chunk in zip(blocks, x.split(sizes, dim=d), strict=True):
            block.narrow(d, 0, chunk.size(d)).copy_(chunk)
    out = blocks.new_empty(blocks.shape[1:])
    ax._reduce_scatter_into(out, blocks)
    return out if even else out.narrow(d, 0, sizes[ax.rank])


def _split(ax: EagerAxis, x: Tensor, move: Move) -> Tensor:
    d, sizes = move.dst
    return x.narrow(d, sum(sizes[: ax.rank]), sizes[ax.rank])


def _all_to_all(ax: EagerAxis, x: Tensor, move: Move) -> Tensor:
    (src, src_sizes), (dst, dst_sizes) = move.src, move.dst
    sends = [chunk.reshape(-1) for chunk in x.split(dst_sizes, dim=dst)]  # chunk i goes to rank i
    shapes = received_shapes(ax, x, move)
    out_splits = [math.prod(shape) for shape in shapes]
    received = x.new_empty(sum(out_splits))
    in_splits = [t.numel() for t in sends]
    if not ax._native(dist.all_to_all_single, received, torch.cat(sends), out_splits, in_splits):
        # fallback: gather everything, keep our chunk
        whole = _all_gather(ax, x, Move("all_gather", move.src, None))
        return _split(ax, whole, Move("split", None, move.dst))
    return torch.cat(
        [flat.view(shape) for flat, shape in zip(received.split(out_splits), shapes, strict=True)], dim=src
    )


OPS: dict[str, Callable[[EagerAxis, Tensor, Move], Tensor]] = {
    "identity": _identity,
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "split": _split,
    "all_to_all": _all_to_all,
}
