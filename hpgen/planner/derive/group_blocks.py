"""Steps 3 and 4 of deriving a plan: the boundaries of a group and the placements of its parameters.

The group's lowest common module is one block (``R -> R`` in, ``P(sum) -> R`` out) when
its ``forward`` returns the row's output alone (:func:`_clean`). Otherwise
the columns' common module becomes a block whose output stays sharded, or each column
``nn.Linear`` a boundary of its own, and each row ``nn.Linear`` a row-parallel boundary
taking the sharded input. Parameters read directly between the projections go with
their block; replicated layers the sharded body runs through get their gradients reduced.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from hpgen.core.placement import REPLICATE, Placement, shard
from hpgen.planner.derive.column_layouts import PLAIN, ColumnLayout
from hpgen.planner.derive.derive_context import DeriveContext
from hpgen.planner.derive.heads.counts import Heads
from hpgen.planner.derive.heads.input_cuts import cut_heads
from hpgen.planner.derive.heads.parts import Parts
from hpgen.planner.derive.heads.rules import HeadRules
from hpgen.planner.derive.latent import fed_columns, pre_chain, replicated_closure
from hpgen.planner.derive.placed import HeadCut, Kind, Placed, Refused
from hpgen.planner.derive.projection_groups import Group
from hpgen.planner.flow import leaf_kind, top_level_class
from hpgen.planner.flow.runner import function_def
from hpgen.planner.model.load import defined_in
from hpgen.planner.model.modules import is_conv1d, is_nn_linear, join, lca, relative

__all__ = ["GroupLayout", "boundaries"]


@dataclass(frozen=True)
class GroupLayout:
    """How a group is sharded, as step 2 decides it: what :func:`boundaries` places."""

    what: str  # "attention" or "MLP", for the notes
    heads: Heads | None  # (query heads, key/value heads, head_dim) of an attention
    parts: Parts | None  # the heads split into parts working together (differential attention)
    layouts: Mapping[str, ColumnLayout]  # column -> its layout
    gathered: frozenset[str]  # columns reading another column's output whole, gathered on entry
    direct: Mapping[str, Placement]  # parameters the code between the projections reads itself
    head_inputs: Mapping[str, HeadCut]  # per-head inputs made outside the attention -> their cut
    row: ColumnLayout = PLAIN  # the row projections' input: S, or whole heads where they do not divide


@dataclass(frozen=True)
class _Body:
    """A module that can be a group's block: the inputs feeding its columns, the replicated layers before them."""

    inputs: tuple[str, ...]
    pre: frozenset[str]  # norms of the replicated input, latent down-projections (MLA)


def boundaries(ctx: DeriveContext, rules: HeadRules, group: Group, layout: GroupLayout) -> list[Placed]:
    """The plan entries of one group: its block, or its column and row boundaries, with their parameters.

    ``rules``: the decoder layer's head rules. Raises :class:`Refused` where no module around
    the projections can hold what the group needs.
    """
    modules, layer = ctx.modules, group.layer
    cols, rows, mids = group.cols, group.rows, group.mids
    layouts, gathered, direct, what = layout.layouts, layout.gathered, layout.direct, layout.what
    head_inputs = layout.head_inputs
    pre: dict[str, frozenset[str]] = {}  # block FQN -> the replicated layers before its columns
    common = lca(cols | rows)
    if not (common == layer or common.startswith(layer + ".")):
        common = layer
    pieces: list[Placed] = []
    # a gathered column reads the other columns, not the block's inputs: in the group, not walked back
    block = _clean(ctx, common, cols - gathered, rows, mids | gathered, latent=group.latent)
    if head_inputs and block is None and common in cols | rows:
        raise Refused(
            f"the attention takes {', '.join(repr(n) for n in sorted(head_inputs))} (one slice per head, made "
            "outside it), and no module around the projections takes it to cut"
        )
    if block is not None:
        why = f"{what}: column- and row-parallel projections"
        if group.latent:
            names = ", ".join(sorted(relative(p, common) for p in group.latent))
            why += f"; the latent down-projection {names} (shared by the heads) replicated in the block"
        if layout.parts is not None:
            why += f"; {layout.parts.why}"
        placed = Placed(common, Kind.BLOCK, inputs=block.inputs, why=why)
        pre[common] = block.pre
        cut_heads(placed, head_inputs, layout.heads.query if layout.heads else None)
        _params(modules, placed, cols - gathered, rows, layouts, layout.row)
        pieces.append(placed)
        for col in sorted(gathered):  # its own wrapped nn.Linear: the input is gathered on entry
            leaf = Placed(
                col,
                Kind.GATHER_LEAF,
                why=f"{what}: column-parallel over its outputs, one per head; its input, a sharded column's "
                "output, is gathered whole on entry (all-gather; reduce-scatter in backward)",
            )
            _params(modules, leaf, {col}, set(), layouts)
            pieces.append(leaf)
    elif gathered:
        names = ", ".join(relative(c, layer) for c in sorted(gathered))
        raise Refused(
            f"{names} reads a sharded column's output whole, and no module around the projections returns only "
            "the row's output to hold the gather"
        )
    else:
        column = lca(cols)
        inputs = None
        if not any(r == column or r.startswith(column + ".") for r in rows) and column not in cols:
            inputs = _clean(ctx, column, cols, frozenset(), mids, latent=None)
        if inputs is not None:
            pre[column] = inputs.pre
            placed = Placed(
                column,
                Kind.COL_BLOCK,
                inputs=inputs.inputs,
                why=f"{what}: column-parallel projections; "
                "the output stays sharded for the row-parallel projection after it",
            )
            _params(modules, placed, cols, set(), layouts)
            pieces.append(placed)
        else:
            if direct:
                raise Refused(
                    f"the code between the projections reads {relative(sorted(direct)[0], layer)} directly and "
                    "needs a block around it, and no module around the columns returns only their output"
                )
            if mids:
                raise Refused(
                    f"{', '.join(relative(m, layer) for m in sorted(mids))} between the projections needs a "
                    "block to reduce its gradient in, and no module around the columns returns only their output"
                )
            for col in sorted(cols):
                if not is_nn_linear(modules[col]):
                    raise Refused(f"{relative(col, layer)} would be a boundary of its own but is not an nn.Linear")
                placed = Placed(col, Kind.COL_LEAF, why=f"{what}: column-parallel nn.Linear (output stays sharded)")
                _params(modules, placed, {col}, set(), layouts)
                pieces.append(placed)
        for row in sorted(rows):
            if not is_nn_linear(modules[row]):
                raise Refused(f"{relative(row, layer)} would be a boundary of its own but is not an nn.Linear")
            placed = Placed(row, Kind.ROW_LEAF, why=f"{what}: row-parallel nn.Linear (input arrives sharded)")
            _params(modules, placed, set(), {row}, layouts, layout.row)
            pieces.append(placed)
        if head_inputs:  # the attention around the leaves still gets its per-head input cut
            if not (top_level_class(type(modules[common])) and defined_in(type(modules[common]), ctx.source)):
                raise Refused(
                    f"{relative(common, layer) or 'the layer'} takes a per-head input to cut, but its class is "
                    "not a top-level class of the lowered file, which is where hpgen lower rewrites classes"
                )
            placed = Placed(common, Kind.HEADS, why=f"{what}: the body between the sharded projections")
            cut_heads(placed, head_inputs, layout.heads.query if layout.heads else None)
            pieces.append(placed)
    for name, placement in direct.items():
        owner = next((p for p in pieces if p.kind.holds_group and name.startswith(p.fqn + ".")), None)
        if owner is None:
            raise Refused(f"{relative(name, layer)} is read directly outside the block of its projections")
        if placement != REPLICATE:
            owner.params[relative(name, owner.fqn)] = placement
        else:
            owner.grad_reduce.add(relative(name, owner.fqn))
    for piece in pieces:  # replicated layers the sharded body runs through: their gradients are partial
        if piece.kind.holds_group:
            for leaf in pre.get(piece.fqn, frozenset()) | mids:
                if not leaf.startswith(piece.fqn + "."):
                    continue
                names = {join(relative(leaf, piece.fqn), n) for n, _ in modules[leaf].named_parameters()}
                if leaf in mids and rules.scales_heads(leaf):
                    piece.params.update(dict.fromkeys(names, shard(0)))  # [heads, d]: this rank's heads' rows
                else:
                    piece.grad_reduce |= names
    return pieces


def _params(
    modules: Mapping[str, Any],
    placed: Placed,
    cols: Collection[str],
    rows: Collection[str],
    layouts: Mapping[str, ColumnLayout],
    row_layout: ColumnLayout = PLAIN,
) -> None:
    """The placements of the columns' and rows' weights and biases, named relative to ``placed`` (the rows' input
    cut by ``row_layout``)."""
    for col in sorted(cols):
        module = modules[col]
        dim = 1 if is_conv1d(module) else 0
        placed.params[join(relative(col, placed.fqn), "weight")] = layouts[col].placement(dim)
        if getattr(module, "bias", None) is not None:
            placed.params[join(relative(col, placed.fqn), "bias")] = layouts[col].placement(0)
    for row in sorted(rows):
        module = modules[row]
        dim = 0 if is_conv1d(module) else 1
        placed.params[join(relative(row, placed.fqn), "weight")] = row_layout.placement(dim)
        if getattr(module, "bias", None) is not None:
            name = join(relative(row, placed.fqn), "bias")
            if row != placed.fqn and _own_forward(module):
                # parallelize adds a deferred bias once after the reduction by taking it out of nn.Linear.forward
                raise Refused(
                    f"{relative(row, placed.fqn)} ({type(module).__name__}) overrides nn.Linear.forward and has a "
                    "bias, which a row-parallel cut adds once after the reduction: hpgen cannot take it out of that forward"
                )
            placed.params[name] = REPLICATE
            placed.deferred.add(name)


def _own_forward(module: Any) -> bool:
    """An ``nn.Linear`` subclass with a ``forward`` of its own (Falcon's ``FalconLinear``: ``input @ weight.T + bias``)."""
    import torch.nn as nn

    return isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward

def _clean(
    ctx: DeriveContext,
    fqn: str,
    cols: frozenset[str],
    rows: frozenset[str],
    mids: frozenset[str],
    *,
    latent: frozenset[str] | None,
) -> _Body | None:
    """The inputs of ``fqn`` feeding the columns when it can be the group's block, else None.

    ``latent`` given (the group's latent down-projections, maybe none): the block holds the rows
    and returns their output alone; None: it holds only the columns and returns their (sharded)
    output alone.
    """
    full = latent is not None
    module = ctx.modules.get(fqn)
    if module is None or leaf_kind(module, ctx.read) != "source" or not fqn:
        return None
    if not (top_level_class(type(module)) and defined_in(type(module), ctx.source)):
        return None  # read from another file or under a module-level if: hpgen lower does not rewrite it
    if not returns_addressable(type(module)):
        return None  # returns a list: the plan addresses a value or the first item of a tuple
    flow = ctx.flow(fqn)
    group = cols | rows | mids
    pre = set()
    latent = latent or set()
    before = replicated_closure(flow, latent, group) | fed_columns(flow, cols, group) if full else set()
    for leaf, origins in flow.edges.items():
        if leaf in group:
            continue
        params = [p for p in ctx.modules[leaf].parameters()]
        if origins and all(o.startswith("in:") for o in origins) and all(p.dim() == 1 for p in params):
            pre.add(leaf)  # a norm of the replicated input before the columns
            continue
        if leaf in before:
            pre.add(leaf)  # a latent down-projection (and its norm), replicated in the block
            continue
        return None
    outputs = flow.result.item(0).whole()
    allowed = rows if full else cols | mids
    if not outputs or not outputs <= allowed | {o for o in outputs if o.startswith("in:")}:
        return None
    inputs: set[str] = set()
    for col in cols:
        pending, seen = list(flow.inputs.get(col, ())), set()
        if any(o in pre for o in pending) and any(o in latent for o in pre_chain(flow, pending, pre)):
            # an up-projection of a latent (MLA's kv_b_proj): its data comes through the latent; the
            # other markers mixed in come from the latent cache's update (cache, kwargs), not data
            pending = [o for o in pending if not o.startswith("in:")]
        while pending:  # through the replicated layers before the columns, to the block's inputs
            origin = pending.pop()
            if origin in seen:
                continue
            seen.add(origin)
            if origin.startswith("in:"):
                inputs.add(origin[3:])
            elif origin in pre:
                pending.extend(flow.inputs.get(origin, ()))
            else:
                return None
    if not inputs:
        return None
    if full and any(o.startswith("in:") for o in outputs):
        return None  # a residual (or another input) added to the output inside the module
    if not full and any(o[3:] in inputs for o in outputs if o.startswith("in:")):
        return None
    return _Body(tuple(sorted(inputs)), frozenset(pre))


def returns_addressable(cls: type) -> bool:
    """Whether every ``return`` of the class's ``forward`` gives a value or a tuple (not a list display): a plan
    addresses a block's output as a value or the first item of a tuple."""
    function = function_def(cls, "forward")
    if function is None:
        return False
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and node.value is not None:
            value = node.value
            if isinstance(value, (ast.List, ast.ListComp)) or (
                isinstance(value, ast.BinOp) and any(isinstance(v, ast.List) for v in (value.left, value.right))
            ):
                return False
            if isinstance(value, ast.Name) and _assigned_list(function, value.id):
                return False  # ``outputs = (out,) ...; return outputs``: the plan would move the whole tuple
    return True


def _assigned_list(function: ast.FunctionDef, name: str) -> bool:
    """Whether ``name`` is ever bound to a list or tuple display (or a concatenation of them)."""
    displays = (ast.List, ast.ListComp, ast.Tuple)
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
            if isinstance(value, displays) or (
                isinstance(value, ast.BinOp) and any(isinstance(v, displays) for v in (value.left, value.right))
            ):
                return True
    return False
