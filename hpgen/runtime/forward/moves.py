"""A collective as data: one transition of a tensor's layout on one mesh axis.

Both forms of the collectives (:mod:`hpgen.runtime.forward.collectives`, eager, and
:mod:`hpgen.runtime.forward.traced_collectives`, as ``torch.compile`` traces them) take a
:class:`Move` and an axis; this module holds what they share so that neither imports the
other's types.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from torch import Tensor

__all__ = ["Axis", "Move", "Sharded", "Size", "received_shapes"]

Size = Any  # an int, or a torch.SymInt while torch.compile traces


class Axis(Protocol):
    """What a collective needs of its mesh axis (an ``AxisCollectives``)."""

    rank: int
    size: int
    group: Any  # its process group


class Sharded(NamedTuple):
    """A layout sharded on ``dim`` (non-negative): rank ``i`` holds ``sizes[i]`` of it."""

    dim: int
    sizes: tuple[Size, ...]


class Move(NamedTuple):
    """One transition on one axis: collective ``op`` from layout ``src`` to ``dst``.

    ``None`` stands for a whole (replicated or partial) layout. ``reduce`` is the
    reduction of ``all_reduce``; gradients always add.
    """

    op: str
    src: Sharded | None
    dst: Sharded | None
    reduce: str = "sum"

    def reversed(self, op: str) -> Move:
        """The transition the gradient makes: ``op`` from this move's ``dst`` to its ``src``."""
        return Move(op, self.dst, self.src)


def received_shapes(ax: Axis, x: Tensor, move: Move) -> list[list[Size]]:
    """What rank ``i`` sends this rank in an all-to-all: its shard of src, our chunk of dst."""
    (src, src_sizes), (dst, dst_sizes) = move.src, move.dst
    shapes = []
    for n in src_sizes:
        shape = list(x.shape)
        shape[src], shape[dst] = n, dst_sizes[ax.rank]
        shapes.append(shape)
    return shapes
