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

5.25 also dropped the rules of shared experts held as stacked weights of their own (Inkling's
``shared_experts``: ``gate_proj``/``up_proj`` ``[n, intermediate, hidden]``, ``down_proj``
``[n, hidden, intermediate]``, rules 5.24 wrote as ``colwise``/``rowwise`` under an ``all_reduce``
module), which left them whole on every rank. A sibling of the experts module (a child of the same
MoE block) that no rule names and whose parameters read so by the same shapes gets those rules back:
column- and row-parallel weights, and its output, a partial sum per rank, reduced at its boundary.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["experts_tp_plan", "model_tp_plan"]

_EXPERTS_STYLE = "ep_dispatch_experts"
_TP_EXPERTS_STYLE = "moe_tp_experts"
_REDUCED_STYLE = "all_reduce"  # a module whose output is a partial sum per rank, reduced at its boundary


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
        found = next((name for name in modules if name and matched(name)), None)
        if found is None:
            continue
        rules = _rules(pattern, modules[found], ep_plan, hidden_size)
        if rules:
            plan.update(rules)
        plan.update(_sibling_rules(pattern, found, modules, tp_plan, ep_plan, hidden_size))
    return plan


def _covered(pattern: str, tp_plan: Mapping[str, str]) -> bool:
    return any(key == pattern or key.startswith(pattern + ".") for key in tp_plan)


def _rules(pattern: str, module: Any, ep_plan: Mapping[str, str], hidden: int) -> dict[str, str] | None:
    """The rules of one experts module, or ``None`` when its weights are not all readable as column/row."""
    if getattr(module, "is_transposed", False):  # [n, in, out] weights (Aria's): the shapes would read them crosswise
        return None
    params = _own_params(module)
    named = {key[len(pattern) + 1 :] for key in ep_plan if key.startswith(pattern + ".")}
    if params is None or set(params) != named:
        return None
    rules = _column_row(pattern, params, hidden)
    return None if rules is None else {**rules, pattern: _TP_EXPERTS_STYLE}


def _sibling_rules(
    pattern: str,
    found: str,
    modules: Mapping[str, Any],
    tp_plan: Mapping[str, str],
    ep_plan: Mapping[str, str],
    hidden: int,
) -> dict[str, str]:
    """Rules for the children of the experts' MoE block (``found``'s parent) that hold stacked expert weights of
    their own (shared experts) and that neither plan names: column/row by shape, the module's output reduced."""
    parent, parent_pattern = found.rpartition(".")[0], pattern.rpartition(".")[0]
    rules: dict[str, str] = {}
    for name, module in modules.items():
        owner, _, leaf = name.rpartition(".")
        sibling = f"{parent_pattern}.{leaf}"
        if owner != parent or sibling == pattern or _covered(sibling, tp_plan) or _covered(sibling, ep_plan):
            continue
        params = _own_params(module)
        found_rules = None if params is None else _column_row(sibling, params, hidden)
        if found_rules:
            rules.update(found_rules)
            rules[sibling] = _REDUCED_STYLE
    return rules


def _own_params(module: Any) -> dict[str, Any] | None:
    """``module``'s parameters when they are all its own (no child with parameters, no identity expert), or None."""
    from torch import nn

    # an identity expert (transformers' moe_identity_expert), a norm, ...: each needs a rule not read here
    if any(isinstance(child, nn.Identity) or any(True for _ in child.parameters()) for child in module.children()):
        return None
    params = dict(module.named_parameters())
    return params or None


def _column_row(pattern: str, params: Mapping[str, Any], hidden: int) -> dict[str, str] | None:
    """``colwise``/``rowwise`` for stacked ``[n, out, in]`` weights read by where the hidden size is; ``None``
    unless every weight reads so and both halves are there (one reduction, at the module's boundary)."""
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
    return rules if set(rules.values()) == {"colwise", "rowwise"} else None


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
