"""Translating transformers' styles: which style applies to which module or parameter, on which mesh axis.

:data:`SUPPORTED_STYLES` lists each style transformers defines that hpgen maps, with what
it becomes. :func:`style_rules` expands the model's ``tp_plan`` and ``ep_plan`` over its
concrete modules and parameters exactly as transformers' ``_expand_parallel_plan`` does
(``layers.*.mlp.down_proj`` matches only the layers that have one), and puts the expert
rules on their axis: the ``tp`` axis (``--ep`` equal to ``--tp``) or one of their own
(``--ep-axis``), where the experts keep the TP plan's intermediate-dim rules on ``tp``;
it returns them as one :class:`StyleRules`. :func:`placement` is the placement of one
parameter under one style.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpgen.core.errors import HpgenError
from hpgen.core.placement import REPLICATE, Placement, shard, strided_shard
from hpgen.planner.model.modules import generic
from hpgen.planner.translate.expert_tp import model_tp_plan

__all__ = [
    "COLWISE",
    "EMBEDDING_LEAVES",
    "EXPERTS",
    "EXPERTS_PARALLEL",
    "GRAD_REDUCE",
    "LINEAR_LEAVES",
    "ROWWISE",
    "SHARDING",
    "SUPPORTED_STYLES",
    "Rule",
    "StyleRules",
    "ep_axis_name",
    "placement",
    "style_rules",
    "supported_styles_text",
]

# Each style transformers defines (transformers/distributed/tensor_parallel.py and
# expert_parallel.py) that hpgen maps, with what it becomes.
SUPPORTED_STYLES: dict[str, str] = {
    "colwise": "weight and bias S(ndim-2): output features sharded inside the enclosing boundary",
    "packed_colwise": "fused weight SS(ndim-2,2) (each rank takes its chunk of every packed block)",
    "rowwise": "weight S(-1); bias R, deferred; the parent module becomes a boundary with output P(sum) -> R",
    "packed_rowwise": "fused weight SS(-1,2) (transposed experts' gate_up_proj)",
    "colwise_gather_output": "column-parallel nn.Linear boundary: weight S(0), output S(-1) -> R",
    "colwise_rep": "as colwise_gather_output",
    "rowwise_split_input": "row-parallel nn.Linear boundary: input R -> S(-1), weight S(1), output P(sum) -> R",
    "rowwise_rep": "as rowwise_split_input",
    "embedding_rowwise": "vocab-parallel nn.Embedding boundary: weight S(0), output P(sum) -> R",
    "embedding_colwise": "nn.Embedding boundary sharded on the embedding dim: weight S(1), output S(-1) -> R",
    "replicated_with_grad_allreduce": "parameters listed in grad_reduce_params of the enclosing boundary",
    "mla_kv_a_proj": "replicated MLA projection: grad_reduce_params of the enclosing attention boundary",
    "moe_tp_experts": "experts boundary: inputs and routing weights R -> R, output P(sum) -> R",
    "all_reduce": "boundary whose output is reduced: P(sum) -> R",
    "moe_identity_expert": "nn.Identity expert inside an experts boundary: output R -> P(sum) (divided by the axis "
    "size, so the experts' reduction counts it once)",
    "grouped_gemm": "expert parameters S(0): whole experts per rank",
    "ep_dispatch_experts": "experts boundary running hpgen.runtime.local.experts_parallel, output P(sum) -> R",
    "ep_router": "nothing: experts_parallel remaps routed expert ids itself (older transformers plans)",
    "local_params": "nothing: hpgen bodies always run on local tensors",
    "replicate": "nothing: the parameter stays replicated",
}

COLWISE = {"colwise", "packed_colwise"}
ROWWISE = {"rowwise", "packed_rowwise"}
LINEAR_LEAVES = {
    "colwise_gather_output": "col",
    "colwise_rep": "col",
    "rowwise_split_input": "row",
    "rowwise_rep": "row",
}
EMBEDDING_LEAVES = {"embedding_rowwise": 0, "embedding_colwise": 1}
EXPERTS = {"moe_tp_experts", "ep_dispatch_experts"}
GRAD_REDUCE = {"replicated_with_grad_allreduce", "mla_kv_a_proj"}
NOTHING = {"ep_router", "local_params", "replicate"}
SHARDING = COLWISE | ROWWISE | {"grouped_gemm"} | set(LINEAR_LEAVES) | set(EMBEDDING_LEAVES)

EXPERTS_PARALLEL = "hpgen.runtime.local.experts_parallel"


def supported_styles_text() -> str:
    """The supported style names, for error messages."""
    return ", ".join(sorted(SUPPORTED_STYLES))


@dataclass(frozen=True)
class Rule:
    """One expanded rule: the style on a concrete module or parameter, and its mesh axis.

    ``via_module`` marks a parameter covered by its module's rule (``q_proj: colwise``
    covers ``q_proj.weight`` and ``q_proj.bias``) rather than by a rule of its own.
    """

    style: str
    axis: str
    via_module: bool = False


def placement(style: str, ndim: int, leaf: str) -> Placement:
    """The placement of one parameter under one style (transformers' ``shard_param``)."""
    if style in ("colwise", "colwise_gather_output", "colwise_rep"):
        return shard(max(ndim - 2, 0))
    if style == "packed_colwise":
        return strided_shard(max(ndim - 2, 0), 2)
    if style in ("rowwise", "rowwise_split_input", "rowwise_rep"):
        return REPLICATE if leaf == "bias" else shard(ndim - 1)
    if style == "packed_rowwise":
        return REPLICATE if ndim == 1 else strided_shard(ndim - 1, 2)
    if style == "grouped_gemm":
        return shard(0)
    if style in EMBEDDING_LEAVES:
        return shard(EMBEDDING_LEAVES[style])
    raise AssertionError(style)  # only sharding styles reach here


@dataclass(frozen=True)
class StyleRules:
    """A model's ``tp_plan``/``ep_plan`` on concrete names: what the translator's later steps read.

    ``rules``: module or parameter name -> its rule. ``expert_tp``: with experts on an axis
    of their own, the TP plan's rules on their parameters (their intermediate dim, on
    ``tp``): a two-axis block. ``mesh``: the axes, in mesh order; ``sizes``: axis -> the
    size the plan must divide (absent without ``--tp``). ``written``: the patterns of the TP
    rules hpgen wrote itself where transformers' plan leaves experts out
    (:mod:`hpgen.planner.translate.expert_tp`), so that a note on them does not quote transformers.
    """

    rules: dict[str, Rule]
    mesh: tuple[str, ...]
    sizes: dict[str, int]
    expert_tp: dict[str, Rule] = field(default_factory=dict)
    written: frozenset[str] = frozenset()


def ep_axis_name(name: str, ep_axis: str | None, ep: int | None) -> str | None:
    """The experts' own axis name, checked (``tp`` means sharing it, as no name does)."""
    from hpgen.core.plan import RESERVED_AXIS_NAMES, is_identifier

    if ep_axis is None:
        return None
    if ep is None:
        raise HpgenError(f"{name}: --ep-axis names the experts' axis; give --ep too")
    if not is_identifier(ep_axis) or ep_axis in RESERVED_AXIS_NAMES or ep_axis.startswith("__"):
        raise HpgenError(f"{name}: --ep-axis {ep_axis!r} is not a usable axis name (an identifier)")
    return None if ep_axis == "tp" else ep_axis


def style_rules(
    model: Any, modules: Mapping[str, Any], name: str, *, tp: int | None, ep: int | None, ep_axis: str | None
) -> StyleRules:
    """The rules of ``model``'s plans on its concrete module and parameter names, and the mesh.

    ``ep_axis`` as :func:`ep_axis_name` returns it. With it (and ``tp``) the experts get
    the EP plan on that axis and keep the TP plan's rules on their parameters
    (``packed_colwise``/``rowwise``: the intermediate dim) on ``tp``.
    """
    config = getattr(model, "config", None)
    tp_plan = model_tp_plan(model, modules)  # transformers >= 5.25 leaves the experts out (see expert_tp)
    written = frozenset(set(tp_plan) - set(getattr(model, "tp_plan", None) or {}))
    ep_plan = dict(getattr(model, "ep_plan", None) or {})
    use_tp = tp is not None or ep is None
    if use_tp and not tp_plan:
        raise HpgenError(f"{name}: {type(config).__name__} has no base_model_tp_plan (no tensor-parallel plan)")
    if ep is not None and not ep_plan:
        raise HpgenError(f"{name}: {type(config).__name__} has no base_model_ep_plan (no expert-parallel plan)")

    def expand(plan: Mapping[str, str], axis: str) -> dict[str, Rule]:
        return _expand(modules, name, plan, axis)

    if ep is None:
        return StyleRules(expand(tp_plan, "tp"), ("tp",), {"tp": tp} if tp is not None else {}, written=written)
    if not use_tp:
        axis = ep_axis or "ep"
        return StyleRules(expand(ep_plan, axis), (axis,), {axis: ep})
    # EP rules win over TP rules on the same modules and below them (as in transformers).
    experts = re.compile(rf"(?:{'|'.join(map(re.escape, ep_plan))})(?:\..+)?").fullmatch
    expert_tp_plan = {key: style for key, style in tp_plan.items() if experts(key)}
    tp_plan = {key: style for key, style in tp_plan.items() if not experts(key)}
    if ep_axis is None:  # experts parallel over the tensor-parallel group: one axis
        if tp != ep:
            raise HpgenError(
                f"{name}: --ep {ep} differs from --tp {tp}, but without --ep-axis the experts share the "
                "tp axis; give --ep-axis ep to put them on an axis of their own (mesh ep x tp)"
            )
        return StyleRules({**expand(tp_plan, "tp"), **expand(ep_plan, "tp")}, ("tp",), {"tp": tp}, written=written)
    assert tp is not None
    expert_tp = expand(expert_tp_plan, "tp")
    rules = {**expand(tp_plan, "tp"), **expand(ep_plan, ep_axis)}
    return StyleRules(rules, (ep_axis, "tp"), {ep_axis: ep, "tp": tp}, expert_tp=expert_tp, written=written)


def _expand(modules: Mapping[str, Any], name: str, plan: Mapping[str, str], axis: str) -> dict[str, Rule]:
    """transformers' ``_expand_parallel_plan``: a rule on a module covers its own parameters."""
    for key, style in plan.items():
        if style not in SUPPORTED_STYLES:
            raise HpgenError(
                f"{name}: style {style!r} of {key!r} has no hpgen mapping; supported styles: {supported_styles_text()}"
            )
    found: dict[str, Rule] = {}
    for module_name, module in modules.items():
        module_style = plan.get(generic(module_name)) if module_name else None
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            own = plan.get(generic(full))
            if own is not None:
                found[full] = Rule(own, axis)
            elif module_style is not None:
                found[full] = Rule(module_style, axis, via_module=True)
        if module_style is not None:
            found[module_name] = Rule(module_style, axis)
    return found
