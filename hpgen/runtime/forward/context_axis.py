"""The ``cp`` axis: context parallelism's load-balanced sequence shards and their collectives.

On the ``cp`` axis a sequence shard is not ``tensor_split``'s contiguous run: the sequence
of ``n`` tokens is cut into ``2 * cp`` chunks (sizes by ``tensor_split``, so any ``n``
works), and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, concatenated (Megatron's
and TransformerEngine's layout). Under a causal mask the early chunks attend to few keys
and the late ones to many, so pairing them gives every rank the same attention work.

:class:`ContextAxis` is the ``cp`` axis's ``self._hp_cp``. Its ``split`` and
``all_gather`` move values between whole and this layout along any dim, built from
:class:`~hpgen.runtime.forward.collectives.AxisCollectives`' own ops with the ranks'
sizes given (``split(sizes=)``, ``all_gather(sizes=)``) and a permutation around them,
so their gradients are the conjugates (a split's is an all-gather, a gather's a split or
reduce-scatter). The layout of the sequence a forward cut is recorded for the gathers
after it (the keys and values in attention, the final gather) for the length of that
forward (:class:`~hpgen.runtime.forward.collectives.ShardScope`).

A forward whose tokens follow a filled key/value cache (a decode step) runs replicated
over ``cp`` (:meth:`ContextAxis.replicate`): every op returns its input, every rank
computes the new tokens whole, except attention over a cache split over ``cp``
(:mod:`hpgen.runtime.context.decode`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

from hpgen.core.shards import split_sizes

from .collectives import AxisCollectives, Size, _each_in_sequences, _norm_dim

__all__ = ["ContextAxis", "HeadTail", "head_tail_sizes"]


def head_tail_sizes(n: int, size: int) -> tuple[int, ...]:
    """Every rank's token count when ``n`` tokens are cut into ``2 * size`` chunks and rank
    ``r`` holds chunks ``r`` and ``2 * size - 1 - r``."""
    chunks = split_sizes(n, 2 * size)
    return tuple(chunks[r] + chunks[2 * size - 1 - r] for r in range(size))


@dataclass(frozen=True)
class HeadTail:
    """The head-tail layout of ``n`` tokens over ``size`` ranks, seen from rank ``rank``."""

    n: int
    size: int
    rank: int
    device: torch.device

    @cached_property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` of each of the ``2 * size`` chunks, in sequence order."""
        sizes = split_sizes(self.n, 2 * self.size)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(zip(starts, sizes, strict=True))

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Every rank's token count, in rank order."""
        return head_tail_sizes(self.n, self.size)

    def _positions(self, rank: int) -> list[int]:
        held = []
        for chunk in (rank, 2 * self.size - 1 - rank):
            start, length = self.chunks[chunk]
            held += range(start, start + length)
        return held

    @cached_property
    def gathered(self) -> Tensor:
        """The sequence position of each token of the ranks' shards concatenated in rank order."""
        order = [p for rank in range(self.size) for p in self._positions(rank)]
        return torch.tensor(order, dtype=torch.long, device=self.device)

    @cached_property
    def local(self) -> Tensor:
        """The sequence positions of this rank's tokens, in the order it holds them."""
        return torch.tensor(self._positions(self.rank), dtype=torch.long, device=self.device)

    @cached_property
    def restore(self) -> Tensor:
        """Where each sequence position lies in the rank-ordered concatenation (``gathered``'s inverse)."""
        return torch.argsort(self.gathered)


class ContextAxis(AxisCollectives):
    """``self._hp_cp``: sequence shards in the head-tail layout (see the module docstring).

    ``split(x, dim)`` keeps this rank's two chunks of ``dim``; ``all_gather(x, dim)`` puts
    the ranks' chunks back in sequence order. ``reduce_scatter`` and ``all_to_all`` have no
    head-tail form here and refuse.
    """

    def __init__(self, group: dist.ProcessGroup | None, name: str) -> None:
        super().__init__(group, name)
        self._layout: HeadTail | None = None  # the sequence this forward cut
        self._replicated = False  # this forward runs whole on every rank (a decode step)
        self._layouts: dict[tuple[int, torch.device], HeadTail] = {}
        self.whole_cache = False  # prefills keep every position's keys/values (hpgen.runtime.context.cache)

    def layout(self, n: int, device: torch.device) -> HeadTail:
        """The head-tail layout of ``n`` tokens (its index tensors built once per length and device)."""
        key = (n, device)
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) > 64:
                self._layouts.clear()
            found = self._layouts[key] = HeadTail(n, self.size, self.rank, device)
        return found

    @property
    def current(self) -> HeadTail | None:
        """The layout of the sequence cut in this forward (``None`` outside one, or before the cut)."""
        return self._layout if self._known is not None else None

    @property
    def active(self) -> bool:
        """Whether this forward shards the sequence (more than one rank, not a replicated step)."""
        return self.size > 1 and not self._replicated

    @contextlib.contextmanager
    def replicate(self) -> Iterator[None]:
        """Run what is inside whole on every rank: each op of this axis returns its input."""
        before, self._replicated = self._replicated, True
        try:
            yield
        finally:
            self._replicated = before

    @_each_in_sequences
    def split(
        self, x: Tensor | None, dim: int, *, backward: str = "all_gather", sizes: tuple[Size, ...] | None = None
    ) -> Tensor | None:
        """``R -> S(dim)`` in the head-tail layout; records it for this forward's gathers."""
        if x is None or not self.active:
            return x
        if sizes is not None:
            raise ValueError(f"axis {self.name!r}: the head-tail layout fixes the sizes of a split")
        d = _norm_dim(dim, x.dim())
        layout = self.layout(x.size(d), x.device)
        if self._known is not None:
            self._layout = layout
        return super().split(x.index_select(d, layout.gathered), d, backward=backward, sizes=layout.sizes)

    @_each_in_sequences
    def all_gather(
        self,
        x: Tensor | None,
        dim: int,
        *,
        backward: str = "reduce_scatter",
        total: Size | None = None,
        sizes: tuple[Size, ...] | None = None,
    ) -> Tensor | None:
        """``S(dim) -> R`` from the head-tail layout: the whole ``dim`` in sequence order."""
        if x is None or not self.active:
            return x
        d = _norm_dim(dim, x.dim())
        gathered = self.gather_ranks(x, d, backward=backward, total=total)
        return gathered.index_select(d, self.layout(gathered.size(d), x.device).restore)

    def shard_sizes(self, *shards: Tensor | None, dim: int) -> None:
        """Nothing to hand on: every gather of this axis takes the head-tail layout of the
        sequence this forward cut (or its ``total``), which costs no exchange."""
        return None

    def split_sizes(self, *wholes: Tensor | None, dim: int) -> None:
        """Nothing to hand on: the head-tail layout fixes every split's sizes."""
        return None

    def gather_ranks(self, x: Tensor, dim: int, *, backward: str = "reduce_scatter", total: Size | None = None) -> Tensor:
        """The ranks' shards of ``dim`` concatenated in rank order (the order of ``layout.gathered``).

        Attention gathers keys and values this way and reorders the mask instead of the
        keys. The sizes come from ``total``, the sequence cut in this forward, or one
        exchange.
        """
        layout = self._gather_layout(x, dim, total)
        return super().all_gather(x, dim, backward=backward, sizes=layout.sizes)

    def _gather_layout(self, x: Tensor, dim: int, total: Size | None) -> HeadTail:
        if total is not None:
            return self.layout(int(total), x.device)
        if self.current is not None:
            return self.current
        sizes = self._exchange_sizes(x.size(dim), x.device)
        layout = self.layout(sum(sizes), x.device)
        if tuple(sizes) != layout.sizes:
            raise RuntimeError(
                f"axis {self.name!r}: all_gather on dim {dim}: the ranks hold {tuple(sizes)} tokens, which is not "
                f"the head-tail layout of {layout.n} ({layout.sizes}); cut the sequence with this axis's split first"
            )
        return layout

    def reduce_scatter(self, x: Tensor | None, dim: int, *, backward: str = "all_gather") -> Tensor | None:
        if x is None or not self.active:
            return x
        raise NotImplementedError(f"axis {self.name!r}: reduce_scatter has no head-tail form; cp plans never ask for it")

    def all_to_all(self, x: Tensor | None, src_dim: int, dst_dim: int, **kwargs: object) -> Tensor | None:
        if x is None or not self.active:
            return x
        raise NotImplementedError(f"axis {self.name!r}: all_to_all has no head-tail form; cp plans never ask for it")

    def all_reduce(self, x: Tensor | None, op: str = "sum", *, backward: str = "identity") -> Tensor | None:
        if not self.active:
            return x
        return super().all_reduce(x, op, backward=backward)

    def copy(self, x: Tensor | None, *, backward: str = "all_reduce") -> Tensor | None:
        if not self.active:
            return x
        return super().copy(x, backward=backward)

    def copy_if_grad(self, value: object) -> object:
        if not self.active:
            return value
        return super().copy_if_grad(value)

    def end_forward(self) -> None:
        self._layout = None
