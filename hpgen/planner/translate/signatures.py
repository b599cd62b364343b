"""Inputs and outputs of a translated boundary: its transitions, by its kind and style.

:func:`set_translated_io` gives a translated boundary its transitions, its names read from
its class's ``forward`` (:class:`~hpgen.planner.translate.forwards.Forwards`): a block's
input is ``R -> R`` and its output ``P(sum) -> R`` (from the sequence shards with
``--sp``); a wrapped ``nn.Linear`` / ``nn.Embedding`` gets the placements of its style.
"""

from __future__ import annotations

from hpgen.core.placement import PARTIAL_SUM, REPLICATE, shard
from hpgen.core.plan_entries import Layout
from hpgen.planner.translate.axis_checks import is_attention
from hpgen.planner.translate.boundary_record import Boundary
from hpgen.planner.translate.plan_context import PlanContext
from hpgen.planner.translate.styles import EMBEDDING_LEAVES, LINEAR_LEAVES, StyleRules

__all__ = ["set_translated_io"]


def set_translated_io(context: PlanContext, rules: StyleRules, boundary: Boundary) -> None:
    """Fill in ``boundary``'s inputs and outputs from its kind and style (``--sp`` boundaries have theirs)."""
    if boundary.kind == "sp":
        return
    axes = sorted(boundary.axes)
    replicated = Layout.same(axes, REPLICATE)
    partial = Layout.same(axes, PARTIAL_SUM)
    if boundary.kind == "linear":
        boundary.wrapped_as = "nn.Linear"
        if LINEAR_LEAVES[rules.rules[boundary.fqn].style] == "col":
            boundary.inputs["input"] = (replicated, replicated)
            boundary.outputs["output"] = (Layout.same(axes, shard(-1)), replicated)
        else:
            boundary.inputs["input"] = (replicated, Layout.same(axes, shard(-1)))
            boundary.outputs["output"] = (partial, replicated)
        return
    if boundary.kind == "identity":  # an identity expert: its replicated output counts once in the sum
        boundary.wrapped_as = "nn.Identity"
        boundary.outputs["output"] = (replicated, partial)
        return
    if boundary.kind == "embedding":
        boundary.wrapped_as = "nn.Embedding"
        vocab_rows = EMBEDDING_LEAVES[rules.rules[boundary.fqn].style] == 0
        boundary.outputs["output"] = (partial if vocab_rows else Layout.same(axes, shard(-1)), replicated)
        return
    forwards = context.forwards
    parameters = forwards.parameters(boundary.module, boundary.fqn)
    inputs = [parameters[0]]
    if boundary.kind == "experts" and len(parameters) >= 3:
        inputs.append(parameters[2])  # the routing weights: their gradient is partial too
    elif boundary.kind == "block" and not is_attention(boundary):
        # a required input of an MLP-like block (shared experts' gating weights) meets the sharded
        # features too, so its gradient is partial on each rank: R -> R reduces it
        inputs += forwards.required_after_first(boundary.module, boundary.fqn)
    for position, name in enumerate(inputs):
        src = replicated.with_axis("tp", shard(1)) if boundary.sp_input and position == 0 else replicated
        boundary.inputs[name] = (src, replicated)
    names = forwards.outputs(boundary.module, boundary.fqn)
    boundary.out_names = names if len(names) > 1 else None
    dst = replicated
    if boundary.sp_input:
        dst = replicated.with_axis("tp", shard(1))
        # a deferred bias added to a sequence shard gets only that shard's gradient
        boundary.grad_reduce.update(boundary.deferred)
    boundary.outputs[names[0]] = (partial, dst)
