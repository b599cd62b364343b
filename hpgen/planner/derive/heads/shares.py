"""Whole heads on any ``--tp``: each rank's heads of an attention, and the placements that give them.

Where the query and key/value heads divide over the axis (and key/value heads fewer than
the ranks divide it: ``RS``), a plain ``S(d)`` keeps heads whole and nothing here is used.
Otherwise the heads are cut unevenly, as DeepSpeed's AutoTP does, never a head in two:

- key/value heads at least as many as the ranks: the axis cuts whole key/value *groups*
  (a key/value head with the query heads it serves), the first ranks taking one more:
  key/value rows ``S(d, head_dim)``, query rows ``S(d, q/kv * head_dim)``, the output
  projection's input ``S(1, q/kv * head_dim)`` (7 heads at ``--tp 3``: 3/2/2; 12 query and
  4 key/value heads at ``--tp 3``: 6/3/3 query, 2/1/1 key/value heads);
- key/value heads fewer than the ranks (the ranks a multiple of them): each key/value
  head on ``r = tp / kv`` consecutive ranks (``RS(d, r)``), and its ``q/kv`` query heads
  cut among those ranks: ``S(d, head_dim, kv)`` (Qwen2.5-7B at ``--tp 8``: 4 key/value heads
  on 2 ranks each, each group's 7 query heads cut 4/3).

A rank left without a query head is refused (:class:`NoHeadForRank`). A multi-query
projection (Falcon's ``[query heads | key | value]``) cuts its query block the same way and
replicates the key and value blocks (``B(d, ...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hpgen.core.placement import Placement, replicated_shard, shard
from hpgen.core.shards import split_sizes

__all__ = ["HeadShares", "NoHeadForRank", "head_shares", "unit_shard"]


class NoHeadForRank(ValueError):
    """``--tp`` larger than the query heads: a rank would hold none (the message says the counts)."""


def unit_shard(dim: int, unit: int, groups: int = 1) -> Placement:
    """``S(dim,unit)``, or ``S(dim,unit,groups)``: dim ``dim`` cut in whole units of ``unit`` elements (in ``groups``
    equal groups, each cut among its own consecutive ranks)."""
    return shard(dim, unit, groups)


@dataclass(frozen=True)
class HeadShares:
    """The query and key/value heads of one attention (``heads``, ``kv_heads`` of ``head_dim``) over ``tp`` ranks."""

    heads: int
    kv_heads: int
    head_dim: int
    tp: int

    @property
    def even(self) -> bool:
        """The heads divide (key/value heads fewer than the ranks dividing them): plain ``S``/``RS`` cut whole heads."""
        kv_ok = self.kv_heads % self.tp == 0 or self.tp % self.kv_heads == 0
        return self.heads % self.tp == 0 and kv_ok

    @property
    def replicas(self) -> int:
        """Consecutive ranks holding each key/value head (1 unless they are fewer than the ranks)."""
        return self.tp // self.kv_heads if self.kv_heads < self.tp else 1

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @cached_property
    def query_heads(self) -> tuple[int, ...]:
        """Query heads of each rank."""
        if self.replicas > 1:
            per_group = split_sizes(self.group, self.replicas)
            return tuple(per_group[rank % self.replicas] for rank in range(self.tp))
        return tuple(n * self.group for n in split_sizes(self.kv_heads, self.tp))

    @cached_property
    def kv_heads_held(self) -> tuple[int, ...]:
        """Key/value heads of each rank."""
        if self.replicas > 1:
            return (1,) * self.tp
        return tuple(split_sizes(self.kv_heads, self.tp))

    @property
    def groups_held(self) -> tuple[int, ...]:
        """Each rank's ``num_key_value_groups`` (query heads per local key/value head)."""
        return tuple(q // kv for q, kv in zip(self.query_heads, self.kv_heads_held))

    def query(self, dim: int, width: int) -> Placement:
        """The cut of a dim of ``heads * width`` elements (``width`` per query head)."""
        if self.even:
            return shard(dim)
        if self.replicas > 1:
            return unit_shard(dim, width, self.kv_heads)
        return unit_shard(dim, self.group * width)

    def keys(self, dim: int, width: int) -> Placement:
        """The cut of a dim of ``kv_heads * width`` elements (``width`` per key/value head)."""
        if self.replicas > 1:
            return replicated_shard(dim, self.replicas)
        return shard(dim) if self.even else unit_shard(dim, width)

    def groups(self, dim: int, width: int) -> Placement:
        """The cut of a dim of ``kv_heads * width`` elements laid out per key/value group (the group's queries with
        its key and value, Falcon's ``new_decoder_architecture``): whole groups, so key/value heads at least as many
        as the ranks."""
        return shard(dim) if self.even else unit_shard(dim, width)


def head_shares(heads: int, kv_heads: int, head_dim: int, tp: int) -> HeadShares:
    """The shares of ``heads`` query and ``kv_heads`` key/value heads over ``tp`` ranks.

    Raises :class:`NoHeadForRank` where a rank would hold no query head, and ``ValueError``
    where key/value heads fewer than the ranks do not divide them (a query head would sit on
    a rank without its key/value head).
    """
    if heads < tp:
        raise NoHeadForRank(
            f"--tp {tp} leaves a rank with no query head: num_attention_heads={heads} is fewer than the ranks"
        )
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    if kv_heads < tp and tp % kv_heads:
        raise ValueError(
            f"num_key_value_heads={kv_heads} is fewer than --tp {tp} and --tp {tp} is not a multiple of it: a "
            "key/value head's query heads would sit on ranks that do not all hold it"
        )
    return HeadShares(heads, kv_heads, head_dim, tp)
