"""Translating transformers' plan into boundaries: the blocks its styles imply, and the parameters inside them.

- a ``rowwise`` layer reduces: the lowest module above it that holds a ``colwise`` layer
  (``mlp`` for ``mlp.down_proj``) becomes a *block* boundary, ``R -> R`` at its input
  (Megatron's *f*: identity forward, all-reduce backward) and ``P(sum) -> R`` at its
  output, and the ``colwise`` layers below it shard inside it. A ``colwise`` layer that
  reaches the reducing layer through a sibling module widens the block to their common
  parent. An experts module (``moe_tp_experts``, ``ep_dispatch_experts``) and an
  ``all_reduce`` module are blocks themselves;
- ``colwise_gather_output``, ``rowwise_split_input`` and ``embedding_*`` are boundaries of
  one ``nn.Linear`` / ``nn.Embedding``, which ``parallelize`` wraps;
- a replicated parameter inside a sharded boundary sees only its rank's share of the
  gradient: it goes to ``grad_reduce_params`` (transformers gets this from an all-reduce
  in every ``colwise`` layer's backward; hpgen has one at the boundary, so every
  parameter the plan leaves replicated inside it is listed);
- a row-parallel bias stays replicated and goes to ``deferred_bias_params``.

Three steps, in this order: :func:`find_boundaries` returns the boundaries,
:func:`place_params` and :func:`implicit_grad_reduce` fill in their parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpgen.core.errors import HpgenError
from hpgen.core.placement import REPLICATE
from hpgen.core.plan_entries import Layout
from hpgen.planner.model.modules import relative
from hpgen.planner.translate.boundary_record import Boundary, add_boundary, enclosing
from hpgen.planner.translate.styles import (
    COLWISE,
    EMBEDDING_LEAVES,
    EXPERTS,
    GRAD_REDUCE,
    LINEAR_LEAVES,
    ROWWISE,
    SHARDING,
    StyleRules,
    placement,
)

if TYPE_CHECKING:
    from hpgen.planner.translate.plan_context import PlanContext

__all__ = ["find_boundaries", "implicit_grad_reduce", "place_params"]


def find_boundaries(context: PlanContext, rules: StyleRules) -> dict[str, Boundary]:
    """Blocks (a reduction at their output) and leaves (one wrapped layer), from the rules, by FQN.

    A rowwise layer's block is its lowest ancestor holding a colwise layer (``mlp`` for
    ``mlp.down_proj``, also when the projections sit one wrapper deeper, as in
    ``mlp.down_proj.linear``). A colwise layer no block holds (its output reaches the
    rowwise layer through a sibling module, as ``q_proj`` reaches
    ``output_projection.o_proj``) widens the nearest block below a common ancestor to
    that ancestor. Neither search climbs out of a ``ModuleList`` element (a decoder layer).
    """
    import torch.nn as nn

    modules, name = context.modules, context.name
    boundaries: dict[str, Boundary] = {}

    def add(fqn: str, kind: str) -> Boundary:
        return add_boundary(context, boundaries, fqn, kind)

    columns = sorted(
        fqn if fqn in modules else fqn.rpartition(".")[0]
        for fqn, rule in rules.rules.items()
        if rule.style in COLWISE and not rule.via_module
    )
    for fqn, rule in sorted(rules.rules.items()):
        if fqn not in modules:
            continue  # a parameter: placed by place_params
        module, style = modules[fqn], rule.style
        if style in ROWWISE:
            add(_block_of_rowwise(context, fqn, columns), "block").axes.add(rule.axis)
        elif style in EXPERTS or style == "all_reduce":
            boundary = add(fqn, "experts" if style in EXPERTS else "block")
            boundary.axes.add(rule.axis)
            if style == "ep_dispatch_experts":
                boundary.injection_axis = rule.axis
        elif style == "moe_identity_expert":
            if not isinstance(module, nn.Identity) or enclosing(boundaries, fqn) is None:
                raise HpgenError(
                    f"{name}: {style} on {fqn} ({type(module).__name__}): hpgen maps it on an nn.Identity "
                    "inside an experts module"
                )
            add(fqn, "identity").axes.add(rule.axis)
        elif style in LINEAR_LEAVES:
            if not isinstance(module, nn.Linear):
                raise HpgenError(
                    f"{name}: {style} on {fqn} ({type(module).__name__}): hpgen wraps only nn.Linear "
                    "as a column- or row-parallel layer of its own"
                )
            add(fqn, "linear").axes.add(rule.axis)
        elif style in EMBEDDING_LEAVES:
            if not isinstance(module, nn.Embedding):
                raise HpgenError(f"{name}: {style} on {fqn} ({type(module).__name__}), which is not an nn.Embedding")
            add(fqn, "embedding").axes.add(rule.axis)
    # A row-sharded parameter with a rule of its own (``experts.down_proj``) reduces in the
    # module holding it, unless a boundary above already does.
    for fqn, rule in sorted(rules.rules.items()):
        if fqn in modules or rule.via_module or rule.style not in ROWWISE:
            continue
        owner = fqn.rpartition(".")[0]
        if enclosing(boundaries, owner) is None:
            add(owner, "block").axes.add(rule.axis)
    for column in columns:
        if enclosing(boundaries, column) is None:
            _widen_for(context, boundaries, column)
    for boundary in boundaries.values():
        if len(boundary.axes) > 1:
            raise HpgenError(
                f"{name}: {boundary.fqn} is sharded on several axes ({', '.join(sorted(boundary.axes))}); "
                "hpgen plans one axis per block"
            )
    # Experts on an axis of their own also shard their intermediate dim on tp, when
    # the TP plan does: the one kind of block on two axes.
    for fqn, rule in sorted(rules.expert_tp.items()):
        boundary = enclosing(boundaries, fqn if fqn in modules else fqn.rpartition(".")[0])
        if boundary is not None and boundary.kind == "experts" and rule.style in EXPERTS | SHARDING:
            boundary.axes.add(rule.axis)
    return boundaries


def _ancestors(modules: Mapping[str, Any], fqn: str, *, include_self: bool = False) -> list[str]:
    """The modules above ``fqn`` (and ``fqn`` itself), nearest first, up to the first
    ``ModuleList`` element: a decoder layer is as far as a block may reach."""
    import torch.nn as nn

    found = []
    path = fqn if include_self else fqn.rpartition(".")[0]
    while path in modules and path:
        found.append(path)
        parent = path.rpartition(".")[0]
        if "." in path and isinstance(modules.get(parent), nn.ModuleList):
            break
        path = parent
    return found


def _block_of_rowwise(context: PlanContext, fqn: str, columns: list[str]) -> str:
    for ancestor in _ancestors(context.modules, fqn):
        if any(column == ancestor or column.startswith(ancestor + ".") for column in columns):
            return ancestor
    raise HpgenError(
        f"{context.name}: rowwise {fqn} has no colwise layer in an enclosing module to shard its input; "
        "hpgen has no block to put it in"
    )


def _widen_for(context: PlanContext, boundaries: dict[str, Boundary], column: str) -> None:
    """Make the nearest ancestor of ``column`` that holds a block the block instead."""
    for ancestor in _ancestors(context.modules, column, include_self=True):
        inner = [key for key, b in boundaries.items() if key.startswith(ancestor + ".") and b.kind == "block"]
        if not inner:
            continue
        axes = {axis for key in inner for axis in boundaries[key].axes}
        for key in inner:
            del boundaries[key]
        add_boundary(context, boundaries, ancestor, "block").axes.update(axes)
        return
    raise HpgenError(
        f"{context.name}: colwise {column} is sharded, but no rowwise layer or experts module near it reduces "
        "its output: hpgen has no block to put it in"
    )


def place_params(context: PlanContext, rules: StyleRules, boundaries: dict[str, Boundary]) -> None:
    """Each sharded parameter's layout in the boundary around it; the replicated parameters the rules
    mark (``replicated_with_grad_allreduce``) in its ``grad_reduce``; row-parallel biases deferred."""
    name = context.name
    params = dict(context.model.named_parameters(remove_duplicate=False))
    expert_rules = [(fqn, rule) for fqn, rule in sorted(rules.expert_tp.items()) if fqn not in context.modules]
    for fqn, rule in [*sorted(rules.rules.items()), *expert_rules]:
        style = rule.style
        if fqn in context.modules:
            if style in GRAD_REDUCE:
                for param_name, _ in context.modules[fqn].named_parameters(recurse=False):
                    _add_grad_reduce(name, boundaries, f"{fqn}.{param_name}", style)
            continue
        if style not in SHARDING:
            if style in GRAD_REDUCE and not rule.via_module:
                _add_grad_reduce(name, boundaries, fqn, style)
            continue  # markers (experts, all_reduce) and no-ops; module rules handled above
        owner, _, leaf = fqn.rpartition(".")
        boundary = enclosing(boundaries, owner)
        if boundary is None:
            raise HpgenError(
                f"{name}: {style} {fqn} is sharded, but no rowwise layer or experts module above it "
                "reduces its output: hpgen has no boundary to put it in"
            )
        if rule.axis not in boundary.axes:
            raise HpgenError(
                f"{name}: {fqn} is sharded on {rule.axis} inside {boundary.fqn}, which is sharded on "
                f"{', '.join(sorted(boundary.axes))}"
            )
        inner = relative(fqn, boundary.fqn)
        layout = placement(style, params[fqn].ndim, leaf)
        boundary.params[inner] = boundary.params.get(inner, Layout(())).with_axis(rule.axis, layout)
        if layout == REPLICATE:  # a row-parallel bias: added once, after the reduction
            boundary.deferred.add(inner)


def _add_grad_reduce(name: str, boundaries: dict[str, Boundary], fqn: str, style: str) -> None:
    boundary = enclosing(boundaries, fqn.rpartition(".")[0])
    if boundary is None or boundary.kind in ("linear", "embedding"):
        raise HpgenError(f"{name}: {style} {fqn} sits in no sharded block whose gradient it could reduce over")
    boundary.grad_reduce.add(relative(fqn, boundary.fqn))


def implicit_grad_reduce(boundaries: dict[str, Boundary]) -> None:
    """Every parameter a boundary leaves replicated in its sharded body gets a partial gradient.

    In a block, each rank's backward runs through its shard of the heads or features
    only; in a wrapped ``nn.Embedding`` subclass (a norm after the lookup), through its
    vocabulary rows only. Parameters of boundaries nested inside are theirs to list.
    """
    for boundary in boundaries.values():
        for name, _ in boundary.module.named_parameters():
            fqn = f"{boundary.fqn}.{name}"
            if enclosing(boundaries, fqn.rpartition(".")[0]) is boundary and name not in boundary.params:
                boundary.grad_reduce.add(name)
