"""Step 2 of deriving a plan: how a group's column projections are cut, decided in one function.

:func:`decide_columns` is the one owner of a column's layout. It reads the layout from
the first reshape of the column's output (:func:`~hpgen.planner.derive.reshapes.column_layout`),
then applies, in this order, every rule that overrides or refuses it:

1. heads split into parts working together (:mod:`~hpgen.planner.derive.heads.parts`):
   every column is cut ``SS(0,k)`` (or kept ``RS`` where a part has one key/value head),
   the parts rule checking the heads against ``--tp`` itself;
2. a column reading another column's output whole (:mod:`~hpgen.planner.derive.gathered`):
   ``S`` over its one value per head, and the columns it reads must be plain
   (:func:`~hpgen.planner.derive.gathered.check_gathered`);
3. the heads against ``--tp``: where they divide, every column holds whole heads that divide
   (:meth:`~hpgen.planner.derive.heads.rules.HeadRules.check_heads`, and
   :meth:`~hpgen.planner.derive.heads.rules.HeadRules.check_runtime_heads`, what ``parallelize``
   refuses); where they do not, each rank takes whole heads
   (:func:`~hpgen.planner.derive.heads.uneven.uneven_layouts`, the layouts cut in whole units).

A layout becomes a placement only on a weight's dim
(:meth:`~hpgen.planner.derive.column_layouts.ColumnLayout.placement`, called by
:mod:`~hpgen.planner.derive.group_blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hpgen.planner.derive.column_layouts import PLAIN, ColumnLayout
from hpgen.planner.derive.derive_context import DeriveContext
from hpgen.planner.derive.gathered import check_gathered
from hpgen.planner.derive.heads.counts import Heads
from hpgen.planner.derive.heads.parts import Parts, head_parts, token_splits
from hpgen.planner.derive.heads.rules import HeadRules
from hpgen.planner.derive.heads.shares import HeadShares
from hpgen.planner.derive.heads.uneven import UnevenHeads, uneven_layouts
from hpgen.planner.derive.placed import NoQueryHead, Refused
from hpgen.planner.derive.projection_groups import Group
from hpgen.planner.derive.reshapes import column_layout
from hpgen.planner.model.modules import lca

__all__ = ["Columns", "decide_columns"]


@dataclass(frozen=True)
class Columns:
    """How a group's columns are cut: each column's layout, and what decided it."""

    heads: Heads | None  # the attention's heads (None for an MLP)
    layouts: Mapping[str, ColumnLayout]  # column -> its layout, every rule applied
    parts: Parts | None  # the heads split into parts working together
    uneven: UnevenHeads | None  # the heads cut whole where they do not divide over --tp
    replicated: frozenset[str]  # columns every rank holds whole (a part's single key/value head)
    tokens: frozenset[tuple[str, int]] = frozenset()  # (module, line) of splits of the batch or sequence


def decide_columns(
    ctx: DeriveContext, rules: HeadRules, group: Group, gathered: Mapping[str, set[str]], attention: bool
) -> Columns:
    """The layout of each column of ``group`` (``gathered``: the columns reading another one whole), or
    :class:`Refused` saying why the group stays whole (:class:`NoQueryHead` where a rank would hold no query head)."""
    modules, cols, rows, layer = ctx.modules, group.cols, group.rows, group.layer
    heads = rules.query_kv_heads(cols, rows, layer) if attention else None
    if heads is not None:
        rules.check_mask_heads(cols, rows, heads)  # ALiBi added into the mask: the attention stays whole
    parts = head_parts(ctx, group, heads)
    tokens = token_splits(ctx, group, heads) if parts is None else frozenset()
    replicated = frozenset(c for c, layout in (parts.layouts if parts else {}).items() if layout.replicated)
    shares = _shares(rules, heads, lca(cols | rows)) if attention and heads is not None and parts is None else None
    if shares is None:
        rules.check_runtime_heads(cols - replicated, layer)
    layouts: dict[str, ColumnLayout]
    if parts is not None:
        layouts = dict(parts.layouts)  # the parts rule checked the heads against --tp itself
    else:
        plain = sorted(cols - set(gathered))
        layouts = {col: column_layout(modules, group, col, heads, attention, tokens) for col in plain}
        layouts.update({col: PLAIN for col in gathered})  # its outputs are whole values, one per head
    check_gathered(gathered, modules, layouts, heads if attention else None, ctx.tp, layer)
    uneven = None
    if attention and heads is not None and parts is None:
        if shares is None:
            rules.check_heads(cols, layouts, heads, layer)
        else:
            uneven = uneven_layouts(modules, cols, rows, layouts, shares, layer)
            layouts = dict(uneven.columns)
    return Columns(heads, layouts, parts, uneven, replicated, tokens)


def _shares(rules: HeadRules, heads: Heads, where: str) -> HeadShares | None:
    """The heads' shares where they do not divide over ``--tp`` (each rank takes whole heads), else None."""
    try:
        return rules.shares(heads, where)
    except NoQueryHead:
        raise
    except Refused:
        return None  # key/value heads fewer than the ranks that do not divide them: the head checks say why
