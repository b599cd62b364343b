"""The collectives of :mod:`hpgen.runtime.forward.collectives` as ``torch.compile`` traces them.

Under Dynamo every op takes torch's functional collectives, which return new tensors and
which Dynamo and Inductor understand; a module of its own because it is the second of the
two forms (the eager form is :mod:`hpgen.runtime.forward.eager_collectives`), sharing only the moves (:mod:`hpgen.runtime.forward.moves`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor

from .moves import Axis, Move, Size, received_shapes

__all__ = ["TRACED", "fc_all_gather"]

# Looked up softly, as in collectives: torch 2.13 renamed the single-tensor collectives.
fc_all_gather = getattr(funcol, "all_gather_single", getattr(funcol, "all_gather_tensor", None))
_fc_reduce_scatter = getattr(funcol, "reduce_scatter_single", getattr(funcol, "reduce_scatter_tensor", None))


# Traced (under torch.compile): functional collectives, which return new tensors and which
# Dynamo and Inductor understand. Written without branches on sizes, which may be symbolic:
# the uneven path (pad every shard to the largest, cut each block back) also serves even
# shards, where the padding and the cuts are empty.


def _padded(x: Tensor, dim: int, size: Size) -> Tensor:
    """``x`` grown with zeros to ``size`` along ``dim`` (a no-op pad when it already is)."""
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, size - x.size(dim)])


def _chunks(x: Tensor, dim: int, sizes: Sequence[Size]) -> list[Tensor]:
    """``x`` cut along ``dim`` into consecutive pieces of ``sizes``."""
    pieces, start = [], 0
    for n in sizes:
        pieces.append(x.narrow(dim, start, n))
        start = start + n
    return pieces


def _largest(sizes: Sequence[Size]) -> Size:
    most = sizes[0]
    for n in sizes[1:]:
        most = torch.sym_max(most, n)
    return most


def _traced_identity(ax: Axis, x: Tensor, move: Move) -> Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def _traced_all_reduce(ax: Axis, x: Tensor, move: Move) -> Tensor:
    op = "sum" if move.reduce == "avg" else move.reduce  # avg: sum then divide, as gloo lacks AVG
    out = funcol.all_reduce(x.contiguous(), op, ax.group)
    return out / ax.size if move.reduce == "avg" else out


def _traced_all_gather(ax: Axis, x: Tensor, move: Move) -> Tensor:
    d, sizes = move.src
    local = _padded(x, d, _largest(sizes)).unsqueeze(0).contiguous()
    blocks = fc_all_gather(local, 0, ax.group)  # [k, *local.shape[1:]]
    return torch.cat([blocks[i].narrow(d, 0, n) for i, n in enumerate(sizes)], dim=d)


def _traced_reduce_scatter(ax: Axis, x: Tensor, move: Move) -> Tensor:
    d, sizes = move.dst
    most = _largest(sizes)  # (a gather's backward scatters the gather's sizes, whatever they are)
    blocks = torch.stack([_padded(chunk, d, most) for chunk in _chunks(x, d, sizes)])
    out = _fc_reduce_scatter(blocks, "sum", 0, ax.group)[0]  # a view: cloned, like every result
    return out.narrow(d, 0, sizes[ax.rank]).clone(memory_format=torch.contiguous_format)


def _traced_split(ax: Axis, x: Tensor, move: Move) -> Tensor:
    d, sizes = move.dst
    return _chunks(x, d, sizes)[ax.rank].clone(memory_format=torch.contiguous_format)


def _traced_all_to_all(ax: Axis, x: Tensor, move: Move) -> Tensor:
    (src, _), (dst, dst_sizes) = move.src, move.dst
    sends = [chunk.reshape(-1) for chunk in _chunks(x, dst, dst_sizes)]  # chunk i goes to rank i
    shapes = received_shapes(ax, x, move)
    out_splits = [math.prod(shape) for shape in shapes]
    received = funcol.all_to_all_single(torch.cat(sends), out_splits, [t.numel() for t in sends], ax.group)
    flats = _chunks(received, 0, out_splits)
    return torch.cat([flat.view(shape) for flat, shape in zip(flats, shapes, strict=True)], dim=src)


TRACED: dict[str, Callable[[Axis, Tensor, Move], Tensor]] = {
    "identity": _traced_identity,
    "all_reduce": _traced_all_reduce,
    "all_gather": _traced_all_gather,
    "reduce_scatter": _traced_reduce_scatter,
    "split": _traced_split,
    "all_to_all": _traced_all_to_all,
}
