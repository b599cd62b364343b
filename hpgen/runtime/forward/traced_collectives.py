"""The collectives of :mod:`hpgen.runtime.forward.collectives` as ``torch.compile`` traces them.

Under Dynamo every op takes torch's functional collectives, which return new tensors and
which Dynamo and Inductor understand; a module of its own because it is the second of the
two forms (the eager form stays beside the autograd node), sharing only the shard moves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from .collectives import AxisCollectives, _Move

__all__ = ["TRACED", "fc_all_gather", "received_shapes"]

Size = Any  # an int, or a torch.SymInt while torch.compile traces

# Looked up softly, as in collectives: torch 2.13 renamed the single-tensor collectives.
fc_all_gather = getattr(funcol, "all_gather_single", getattr(funcol, "all_gather_tensor", None))
_fc_reduce_scatter = getattr(funcol, "reduce_scatter_single", getattr(funcol, "reduce_scatter_tensor", None))


# Traced (under torch.compile): functional collectives, which return new tensors and which
# Dynamo and Inductor understand. Written without branches on sizes, which may be symbolic:
# the uneven path (pad every shard to the largest, cut each block back) also serves even
# shards, where the padding and the cuts are empty.


def received_shapes(ax: AxisCollectives, x: Tensor, move: _Move) -> list[list[Size]]:
    """What rank ``i`` sends this rank in an all-to-all: its shard of src, our chunk of dst."""
    (src, src_sizes), (dst, dst_sizes) = move.src, move.dst
    shapes = []
    for n in src_sizes:
        shape = list(x.shape)
        shape[src], shape[dst] = n, dst_sizes[ax.rank]
        shapes.append(shape)
    return shapes


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


def _traced_identity(ax: AxisCollectives, x: Tensor, move: _Move) -> Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def _traced_all_reduce(ax: AxisCollectives, x: Tensor, move: _Move) -> Tensor:
    op = "sum" if move.reduce == "avg" else move.reduce  # avg: sum then divide, as gloo lacks AVG
    out = funcol.all_reduce(x.contiguous(), op, ax.group)
    return out / ax.size if move.reduce == "avg" else out


def _traced_all_gather(ax: AxisCollectives, x: Tensor, move: _Move) -> Tensor:
    d, sizes = move.src
    local = _padded(x, d, _largest(sizes)).unsqueeze(0).contiguous()
    blocks = fc_all_gather(local, 0, ax.group)  # [k, *local.shape[1:]]
    return torch.cat([blocks[i].narrow(d, 0, n) for i, n in enumerate(sizes)], dim=d)


def _traced_reduce_scatter(ax: AxisCollectives, x: Tensor, move: _Move) -> Tensor:
    d, sizes = move.dst
    most = _largest(sizes)  # (a gather's backward scatters the gather's sizes, whatever they are)
    blocks = torch.stack([_padded(chunk, d, most) for chunk in _chunks(x, d, sizes)])
    out = _fc_reduce_scatter(blocks, "sum", 0, ax.group)[0]  # a view: cloned, like every result
    return out.narrow(d, 0, sizes[ax.rank]).clone(memory_format=torch.contiguous_format)


def _traced_split(ax: AxisCollectives, x: Tensor, move: _Move) -> Tensor:
    d, sizes = move.dst
    return _chunks(x, d, sizes)[ax.rank].clone(memory_format=torch.contiguous_format)


def _traced_all_to_all(ax: AxisCollectives, x: Tensor, move: _Move) -> Tensor:
    (src, _), (dst, dst_sizes) = move.src, move.dst
    sends = [chunk.reshape(-1) for chunk in _chunks(x, dst, dst_sizes)]  # chunk i goes to rank i
    shapes = received_shapes(ax, x, move)
    out_splits = [math.prod(shape) for shape in shapes]
    received = funcol.all_to_all_single(torch.cat(sends), out_splits, [t.numel() for t in sends], ax.group)
    flats = _chunks(received, 0, out_splits)
    return torch.cat([flat.view(shape) for flat, shape in zip(flats, shapes, strict=True)], dim=src)


TRACED: dict[str, Callable[[AxisCollectives, Tensor, _Move], Tensor]] = {
    "identity": _traced_identity,
    "all_reduce": _traced_all_reduce,
    "all_gather": _traced_all_gather,
    "reduce_scatter": _traced_reduce_scatter,
    "split": _traced_split,
    "all_to_all": _traced_all_to_all,
}
