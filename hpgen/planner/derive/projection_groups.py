"""Step 1 of deriving a plan: the column -> row groups of one decoder layer, from its dataflow.

A projection that writes the stream's width from other projections' outputs alone (not
from the residual stream) is row-parallel; the projections it reads are its columns.
:func:`sources` walks back from a projection through per-head norms; any other layer on
the way ends the walk. What the code between a group's projections does is checked here
too: a layer there must work on whole heads (:func:`check_mid`), and a parameter it reads
directly must follow the shards (:func:`direct_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from hpgen.core.placement import REPLICATE, Placement, shard, strided_shard
from hpgen.planner.derive.column_layouts import ColumnLayout
from hpgen.planner.derive.derive_context import DeriveContext
from hpgen.planner.derive.heads.counts import Heads
from hpgen.planner.derive.heads.per_head_params import head_matrix_placement, view_sizes
from hpgen.planner.derive.heads.rules import HeadRules, normalized_heads
from hpgen.planner.derive.latent import pre_projections, replicated_closure
from hpgen.planner.derive.linear_mixers import absent, conv_placement, per_head_placement, single_column_conv
from hpgen.planner.derive.placed import Refused
from hpgen.planner.flow import Flow
from hpgen.planner.model.modules import in_features, out_features, positive_int, relative

__all__ = ["Group", "Sources", "check_mid", "depths", "direct_params", "find_groups", "first_marker", "sources"]


@dataclass(frozen=True)
class Group:
    """One column -> row group of a decoder layer, as :func:`find_groups` finds it."""

    layer: str  # the decoder layer's FQN
    flow: Flow  # the decoder layer's dataflow
    cols: frozenset[str]  # the column-parallel projections
    rows: frozenset[str]  # the row-parallel projections
    mids: frozenset[str]  # the per-head layers between them (q_norm)
    latent: frozenset[str] = frozenset()  # latent down-projections kept replicated in the block (MLA)


def find_groups(
    ctx: DeriveContext, rules: HeadRules, layer: str, flow: Flow, linears: set[str], depth: Mapping[str, int]
) -> list[Group]:
    """The column -> row groups of one layer, with the per-head layers between their projections.

    A row-parallel projection writes the stream's width (the hidden size, or the width
    the layer's stream-fed projections read) from other projections' outputs alone; the
    projections it reads are its columns, unless they are rows themselves (a reduced,
    replicated value: ``down_proj -> linear`` in Zamba2 pairs ``down_proj`` with its
    own columns, and ``linear`` stays replicated). A latent down-projection feeding another
    column (MLA's) is no column: it is the group's ``latent``.
    """
    modules = ctx.modules
    main = first_marker(flow)
    found = {fqn: sources(flow, fqn, linears, rules.per_head) for fqn in linears}
    widths = {positive_int(ctx.config("hidden_size"))}
    widths |= {in_features(modules[f]) for f, src in found.items() if not src.linears}
    rows = {
        fqn
        for fqn, src in found.items()
        if src.linears
        and main not in src.markers
        # a full-width norm of a latent down-projection (MLA's kv_a_layernorm) is no stop: it stays replicated
        and not src.stops - replicated_closure(flow, pre_projections(flow, src.linears, linears), set())
        and out_features(modules[fqn]) in widths
    }
    for fqn in sorted(rows):  # a "row" whose output another row mixes with columns is a column of that row
        if fqn in rows and found[fqn].linears - rows:  # (Kimi's f_b_proj: qkv_dim == hidden_size, into o_proj)
            rows -= found[fqn].linears & rows
    groups: list[tuple[set[str], set[str], set[str]]] = []
    latents: dict[str, set[str]] = {}  # row -> its latent down-projections
    for row in sorted(rows, key=lambda f: (depth.get(f, 0), f)):
        src = found[row]
        cols = src.linears - rows
        if not cols or src.linears & rows:  # nothing to pair, or a sharded value mixed with a reduced one
            continue
        latent = pre_projections(flow, cols, linears)  # MLA's down-projections: replicated, not columns
        if latent and cols - latent:
            cols -= latent
            latents[row] = latent
        merged = next((g for g in groups if g[0] & cols), None)
        if merged is None:
            groups.append((set(cols), {row}, set(src.mids)))
        else:
            merged[0].update(cols)
            merged[1].add(row)
            merged[2].update(src.mids)
    return [
        Group(
            layer,
            flow,
            frozenset(cols),
            frozenset(rows),
            frozenset(mids),
            frozenset().union(*(latents.get(row, set()) for row in rows)),
        )
        for cols, rows, mids in groups
    ]


def check_mid(modules: Mapping[str, Any], rules: HeadRules, fqn: str, group: Group) -> None:
    """Refuse a layer between the group's projections that does not work on whole heads."""
    module = modules[fqn]
    head_dim = rules.head_dim(group.cols)
    sizes = {p.numel() for p in module.parameters()}
    shapes = [tuple(p.shape) for p in module.parameters()]
    layer = group.layer
    if not shapes:  # a weightless norm over whole heads, narrower than the rows' input: rows a rank holds whole
        width = normalized_heads(module, {head_dim} if head_dim else set())
        if width is not None and all(width < in_features(modules[r]) for r in group.rows):
            return
        if rules.norms_heads(fqn):
            return  # a norm of the file without parameters over a per-head view
        raise Refused(
            f"{relative(fqn, layer)} ({type(module).__name__}) sits between the column- and row-parallel "
            "projections and normalises across the sharded features"
        )
    if all(len(s) == 1 for s in shapes) and head_dim is not None and sizes <= {head_dim}:
        return  # a per-head norm (q_norm): runs on whole heads; its gradient is reduced
    if rules.maps_heads(fqn) or rules.norms_heads(fqn) or rules.scales_heads(fqn):
        return  # one matrix for each head's features, a norm or a per-head scale over a per-head view
    raise Refused(
        f"{relative(fqn, layer)} ({type(module).__name__}, parameters {shapes}) sits between the column- and "
        "row-parallel projections and works across the sharded features"
    )


def _parts_placement(param: Any, heads: Heads, k: int, name: str) -> Placement:
    """A parameter read between the projections of an attention whose heads are split into ``k`` parts:
    a scalar or one head's worth (DiffLlama's lambdas) replicated, one value per query head ``SS(0,k)``."""
    q, _, head_dim = heads
    if param.numel() == 1 or (param.dim() == 1 and param.numel() == head_dim != q):
        return REPLICATE
    if param.dim() == 1 and param.numel() == q != head_dim:
        return strided_shard(0, k)
    both = " (head_dim and the query heads are both that size)" if q == head_dim else ""
    raise Refused(
        f"the code between the projections computes with {name} {tuple(param.shape)} directly, which hpgen cannot "
        f"place on heads split into {k} parts{both}"
    )


def direct_params(
    model: Any,
    modules: Mapping[str, Any],
    group: Group,
    raw: list[str],
    layouts: Mapping[str, ColumnLayout],
    heads: Heads | None,
    parts: int | None,
) -> dict[str, Placement]:
    """Parameters the code between the projections reads itself, and their placement.

    One value per feature of a plainly sharded column (a learned scale on ``q``): sharded
    with it, ``S(0)``; a scalar or one head's worth (DiffLlama's lambdas): replicated, its
    gradient reduced by the block; a depthwise conv's weight over the columns
    (:mod:`hpgen.planner.derive.linear_mixers`); a per-head scale ``[heads, d]``, a map of each head's
    features ``[d, e]`` or a weight over a column's channels (:mod:`hpgen.planner.derive.heads.per_head_params`);
    anything else cannot follow the shards. ``parts``: the parts the heads are split into
    (:mod:`hpgen.planner.derive.heads.parts`), None where they are not.
    """
    found: dict[str, Placement] = {}
    head_dim = heads.head_dim if heads is not None else None
    cols, layer = group.cols, group.layer
    plain = {c: out_features(modules[c]) for c in cols if layouts[c].plain}
    widths, col_widths = set(plain.values()), list(plain.values())
    contiguous = {c: out_features(modules[c]) for c in cols if layouts[c].contiguous}  # S(0) weights
    shapes = group.flow.shapes
    for name in raw:
        if absent(model, name):
            continue  # a bias the layer was built without: read as None
        try:
            param = model.get_parameter(name)
        except AttributeError:
            raise Refused(
                f"the code between the projections reads a parameter hpgen cannot place ({name})"
            ) from None
        special = (
            conv_placement(model, name, param, col_widths, shapes)
            or single_column_conv(model, name, param, group.flow, plain)
            or per_head_placement(param, heads.query if heads is not None else None)
            or _head_matrix(model, group.flow, name, param, contiguous, heads)
        )
        if parts is not None and heads is not None:  # heads in parts: a per-head vector takes every part's chunk
            found[name] = _parts_placement(param, heads, parts, relative(name, layer))
        elif special is not None:
            found[name] = special  # a depthwise conv over the columns, or one value per head (A_log)
        elif param.dim() == 1 and (param.numel() in widths or (heads is not None and param.numel() == heads.query)):
            found[name] = shard(0)  # one value per feature of a column, or one per query head (GPT-OSS sinks)
        elif param.numel() == 1 or (param.dim() == 1 and param.numel() == head_dim):
            found[name] = REPLICATE
        else:
            raise Refused(
                f"the code between the projections computes with {relative(name, layer)} "
                f"{tuple(param.shape)} directly, which does not follow the shards"
            )
    return found


def _head_matrix(
    model: Any, flow: Flow, name: str, param: Any, contiguous: Mapping[str, int], heads: Heads | None
) -> Placement | None:
    """A 2-D parameter per head, shared by the heads, or over a column's channels (:mod:`hpgen.planner.derive.heads.per_head_params`).

    ``contiguous``: the columns whose weights shard contiguously (``S(0)``) and their widths. The
    columns a parameter is computed with are those in every recorded value that reads it
    and holds a column (the flow over-approximates origins, never under).
    """
    if heads is None or param.dim() != 2:
        return None
    sizes = {heads.head_dim}
    for col, width in contiguous.items():
        sizes |= view_sizes(flow, frozenset({col}), width)
    origin = f"param:{name}"
    mixed = [
        {o for o in found if o in contiguous}
        for found in [*flow.edges.values(), *(use.receiver for use in flow.shapes)]
        if origin in found
    ]
    common = set.intersection(*[m for m in mixed if m]) if any(mixed) else set()
    return head_matrix_placement(model, name, param, (heads.query, heads.kv), sizes, {contiguous[c] for c in common})


@dataclass
class Sources:
    linears: set[str] = field(default_factory=set)
    markers: set[str] = field(default_factory=set)
    mids: set[str] = field(default_factory=set)  # per-head norms passed through
    stops: set[str] = field(default_factory=set)  # other layers: their output counts as replicated
    raw: set[str] = field(default_factory=set)  # parameters the code between reads directly (F.conv1d(x, w))


def sources(flow: Flow, fqn: str, linears: AbstractSet[str], per_head: Any = None) -> Sources:
    """The projections and inputs feeding ``fqn``, looking through per-head norms (``q_norm``).

    Any other layer on the way (a norm over the whole width, a convolution) ends the walk:
    what it computes is not a shard of a projection's output.
    """
    found = Sources()
    pending = list(flow.edges.get(fqn, ()))
    seen: set[str] = set()
    while pending:
        origin = pending.pop()
        if origin in seen:
            continue
        seen.add(origin)
        if origin.startswith("in:"):
            found.markers.add(origin[3:])
        elif origin.startswith("param:"):
            found.raw.add(origin[len("param:") :])
        elif origin in linears:
            found.linears.add(origin)
        elif origin in flow.edges:
            if per_head is not None and not per_head(origin):
                found.stops.add(origin)
                continue
            found.mids.add(origin)
            pending.extend(flow.edges[origin])
    return found


def first_marker(flow: Flow) -> str | None:
    """The layer's first ``forward`` parameter: the residual stream."""
    return flow.first_input


def depths(flow: Flow) -> dict[str, int]:
    memo: dict[str, int] = {}

    def depth(node: str, stack: frozenset[str] = frozenset()) -> int:
        if node in memo:
            return memo[node]
        if node in stack or node not in flow.edges:
            return 0
        value = 1 + max((depth(o, stack | {node}) for o in flow.edges[node]), default=0)
        memo[node] = value
        return value

    for node in flow.edges:
        depth(node)
    return memo
