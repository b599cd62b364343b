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
   :mod:`hpgen.index`: a boundary's input is the first parameter of its class's
   ``forward`` (and the routing weights of an experts module), its outputs follow the
   ``return`` (``attn_output, attn_weights``). :mod:`hpgen.resolve` says which FQNs it
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
``num_key_value_groups`` by the same number (``divide_attrs``).

The steps are modules of :mod:`hpgen.planner`, each a base class of :class:`Translator`:
step 1 is :mod:`~hpgen.planner.load` (the model) and :mod:`~hpgen.planner.styles` (the
rules, TP and EP); step 2 :mod:`~hpgen.planner.blocks` (boundaries and parameters) and
:mod:`~hpgen.planner.checks` (sizes); step 3 :mod:`~hpgen.planner.signatures`; step 4
:mod:`~hpgen.planner.document`; ``--sp`` is :mod:`~hpgen.planner.sequence`.
:mod:`hpgen.planner.derived_plan` subclasses :class:`Translator` for the plans derived from
the source.

torch and transformers are imported inside the functions that need them: the generator
(``hpgen lower``) never imports them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpgen.errors import HpgenError
from hpgen.planner.blocks import BoundaryFinding
from hpgen.planner.boundary import Boundary
from hpgen.planner.checks import SizeChecks
from hpgen.planner.corrections import correct_packed_chunks
from hpgen.planner.document import PlanDocument
from hpgen.planner.load import index_source, source_file
from hpgen.planner.sequence import SequenceParallel
from hpgen.planner.signatures import ForwardSignatures
from hpgen.planner.styles import Rule, StyleRules

if TYPE_CHECKING:
    from torch import nn

    from hpgen.index import ModuleIndex, ParsedSource

__all__ = ["Translator", "translated_plan"]


def translated_plan(
    model: nn.Module,
    *,
    tp: int | None = None,
    ep: int | None = None,
    sp: bool = False,
    ep_axis: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """The frozen plan for ``model`` (an instance, normally on the meta device).

    Raises :class:`HpgenError` for a style hpgen cannot map, sizes the axes do not divide,
    or a module layout the plan cannot express.
    """
    return Translator(model, tp=tp, ep=ep, sp=sp, ep_axis=ep_axis, name=name or type(model).__name__).plan()


class Translator(StyleRules, BoundaryFinding, SizeChecks, SequenceParallel, ForwardSignatures, PlanDocument):
    """transformers' plan of one model translated into hpgen's plan, one step per base class."""

    rules: dict[str, Rule]
    mesh: tuple[str, ...]

    def __init__(
        self, model: nn.Module, *, tp: int | None, ep: int | None, sp: bool, ep_axis: str | None, name: str
    ) -> None:
        for flag, value in (("--tp", tp), ("--ep", ep)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise HpgenError(f"{flag} must be a positive integer, got {value!r}")
        self.model = model
        self.name = name
        self.sp = sp
        self.sizes: dict[str, int] = {}
        self.modules = dict(model.named_modules())
        self.config = getattr(model, "config", None)
        # tp rules on the experts when they have an axis of their own (their intermediate dim)
        self.expert_tp_rules: dict[str, Rule] = {}
        self.rules, self.mesh = self._rules(tp, ep, self._ep_axis(ep_axis, ep))
        if sp and "tp" not in self.mesh:
            raise HpgenError(f"{name}: --sp shards the sequence on the tp axis; give --tp too")
        self.source = Path(source_file(type(model)))
        self.parsed, self.index = index_source(self.source)
        # the modeling files the boundaries' classes come from (a language model built through
        # AutoModel from another model's file), each indexed once
        self._sources: dict[Path, tuple[ParsedSource, ModuleIndex]] = {self.source.resolve(): (self.parsed, self.index)}
        self.boundaries: dict[str, Boundary] = {}
        # rule -> why transformers' style was changed (the rules corrected in place)
        self.corrected = correct_packed_chunks(self.rules, self.modules, self._forward_owner, self._source_of)

    def plan(self) -> dict[str, Any]:
        """The plan document: boundaries, their parameters, the checks, ``--sp``, inputs and outputs."""
        self._find_boundaries()
        self._place_params()
        self._implicit_grad_reduce()
        self._check_sizes()
        if self.sp:
            self._sequence_parallel()
        for boundary in self.boundaries.values():
            self._set_io(boundary)
        return self._document()
