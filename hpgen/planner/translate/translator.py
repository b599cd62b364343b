"""``hpgen plan``: a frozen plan from transformers' own tensor/expert parallel plan.

transformers describes tensor parallelism per *layer*: ``base_model_tp_plan`` maps module
globs to styles (``colwise`` on ``q_proj``, ``rowwise`` on ``o_proj``, ...) and its
runtime hooks every sharded ``nn.Linear``. hpgen describes it per *block*: one boundary
at the module whose ``forward`` goes from a replicated input to a partial output, with
the collectives written into that ``forward``. This module translates the first into the
second for one architecture:

1. Build the model on the meta device from its config (no weights, no download) and
   read the instance's ``tp_plan`` / ``ep_plan`` (the config's ``base_model_*_plan``, the
   model class's ``_tp_plan`` and its children's, with their prefixes). Expand them over
   the instance's modules and parameters exactly as transformers'
   ``_expand_parallel_plan`` does, so that ``layers.*.mlp.down_proj`` matches only the
   layers that have one (dense layers of an MoE model).
2. Map each style (:data:`SUPPORTED_STYLES`) to placements and boundaries:

   - a ``rowwise`` layer reduces: the lowest module above it that holds a ``colwise``
     layer (``mlp`` for ``mlp.down_proj``) becomes a *block* boundary, ``R -> R`` at its
     input (Megatron's *f*: identity forward, all-reduce backward) and ``P(sum) -> R`` at
     its output, and the ``colwise`` layers below it shard inside it. A ``colwise`` layer
     that reaches the reducing layer through a sibling module widens the block to their
     common parent. An experts module (``moe_tp_experts``, ``ep_dispatch_experts``) and an
     ``all_reduce`` module are blocks themselves;
   - ``colwise_gather_output``, ``rowwise_split_input`` and ``embedding_*`` are boundaries
     of one ``nn.Linear`` / ``nn.Embedding``, which ``parallelize`` wraps (also a subclass
     defined in the modeling file, named in ``boundary_classes`` as ``nn.Embedding`` or
     ``nn.Linear`` so that the runtime wraps it instead of lowering it);
   - a replicated parameter inside a sharded boundary (``q_norm`` per head, an MLA
     ``kv_a_proj_with_mqa``, a low-rank ``q_a_proj``, the norm of a normed embedding)
     sees only its rank's share of the gradient: it goes to ``grad_reduce_params``.
     transformers gets this from an all-reduce in every ``colwise`` layer's backward;
     hpgen has one at the boundary, so every parameter the plan leaves replicated inside
     it is listed, not only those the plan marks ``replicated_with_grad_allreduce``;
   - a row-parallel bias stays replicated and goes to ``deferred_bias_params``.
3. Read the modeling file the model class comes from (``inspect.getsourcefile``) with
   :mod:`hpgen.generator.index`: a boundary's input is the first parameter of its class's
   ``forward`` (and the routing weights of an experts module), its outputs follow the
   ``return`` (``attn_output, attn_weights``). :mod:`hpgen.generator.resolve` says which FQNs it
   resolves statically; the others get ``boundary_classes``.
4. Group the concrete FQNs back into ``*`` keys where every match of the key has the same
   class and entry; otherwise list them per index (one key may not overlap another).

``--sp`` adds Megatron-style sequence parallelism on the ``tp`` axis: every decoder layer
is listed by index (the first splits ``R -> S(1)`` at its input), blocks gather ``S(1) -> R``
and reduce-scatter ``P(sum) -> S(1)``, a child of a layer that mixes positions without
being sharded (an MoE block around its experts, a recurrent mixer) gathers and splits,
norms on the shards get ``grad_reduce_params``, and the final norm gathers at its output
(when it is a class of the modeling file; otherwise the last layer does), before the
causal LM slices ``logits_to_keep`` and calls ``lm_head``. ``--ep`` shards the experts by
expert from ``base_model_ep_plan`` through ``hpgen.runtime.local.experts_parallel``: on
the ``tp`` axis (``--ep`` equal to ``--tp``), or with ``--ep-axis NAME`` on an axis of
their own (mesh ``NAME x tp``), keeping the TP plan's intermediate-dim rules on ``tp``.

Key/value heads fewer than ``--tp`` (``--tp`` a multiple of them) are replicated, as vLLM
does: the key/value projections become ``RS(0, tp / kv)`` and the attention entry divides
``num_key_value_groups`` by the same number (``divide_attrs``). Heads that do not divide
``--tp`` are cut whole, some ranks holding one more (:mod:`~hpgen.planner.derive.heads.shares`).

Each step is a function of its own module, and :func:`translated_plan` calls them in
order, passing what one returns to the next: step 1 is :mod:`~hpgen.planner.model.load` (the
model) and :func:`~hpgen.planner.translate.styles.style_rules` (the rules, TP and EP, as one
:class:`~hpgen.planner.translate.styles.StyleRules`), corrected where the source contradicts them
(:func:`~hpgen.planner.translate.corrections.correct_packed_chunks`); step 2
:func:`~hpgen.planner.translate.style_blocks.find_boundaries` (the boundaries, by FQN), which
:func:`~hpgen.planner.translate.style_blocks.place_params` and
:func:`~hpgen.planner.translate.style_blocks.implicit_grad_reduce` fill with parameters, then
:func:`~hpgen.planner.translate.axis_checks.check_sizes`; ``--sp`` is
:func:`~hpgen.planner.translate.sequence_parallel.sequence_parallel`; step 3
:func:`~hpgen.planner.translate.signatures.set_translated_io`; step 4
:func:`~hpgen.planner.translate.document.grouped` and
:func:`~hpgen.planner.translate.document.plan_draft`. Every step reads one
:class:`~hpgen.planner.translate.plan_context.PlanContext` (the model, its modules, its modeling files,
the mesh). :func:`hpgen.planner.translate.derived_plan.derived_plan` calls the same steps from
``--sp`` on, for the plans derived from the source.

torch and transformers are imported inside the functions that need them: the generator
(``hpgen lower``) never imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpgen.core.errors import HpgenError
from hpgen.planner.translate.axis_checks import check_sizes
from hpgen.planner.translate.corrections import correct_packed_chunks
from hpgen.planner.translate.document import expert_injections, grouped, plan_draft
from hpgen.planner.translate.draft import DraftPlan
from hpgen.planner.translate.forwards import Forwards
from hpgen.planner.translate.plan_context import PlanContext
from hpgen.planner.translate.sequence_parallel import sequence_parallel
from hpgen.planner.translate.signatures import set_translated_io
from hpgen.planner.translate.style_blocks import find_boundaries, implicit_grad_reduce, place_params
from hpgen.planner.translate.styles import ep_axis_name, style_rules

if TYPE_CHECKING:
    from torch import nn

__all__ = ["check_axis_sizes", "translated_draft", "translated_plan"]


def translated_plan(model: nn.Module, **options: Any) -> dict[str, Any]:
    """The frozen plan document for ``model``: :func:`translated_draft`'s, for callers that want the document."""
    return translated_draft(model, **options).document()


def translated_draft(
    model: nn.Module,
    *,
    tp: int | None = None,
    ep: int | None = None,
    sp: bool = False,
    ep_axis: str | None = None,
    name: str | None = None,
) -> DraftPlan:
    """The plan for ``model`` (an instance, normally on the meta device), as a draft the later passes take.

    Raises :class:`HpgenError` for a style hpgen cannot map, sizes the axes do not divide,
    or a module layout the plan cannot express.
    """
    name = name or type(model).__name__
    check_axis_sizes(tp=tp, ep=ep)
    modules = dict(model.named_modules())
    rules = style_rules(model, modules, name, tp=tp, ep=ep, ep_axis=ep_axis_name(name, ep_axis, ep))
    if sp and "tp" not in rules.mesh:
        raise HpgenError(f"{name}: --sp shards the sequence on the tp axis; give --tp too")
    context = PlanContext(model, name, modules, Forwards(type(model), name), rules.mesh)
    rules, corrected = correct_packed_chunks(rules, modules, context.forwards)
    boundaries = find_boundaries(context, rules)
    place_params(context, rules, boundaries)
    implicit_grad_reduce(boundaries)
    check_sizes(context, rules.sizes, boundaries)
    if sp:
        sequence_parallel(context, boundaries)
    for boundary in boundaries.values():
        set_translated_io(context, rules, boundary)
    groups = grouped(context, boundaries)
    # transformers' styles the source contradicts (corrections.py)
    comments = {"corrected": dict(sorted(corrected.items()))} if corrected else None
    return plan_draft(context, groups, injections=expert_injections(groups), comments=comments)


def check_axis_sizes(*, tp: int | None, ep: int | None) -> None:
    """``--tp`` and ``--ep``, where given, are positive integers."""
    for flag, value in (("--tp", tp), ("--ep", ep)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise HpgenError(f"{flag} must be a positive integer, got {value!r}")
