"""Step 2 of deriving a plan, reshape rules: a fused projection's layout and the attributes to divide.

The first reshape of a column's output (``split``, ``chunk``, ``view``) says how its
features are laid out (a :class:`~hpgen.planner.derive.column_layouts.ColumnLayout`): one run (``S``), or
k packed blocks (``SS(d,k)``). :func:`first_reshape` finds that call in the dataflow records;
:func:`column_layout` reads it for a derived group's projections and :func:`packed_blocks` for
the projections transformers' plans name (the translator's correction of a ``colwise`` that
the code splits into packed blocks), so both plan paths read packed blocks one way.

Integer attributes that size a reshape of sharded values (``self.num_heads``,
``self.split_size``) are divided on each rank (``tp_divide_attrs``); a global count read
from the config there, a split into head groups, or a width read from an unsharded
tensor's size are refused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

from hpgen.planner.derive.column_layouts import (
    PLAIN,
    SPLITS,
    ColumnLayout,
    UnequalBlocks,
    arg_reads,
    dim_of,
    flat_dims,
    grouped,
    last_dim,
    layout_of,
)
from hpgen.planner.derive.heads.attr_names import HEADS_ATTRS, KV_HEADS_ATTRS
from hpgen.planner.derive.heads.counts import Heads
from hpgen.planner.derive.heads.rules import is_head_dim_name
from hpgen.planner.derive.placed import Refused
from hpgen.planner.derive.projection_groups import Group
from hpgen.planner.flow import SIZE, Flow, ShapeUse
from hpgen.planner.model.modules import attr_value, in_features, out_features, relative

__all__ = [
    "PackedBlocks",
    "column_layout",
    "divided_attrs",
    "first_reshape",
    "linear_origins",
    "packed_blocks",
    "sharded_counts",
]


def column_layout(
    modules: Mapping[str, Any],
    group: Group,
    col: str,
    heads: Heads | None,
    attention: bool,
    tokens: AbstractSet[tuple[str, int]] = frozenset(),
) -> ColumnLayout:
    """The layout of one column projection of ``group``, read from the first reshape of its output.

    ``tokens``: ``(module, line)`` of splits of the batch or sequence, passed over (they say nothing of it).
    """
    flow, layer = group.flow, group.layer
    n = out_features(modules[col])
    first = first_reshape(flow, col, group.cols, tokens)
    if first is None:
        return PLAIN
    try:
        layout = layout_of(first, n, heads)
    except UnequalBlocks as reason:
        raise Refused(f"{relative(col, layer)}: {reason} (the reshape at line {first.line})") from None
    if layout == PLAIN and heads is not None and n not in (heads.query_features, heads.kv_features):
        layout = _after_head_view(flow, first, col, group.cols, n, heads) or layout
    if layout is None:
        if attention and heads is not None and n not in (heads.query_features, heads.kv_features):
            raise Refused(
                f"{relative(col, layer)} packs several projections ({n} features) and hpgen cannot tell their "
                f"layout from the reshape at line {first.line}"
            )
        return PLAIN
    return layout


def _after_head_view(
    flow: Flow, first: ShapeUse, col: str, cols: AbstractSet[str], n: int, heads: Heads
) -> ColumnLayout | None:
    """The layout of a fused projection whose first reshape only splits its features into heads
    (``view(*shape, -1, head_dim)``, transformers 5.25's Falcon), read from the reshape after it: a view into key/value
    groups (``view(*shape, num_kv_heads, -1, head_dim)``) or an ``unflatten(-2, (num_heads, 3))`` of the heads."""
    dims = flat_dims(first.arg_vals) if first.method in ("view", "reshape") else []
    if not dims or dims[-1] != heads.head_dim or (len(dims) > 1 and dims[-2] not in (-1, n // heads.head_dim)):
        return None
    later = [use for use in flow.shapes[flow.shapes.index(first) + 1 :] if col in use.receiver]
    following = next((use for use in later if linear_origins(use.receiver, flow) <= cols), None)
    if following is None:
        return None
    if following.method == "unflatten":
        if not following.arg_vals or following.arg_vals[0].const not in (-2, len(dims) - 2):
            return None
        suffix = [*flat_dims(following.arg_vals[1:]), heads.head_dim]
        if None in suffix or -1 in suffix:
            return None
        q, kv, head_dim = heads
        lead = suffix[0]
        if len(suffix) == 3 and lead in (q, kv) and suffix[1] in (2, 3) and lead * suffix[1] * head_dim == n:
            return grouped(lead)  # [heads, 3, head_dim]: interleaved per head
        return None
    if following.method not in ("view", "reshape"):
        return None
    layout = layout_of(following, n, heads)
    return layout if layout is not None and layout.grouped else None


def first_reshape(
    flow: Flow, origin: str, layers: AbstractSet[str], skip: AbstractSet[tuple[str, int]] = frozenset()
) -> ShapeUse | None:
    """The first reshape-like call on a value computed from ``origin`` (a layer's FQN, or ``param:<fqn>`` for a
    weight the code reads directly) and from no layer outside ``layers`` (a group's columns), but those at the
    ``(module, line)`` of ``skip``."""
    return next(
        (
            use
            for use in flow.shapes
            if origin in use.receiver
            and linear_origins(use.receiver, flow) <= layers
            and (use.module, use.line) not in skip
        ),
        None,
    )


class PackedBlocks(NamedTuple):
    """A projection's output split into ``count`` packed blocks by ``call`` (its first reshape)."""

    count: int
    call: ShapeUse

    def says(self) -> str:
        """The call as a note quotes it: ``chunk(2)``, or the method and its line."""
        return f"chunk({self.count})" if self.call.method == "chunk" else f"{self.call.method} (line {self.call.line})"


def packed_blocks(flow: Flow, owner: str, projections: Mapping[str, int]) -> dict[str, PackedBlocks]:
    """The projections of the module at ``owner`` whose output its ``forward`` splits into k > 1 packed blocks.

    ``projections``: attribute name -> output features, of a child layer or of a weight the code applies itself
    (``F.linear(x, self.gate_up_proj[e])``); ``flow`` is the owner's dataflow. The first reshape after the
    projection is read by :func:`~hpgen.planner.derive.column_layouts.layout_of`, as for a derived group, when it
    is a split (``chunk``, ``split``): a split says its blocks by itself, while a ``view``'s sizes need the head
    counts (``[2, head_dim]`` is two key/value heads in an attention, gate and up in an MLP), which only a derived
    group knows. Blocks of unequal sizes raise :class:`~hpgen.planner.derive.column_layouts.UnequalBlocks`.
    """
    found: dict[str, PackedBlocks] = {}
    for attr, n in projections.items():
        fqn = f"{owner}.{attr}" if owner else attr
        first = first_reshape(flow, fqn if fqn in flow.edges else f"param:{fqn}", {fqn})
        if first is None or first.method not in SPLITS:
            continue
        layout = layout_of(first, n, None)
        if layout is not None and layout.packed:
            found[attr] = PackedBlocks(layout.count, first)
    return found


def sharded_counts(
    modules: Mapping[str, Any],
    cols: Collection[str],
    rows: Collection[str],
    layouts: Mapping[str, ColumnLayout],
    heads: Heads | None,
) -> set[int]:
    """The sizes a shard changes: the columns' widths and blocks, the rows' input, the head counts."""
    counts: set[int] = set()
    for col in cols:
        n = out_features(modules[col])
        counts.add(n)
        layout = layouts[col]
        if layout.packed:
            counts.add(layout.block(n))
        elif layout.count > 1:  # interleaved per head, per key/value group or per group of heads: the group count too
            counts.add(layout.count)
    for row in rows:
        counts.add(in_features(modules[row]))
    if heads is not None:
        q, kv, head_dim = heads
        counts |= {q, kv, q * head_dim, kv * head_dim}
        if head_dim not in (q, kv):  # a head count equal to head_dim (8 heads of 8) is still a count to divide
            counts.discard(head_dim)
    counts.discard(1)
    counts.discard(0)
    return counts


def divided_attrs(
    modules: Mapping[str, Any],
    flow: Flow,
    sharded: AbstractSet[str],
    counts: set[int],
    layer: str,
    parts: Collection[tuple[str, int]] = (),
) -> dict[str, set[str]]:
    """Module FQN -> integer attributes that size reshapes of the sharded values.

    ``parts``: ``(module, line)`` of the splits of the heads into parts that the strided
    cut of :mod:`hpgen.planner.derive.heads.parts` keeps whole.
    """
    wanted: dict[str, set[str]] = {}
    replicated: set[tuple[str, str]] = set()
    for use in flow.shapes:
        origins = use.receiver
        split = use.method in SPLITS
        if origins & sharded and split and dim_of(use) in (1, -3) and (use.module, use.line) not in parts:
            raise Refused(
                f"{relative(use.module, layer) or 'the layer'} splits the heads into groups ({use.method} along "
                f"dim {dim_of(use)}, line {use.line}): a rank's contiguous heads are not whole groups"
            )
        if origins & sharded and use.method in ("view", "reshape"):
            last = last_dim(use)
            if (
                last is not None
                and any(module == SIZE and not (set(attr.split(",")) & sharded) for module, attr in last.all_reads())
                and last.const != -1
            ):
                raise Refused(
                    f"{relative(use.module, layer) or 'the layer'} reshapes the sharded values to a width read "
                    f"from an unsharded tensor's size (line {use.line}), which a shard does not have"
                )
        inner = _within_heads(use) if origins & sharded else set()
        for module, attr in arg_reads(use):
            if attr.startswith(("missing:", "method:")) or (module, attr) in inner:
                continue
            value = attr_value(modules, module, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value not in counts:
                continue
            if is_head_dim_name(attr):
                continue
            if origins & sharded:
                if attr.startswith("config."):
                    raise Refused(
                        f"{relative(module, layer) or 'the layer'} reshapes sharded values with self.{attr} "
                        f"(line {use.line}), a global count hpgen cannot divide"
                    )
                wanted.setdefault(module, set()).add(attr)
            elif origins:
                replicated.add((module, attr))
    for module, attrs in wanted.items():
        both = sorted(a for a in attrs if (module, a) in replicated)
        if both:
            raise Refused(
                f"self.{both[0]} of {relative(module, layer) or 'the layer'} sizes both the replicated input and "
                "the sharded heads"
            )
        for attr in attrs:
            if "." in attr:
                raise Refused(f"self.{attr} of {relative(module, layer)} sizes the sharded heads but is nested")
    return wanted


def _within_heads(use: Any) -> set[tuple[str, str]]:
    """Attributes read only by the dims after a head count in a ``view``/``reshape`` (``(..., self.num_heads, 1,
    self.conv_kernel_size)``): sizes within one head, which sharding the heads leaves whole."""
    if use.method not in ("view", "reshape"):
        return set()
    values = list(use.arg_vals[0].items) if len(use.arg_vals) == 1 and use.arg_vals[0].items else list(use.arg_vals)
    counts = set(HEADS_ATTRS) | set(KV_HEADS_ATTRS)
    first = next(
        (i for i, v in enumerate(values) if any(attr.rpartition(".")[2] in counts for _, attr in v.all_reads())), None
    )
    if first is None:
        return set()
    before = set().union(*(v.all_reads() for v in values[: first + 1]))
    after = set().union(*(v.all_reads() for v in values[first + 1 :])) if values[first + 1 :] else set()
    return after - before


def linear_origins(origins: frozenset[str], flow: Flow) -> set[str]:
    return {o for o in origins if o in flow.edges}
