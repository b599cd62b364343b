"""``hpgen plan --ep N --attn-dp``: data-parallel attention around expert-parallel experts.

The serving layout of large MoE models (SGLang's DP attention): the decoder stack (embedding,
attention, norms, routers, dense layers) runs on each rank's share of the batch, and the
experts, sharded by expert over the same axis, run on every rank's tokens::

    rank 0: seqs 0-1 ─ attention ─ router ─┐                 ┌─ its tokens back ─ ...
    rank 1: seq  2   ─ attention ─ router ─┴─ all_gather ─ experts (own ids) ─ reduce_scatter

The ``--ep`` plan is rewritten: its experts entries gather their inputs on the flattened
token dim (``S(0) -> R``) and reduce-scatter their partial sum back (``P(sum) -> S(0)``; the
scatter returns each rank exactly the tokens it gave); one entry on the inner model splits
the batch at its entry (``R -> S(0)``), gathers ``last_hidden_state`` at its exit, runs
through ``hpgen.runtime.local.batch_parallel`` (a placeholder sequence on a rank whose share
is empty) and sums the gradients of every replicated parameter it holds over the axis.

With ``--tp M`` (``tp_plan``: what ``hpgen plan --tp M`` writes) the mesh is ``(ep, tp)``:
inside each data-parallel group of ``tp`` ranks, the decoder layers' attention and dense
blocks take the ``--tp`` plan's entries (heads split where they divide, as ``--tp`` alone
decides), and each layer's gradient sums name ``ep`` alone, so a weight sharded on ``tp``
is never summed over ``tp``. Embedding, norms, routers and ``lm_head`` stay whole, and the
experts are sharded over ``ep`` (each ``tp`` rank of a group runs its group's experts).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from hpgen.core.errors import HpgenError

__all__ = ["BATCH_INPUTS", "data_parallel_attention"]

# the inner model's forward arguments that carry the batch on dim 0 (split where present)
BATCH_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
_EXPERTS_FN = "hpgen.runtime.local.experts_parallel"


def data_parallel_attention(
    model: Any, plan: dict[str, Any], name: str, tp_plan: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``plan`` (an ``--ep`` plan document of ``model``) rewritten for data-parallel attention;
    with ``tp_plan`` (a ``--tp`` plan document of ``model``), attention tensor-parallel inside
    each data-parallel group (see the module docstring)."""
    plan = copy.deepcopy(plan)
    experts = [inj for inj in plan.get("injections", []) if _target(inj) == _EXPERTS_FN]
    if not experts:
        raise HpgenError(f"{name}: --attn-dp needs experts to shard (--ep), and the plan has none")
    axes = {inj["local_compute_fn"].get("axis", "ep") for inj in experts}
    if plan["mesh_dim_names"] != [*axes] or len(axes) != 1:
        raise HpgenError(
            f"{name}: --attn-dp runs on the expert axis alone; give --ep without --tp or --sp "
            f"(the plan's axes: {', '.join(plan['mesh_dim_names'])})"
        )
    axis = axes.pop()
    others = sorted(key for key in plan["param_plan"] if key not in {inj["match"] for inj in experts})
    if others:
        raise HpgenError(f"{name}: --attn-dp: the --ep plan shards {', '.join(others)} too, which it cannot keep")
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    if inner is None:
        raise HpgenError(f"{name}: --attn-dp: no inner model (base_model_prefix) to split the batch at")
    modules = dict(model.named_modules())
    whole, shard = {axis: "R"}, {axis: "S(0)"}
    expert_params: set[str] = set()
    for inj in experts:
        entry = plan["param_plan"][inj["match"]]
        module = next(m for fqn, m in modules.items() if fqn and _matches(inj["match"], fqn))
        inputs = [p for p in _forward_params(module) if p not in ("self",)]
        (output,) = entry["out_src"]
        entry["in_src"] = {n: shard for n in inputs}
        entry["in_dst"] = {n: whole for n in inputs}
        entry["out_dst"] = {output: shard}
        expert_params |= {f"{inj['match']}.{p}" for p in entry.get("params", {})}
    takes = _forward_params(inner)
    batch = [n for n in BATCH_INPUTS if n in takes]
    if "input_ids" not in batch:
        raise HpgenError(f"{name}: --attn-dp: {type(inner).__name__}.forward takes no input_ids")
    replicated = [
        n
        for n, _ in inner.named_parameters()
        if not any(_matches(key, f"{prefix}.{n}") for key in expert_params)
    ]
    # the decoder layers' parameters by a pattern entry of their own (the plan holds for any
    # layer count); each gradient summed over the axis, named since a layer's body is not sharded
    layers = _layer_list(inner)
    per_layer = sorted({n.split(".", 2)[2] for n in replicated if layers and n.startswith(f"{layers}.")})
    if per_layer:
        plan["param_plan"][f"{prefix}.{layers}.*"] = {"grad_reduce_params": {n: [axis] for n in per_layer}}
    plan["param_plan"][prefix] = {
        "in_src": {n: whole for n in batch},
        "in_dst": {n: shard for n in batch},
        "out_src": {"last_hidden_state": shard},
        "out_dst": {"last_hidden_state": whole},
        "grad_reduce_params": sorted(n for n in replicated if not (layers and n.startswith(f"{layers}."))),
    }
    plan.setdefault("boundary_classes", {})
    plan["injections"] = [
        {"match": prefix, "local_compute_fn": {"_target_": "hpgen.runtime.local.batch_parallel", "axis": axis}},
        *plan["injections"],
    ]
    if tp_plan is not None:
        matches = {inj["match"] for inj in experts}
        _attention_tensor_parallel(plan, tp_plan, f"{prefix}.{layers}." if layers else None, axis, matches, name)
    comments = plan.setdefault("comments", {})
    comments["attn_dp"] = (
        f"the batch split over {axis!r} at {prefix}'s entry (one batch on every rank; for serving, each rank its "
        f"own requests, make {prefix}'s in_src and out_dst S(0)); experts gather every rank's tokens"
    )
    return plan


def _attention_tensor_parallel(
    plan: dict[str, Any], tp_plan: dict[str, Any], layers: str | None, axis: str, experts: set[str], name: str
) -> None:
    """Add ``tp_plan``'s entries inside the decoder layers (attention, dense MLPs), but the
    ``experts`` entries and those around them (MoE blocks), on a second mesh axis."""
    (tp_axis,) = tp_plan["mesh_dim_names"]
    if tp_axis == axis or layers is None:
        raise HpgenError(
            f"{name}: --attn-dp --tp: needs the experts on an axis other than {tp_axis!r} and one decoder layer list"
        )
    taken = []
    for key, entry in tp_plan["param_plan"].items():
        if not key.startswith(layers) or key in plan["param_plan"]:
            continue  # outside the layers: whole and data-parallel, as without --tp
        if any(e.startswith(key + ".") or key.startswith(e + ".") for e in experts):
            continue  # the experts' (or a block holding them): sharded on the expert axis
        plan["param_plan"][key] = copy.deepcopy(entry)
        taken.append(key)
        if key in tp_plan.get("boundary_classes", {}):
            plan["boundary_classes"][key] = tp_plan["boundary_classes"][key]
    if not taken:
        raise HpgenError(f"{name}: --attn-dp --tp: the --tp plan shards nothing in the decoder layers but the experts")
    plan["injections"] += [inj for inj in tp_plan.get("injections", []) if inj["match"] in taken]
    plan["mesh_dim_names"] = [axis, tp_axis]
    plan["comments"]["attn_dp_tp"] = (
        f"inside each data-parallel group, {', '.join(sorted(taken))} tensor-parallel over {tp_axis!r} "
        f"(the --tp plan's entries); the layers' gradient sums name {axis!r} alone"
    )


def _layer_list(inner: Any) -> str | None:
    """The attribute of ``inner`` holding its decoder layers (an ``nn.ModuleList``), if one."""
    from torch import nn

    lists = [name for name, child in inner.named_children() if isinstance(child, nn.ModuleList)]
    return lists[0] if len(lists) == 1 else None


def _target(injection: dict[str, Any]) -> str:
    fn = injection.get("local_compute_fn")
    return fn.get("_target_", "") if isinstance(fn, dict) else str(fn)


def _forward_params(module: Any) -> list[str]:
    return [
        p.name
        for p in inspect.signature(type(module).forward).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
    ]


def _matches(pattern: str, fqn: str) -> bool:
    from hpgen.core.plan import fqn_matches

    return fqn_matches(pattern, fqn)
