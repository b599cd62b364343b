"""The shard sizes one mesh axis's collectives saw in one model forward, per tensor shape.

A gather must know what every rank holds; a scatter (``reduce_scatter``, ``split``) must
give back exactly what a gather took, or a token count that differed per rank comes back
evenly split. Both are answered from records, kept per tensor rather than per dim: a
record is the dim, the shape of the tensor's other dims (its *rest*) and every rank's
size on the dim, and whether the tensor holds floating-point values. Two tensors sharded
on the same dim (a batch split at the first layer, then the flattened tokens gathered into
the experts) then keep records of their own; the kind of values tells apart the integer
inputs (``input_ids [b, s]`` split by batch) from the hidden states (``[tokens, hidden]``)
even where the sequence length happens to equal the hidden size.

Every lookup depends only on what is the same on every rank, so every rank takes the
same branch (one that took a shortcut its peers did not would wait in a collective they
never run):

- a gather looks for the last *made* shard (by ``split``, ``reduce_scatter`` or
  ``all_to_all``, whose sizes follow from a shape every rank shares) on its dim with its
  rest and kind of values; a gather's other dims are equal on every rank, or it could not
  run. A tensor made from a shard without changing the sharded dim (two norms' outputs
  concatenated on their features) is recorded like it by whoever makes it
  (:meth:`~hpgen.runtime.forward.collectives.AxisCollectives.shard_like`);
- a scatter of a dim of full size ``n`` looks for the last record, made or *gathered*, on
  its dim whose sizes add up to ``n``, and returns those sizes (a scatter's input is whole,
  so ``n`` is the same on every rank); with none, ``torch.tensor_split``'s sizes.

A gather that finds nothing exchanges the sizes (one small all-gather) and records what
it got, so the conjugate scatter of the same forward returns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["ShardRecord", "ShardRecords"]

Size = Any  # an int, or a torch.SymInt while torch.compile traces


class ShardRecord(NamedTuple):
    """Every rank's ``sizes`` on ``dim`` of a tensor whose other dims are ``rest``."""

    dim: int
    rest: tuple[Size, ...]
    floating: bool  # the tensor holds floating-point values (hidden states), not ids or masks
    sizes: tuple[Size, ...]
    gathered: bool  # made by a gather (sizes its ranks gave), not by a scatter


def rest_of(shape: Any, dim: int) -> tuple[Size, ...]:
    """The shape without ``dim``."""
    return (*shape[:dim], *shape[dim + 1 :])


class ShardRecords:
    """The records of one axis during one model forward (see the module docstring)."""

    def __init__(self) -> None:
        self._records: list[ShardRecord] = []

    def add(self, x: Tensor, dim: int, sizes: tuple[Size, ...], *, gathered: bool) -> None:
        """Record every rank's ``sizes`` on ``dim`` of ``x`` (whole or sharded: only its other dims count)."""
        self._records.append(ShardRecord(dim, rest_of(x.shape, dim), x.is_floating_point(), tuple(sizes), gathered))

    def for_gather(self, x: Tensor, dim: int) -> tuple[Size, ...] | None:
        """The sizes of the last shard made on ``dim`` of a tensor of ``x``'s other dims and kind of values."""
        rest, floating = rest_of(x.shape, dim), x.is_floating_point()
        for record in reversed(self._records):
            if (
                not record.gathered
                and record.dim == dim
                and record.floating == floating
                and _same_shape(record.rest, rest)
            ):
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


def _same_shape(a: tuple[Size, ...], b: tuple[Size, ...]) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


def _total(sizes: tuple[Size, ...]) -> Size:
    total = sizes[0]
    for n in sizes[1:]:
        total = total + n
    return total
