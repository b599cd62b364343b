"""The shard sizes one mesh axis's collectives saw in one model forward, per sharded dim.

A gather must know what every rank holds; a scatter (``reduce_scatter``, ``split``) must
give back exactly what a gather took, or a token count that differed per rank comes back
evenly split. Within one boundary the generated ``forward`` hands the sizes from op to op
(``sizes=``: the experts' tokens, routing ids and weights; a batch split at a model's
entry and the gather at its exit). Between boundaries (a sequence split at the first
decoder layer and the gathers in every attention after it; one layer's experts scattering
their tokens back and the next layer's gathering them) the sizes travel in these records:
a record is the dim and every rank's size on it. Nothing of a tensor's shape but the
sharded dim is looked at: on one axis, in one forward, the shards of one dim are cuts of
one thing (the sequence, the tokens), whatever the tensors around it hold.

Every lookup depends only on what is the same on every rank, so every rank takes the
same branch (one that took a shortcut its peers did not would wait in a collective they
never run):

- a gather looks for the last *made* shard of its dim (by ``split``, ``reduce_scatter``
  or ``all_to_all``, whose sizes follow from a shape every rank shares);
- a scatter of a dim of full size ``n`` looks for the last record, made or *gathered*, on
  its dim whose sizes add up to ``n``, and returns those sizes (a scatter's input is whole,
  so ``n`` is the same on every rank); with none, ``torch.tensor_split``'s sizes.

A gather that finds nothing exchanges the sizes (one small all-gather) and records what
it got, so the conjugate scatter of the same forward returns it. A gather whose shard is
not the recorded size raises, naming both: a second, different cut of the same dim in one
forward must be handed its sizes (``sizes=``, ``total=``) rather than left to the records.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["ShardRecord", "ShardRecords"]

Size = Any  # an int, or a torch.SymInt while torch.compile traces


class ShardRecord(NamedTuple):
    """Every rank's ``sizes`` on ``dim``."""

    dim: int
    sizes: tuple[Size, ...]
    gathered: bool  # made by a gather (sizes its ranks gave), not by a scatter


class ShardRecords:
    """The records of one axis during one model forward (see the module docstring)."""

    def __init__(self) -> None:
        self._records: list[ShardRecord] = []

    def add(self, dim: int, sizes: tuple[Size, ...], *, gathered: bool) -> None:
        """Record every rank's ``sizes`` on ``dim``."""
        self._records.append(ShardRecord(dim, tuple(sizes), gathered))

    def for_gather(self, dim: int) -> tuple[Size, ...] | None:
        """The sizes of the last shard made on ``dim``."""
        for record in reversed(self._records):
            if not record.gathered and record.dim == dim:
                return record.sizes
        return None

    def for_scatter(self, dim: int, n: Size) -> tuple[Size, ...] | None:
        """The sizes of the last record on ``dim`` whose sizes add up to ``n``."""
        for record in reversed(self._records):
            if record.dim == dim and _same(_total(record.sizes), n):
                return record.sizes
        return None


def _same(a: Size, b: Size) -> bool:
    """``a == b`` for ints; for symbolic sizes under torch.compile, true only where provable
    (a size exchanged at run time is an unbacked int, which no guard may branch on)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return bool(guard_or_false(a == b))


def _total(sizes: tuple[Size, ...]) -> Size:
    total = sizes[0]
    for n in sizes[1:]:
        total = total + n
    return total
