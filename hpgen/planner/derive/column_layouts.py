"""A fused projection's layout, and the sizes a reshape uses, read from the reshape calls after it.

:mod:`hpgen.planner.flow` records every reshape-like call (``view``, ``reshape``,
``split``, ``chunk``) with the constant value of each size argument where module
attributes decide it. For a projection of ``n`` output features, the first such call on
its output says how the features are packed (a :class:`ColumnLayout`):

- ``split(split_size)`` / ``split([a, a, a])`` / ``chunk(3)``: equal blocks, Q|K|V ->
  ``packed(3)``; blocks of unequal sizes (one shared key/value head after the queries,
  multi-query) are refused (:class:`UnequalBlocks`);
- ``view(..., heads, 3, head_dim)`` or ``view(..., heads, 3 * head_dim)``: per head
  interleaved -> ``grouped(heads)``, whole heads stay together under a plain shard;
  ``view(..., 3, heads, head_dim)``: blocks again; ``view(..., kv, q // kv + 2, head_dim)``
  (Falcon's grouped layout): per key/value group; ``view(..., heads + 2, head_dim)``
  with one key/value head (multi-query Falcon): blocks of unequal sizes ``[queries | key |
  value]``, the query block cut by heads and the key and value whole (``B``);
- an MLP's ``view(..., 2, -1)`` packs gate and up -> ``packed(2)``.

A layout becomes a placement (``S``, ``SS``, ``RS`` text) only on a weight's dim
(:meth:`ColumnLayout.placement`), when the plan is written.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from hpgen.core.placement import REPLICATE, Placement, block_placement, replicated_shard, shard, strided_shard
from hpgen.planner.derive.heads.counts import Heads
from hpgen.planner.flow import ShapeUse, Val

__all__ = [
    "PLAIN",
    "SPLITS",
    "ColumnLayout",
    "Packing",
    "UnequalBlocks",
    "arg_reads",
    "dim_of",
    "grouped",
    "last_dim",
    "layout_of",
    "packed",
    "query_blocks",
    "replicated",
]


class Packing(Enum):
    """How a column projection's output features are laid out, which says how its rows are cut."""

    CONTIGUOUS = "contiguous"  # one run of features (S), maybe in groups a cut keeps whole (whole heads)
    PACKED = "packed"  # equal packed blocks (Q|K|V), each cut on its own (SS)
    REPLICATED = "replicated"  # each chunk on consecutive ranks: key/value heads every rank needs (RS)
    WHOLE = "whole"  # every rank holds all of it (R): a multi-query projection's key or value block
    BLOCKS = "blocks"  # blocks of unequal sizes, each with its own layout (B): multi-query [queries | key | value]


@dataclass(frozen=True)
class ColumnLayout:
    """The layout of one column projection's output features.

    ``count``: CONTIGUOUS, the groups of features (heads, key/value groups) a rank takes whole
    (1: no grouping); PACKED, the blocks; REPLICATED, the consecutive ranks holding each chunk.
    """

    packing: Packing
    count: int = 1
    # cut in whole units of this many features where the heads do not divide (0: a plain cut), in ``groups`` groups
    unit: int = 0
    groups: int = 1
    blocks: tuple[tuple[int, ColumnLayout], ...] = ()  # BLOCKS: (features, layout) of each block, in order

    @property
    def plain(self) -> bool:
        """One run of features with nothing to keep together (``S`` with no grouping)."""
        return self.packing is Packing.CONTIGUOUS and self.count == 1

    @property
    def contiguous(self) -> bool:
        """A rank's share is one run of the features (``S``)."""
        return self.packing is Packing.CONTIGUOUS

    @property
    def grouped(self) -> bool:
        """One run, in ``count`` > 1 groups a cut keeps whole (interleaved per head or per key/value group)."""
        return self.packing is Packing.CONTIGUOUS and self.count > 1

    @property
    def packed(self) -> bool:
        return self.packing is Packing.PACKED

    @property
    def replicated(self) -> bool:
        return self.packing is Packing.REPLICATED

    @property
    def in_blocks(self) -> bool:
        """Blocks each with its own layout (``B``): multi-query ``[query heads | key | value]`` (:func:`query_blocks`),
        or packed blocks each cut in whole heads."""
        return self.packing is Packing.BLOCKS

    def block(self, features: int) -> int:
        """The features of one packed block (all of them when not packed)."""
        return features // self.count if self.packed else features

    def placement(self, dim: int) -> Placement:
        """The placement of a weight whose ``dim`` holds these features: ``S``, ``SS`` or ``RS`` on it (a
        grouping needs no count there: a plain shard of whole groups keeps them whole)."""
        if self.in_blocks:
            return block_placement(dim, tuple((size, layout.placement(dim)) for size, layout in self.blocks))
        if self.packing is Packing.WHOLE:
            return REPLICATE
        if self.unit:
            return shard(dim, self.unit, self.groups)
        if self.packed:
            return strided_shard(dim, self.count)
        if self.replicated:
            return replicated_shard(dim, self.count)
        return shard(dim)

    def in_units(self, unit: int, groups: int = 1) -> ColumnLayout:
        """This contiguous layout cut in whole units of ``unit`` features (in ``groups`` groups): ``S(d,unit,groups)``."""
        return ColumnLayout(self.packing, self.count, unit, groups)


PLAIN = ColumnLayout(Packing.CONTIGUOUS)


def grouped(groups: int) -> ColumnLayout:
    """One run of features in ``groups`` groups a rank takes whole."""
    return ColumnLayout(Packing.CONTIGUOUS, groups)


def packed(blocks: int) -> ColumnLayout:
    """``blocks`` equal packed blocks (``SS``)."""
    return ColumnLayout(Packing.PACKED, blocks)


def replicated(ranks: int) -> ColumnLayout:
    """Each chunk held by ``ranks`` consecutive ranks (``RS``)."""
    return ColumnLayout(Packing.REPLICATED, ranks)


WHOLE = ColumnLayout(Packing.WHOLE)


def query_blocks(heads: int, head_dim: int, query: ColumnLayout = PLAIN) -> ColumnLayout:
    """Multi-query ``[heads query heads | one key head | one value head]``: the query block cut by ``query``, the key
    and value whole on every rank (their gradients summed over the ranks, as ``RS`` ones are)."""
    return ColumnLayout(Packing.BLOCKS, 3, blocks=((heads * head_dim, query), (head_dim, WHOLE), (head_dim, WHOLE)))


# the reshape-like calls that cut a tensor into blocks along a dim (their sizes say the blocks without head counts)
SPLITS = frozenset({"chunk", "split", "tensor_split"})


class UnequalBlocks(ValueError):
    """The reshape packs blocks that no column layout cuts into whole heads per rank (the message says which)."""


def layout_of(use: ShapeUse, n: int, heads: Heads | None) -> ColumnLayout | None:
    """What the first reshape after a projection of ``n`` features says about its layout: None where it
    says nothing; :class:`UnequalBlocks` where it packs blocks no layout cuts."""
    if use.method in ("split", "tensor_split"):
        first = use.arg_vals[0] if use.arg_vals else None
        sizes = first.const if first is not None else None
        if first is not None and first.items is not None:
            sizes = tuple(item.const for item in first.items)
        if isinstance(sizes, int) and sizes > 0 and n % sizes == 0:
            k = n // sizes
            return packed(k) if k > 1 else PLAIN
        if isinstance(sizes, (tuple, list)) and sizes and all(isinstance(s, int) for s in sizes):
            if sum(sizes) != n:
                return None
            if len(set(sizes)) == 1:
                return packed(len(sizes)) if len(sizes) > 1 else PLAIN
            raise UnequalBlocks(
                f"the projection packs blocks of unequal sizes {list(sizes)} (multi-query: one key/value head shared "
                "by all query heads), which no S or SS placement cuts into whole heads per rank"
            )
        return None
    if use.method == "chunk":
        k = use.arg_vals[0].const if use.arg_vals else None
        if isinstance(k, int) and k > 1 and n % k == 0:
            return packed(k)
        return None
    if use.method in ("view", "reshape", "unflatten"):
        values = use.arg_vals[1:] if use.method == "unflatten" else use.arg_vals
        dims = flat_dims(values)
        suffix = feature_dims(dims, n)
        if suffix is None:
            return None
        if heads is None:  # an MLP: [k, features] packs k projections (gate and up)
            if len(suffix) >= 2 and suffix[0] in (2, 3):
                return packed(suffix[0])
            return PLAIN
        q, kv, head_dim = heads
        if len(suffix) == 1:
            return PLAIN
        lead = suffix[0]
        rest = n // lead
        if lead in (2, 3) and rest % head_dim == 0 and lead * rest == n and len(suffix) >= 2 and lead not in (q, kv):
            return packed(lead)  # [k, heads, head_dim]: k packed blocks
        if (
            lead in (q, kv)
            and rest % head_dim == 0
            and rest // head_dim in (2, 3)
            or (lead in (q, kv) and len(suffix) >= 3 and suffix[1] in (2, 3))
        ):
            return grouped(lead)  # [heads, k, head_dim]: interleaved per head, whole heads stay together
        if len(suffix) == 3 and suffix[0] == kv == 1 and suffix[1] == q + 2 and suffix[2] == head_dim:
            return query_blocks(q, head_dim)  # one key/value group [queries | key | value] (new_decoder_architecture)
        if lead == kv and len(suffix) == 3 and suffix[1] == q // kv + 2:
            return grouped(lead)  # [kv groups, queries per group + 2, head_dim]: per key/value group
        if len(suffix) == 2 and lead == q + 2 and suffix[1] == head_dim and kv == 1:
            return query_blocks(q, head_dim)  # [queries | key | value], multi-query (Falcon-7B)
        if lead == q + 2 and len(suffix) == 2:
            raise UnequalBlocks(
                "the projection packs the query heads with one shared key and value head (multi-query), which no S "
                "or SS placement cuts into whole heads per rank"
            )
        if lead * head_dim == n or (len(suffix) == 2 and suffix[1] == head_dim and lead == n // head_dim):
            return PLAIN
        if len(suffix) == 2 and lead in (q, kv) and lead * suffix[1] == n:
            return grouped(lead)  # [heads, features of one head] of another width (MLA's key and value per head)
        if lead in (q, kv) and n % head_dim and n % lead == 0:
            return grouped(lead)  # [heads, 1, taps]: a few values per head, no head_dim (per-head conv taps)
        if len(suffix) == 2 and 1 < lead < q == kv and q % lead == 0 and rest == 3 * (q // lead) * head_dim:
            # [groups, 3 blocks of the group's heads]: CodeGen's qkv_proj, [q | v | k] of q / groups heads in each of
            # its mp_num groups; whole groups stay together, so a rank's rows are its own heads' q, v and k
            return grouped(lead)
        return None
    return None


def flat_dims(values: Iterable[Val]) -> list[int | None]:
    dims: list[int | None] = []
    for value in values:
        const = value.const
        if isinstance(const, (tuple, list)):
            dims.extend(c if isinstance(c, int) else None for c in const)
        elif value.items is not None:
            dims.extend(flat_dims(value.items))
        elif isinstance(const, int):
            dims.append(const)
        else:
            dims.append(None)
    return dims


def feature_dims(dims: list[int | None], n: int) -> list[int] | None:
    """The trailing known sizes that split ``n`` features (one ``-1`` among them inferred), else None."""
    known: list[int] = []
    for dim in reversed(dims):
        if dim is None:
            break
        known.append(dim)
    known.reverse()
    if known.count(-1) > 1:
        return None
    if -1 in known:
        others = 1
        for dim in known:
            others *= dim if dim != -1 else 1
        if others <= 0 or n % others:
            return None
        return [n // others if dim == -1 else dim for dim in known]
    for start in range(len(known) - 1, -1, -1):  # the shortest suffix whose product is n
        product = 1
        for dim in known[start:]:
            product *= dim
        if product == n:
            return known[start:]
    return None


def dim_of(use: ShapeUse) -> int | None:
    """The ``dim`` of a ``chunk``/``split`` call (keyword or second argument), when constant."""
    if use.dim is not None:
        return use.dim
    if len(use.arg_vals) >= 2 and isinstance(use.arg_vals[1].const, int):
        return use.arg_vals[1].const
    return None


def last_dim(use: ShapeUse) -> Val | None:
    """The value that sizes the last dim of a ``view``/``reshape`` (None when it is not one plain argument)."""
    if not use.arg_vals:
        return None
    last = use.arg_vals[-1]
    if last.items is not None:
        return last.items[-1] if last.items else None
    if len(use.arg_vals) == 1 and isinstance(last.const, (tuple, list)):
        return None
    return last


def arg_reads(use: ShapeUse) -> set[tuple[str, str]]:
    reads: set[tuple[str, str]] = set()
    for value in use.arg_vals:
        reads |= value.all_reads()
    return reads
