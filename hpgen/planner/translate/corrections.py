"""Where transformers' own plan is wrong for the code it shards, read from the source.

transformers' plans are written by hand, and a few give a style that the modeling code
does not follow; translating them as written gives wrong numbers. This module finds
such places in a class's ``forward`` so that the translator (:mod:`hpgen.planner.translate.translator`)
corrects the style (:func:`correct_packed_chunks` returns the rules corrected) and says so
in the plan's ``comments`` (``corrected``):

- a fused projection sharded ``colwise`` whose output the ``forward`` splits with
  ``.chunk(2, ...)`` (InklingExperts: ``linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)``)
  holds two packed blocks, gate and up: plain ``colwise`` gives one rank the gate half and
  the other the up half; ``packed_colwise`` (``SS(d,2)``) gives each rank its chunk of both.
  The blocks are read from the owner's dataflow as a derived plan reads a fused column's
  (:func:`hpgen.planner.derive.reshapes.packed_blocks`), not by a reading of their own.

The note names whose ``colwise`` it corrects: transformers' plan's, or the rule hpgen wrote itself
from the experts' shapes where the release's plan leaves them out (``StyleRules.written``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hpgen.core.errors import HpgenError
from hpgen.planner.derive.column_layouts import UnequalBlocks
from hpgen.planner.derive.reshapes import PackedBlocks, packed_blocks
from hpgen.planner.model.modules import generic, is_linear, out_features
from hpgen.planner.translate.styles import Rule, StyleRules

if TYPE_CHECKING:
    from hpgen.planner.translate.forwards import Forwards

__all__ = ["correct_packed_chunks"]


def correct_packed_chunks(
    rules: StyleRules, modules: Mapping[str, Any], forwards: Forwards
) -> tuple[StyleRules, dict[str, str]]:
    """``colwise`` on a fused projection whose output ``forward`` splits into two packed blocks becomes
    ``packed_colwise``: the rules corrected, and each correction's why, by pattern.

    The blocks are read as a derived plan reads them (:func:`~hpgen.planner.derive.reshapes.packed_blocks`, the
    owner's dataflow), once per owner class; a split into another number of blocks, which ``packed_colwise``
    does not express, is refused rather than translated into wrong numbers.
    """
    why: dict[str, str] = {}
    blocks_by_class: dict[tuple[type, str], PackedBlocks | None] = {}
    # the experts' own tp rules (experts on an axis of their own) hold the same fused projections
    corrected = _corrected(rules.rules, modules, forwards, why, blocks_by_class, rules.written)
    expert_tp = _corrected(rules.expert_tp, modules, forwards, why, blocks_by_class, rules.written)
    return replace(rules, rules=corrected, expert_tp=expert_tp), why


def _corrected(
    found: Mapping[str, Rule],
    modules: Mapping[str, Any],
    forwards: Forwards,
    why: dict[str, str],
    blocks_by_class: dict[tuple[type, str], PackedBlocks | None],
    written: frozenset[str],
) -> dict[str, Rule]:
    """``found`` with each ``colwise`` on two packed blocks made ``packed_colwise`` (the why into ``why``)."""
    corrected = dict(found)
    for fqn, rule in sorted(found.items()):
        if rule.style != "colwise" or rule.via_module:
            continue
        owner_fqn, _, attr = fqn.rpartition(".")
        owner = modules.get(owner_fqn)
        if owner is None:
            continue
        says = _says_colwise(fqn, written)
        key = (type(owner), attr)
        if key not in blocks_by_class:
            blocks_by_class[key] = _packed(modules, owner_fqn, attr, forwards, says)
        blocks = blocks_by_class[key]
        if blocks is None:
            continue
        try:
            name = forwards.owner(owner, owner_fqn).name
        except HpgenError:  # no class of a modeling file runs its forward: nothing hpgen reads to correct
            continue
        if blocks.count != 2:
            raise HpgenError(
                f"{fqn}: {says}, but {name}.forward splits its output into {blocks.count} "
                f"packed blocks with {blocks.says()}, which no style of transformers' plan shards; plan it with "
                "--from-source"
            )
        for other_name, other in list(corrected.items()):
            if other_name == fqn or (
                other_name.startswith(fqn + ".") and other.via_module and other.style == "colwise"
            ):
                corrected[other_name] = Rule("packed_colwise", other.axis, other.via_module)
        why[generic(fqn)] = (
            f"{says}, but {name}.forward splits the output of {attr} with "
            f"{blocks.says()}: two packed blocks, so packed_colwise (each rank takes its chunk of both)"
        )
    return corrected


def _says_colwise(fqn: str, written: frozenset[str]) -> str:
    """Whose ``colwise`` rule on ``fqn`` this is, as the note says it."""
    if generic(fqn) in written:
        return (
            "hpgen's experts rule (read from the weights' shapes: this release's plan leaves the experts out) "
            "says colwise"
        )
    return "transformers' plan says colwise"


def _packed(
    modules: Mapping[str, Any], owner_fqn: str, attr: str, forwards: Forwards, says: str
) -> PackedBlocks | None:
    """The packed blocks the owner's code splits ``attr``'s output into (None: one run, or not read)."""
    import torch

    from hpgen.planner.flow import run_module

    owner = modules[owner_fqn]
    value = getattr(owner, attr, None)
    if isinstance(value, torch.Tensor):  # a weight the code applies itself: [..., out, in], as F.linear takes it
        features = value.shape[-2] if value.dim() >= 2 else None
    else:
        features = out_features(value) if is_linear(value) else None
    if features is None:
        return None
    try:
        path = forwards.source_of(type(owner))[0]
    except HpgenError:  # a class with no source to read (torch's own)
        return None
    flow = run_module(modules[""], owner_fqn, path, open_leaf=True)
    try:
        return packed_blocks(flow, owner_fqn, {attr: features}).get(attr)
    except UnequalBlocks as reason:
        raise HpgenError(f"{owner_fqn}.{attr}: {says}, but {reason}") from None
