"""Step 2 of deriving a plan where the heads do not divide over ``--tp``: each projection cut in whole heads.

The columns' layouts read from the reshapes (:mod:`hpgen.planner.derive.column_layouts`) say how their
features group into heads; here each becomes the cut of :mod:`hpgen.planner.derive.heads.shares`:
a projection of the query heads ``S(d, u)`` or ``S(d, u, kv)``, of the key/value heads
``S(d, head_dim)`` or ``RS(d, r)``, a projection interleaved per head or per key/value
group whole groups, packed ``Q|K|V`` blocks (one head count) a ``B`` of three such
cuts, a multi-query ``[queries | key | value]`` its query block cut and the key and value
whole. The row projection's input is cut like the query heads. Each rank's value of every
attribute that sizes a reshape of the sharded values (``num_heads``...) is worked out from
the same cuts (:func:`rank_values`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from hpgen.core.conv1d import is_conv1d
from hpgen.core.plan_entries import LocalCount

from hpgen.planner.derive.column_layouts import PLAIN, ColumnLayout, Packing, query_blocks, replicated
from hpgen.planner.derive.heads.shares import HeadShares
from hpgen.planner.derive.placed import Refused
from hpgen.planner.model.modules import in_features, out_features, relative
from hpgen.core.shards import ShardLayout

__all__ = ["RankValue", "UnevenHeads", "groups_count", "rank_values", "relative_count", "uneven_layouts"]


@dataclass(frozen=True)
class RankValue:
    """One size on each rank where the heads do not divide, and the count of a parameter's shard that gives it."""

    per_rank: tuple[int, ...]
    counts: tuple[LocalCount, ...]  # each gives it; their ``of`` FQNs until written relative to the attribute's owner

    def under(self, owner: str) -> LocalCount | None:
        """The first count whose parameters are all under ``owner``, named relative to it."""
        return next((c for c in (relative_count(count, owner) for count in self.counts) if c is not None), None)


class UnevenHeads:
    """The layouts of one attention group cut in whole heads: ``columns`` (by FQN) and ``row`` (the row projections'
    input), with the shares behind them."""

    def __init__(self, shares: HeadShares, columns: Mapping[str, ColumnLayout], row: ColumnLayout) -> None:
        self.shares = shares
        self.columns = dict(columns)
        self.row = row


def _query(shares: HeadShares, width: int) -> ColumnLayout:
    """A run of the query heads, ``width`` features each."""
    if shares.even:
        return PLAIN
    if shares.replicas > 1:
        return PLAIN.in_units(width, shares.kv_heads)
    return PLAIN.in_units(shares.group * width)


def _keys(shares: HeadShares, width: int) -> ColumnLayout:
    """A run of the key/value heads, ``width`` features each."""
    if shares.replicas > 1:
        return replicated(shares.replicas)
    return PLAIN if shares.even else PLAIN.in_units(width)


def uneven_layouts(
    modules: Mapping[str, object],
    cols: Iterable[str],
    rows: Iterable[str],
    layouts: Mapping[str, ColumnLayout],
    shares: HeadShares,
    layer: str,
) -> UnevenHeads:
    """The columns and rows of an attention group cut in whole heads by ``shares`` (:class:`Refused` where a column's
    features do not group into the heads a cut keeps whole)."""
    q, kv, head_dim = shares.heads, shares.kv_heads, shares.head_dim
    cut: dict[str, ColumnLayout] = {}
    for col in sorted(cols):
        n = out_features(modules[col])
        layout = layouts[col]
        name = relative(col, layer)
        if layout.in_blocks:
            cut[col] = query_blocks(q, head_dim, _query(shares, head_dim))
        elif layout.plain and n == q * head_dim:
            cut[col] = _query(shares, head_dim)
        elif layout.plain and n == kv * head_dim:
            cut[col] = _keys(shares, head_dim)
        elif layout.plain and n in (q, kv):  # one value per head (a per-head gate)
            cut[col] = _query(shares, 1) if n == q else _keys(shares, 1)
        elif layout.grouped and layout.count == kv and shares.replicas == 1:
            # interleaved per key/value group (Falcon's new_decoder_architecture) or per head (q == kv): whole groups
            cut[col] = layout.in_units(n // kv)
        elif layout.packed and q == kv and n == layout.count * q * head_dim:
            # Q|K|V packed blocks of one head count: each block cut in whole heads, its own B block
            block = _query(shares, head_dim)
            cut[col] = ColumnLayout(Packing.BLOCKS, layout.count, blocks=((q * head_dim, block),) * layout.count)
        else:
            raise Refused(
                f"{name} has {n} features laid out as {layout.packing.value} ({layout.count}), which hpgen cannot cut "
                f"into whole heads: {q} query and {kv} key/value heads do not divide over --tp {shares.tp}"
            )
    for row in sorted(rows):
        if in_features(modules[row]) != q * head_dim:
            raise Refused(
                f"{relative(row, layer)} reads {in_features(modules[row])} features, not the {q} query heads' "
                f"{q * head_dim}: hpgen cannot cut its input in whole heads over --tp {shares.tp}"
            )
    return UnevenHeads(shares, cut, _query(shares, head_dim))


def rank_values(
    modules: Mapping[str, object],
    cols: Collection[str],
    rows: Collection[str],
    uneven: UnevenHeads,
) -> dict[int, RankValue]:
    """Each rank's share of every size the heads' cut changes, by the global value: the columns' widths, the rows'
    input, the head counts and their widths, each with the count of a parameter's shard that gives it on every rank
    (its ``of`` an FQN). Two sizes of one value that differ per rank are refused (an attribute of that value could
    not say which it is)."""
    shares = uneven.shares
    q, kv, head_dim, tp = shares.heads, shares.kv_heads, shares.head_dim, shares.tp
    found: dict[int, RankValue] = {}

    def add(value: int, per_rank: tuple[int, ...], count: LocalCount | None) -> None:
        if value in (0, 1, head_dim) or count is None:
            return
        known = found.setdefault(value, RankValue(per_rank, ()))
        if known.per_rank == per_rank:
            found[value] = replace(known, counts=(*known.counts, count))
        else:
            raise Refused(
                f"a size of {value} is cut two ways over --tp {tp} ({list(known.per_rank)} and {list(per_rank)} per "
                "rank): hpgen cannot tell which an attribute of that value is"
            )

    def local(n: int, layout: ColumnLayout) -> tuple[int, ...]:
        placement = layout.placement(0)
        return tuple(ShardLayout((n,), ((placement, rank, tp),)).local_shape[0] for rank in range(tp))

    def weight(fqn: str, output: bool) -> tuple[str, int]:
        """The weight of a projection and its dim of outputs (``output``) or inputs (``Conv1D`` is transposed)."""
        transposed = is_conv1d(modules[fqn])
        return f"{fqn}.weight", (1 if transposed else 0) if output else (0 if transposed else 1)

    row = sorted(rows)[0] if rows else None
    if row is not None:  # the row projection's input is every query head's features
        of, dim = weight(row, False)
        add(q, shares.query_heads, LocalCount(of, dim, head_dim))
        add(q * head_dim, tuple(n * head_dim for n in shares.query_heads), LocalCount(of, dim))
    for col in sorted(cols):
        n = out_features(modules[col])
        layout = uneven.columns[col]
        of, dim = weight(col, True)
        add(n, local(n, layout), LocalCount(of, dim))
        if layout.grouped and layout.unit:  # whole groups (per head or per key/value group)
            add(layout.count, tuple(size // layout.unit for size in local(n, layout)), LocalCount(of, dim, layout.unit))
        if n == q * head_dim and layout.contiguous and not layout.grouped:  # a query projection of its own
            add(q, shares.query_heads, LocalCount(of, dim, head_dim))
        if n == kv * head_dim and (layout.plain or layout.replicated):
            add(kv, shares.kv_heads_held, LocalCount(of, dim, head_dim))
        if layout.grouped and layout.count == kv and layout.unit % head_dim == 0:
            add(kv, shares.kv_heads_held, LocalCount(of, dim, layout.unit))
            add(kv * head_dim, tuple(k * head_dim for k in shares.kv_heads_held), LocalCount(of, dim, layout.unit // head_dim))
    for row in sorted(rows):
        n = in_features(modules[row])
        of, dim = weight(row, False)
        add(n, local(n, uneven.row), LocalCount(of, dim))
    return found


def groups_count(values: Mapping[int, RankValue], shares: HeadShares, owner: str) -> LocalCount | None:
    """``num_key_value_groups`` on each rank (query heads over key/value heads), counted from parameters under
    ``owner`` (named relative to it), where both counts are known."""
    query, keys = values.get(shares.heads), values.get(shares.kv_heads)
    if query is None or keys is None:
        return None
    per, first = keys.under(owner), query.under(owner)
    return replace(first, per=per) if per is not None and first is not None else None


def relative_count(count: LocalCount, owner: str) -> LocalCount | None:
    """``count`` with its parameters named relative to ``owner`` (None where one is not under it)."""
    if not count.of.startswith(owner + ".") and owner:
        return None
    per = relative_count(count.per, owner) if count.per is not None else None
    if count.per is not None and per is None:
        return None
    return replace(count, of=count.of[len(owner) + 1 :] if owner else count.of, per=per)
