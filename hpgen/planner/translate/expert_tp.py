"""Tensor-parallel rules for experts whose ``tp_plan`` no longer names them (transformers >= 5.25).

Up to transformers 5.24 every MoE config's ``base_model_tp_plan`` sharded its experts on
the intermediate dim (``gate_up_proj: packed_colwise``, ``down_proj: rowwise``,
``experts: moe_tp_experts``). 5.25 deprecated that style and dropped those entries, keeping
only ``base_model_ep_plan``; read as it now is, ``--tp`` would keep every expert whole on
every rank. hpgen's experts boundary does not depend on transformers' style code, so
:func:`experts_tp_plan` reads the shapes of the experts the EP plan names and writes the
rules 5.24 wrote: a weight whose last dim is the hidden size is column-parallel (``colwise``;
the translator's correction makes a fused ``gate_up_proj`` ``packed_colwise`` from the
forward's dataflow), one whose second-to-last dim is the hidden size is row-parallel. An
experts module it cannot read so (transposed weights, biases, submodules such as an identity expert) is left
as transformers' plan leaves it: whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["experts_tp_plan", "model_tp_plan"]

_EXPERTS_STYLE = "ep_dispatch_experts"
_TP_EXPERTS_STYLE = "moe_tp_experts"


def experts_tp_plan(
    tp_plan: Mapping[str, str], ep_plan: Mapping[str, str], modules: Mapping[str, Any], hidden_size: int | None
) -> dict[str, str]:
    """``tp_plan`` with tensor-parallel rules for each EP-plan experts module that it does not cover."""
    plan = dict(tp_plan)
    if not hidden_size:
        return plan
    for pattern, style in ep_plan.items():
        if style != _EXPERTS_STYLE or _covered(pattern, tp_plan):
            continue
        matched = re.compile(re.escape(pattern).replace(r"\*", r"\d+")).fullmatch
        found = next((module for name, module in modules.items() if name and matched(name)), None)
        rules = None if found is None else _rules(pattern, found, ep_plan, hidden_size)
        if rules:
            plan.update(rules)
    return plan


def _covered(pattern: str, tp_plan: Mapping[str, str]) -> bool:
    return any(key == pattern or key.startswith(pattern + ".") for key in tp_plan)


def _rules(pattern: str, module: Any, ep_plan: Mapping[str, str], hidden: int) -> dict[str, str] | None:
    """The rules of one experts module, or ``None`` when its weights are not all readable as column/row."""
    from torch import nn

    # an identity expert (transformers' moe_identity_expert), a norm, ...: each needs a rule not read here
    if any(isinstance(child, nn.Identity) or any(True for _ in child.parameters()) for child in module.children()):
        return None
    params = dict(module.named_parameters())
    named = {key[len(pattern) + 1 :] for key in ep_plan if key.startswith(pattern + ".")}
    if not params or set(params) != named:
        return None
    rules: dict[str, str] = {}
    for leaf, param in params.items():
        if param.dim() != 3:
            return None
        rows, cols = param.shape[-2], param.shape[-1]
        if cols == hidden and (rows != hidden or "down" not in leaf):
            rules[f"{pattern}.{leaf}"] = "colwise"
        elif rows == hidden:
            rules[f"{pattern}.{leaf}"] = "rowwise"
        else:
            return None
    styles = set(rules.values())
    if styles != {"colwise", "rowwise"}:  # a column- and a row-parallel half: one reduction, at the boundary
        return None
    rules[pattern] = _TP_EXPERTS_STYLE
    return rules


def model_tp_plan(model: Any, modules: Mapping[str, Any] | None = None) -> dict[str, str]:
    """``model``'s ``tp_plan`` with the experts' rules :func:`experts_tp_plan` adds (``{}``: no tp_plan)."""
    tp_plan = dict(getattr(model, "tp_plan", None) or {})
    if not tp_plan:
        return tp_plan
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    ep_plan = dict(getattr(model, "ep_plan", None) or {})
    modules = dict(model.named_modules()) if modules is None else modules
    return experts_tp_plan(tp_plan, ep_plan, modules, getattr(text_config, "hidden_size", None))
