"""A derived layout (:mod:`hpgen.planner.derive.derivation`) written as a frozen plan.

:func:`derived_plan` calls the steps of the translator of transformers' plans
(:mod:`hpgen.planner.translate.translator`) that come after the choice of boundaries: ``--sp``
(:func:`~hpgen.planner.translate.sequence_parallel.sequence_parallel`), grouping of the layers into ``*``
keys, ``boundary_classes`` where static resolution needs them, and the check that the
document loads (:mod:`~hpgen.planner.translate.document`), with the inputs and outputs read from
each class's ``forward`` (:class:`~hpgen.planner.translate.forwards.Forwards`). What differs is
where the boundaries come from (the derivation, not the styles: the styles' rules, size
checks and corrections are not called), and the kinds a derivation has that transformers'
plans never produce, with their transitions on ``tp`` (:class:`~hpgen.planner.derive.placed.Kind`):

- ``col_block``: a module holding only column-parallel projections, whose output stays
  sharded (``S(-1) -> S(-1)``) for the row-parallel ``nn.Linear`` after it;
- ``col_leaf`` / ``row_leaf``: one ``nn.Linear`` that ``parallelize`` wraps, column-parallel
  with its output left sharded, or row-parallel taking a sharded input and reducing;
- ``reduce_leaf``: a row-parallel ``nn.Linear`` inside a block (Mamba's ``x_proj``) whose reduced
  output the block's channel-sharded code consumes: its gradient arrives partial and is
  reduced too (``out_grad_partial``);
- ``gather_leaf``: a column-parallel ``nn.Linear`` inside a block that reads another column's
  sharded output whole (Doge's ``dt_proj``, one output per head, :mod:`hpgen.planner.derive.gathered`):
  its input is gathered (``S(-1) -> R``, reduce-scattered in backward) and its output stays
  sharded with the heads (``S(-1) -> S(-1)``);
- ``col_gather`` / ``split_row``: a column-parallel ``nn.Linear`` whose output is gathered
  (``S(-1) -> R``) and a row-parallel one that splits its replicated input (``R -> S(-1)``),
  around a body that runs replicated (a state-space mixer whose packed projection no
  placement cuts);
- ``split_row_leaf``: the same split row on its own, where no group shards a projection into the
  stream (:mod:`hpgen.planner.derive.split_rows`); ``--sp`` leaves it replicated;
- ``attrs`` / ``alias``: entries that are not boundaries, holding only ``tp_divide_attrs``
  or the layout of a parameter registered under a second name.
"""

from __future__ import annotations

from typing import Any

from hpgen.core.errors import HpgenError
from hpgen.core.placement import PARTIAL_SUM, REPLICATE, Placement, shard
from hpgen.core.plan_entries import Injection, Layout
from hpgen.planner.derive.derivation import Derivation, Placed
from hpgen.planner.derive.placed import BATCH_MAJOR, Kind
from hpgen.planner.model.modules import generic
from hpgen.planner.translate.boundary_record import Boundary, add_boundary
from hpgen.planner.translate.document import Grouped, grouped, plan_draft
from hpgen.planner.translate.draft import DraftPlan, injection
from hpgen.planner.translate.forwards import Forwards
from hpgen.planner.translate.plan_context import PlanContext
from hpgen.planner.translate.sequence_parallel import sequence_parallel
from hpgen.planner.translate.translator import check_axis_sizes

__all__ = ["derived_plan"]

BATCH_MAJOR_HEADS = "hpgen.runtime.local_heads.batch_major_heads"

# On the one axis of a derived plan: replicated, the sequence sharded (--sp), the last dim sharded, partial
_R = Layout.same(("tp",), REPLICATE)
_SEQ = Layout.same(("tp",), shard(1))
_LAST = Layout.same(("tp",), shard(-1))
_PARTIAL = Layout.same(("tp",), PARTIAL_SUM)


def derived_plan(model: Any, derivation: Derivation, *, tp: int | None, sp: bool = False, name: str) -> DraftPlan:
    """The plan of ``derivation`` for ``model``, as a draft for the passes after it (:mod:`hpgen.planner.entry.make`)."""
    if sp and any(p.kind is Kind.SPLIT_ROW_LEAF for p in derivation.placed.values()):
        # a split row reduces to the replicated stream, which --sp keeps sequence-sharded: left replicated
        kept = {fqn: p for fqn, p in derivation.placed.items() if p.kind is not Kind.SPLIT_ROW_LEAF}
        derivation = type(derivation)(placed=kept, notes=list(derivation.notes))
    if sp:
        leaves = sorted(p.fqn for p in derivation.placed.values() if p.kind.sharded_outside_a_block)
        if leaves:
            raise HpgenError(
                f"{name}: --sp needs every sharded group in a block of its own; the derived plan shards "
                f"{generic(leaves[0])} on its own (the module around it adds a residual or a norm)"
            )
    check_axis_sizes(tp=tp, ep=None)
    modules = dict(model.named_modules())
    context = PlanContext(model, name, modules, Forwards(type(model), name), ("tp",))
    placed = dict(sorted(derivation.placed.items()))
    boundaries = _placed_boundaries(context, placed)
    if sp:
        sequence_parallel(context, boundaries)
    for fqn, boundary in boundaries.items():
        if fqn in placed:  # the others are --sp's, with their transitions
            _set_io(context, placed[fqn], boundary)
    groups = grouped(context, boundaries)
    return plan_draft(context, groups, injections=_batch_major_injections(groups, placed))


def _placed_boundaries(context: PlanContext, placed: dict[str, Placed]) -> dict[str, Boundary]:
    """A boundary per derived entry, with its parameters.

    The derivation says which replicated parameters the sharded body runs through (the norms
    before the columns, per-head norms, scales read between the projections); only their
    gradients are partial. A parameter a block merely returns (GPT-NeoX-Japanese's
    ``dense_bias``, added by the caller) keeps its full gradient.
    """
    boundaries: dict[str, Boundary] = {}
    for fqn, entry in placed.items():
        add_boundary(context, boundaries, fqn, entry.kind.boundary).axes.add("tp")
    for fqn, entry in placed.items():
        boundary = boundaries[fqn]
        boundary.params = {param: Layout.same(("tp",), layout) for param, layout in entry.params.items()}
        boundary.deferred = set(entry.deferred)
        boundary.tp_divide_attrs = set(entry.divide)
        boundary.local_attrs = dict(entry.local_attrs)
        if entry.kind is Kind.REDUCE_LEAF:
            boundary.out_grad_partial = ("output",)
    for fqn, entry in placed.items():
        if entry.kind.holds_group:
            boundaries[fqn].grad_reduce.update(entry.grad_reduce)
    return boundaries


def _set_io(context: PlanContext, placed: Placed, boundary: Boundary) -> None:
    """The transitions of one derived boundary, by its kind."""
    kind = placed.kind
    if kind.boundary == "attrs":
        return
    if kind.leaf_transitions is not None:
        into, out = kind.leaf_transitions
        boundary.wrapped_as = "nn.Embedding" if kind is Kind.EMBEDDING else "nn.Linear"
        if into is not None:
            boundary.inputs["input"] = into
        boundary.outputs["output"] = out
        return
    if kind is Kind.HEADS:  # only the per-head inputs move; the leaves inside do the rest
        for name, cut in sorted(placed.head_inputs.items()):
            boundary.inputs[name] = (_R, Layout.same(("tp",), cut) if isinstance(cut, Placement) else _R)
        return
    # a block: every input that feeds the columns is R -> R (its gradient comes back partial);
    # entered from the sequence-sharded stream (--sp) it gathers S(1) first and reduce-scatters after
    forwards = context.forwards
    parameters = forwards.parameters(boundary.module, boundary.fqn)
    for name in placed.inputs:
        if name not in parameters and name not in forwards.keyword_names(boundary.module, boundary.fqn):
            raise HpgenError(f"{context.name}: {boundary.fqn}: {name} is not a parameter of its forward")
        boundary.inputs[name] = (_SEQ if boundary.sp_input and name == parameters[0] else _R, _R)
    for name, cut in sorted(placed.head_inputs.items()):
        # a per-head tensor made outside the block (MPT's position_bias): each rank keeps its heads' slice
        if name not in parameters and name not in forwards.keyword_names(boundary.module, boundary.fqn):
            raise HpgenError(f"{context.name}: {boundary.fqn}: {name} is not a parameter of its forward")
        if isinstance(cut, Placement):  # cut on its head dim; a batch-major one by the region
            boundary.inputs[name] = (_R, Layout.same(("tp",), cut))
    names = forwards.outputs(boundary.module, boundary.fqn)
    boundary.out_names = names if len(names) > 1 else None
    if kind is Kind.COL_BLOCK:
        boundary.outputs[names[0]] = (_LAST, _LAST)
        return
    if boundary.sp_input:
        boundary.grad_reduce.update(boundary.deferred)  # added to a sequence shard
    boundary.outputs[names[0]] = (_PARTIAL, _SEQ if boundary.sp_input else _R)


def _batch_major_injections(groups: Grouped, placed: dict[str, Placed]) -> list[Injection]:
    """The region injections of blocks whose per-head input fuses the heads into the batch dim
    (BLOOM's ``alibi``): see :mod:`hpgen.runtime.forward.local_heads`."""
    injections = []
    for key, (boundary, _) in sorted(groups.items()):
        entry = placed.get(boundary.fqn)
        names = sorted(n for n, cut in entry.head_inputs.items() if cut == BATCH_MAJOR) if entry else []
        if names:
            injections.append(
                injection(key, BATCH_MAJOR_HEADS, head_inputs=names, global_heads=entry.global_heads, axis="tp")
            )
    return injections
