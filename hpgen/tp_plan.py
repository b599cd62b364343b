"""``hpgen plan``: a frozen plan (SPEC §2) from transformers' own tensor/expert parallel plan.

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

torch and transformers are imported inside the functions that need them: the generator
(``hpgen lower``) never imports them.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpgen.errors import HpgenError
from hpgen.plan import PLAN_FORMAT, plan_from_dict

if TYPE_CHECKING:
    from torch import nn

    from hpgen.index import ClassInfo, ModuleIndex, ParsedSource

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
    "grouped_gemm": "expert parameters S(0): whole experts per rank",
    "ep_dispatch_experts": "experts boundary running hpgen.runtime.local.experts_parallel, output P(sum) -> R",
    "ep_router": "nothing: experts_parallel remaps routed expert ids itself (older transformers plans)",
    "local_params": "nothing: hpgen bodies always run on local tensors",
    "replicate": "nothing: the parameter stays replicated",
}

_COLWISE = {"colwise", "packed_colwise"}
_ROWWISE = {"rowwise", "packed_rowwise"}
_LINEAR_LEAVES = {
    "colwise_gather_output": "col",
    "colwise_rep": "col",
    "rowwise_split_input": "row",
    "rowwise_rep": "row",
}
_EMBEDDING_LEAVES = {"embedding_rowwise": 0, "embedding_colwise": 1}
_EXPERTS = {"moe_tp_experts", "ep_dispatch_experts"}
_GRAD_REDUCE = {"replicated_with_grad_allreduce", "mla_kv_a_proj"}
_NOTHING = {"ep_router", "local_params", "replicate"}
_SHARDING = _COLWISE | _ROWWISE | {"grouped_gemm"} | set(_LINEAR_LEAVES) | set(_EMBEDDING_LEAVES)

EXPERTS_PARALLEL = "hpgen.runtime.local.experts_parallel"
_DIGITS = re.compile(r"\.\d+(?=\.|$)")


def supported_styles_text() -> str:
    """The supported style names, for error messages."""
    return ", ".join(sorted(SUPPORTED_STYLES))


# --------------------------------------------------------------------------- entry points


def make_plan(
    target: str, *, tp: int | None = None, ep: int | None = None, sp: bool = False, ep_axis: str | None = None
) -> dict[str, Any]:
    """The frozen plan for ``target``: a transformers model type (``llama``) or a config.json path.

    ``tp`` and ``ep`` are the axis sizes the plan must divide (heads, experts); without
    either, a tensor-parallel plan whose divisibility is not checked. ``sp`` keeps the
    residual stream sequence-sharded between decoder layers. ``ep_axis`` names an axis
    of the experts' own (mesh ``ep_axis x tp``); without it they share ``tp``.
    """
    config = load_config(target)
    return plan_for_model(meta_model(config), tp=tp, ep=ep, sp=sp, ep_axis=ep_axis, name=target)


def load_config(target: str) -> Any:
    """The config of a model type (``AutoConfig.for_model``) or of a config.json file or folder."""
    from transformers import AutoConfig

    path = Path(target)
    if target.endswith(".json") or "/" in target or "\\" in target or (path / "config.json").is_file():
        if not path.exists():
            raise HpgenError("no such config file", file=target)
        try:
            return AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HpgenError(f"cannot load the config: {_one_line(exc)}", file=target) from None
    try:
        return AutoConfig.for_model(target)
    except ValueError:
        raise HpgenError(
            f"{target!r} is neither a config.json path nor a model type of the installed transformers "
            "(e.g. llama, qwen3_moe)"
        ) from None
    except (TypeError, KeyError, AttributeError) as exc:
        raise HpgenError(f"{target}: transformers cannot build its default config: {_one_line(exc)}") from None


def model_class_for(config: Any) -> type:
    """The class to instantiate: the causal LM if there is one, else the base model.

    Configs of sub-models (``qwen2_5_vl_text``) that no auto class maps are looked up in
    their own modeling module: the ``PreTrainedModel`` subclass built from exactly this
    config class, a ``*ForCausalLM`` first.
    """
    import importlib

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    config_class = type(config)
    for architecture in getattr(config, "architectures", None) or ():
        found = getattr(transformers, architecture, None)
        if isinstance(found, type) and getattr(found, "config_class", None) is config_class:
            return found
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING):
        if config_class in mapping:
            try:
                return mapping[config_class]
            except ValueError:  # mapped to a class this transformers does not define; search below
                break
    package = config_class.__module__.rpartition(".")[0]
    try:
        modeling = importlib.import_module(f"{package}.modeling_{package.rpartition('.')[2]}")
    except ImportError:
        modeling = None
    candidates: list[type] = []
    for value in vars(modeling).values() if modeling is not None else ():
        if isinstance(value, type) and getattr(value, "config_class", None) is config_class and value not in candidates:
            candidates.append(value)
    # a deprecated alias is a subclass of the class it renames: keep the original (every model subclasses
    # the PreTrainedModel, which is no alias)
    candidates = [cls for cls in candidates if not cls.__name__.endswith("PreTrainedModel")]
    candidates = [
        cls for cls in candidates if not any(other is not cls and issubclass(cls, other) for other in candidates)
    ]
    causal = [cls for cls in candidates if cls.__name__.endswith("ForCausalLM")]
    models = [cls for cls in candidates if not cls.__name__.endswith("PreTrainedModel")]
    for group in (causal, models, [cls for cls in models if cls.__name__.endswith("Model")]):
        if len(group) == 1:
            return group[0]
    raise HpgenError(f"{config_class.__name__}: no model class of the installed transformers is built from this config")


def model_and_config(config: Any) -> tuple[type, Any]:
    """The model class of ``config`` and the config to build it from.

    A multimodal config whose causal LM is built from its text part (``llama4`` ->
    ``Llama4ForCausalLM(Llama4TextConfig)``) hands over that text config.
    """
    cls = model_class_for(config)
    wanted = getattr(cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted) and hasattr(config, "get_text_config"):
        try:
            text = config.get_text_config()
        except ValueError:  # several text configs (musicgen: text_encoder and decoder): the one of the class
            text = next((v for v in vars(config).values() if isinstance(v, wanted)), None)
        if isinstance(text, wanted):
            return cls, text
    return cls, config


def meta_model(config: Any) -> nn.Module:
    """The model of ``config`` on the meta device: every module and shape, no memory, no weights."""
    import torch

    cls, config = model_and_config(config)
    try:
        with torch.device("meta"):
            return cls._from_config(config)
    except Exception as exc:  # a config transformers cannot build a model from: bad input, said in one line
        raise HpgenError(f"{cls.__name__}: cannot build the model from its config: {_one_line(exc)}") from None


def dumps_plan(plan: Mapping[str, Any]) -> str:
    """The plan as deterministic JSON text: sorted keys, two-space indent, final newline."""
    return json.dumps(plan, indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------- the translation


@dataclass(frozen=True)
class _Rule:
    """One expanded rule: the style on a concrete module or parameter, and its mesh axis.

    ``via_module`` marks a parameter covered by its module's rule (``q_proj: colwise``
    covers ``q_proj.weight`` and ``q_proj.bias``) rather than by a rule of its own.
    """

    style: str
    axis: str
    via_module: bool = False


@dataclass
class _Boundary:
    """One concrete boundary module and the entry it is getting."""

    fqn: str
    module: Any
    kind: str  # block | experts | linear | embedding | sp
    inputs: dict[str, tuple[dict[str, str], dict[str, str]]] = field(default_factory=dict)  # name -> (src, dst)
    outputs: dict[str, tuple[dict[str, str], dict[str, str]]] = field(default_factory=dict)
    out_names: tuple[str, ...] | None = None
    params: dict[str, dict[str, str]] = field(default_factory=dict)
    deferred: set[str] = field(default_factory=set)
    grad_reduce: set[str] = field(default_factory=set)
    divide_attrs: dict[str, int] = field(default_factory=dict)
    axes: set[str] = field(default_factory=set)
    injection_axis: str | None = None
    wrapped_as: str | None = None  # "nn.Linear" / "nn.Embedding" for modules parallelize wraps
    sp_input: bool = False  # a block entered from the sequence-sharded residual stream (--sp)

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        for part, values in (("in", self.inputs), ("out", self.outputs)):
            if values:
                entry[f"{part}_src"] = {name: dict(src) for name, (src, _) in values.items()}
                entry[f"{part}_dst"] = {name: dict(dst) for name, (_, dst) in values.items()}
        if self.out_names is not None:
            entry["out_names"] = list(self.out_names)
        if self.params:
            entry["params"] = {name: dict(layout) for name, layout in self.params.items()}
        if self.deferred:
            entry["deferred_bias_params"] = sorted(self.deferred)
        if self.grad_reduce:
            entry["grad_reduce_params"] = sorted(self.grad_reduce)
        if self.divide_attrs:
            entry["divide_attrs"] = dict(self.divide_attrs)
        return entry


def plan_for_model(
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
    return _Translator(model, tp=tp, ep=ep, sp=sp, ep_axis=ep_axis, name=name or type(model).__name__).plan()


class _Translator:
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
        self.expert_tp_rules: dict[str, _Rule] = {}
        self.rules, self.mesh = self._rules(tp, ep, self._ep_axis(ep_axis, ep))
        if sp and "tp" not in self.mesh:
            raise HpgenError(f"{name}: --sp shards the sequence on the tp axis; give --tp too")
        self.source = Path(_source_file(type(model)))
        self.parsed, self.index = _index_source(self.source)
        # the modeling files the boundaries' classes come from (a language model built through
        # AutoModel from another model's file), each indexed once
        self._sources: dict[Path, tuple[ParsedSource, ModuleIndex]] = {self.source.resolve(): (self.parsed, self.index)}
        self.corrected: dict[str, str] = {}  # rule -> why transformers' style was changed
        self._correct_packed_chunks()
        self.boundaries: dict[str, _Boundary] = {}

    # -- rules

    def _correct_packed_chunks(self) -> None:
        """``colwise`` on a fused projection whose output ``forward`` splits with ``chunk(2)``
        becomes ``packed_colwise`` (:mod:`hpgen.planner.corrections`)."""
        from hpgen.planner.corrections import chunked_attributes

        for fqn, rule in sorted(self.rules.items()):
            if rule.style != "colwise" or rule.via_module:
                continue
            owner_fqn, _, attr = fqn.rpartition(".")
            owner = self.modules.get(owner_fqn)
            if owner is None:
                continue
            try:
                info = self._forward_owner(owner, owner_fqn)
                parsed = self._source_of(type(owner))[1]
            except HpgenError:  # a class with no source here (torch's): nothing to read
                continue
            if attr not in chunked_attributes(parsed.tree, info.name):
                continue
            for name, other in list(self.rules.items()):
                if name == fqn or (name.startswith(fqn + ".") and other.via_module and other.style == "colwise"):
                    self.rules[name] = _Rule("packed_colwise", other.axis, other.via_module)
            self.corrected[_generic(fqn)] = (
                f"transformers' plan says colwise, but {info.name}.forward splits the output of {attr} with "
                "chunk(2): two packed blocks, so packed_colwise (each rank takes its chunk of both)"
            )

    def _ep_axis(self, ep_axis: str | None, ep: int | None) -> str | None:
        """The experts' own axis name, checked (``tp`` means sharing it, as no name does)."""
        from hpgen.plan import RESERVED_AXIS_NAMES, is_identifier

        if ep_axis is None:
            return None
        if ep is None:
            raise HpgenError(f"{self.name}: --ep-axis names the experts' axis; give --ep too")
        if not is_identifier(ep_axis) or ep_axis in RESERVED_AXIS_NAMES or ep_axis.startswith("__"):
            raise HpgenError(f"{self.name}: --ep-axis {ep_axis!r} is not a usable axis name (an identifier)")
        return None if ep_axis == "tp" else ep_axis

    def _rules(
        self, tp: int | None, ep: int | None, ep_axis: str | None
    ) -> tuple[dict[str, _Rule], tuple[str, ...]]:
        """Concrete module/parameter name -> (style, axis), and the mesh axes.

        With ``ep_axis`` (and ``tp``) the experts get the EP plan on that axis and keep
        the TP plan's rules on their parameters (``packed_colwise``/``rowwise``: the
        intermediate dim) on ``tp`` (:attr:`expert_tp_rules`): a two-axis block.
        """
        tp_plan = dict(getattr(self.model, "tp_plan", None) or {})
        ep_plan = dict(getattr(self.model, "ep_plan", None) or {})
        use_tp = tp is not None or ep is None
        if use_tp and not tp_plan:
            raise HpgenError(
                f"{self.name}: {type(self.config).__name__} has no base_model_tp_plan (no tensor-parallel plan)"
            )
        if ep is not None and not ep_plan:
            raise HpgenError(
                f"{self.name}: {type(self.config).__name__} has no base_model_ep_plan (no expert-parallel plan)"
            )
        if ep is None:
            self.sizes = {"tp": tp} if tp is not None else {}
            return self._expand(tp_plan, "tp"), ("tp",)
        if not use_tp:
            axis = ep_axis or "ep"
            self.sizes = {axis: ep}
            return self._expand(ep_plan, axis), (axis,)
        # EP rules win over TP rules on the same modules and below them (as in transformers).
        experts = re.compile(rf"(?:{'|'.join(map(re.escape, ep_plan))})(?:\..+)?").fullmatch
        expert_tp_plan = {key: style for key, style in tp_plan.items() if experts(key)}
        tp_plan = {key: style for key, style in tp_plan.items() if not experts(key)}
        if ep_axis is None:  # experts parallel over the tensor-parallel group: one axis
            if tp != ep:
                raise HpgenError(
                    f"{self.name}: --ep {ep} differs from --tp {tp}, but without --ep-axis the experts share the "
                    "tp axis; give --ep-axis ep to put them on an axis of their own (mesh ep x tp)"
                )
            self.sizes = {"tp": tp}
            return {**self._expand(tp_plan, "tp"), **self._expand(ep_plan, "tp")}, ("tp",)
        self.sizes = {ep_axis: ep, "tp": tp}
        self.expert_tp_rules = self._expand(expert_tp_plan, "tp")
        return {**self._expand(tp_plan, "tp"), **self._expand(ep_plan, ep_axis)}, (ep_axis, "tp")

    def _expand(self, plan: Mapping[str, str], axis: str) -> dict[str, _Rule]:
        """transformers' ``_expand_parallel_plan``: a rule on a module covers its own parameters."""
        for key, style in plan.items():
            if style not in SUPPORTED_STYLES:
                raise HpgenError(
                    f"{self.name}: style {style!r} of {key!r} has no hpgen mapping; "
                    f"supported styles: {supported_styles_text()}"
                )
        found: dict[str, _Rule] = {}
        for module_name, module in self.modules.items():
            module_style = plan.get(_generic(module_name)) if module_name else None
            for param_name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}" if module_name else param_name
                own = plan.get(_generic(full))
                if own is not None:
                    found[full] = _Rule(own, axis)
                elif module_style is not None:
                    found[full] = _Rule(module_style, axis, via_module=True)
            if module_style is not None:
                found[module_name] = _Rule(module_style, axis)
        return found

    # -- boundaries

    def plan(self) -> dict[str, Any]:
        self._find_boundaries()
        self._place_params()
        self._implicit_grad_reduce()
        self._check_sizes()
        if self.sp:
            self._sequence_parallel()
        for boundary in self.boundaries.values():
            self._set_io(boundary)
        return self._document()

    def _boundary(self, fqn: str, kind: str) -> _Boundary:
        found = self.boundaries.get(fqn)
        if found is None:
            found = self.boundaries[fqn] = _Boundary(fqn, self.modules[fqn], kind)
        elif found.kind != kind and {found.kind, kind} != {"block", "experts"}:
            raise HpgenError(f"{self.name}: {fqn} would be both a {found.kind} and a {kind} boundary")
        elif kind == "experts":
            found.kind = kind
        return found

    def _find_boundaries(self) -> None:
        """Blocks (a reduction at their output) and leaves (one wrapped layer), from the rules.

        A rowwise layer's block is its lowest ancestor holding a colwise layer (``mlp`` for
        ``mlp.down_proj``, also when the projections sit one wrapper deeper, as in
        ``mlp.down_proj.linear``). A colwise layer no block holds (its output reaches the
        rowwise layer through a sibling module, as ``q_proj`` reaches
        ``output_projection.o_proj``) widens the nearest block below a common ancestor to
        that ancestor. Neither search climbs out of a ``ModuleList`` element (a decoder layer).
        """
        import torch.nn as nn

        columns = sorted(
            fqn if fqn in self.modules else fqn.rpartition(".")[0]
            for fqn, rule in self.rules.items()
            if rule.style in _COLWISE and not rule.via_module
        )
        for fqn, rule in sorted(self.rules.items()):
            if fqn not in self.modules:
                continue  # a parameter: placed by _place_params
            module, style = self.modules[fqn], rule.style
            if style in _ROWWISE:
                self._boundary(self._block_of_rowwise(fqn, columns), "block").axes.add(rule.axis)
            elif style in _EXPERTS or style == "all_reduce":
                boundary = self._boundary(fqn, "experts" if style in _EXPERTS else "block")
                boundary.axes.add(rule.axis)
                if style == "ep_dispatch_experts":
                    boundary.injection_axis = rule.axis
            elif style in _LINEAR_LEAVES:
                if not isinstance(module, nn.Linear):
                    raise HpgenError(
                        f"{self.name}: {style} on {fqn} ({type(module).__name__}): hpgen wraps only nn.Linear "
                        "as a column- or row-parallel layer of its own"
                    )
                self._boundary(fqn, "linear").axes.add(rule.axis)
            elif style in _EMBEDDING_LEAVES:
                if not isinstance(module, nn.Embedding):
                    raise HpgenError(
                        f"{self.name}: {style} on {fqn} ({type(module).__name__}), which is not an nn.Embedding"
                    )
                self._boundary(fqn, "embedding").axes.add(rule.axis)
        # A row-sharded parameter with a rule of its own (``experts.down_proj``) reduces in the
        # module holding it, unless a boundary above already does.
        for fqn, rule in sorted(self.rules.items()):
            if fqn in self.modules or rule.via_module or rule.style not in _ROWWISE:
                continue
            owner = fqn.rpartition(".")[0]
            if self._enclosing(owner) is None:
                self._boundary(owner, "block").axes.add(rule.axis)
        for column in columns:
            if self._enclosing(column) is None:
                self._widen_for(column)
        for boundary in self.boundaries.values():
            if len(boundary.axes) > 1:
                raise HpgenError(
                    f"{self.name}: {boundary.fqn} is sharded on several axes ({', '.join(sorted(boundary.axes))}); "
                    "hpgen plans one axis per block"
                )
        # Experts on an axis of their own also shard their intermediate dim on tp, when
        # the TP plan does: the one kind of block on two axes.
        for fqn, rule in sorted(self.expert_tp_rules.items()):
            boundary = self._enclosing(fqn if fqn in self.modules else fqn.rpartition(".")[0])
            if boundary is not None and boundary.kind == "experts" and rule.style in _EXPERTS | _SHARDING:
                boundary.axes.add(rule.axis)

    def _ancestors(self, fqn: str, *, include_self: bool = False) -> list[str]:
        """The modules above ``fqn`` (and ``fqn`` itself), nearest first, up to the first
        ``ModuleList`` element: a decoder layer is as far as a block may reach."""
        import torch.nn as nn

        found = []
        path = fqn if include_self else fqn.rpartition(".")[0]
        while path in self.modules and path:
            found.append(path)
            parent = path.rpartition(".")[0]
            if "." in path and isinstance(self.modules.get(parent), nn.ModuleList):
                break
            path = parent
        return found

    def _block_of_rowwise(self, fqn: str, columns: list[str]) -> str:
        for ancestor in self._ancestors(fqn):
            if any(column == ancestor or column.startswith(ancestor + ".") for column in columns):
                return ancestor
        raise HpgenError(
            f"{self.name}: rowwise {fqn} has no colwise layer in an enclosing module to shard its input; "
            "hpgen has no block to put it in"
        )

    def _widen_for(self, column: str) -> None:
        """Make the nearest ancestor of ``column`` that holds a block the block instead."""
        for ancestor in self._ancestors(column, include_self=True):
            inner = [key for key, b in self.boundaries.items() if key.startswith(ancestor + ".") and b.kind == "block"]
            if not inner:
                continue
            axes = {axis for key in inner for axis in self.boundaries[key].axes}
            for key in inner:
                del self.boundaries[key]
            self._boundary(ancestor, "block").axes.update(axes)
            return
        raise HpgenError(
            f"{self.name}: colwise {column} is sharded, but no rowwise layer or experts module near it reduces "
            "its output: hpgen has no block to put it in"
        )

    def _enclosing(self, fqn: str) -> _Boundary | None:
        """The nearest boundary at ``fqn`` or above it."""
        path = fqn
        while True:
            if path in self.boundaries:
                return self.boundaries[path]
            if not path:
                return None
            path = path.rpartition(".")[0] if "." in path else ""

    def _place_params(self) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        expert_rules = [(fqn, rule) for fqn, rule in sorted(self.expert_tp_rules.items()) if fqn not in self.modules]
        for fqn, rule in [*sorted(self.rules.items()), *expert_rules]:
            style = rule.style
            if fqn in self.modules:
                if style in _GRAD_REDUCE:
                    for param_name, _ in self.modules[fqn].named_parameters(recurse=False):
                        self._add_grad_reduce(f"{fqn}.{param_name}", style)
                continue
            if style not in _SHARDING:
                if style in _GRAD_REDUCE and not rule.via_module:
                    self._add_grad_reduce(fqn, style)
                continue  # markers (experts, all_reduce) and no-ops; module rules handled above
            owner, _, leaf = fqn.rpartition(".")
            boundary = self._enclosing(owner)
            if boundary is None:
                raise HpgenError(
                    f"{self.name}: {style} {fqn} is sharded, but no rowwise layer or experts module above it "
                    "reduces its output: hpgen has no boundary to put it in"
                )
            if rule.axis not in boundary.axes:
                raise HpgenError(
                    f"{self.name}: {fqn} is sharded on {rule.axis} inside {boundary.fqn}, which is sharded on "
                    f"{', '.join(sorted(boundary.axes))}"
                )
            relative = _relative(fqn, boundary.fqn)
            placement = _placement(style, params[fqn].ndim, leaf)
            boundary.params.setdefault(relative, {})[rule.axis] = placement
            if placement == "R":  # a row-parallel bias: added once, after the reduction
                boundary.deferred.add(relative)

    def _add_grad_reduce(self, fqn: str, style: str) -> None:
        boundary = self._enclosing(fqn.rpartition(".")[0])
        if boundary is None or boundary.kind in ("linear", "embedding"):
            raise HpgenError(f"{self.name}: {style} {fqn} sits in no sharded block whose gradient it could reduce over")
        boundary.grad_reduce.add(_relative(fqn, boundary.fqn))

    def _implicit_grad_reduce(self) -> None:
        """Every parameter a boundary leaves replicated in its sharded body gets a partial gradient.

        In a block, each rank's backward runs through its shard of the heads or features
        only; in a wrapped ``nn.Embedding`` subclass (a norm after the lookup), through its
        vocabulary rows only. Parameters of boundaries nested inside are theirs to list.
        """
        for boundary in self.boundaries.values():
            for name, _ in boundary.module.named_parameters():
                fqn = f"{boundary.fqn}.{name}"
                if self._enclosing(fqn.rpartition(".")[0]) is boundary and name not in boundary.params:
                    boundary.grad_reduce.add(name)

    # -- sizes

    def _check_sizes(self) -> None:
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        for axis, size in self.sizes.items():
            flag = "--tp" if axis == "tp" else "--ep"
            attention = [
                b for b in self.boundaries.values() if axis in b.axes and b.kind == "block" and _is_attention(b)
            ]
            if attention:
                for attr in ("num_attention_heads", "num_key_value_heads"):
                    value = _config_value(text, attr)
                    if not isinstance(value, int) or value % size == 0:
                        continue
                    if attr == "num_key_value_heads" and size % value == 0:
                        for boundary in attention:
                            self._replicate_kv_heads(boundary, axis, value, size // value, text)
                        continue
                    raise HpgenError(
                        f"{self.name}: {attr}={value} does not divide over {flag} {size}"
                        + (f" and {flag} {size} is not a multiple of it" if attr == "num_key_value_heads" else "")
                        + f": {attention[0].fqn} is head-sharded and a rank would hold part of a head"
                    )
            for boundary in self.boundaries.values():
                if axis not in boundary.axes:
                    continue
                if boundary.kind == "experts" and boundary.injection_axis is not None:
                    count = getattr(boundary.module, "num_experts", None)
                    if isinstance(count, int) and count % size:
                        raise HpgenError(
                            f"{self.name}: {boundary.fqn} holds num_experts={count}, which does not divide over "
                            f"{flag} {size}"
                        )
                if boundary.kind == "embedding" and boundary.module.num_embeddings < size:
                    rows = boundary.module.num_embeddings
                    raise HpgenError(f"{self.name}: {boundary.fqn} has {rows} rows, fewer than {flag} {size}")

    def _replicate_kv_heads(self, boundary: _Boundary, axis: str, kv_heads: int, replicas: int, config: Any) -> None:
        """Fewer key/value heads than ranks: each on ``replicas`` consecutive ranks (``RS(0,r)``), as vLLM does.

        The key/value projections are the sharded parameters of the attention block whose
        dim 0 holds ``kv_heads`` heads; ``num_key_value_groups`` (query heads per key/value
        head, what ``repeat_kv`` repeats by) is divided by ``replicas`` on each rank.
        """
        head_dim = getattr(boundary.module, "head_dim", None) or _config_value(config, "head_dim")
        if not isinstance(head_dim, int):
            hidden, heads = _config_value(config, "hidden_size"), _config_value(config, "num_attention_heads")
            head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None
        found = []
        for name, layout in boundary.params.items():
            shape = boundary.module.get_parameter(name).shape
            if layout.get(axis) == "S(0)" and isinstance(head_dim, int) and shape[0] == kv_heads * head_dim:
                layout[axis] = f"RS(0,{replicas})"
                found.append(name)
        if not any(name.endswith("weight") for name in found):
            raise HpgenError(
                f"{self.name}: num_key_value_heads={kv_heads} is fewer than --{axis} {replicas * kv_heads}, and "
                f"{boundary.fqn} has no key/value projection of its own to replicate (sharded rows = "
                f"{kv_heads} x head_dim {head_dim})"
            )
        if not isinstance(getattr(boundary.module, "num_key_value_groups", None), int):
            # without it hpgen cannot say (nor parallelize check) how the local heads pair up
            raise HpgenError(
                f"{self.name}: num_key_value_heads={kv_heads} is fewer than --{axis} {replicas * kv_heads}; "
                f"replicating them needs {type(boundary.module).__name__}.num_key_value_groups (what repeat_kv "
                "repeats by), which it does not have"
            )
        boundary.divide_attrs["num_key_value_groups"] = replicas

    # -- sequence parallel

    def _sequence_parallel(self) -> None:
        """Residual stream sharded on dim 1 between decoder layers (Megatron sequence parallel)."""
        layers_path, layers = self._decoder_layers()
        count = len(layers)
        final_norm = self._final_norm(layers_path)
        for index, (fqn, layer) in enumerate(layers):
            boundary = self._boundary(fqn, "sp")
            first = index == 0
            last_gathers = index == count - 1 and final_norm is None
            boundary.inputs[self._input(layer, fqn)] = ({"tp": "R" if first else "S(1)"}, {"tp": "S(1)"})
            names = self._outputs(layer, fqn)
            boundary.out_names = names if len(names) > 1 else None
            boundary.outputs[names[0]] = ({"tp": "S(1)"}, {"tp": "R" if last_gathers else "S(1)"})
            boundary.axes.add("tp")
            for child_name, child in layer.named_children():
                child_fqn = f"{fqn}.{child_name}"
                inner = [b for key, b in self.boundaries.items() if key == child_fqn or key.startswith(child_fqn + ".")]
                own = child_fqn in self.boundaries and self.boundaries[child_fqn].kind in ("block", "experts")
                if own:
                    self.boundaries[child_fqn].sp_input = True
                elif inner or (_has_params(child) and not _is_per_token(child)):
                    wrapper = self._boundary(child_fqn, "sp")
                    wrapper.inputs[self._input(child, child_fqn)] = ({"tp": "S(1)"}, {"tp": "R"})
                    child_names = self._outputs(child, child_fqn)
                    wrapper.out_names = child_names if len(child_names) > 1 else None
                    wrapper.outputs[child_names[0]] = ({"tp": "R"}, {"tp": "S(1)"})
                elif _has_params(child):
                    for param_name, _ in child.named_parameters():
                        boundary.grad_reduce.add(f"{child_name}.{param_name}")
            for param_name, _ in layer.named_parameters(recurse=False):
                boundary.grad_reduce.add(param_name)
        if final_norm is not None:
            fqn, norm = final_norm
            boundary = self._boundary(fqn, "sp")
            boundary.inputs[self._input(norm, fqn)] = ({"tp": "S(1)"}, {"tp": "S(1)"})
            names = self._outputs(norm, fqn)
            boundary.out_names = names if len(names) > 1 else None
            boundary.outputs[names[0]] = ({"tp": "S(1)"}, {"tp": "R"})
            boundary.grad_reduce.update(name for name, _ in norm.named_parameters())
            boundary.axes.add("tp")

    def _decoder_layers(self) -> tuple[str, list[tuple[str, Any]]]:
        """The ``nn.ModuleList`` holding the most boundaries: the decoder layers."""
        import torch.nn as nn

        best: tuple[int, str] | None = None
        for fqn, module in self.modules.items():
            if not isinstance(module, nn.ModuleList):
                continue
            held = sum(1 for key in self.boundaries if key.startswith(fqn + "."))
            if held and (best is None or held > best[0]):
                best = (held, fqn)
        if best is None:
            raise HpgenError(
                f"{self.name}: --sp: no decoder layer holds a sharded block (the plan shards "
                f"{', '.join(sorted(self.boundaries)) or 'nothing'}), so there is no all-reduce to split"
            )
        path = best[1]
        outside = [
            key
            for key, b in self.boundaries.items()
            if b.kind in ("block", "experts") and not key.startswith(path + ".")
        ]
        if outside:
            raise HpgenError(
                f"{self.name}: --sp: the sharded blocks {', '.join(outside)} are outside the decoder layers {path}"
            )
        return path, [(f"{path}.{name}", layer) for name, layer in self.modules[path].named_children()]

    def _final_norm(self, layers_path: str) -> tuple[str, Any] | None:
        """The norm after the decoder layers, when it can gather the sequence at its output.

        It must be a class of the modeling file with a ``forward`` of its own, and the
        model's ``forward`` must call it once: a norm also applied before the layers
        (NanoChat) would gather a stream that is not sharded yet. Otherwise the last
        decoder layer gathers.
        """
        parent_path = layers_path.rpartition(".")[0]
        parent = self.modules[parent_path]
        after = False
        for name, child in parent.named_children():
            fqn = f"{parent_path}.{name}" if parent_path else name
            if fqn == layers_path:
                after = True
                continue
            if after and _is_norm(child):
                info = self.index.class_named(type(child).__name__)
                if info is None or info.forward is None or not defined_in(type(child), self.source):
                    return None
                if _self_calls(self.parsed, self._forward_owner(parent, parent_path).name, name) != 1:
                    return None
                return fqn, child
        return None

    # -- inputs and outputs

    def _set_io(self, boundary: _Boundary) -> None:
        if boundary.kind == "sp":
            return
        sp_input = boundary.sp_input
        axes = sorted(boundary.axes)
        replicated = {axis: "R" for axis in axes}
        if boundary.kind == "linear":
            style = self.rules[boundary.fqn].style
            boundary.wrapped_as = "nn.Linear"
            if _LINEAR_LEAVES[style] == "col":
                boundary.inputs["input"] = (dict(replicated), dict(replicated))
                boundary.outputs["output"] = ({axis: "S(-1)" for axis in axes}, dict(replicated))
            else:
                boundary.inputs["input"] = (dict(replicated), {axis: "S(-1)" for axis in axes})
                boundary.outputs["output"] = ({axis: "P(sum)" for axis in axes}, dict(replicated))
            return
        if boundary.kind == "embedding":
            style = self.rules[boundary.fqn].style
            boundary.wrapped_as = "nn.Embedding"
            partial = "P(sum)" if _EMBEDDING_LEAVES[style] == 0 else "S(-1)"
            boundary.outputs["output"] = ({axis: partial for axis in axes}, dict(replicated))
            return
        parameters = self._parameters(boundary.module, boundary.fqn)
        inputs = [parameters[0]]
        if boundary.kind == "experts" and len(parameters) >= 3:
            inputs.append(parameters[2])  # the routing weights: their gradient is partial too
        for position, name in enumerate(inputs):
            src = dict(replicated)
            if sp_input and position == 0:
                src["tp"] = "S(1)"
            boundary.inputs[name] = (src, dict(replicated))
        names = self._outputs(boundary.module, boundary.fqn)
        boundary.out_names = names if len(names) > 1 else None
        dst = dict(replicated)
        if sp_input:
            dst["tp"] = "S(1)"
            # a deferred bias added to a sequence shard gets only that shard's gradient
            boundary.grad_reduce.update(boundary.deferred)
        boundary.outputs[names[0]] = ({axis: "P(sum)" for axis in axes}, dst)

    def _source_of(self, cls: type) -> tuple[Path, ParsedSource, ModuleIndex]:
        """The modeling file defining ``cls``, parsed and indexed (once per file)."""
        path = Path(_source_file(cls)).resolve()
        if path not in self._sources:
            self._sources[path] = _index_source(path)
        return (path, *self._sources[path])

    def _class_info(self, module: Any, fqn: str) -> ClassInfo:
        cls = type(module)
        path, _, index = self._source_of(cls)
        info = index.class_named(cls.__name__)
        if info is None:
            raise HpgenError(f"{self.name}: {fqn}: {cls.__qualname__} is not a top-level class of {path.name}")
        return info

    def _forward_owner(self, module: Any, fqn: str) -> ClassInfo:
        """The class (in the module's modeling file) whose ``forward`` the module runs."""
        info = self._class_info(module, fqn)
        path, _, index = self._source_of(type(module))
        pending, seen = [info], set()
        while pending:
            current = pending.pop(0)
            if current.name in seen:
                continue
            seen.add(current.name)
            if current.forward is not None:
                return current
            pending.extend(index.classes[base] for base in current.bases if base in index.classes)
        raise HpgenError(f"{self.name}: {fqn} ({info.name}) has no forward in {path.name}")

    def _parameters(self, module: Any, fqn: str) -> list[str]:
        """The positional parameters of the module's ``forward`` after ``self``."""
        forward = self._forward_owner(module, fqn).forward
        assert forward is not None
        names = [p.name for p in forward.parameters if p.kind in ("positional_only", "positional")][1:]
        if not names:
            raise HpgenError(f"{self.name}: {fqn} ({type(module).__name__}).forward takes no tensor input")
        return names

    def _input(self, module: Any, fqn: str) -> str:
        return self._parameters(module, fqn)[0]

    def _outputs(self, module: Any, fqn: str) -> tuple[str, ...]:
        """Output names in return order: the tuple's element names, or ``output``."""
        owner = self._forward_owner(module, fqn)
        return _return_names(self._source_of(type(module))[1], owner.name)

    # -- the document

    def _document(self) -> dict[str, Any]:
        groups = self._grouped()
        param_plan = {key: entry for key, (_, entry) in groups.items()}
        injections = [
            {"match": key, "local_compute_fn": {"_target_": EXPERTS_PARALLEL, "axis": boundary.injection_axis}}
            for key, (boundary, _) in sorted(groups.items())
            if boundary.injection_axis is not None
        ]
        document: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "model_class": type(self.model).__name__,
            "mesh_dim_names": list(self.mesh),
            "param_plan": param_plan,
        }
        if injections:
            document["injections"] = injections
        if self.corrected:
            document["comments"] = {"corrected": dict(sorted(self.corrected.items()))}
        classes = self._boundary_classes(groups)
        if classes:
            document["boundary_classes"] = classes
        plan_from_dict(document, name=f"hpgen plan {self.name}")  # what we write must load
        return document

    def _grouped(self) -> dict[str, tuple[_Boundary, dict[str, Any]]]:
        """Concrete boundaries folded into ``*`` keys where every match agrees."""
        by_pattern: dict[str, list[_Boundary]] = {}
        for fqn, boundary in sorted(self.boundaries.items()):
            by_pattern.setdefault(_generic(fqn), []).append(boundary)
        result: dict[str, tuple[_Boundary, dict[str, Any]]] = {}
        for pattern, members in by_pattern.items():
            matches = [fqn for fqn in self.modules if fqn and _generic(fqn) == pattern]
            signatures = {
                (type(b.module).__name__, json.dumps(self._entry(b), sort_keys=True), b.injection_axis) for b in members
            }
            if len(members) == len(matches) and len(signatures) == 1:
                result[pattern] = (members[0], self._entry(members[0]))
            else:
                for boundary in members:
                    result[boundary.fqn] = (boundary, self._entry(boundary))
        return result

    def _entry(self, boundary: _Boundary) -> dict[str, Any]:
        """The plan entry of one boundary (a derived plan adds what its layouts need)."""
        return boundary.entry()

    def _boundary_classes(self, groups: Mapping[str, tuple[_Boundary, dict[str, Any]]]) -> dict[str, str]:
        """``boundary_classes`` for the keys that hpgen's static resolution gets wrong or cannot get."""
        from hpgen.errors import HpgenError as _Error
        from hpgen.resolve import resolve_boundaries

        classes = {}
        for key, (boundary, entry) in groups.items():
            wanted = boundary.wrapped_as or type(boundary.module).__name__
            single = {
                "mesh_dim_names": list(self.mesh),
                "model_class": type(self.model).__name__,
                "param_plan": {key: entry},
            }
            try:
                found = resolve_boundaries(plan_from_dict(single), self.index, source_name=self.source.name)[key]
                ok = found.name.rsplit(".", 1)[-1] == wanted.rsplit(".", 1)[-1] and found.external == bool(
                    boundary.wrapped_as
                )
            except _Error:
                ok = False
            if not ok:
                classes[key] = wanted
        return classes


# --------------------------------------------------------------------------- helpers


def _generic(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp`` (transformers' wildcard form)."""
    return _DIGITS.sub(".*", name)


def _relative(fqn: str, base: str) -> str:
    return fqn[len(base) + 1 :] if base else fqn


def _placement(style: str, ndim: int, leaf: str) -> str:
    """The placement text of one parameter under one style (transformers' ``shard_param``)."""
    if style in ("colwise", "colwise_gather_output", "colwise_rep"):
        return f"S({max(ndim - 2, 0)})"
    if style == "packed_colwise":
        return f"SS({max(ndim - 2, 0)},2)"
    if style in ("rowwise", "rowwise_split_input", "rowwise_rep"):
        return "R" if leaf == "bias" else f"S({ndim - 1})"
    if style == "packed_rowwise":
        return "R" if ndim == 1 else f"SS({ndim - 1},2)"
    if style == "grouped_gemm":
        return "S(0)"
    if style in _EMBEDDING_LEAVES:
        return f"S({_EMBEDDING_LEAVES[style]})"
    raise AssertionError(style)  # only sharding styles reach here


def _config_value(config: Any, attr: str) -> Any:
    """A config attribute, or None when it is absent or ambiguous (per-layer heads)."""
    try:
        return getattr(config, attr, None)
    except Exception:  # transformers' per-layer configs raise their own error for a global read
        return None


def _is_attention(boundary: _Boundary) -> bool:
    last = boundary.fqn.rpartition(".")[2].lower()
    return "attention" in type(boundary.module).__name__.lower() or "attn" in last or "attention" in last


def _is_norm(module: Any) -> bool:
    return "norm" in type(module).__name__.lower()


def _is_per_token(module: Any) -> bool:
    """A layer that computes each position on its own (a norm, a linear map): it runs on sequence shards."""
    import torch.nn as nn

    return _is_norm(module) or isinstance(module, nn.Linear)


def _has_params(module: Any) -> bool:
    return any(True for _ in module.parameters())


def _source_file(cls: type) -> str:
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        path = None
    if path is None:
        raise HpgenError(f"{cls.__name__}: cannot find the file that defines it")
    return path


def defined_in(cls: type, source: Path) -> bool:
    """True when ``cls`` is defined in the file ``source``."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return False
    return path is not None and Path(path).resolve() == source.resolve()


def _index_source(source: Path) -> tuple[ParsedSource, ModuleIndex]:
    from hpgen.index import index_module, parse_source

    text = source.read_text(encoding="utf-8")
    parsed = parse_source(text, name=source.name)
    return parsed, index_module(parsed)


def _return_names(parsed: ParsedSource, class_name: str) -> tuple[str, ...]:
    """Names of what ``<class_name>.forward`` returns: tuple items in order, else ``("output",)``.

    An item that is a plain name keeps it (``attn_output``); others are ``output_<i>``.
    Returns of different tuple lengths or kinds leave the single name ``output`` (the
    classifier then picks the generic form if it must).
    """
    node = next((n for n in parsed.tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    forward = None
    for statement in node.body if node is not None else ():
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == "forward":
            forward = statement
    if forward is None:
        return ("output",)
    returns = [r for r in _own_returns(forward) if r.value is not None and not _is_none(r.value)]
    tuples = [r.value for r in returns if isinstance(r.value, ast.Tuple)]
    if not returns or len(tuples) != len(returns):
        records = [r.value for r in returns if isinstance(r.value, ast.Call) and r.value.keywords and not r.value.args]
        if records and len(records) == len(returns) and records[0].keywords[0].arg:
            return (records[0].keywords[0].arg,)
        return ("output",)
    lengths = {len(t.elts) for t in tuples}
    if len(lengths) != 1 or any(isinstance(e, ast.Starred) for t in tuples for e in t.elts):
        return ("output",)
    names: list[str] = []
    for position in range(lengths.pop()):
        found = {t.elts[position].id for t in tuples if isinstance(t.elts[position], ast.Name)}
        name = found.pop() if len(found) == 1 else f"output_{position}"
        names.append(name if name not in names else f"output_{position}")
    return tuple(names) if names else ("output",)


def _self_calls(parsed: ParsedSource, class_name: str, attr: str) -> int:
    """How many times ``<class_name>.forward`` calls ``self.<attr>(...)``."""
    node = next((n for n in parsed.tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    forward = next(
        (n for n in (node.body if node else ()) if isinstance(n, ast.FunctionDef) and n.name == "forward"), None
    )
    if forward is None:
        return 0
    return sum(
        1
        for call in ast.walk(forward)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == attr
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "self"
    )


def _own_returns(function: ast.AST) -> Iterable[ast.Return]:
    """The ``return`` statements of ``function`` itself (nested functions and classes skipped)."""
    for child in ast.iter_child_nodes(function):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(child, ast.Return):
            yield child
        yield from _own_returns(child)


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
