"""``parallelize(model, plan, mesh)``: install a frozen plan on a model built from a generated file.

It runs in two phases. The survey reads the plan against the model and the mesh and
raises :class:`ParallelizeError` for anything that cannot work, while the model is still
untouched:

- plan axes missing from the mesh; a plan key that matches no module;
- parameters the plan names that the module does not have; placements a parameter
  cannot take; attention heads, key/value heads or experts that the axis does not
  divide; ``nn.Linear`` biases that do not follow their weight; tied parameters with
  different layouts (:mod:`hpgen.runtime.install.params`);
- a boundary whose class has no generated ``forward`` for the plan's contract (the
  generated file is stale), or a wrapped ``nn.Embedding``/``nn.Linear`` whose layout is
  not vocab-, column- or row-parallel (:mod:`hpgen.runtime.install.module_decisions`);
- deferred biases without a single reduced output, grad-reduced parameters of a body
  that is not sharded (:mod:`hpgen.runtime.install.hooks`); ``tp_divide_attrs`` and
  ``divide_attrs`` that do not divide, attention whose local query and key/value heads
  would be paired wrongly (:mod:`hpgen.runtime.install.attrs`).

Before the survey, every rank checks that all ranks of each axis were given the same
plan, generated file and hpgen version (:mod:`hpgen.runtime.install.agreement`), that the
world has no rank outside the mesh, and that the plan names only functions the user trusts
(:mod:`hpgen.core.plan_trust`); a refusal of a plan written for another mesh size or model
class says so (:mod:`hpgen.runtime.install.launch_checks`).

The install then shards the parameters in place (plain ``nn.Parameter``s holding the
local chunk), swaps classes (generated per-contract subclasses, wrappers), binds the
axes' collectives, the region functions and the generic boundaries, adds the deferred
biases' and the gradient reductions' hooks, and divides the attributes. Last, the
state-dict hooks (:mod:`hpgen.runtime.checkpoint.state_dict`) and ``save_pretrained``
(:mod:`hpgen.runtime.checkpoint.saving`) make checkpoints keep every shard.

The two phases are :func:`survey_model` and the :class:`Survey` it returns (``shard``,
then ``install``): ``from_pretrained`` (:mod:`hpgen.runtime.install.pretrained`) reads the
checkpoint into the shards between the two, before any hook is attached.

Other mesh axes belong to torch's engines, applied after ``parallelize``: FSDP2
(``fully_shard`` per decoder layer and on the root, on a ``dp`` axis) or DDP; a DDP over
ranks of a plan axis is kept from the shards and refused at its first forward
(:mod:`hpgen.runtime.install.wrapped`). The
gradient reductions happen in tensor hooks that follow FSDP2's parameters
(:mod:`hpgen.runtime.install.hooks`), so those engines see whole gradients.

A plan axis the mesh does not have is refused, except in a model whose generated
classes are all toggle mode (``hpgen lower --mode toggle``) for that axis: there it is
an axis of size one, switched off, so one file serves any mesh.

Nothing here runs in a forward: the generated code calls the bound collectives directly.
"""

from __future__ import annotations

import os
import sys
import types
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from hpgen.core.context_coverage import CONTEXT_AXIS
from hpgen.core.errors import HpgenError, did_you_mean
from hpgen.core.plan import Plan, load_plan, plan_from_dict
from hpgen.core.plan_trust import untrusted_target
from hpgen.runtime.checkpoint.saving import bind_save_pretrained
from hpgen.runtime.checkpoint.state_dict import install_state_dict_hooks
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.collectives import AxisCollectives, scope_shard_sizes
from hpgen.runtime.forward.devices import collective_device
from hpgen.runtime.forward.sampling import bind_generate
from hpgen.runtime.forward.streams import install_streams
from hpgen.runtime.install.adapters import survey_adapters, watch_adapters
from hpgen.runtime.forward.context_axis import ContextAxis
from hpgen.runtime.install.agreement import check_ranks_agree, raise_together
from hpgen.runtime.install.context_checks import install_context, survey_context
from hpgen.runtime.install.attrs import survey_attrs
from hpgen.runtime.install.counterparts import GeneratedModule, generated_modules
from hpgen.runtime.install.hooks import (
    DeferredBias,
    GradReduce,
    install_grad_reduce,
    survey_deferred_biases,
    survey_grad_reduce,
)
from hpgen.runtime.install.inputs import InputCheck
from hpgen.runtime.install.kernels import fit_experts_kernel, fit_hub_functions
from hpgen.runtime.install.launch_checks import refuse_lone_batch_splits, refuse_ranks_outside, reworded
from hpgen.runtime.install.module_decisions import ModuleDecision, survey_modules
from hpgen.runtime.install.module_installs import install_module
from hpgen.runtime.install.params import Matched, ParamShard, shard_params, survey_params
from hpgen.runtime.install.replaced_stubs import refuse_replaced_stubs
from hpgen.runtime.install.summed import SummedBlock, branch_fqns, survey_summed
from hpgen.runtime.install.tuners import peft_base_model, resolve_tuner_names
from hpgen.runtime.install.wrapped import DataParallelCheck, KeptFromDDP, MeshAxes, install_accelerate_check
from hpgen.runtime.pipeline.attach import install_stage
from hpgen.runtime.pipeline.relay import install_relay
from hpgen.runtime.pipeline.stages import StageCut, refuse_axes, survey_stage
from hpgen.core.shards import ShardLayout

__all__ = ["ParallelizeError", "Survey", "parallelize", "survey_model"]

PlanLike = str | os.PathLike[str] | Mapping[str, Any] | Plan


def parallelize(
    model: nn.Module,
    plan: PlanLike,
    mesh: DeviceMesh,
    *,
    generated: Iterable[types.ModuleType] = (),
    check_inputs: bool | Iterable[str] = True,
    trust_plan_code: bool = False,
    trusted_modules: str | Iterable[str] = (),
) -> nn.Module:
    """Shard ``model``'s planned parameters and bind its boundaries' collectives; return ``model``.

    ``model`` is an instance built from a file generated by ``hpgen lower`` (with the
    unsharded weights loaded), ``plan`` a plan path, decoded JSON dict or
    :class:`~hpgen.core.plan.Plan`, and ``mesh`` a ``DeviceMesh`` with every axis the plan
    names. Every rank of the mesh must call it, with the same model and plan (checked:
    otherwise every rank raises). On any problem it raises :class:`ParallelizeError` and
    the model is left unchanged.

    A boundary whose module is transformers' own class (a language model built through
    ``AutoModel.from_config``, or another model's decoder layers) takes the generated class
    lowered from that class's modeling file: from the generated files the model's classes
    come from, or from the imported generated modules in ``generated`` (one per other
    modeling file the plan's boundaries live in; ``hpgen plan --explain`` names them).

    A peft model (``get_peft_model`` first) takes the plan of its base model: the plan
    applies to ``get_base_model()``, through peft's ``base_layer`` indirection, and the
    adapters are sharded like their base layers (:mod:`hpgen.runtime.install.adapters`), as they
    are when peft comes after ``parallelize``.

    ``check_inputs``: the axes whose ranks must be fed the same inputs, checked on the
    first forwards (:mod:`hpgen.runtime.install.inputs`); ``True`` for every axis,
    ``False`` for none, or the names of some (``("tp",)`` where the ranks of ``ep`` serve
    requests of their own under data-parallel attention).

    ``trust_plan_code``, ``trusted_modules``: a plan is data. Its injections may name hpgen's own
    local compute functions; a function of any other module is imported only with
    ``trust_plan_code=True``, or when its module is in ``trusted_modules`` (or under one of them).
    Otherwise every rank refuses the plan before importing anything (:mod:`hpgen.core.plan_trust`).
    """
    plan = _as_plan(plan)
    checked = _checked_axes(check_inputs, plan)
    survey = survey_model(
        model, plan, mesh, generated=generated, trust_plan_code=trust_plan_code, trusted_modules=trusted_modules
    )
    survey.shard()
    return survey.install(checked=checked)


def survey_model(
    model: nn.Module,
    plan: PlanLike,
    mesh: DeviceMesh,
    *,
    generated: Iterable[types.ModuleType] = (),
    trust_plan_code: bool = False,
    trusted_modules: str | Iterable[str] = (),
) -> Survey:
    """Every check :func:`parallelize` makes, on every rank together, with ``model`` untouched.

    The :class:`Survey` returned then shards the parameters and installs the rest;
    ``from_pretrained`` reads the checkpoint into the shards between the two, so the
    tensors are in place before any hook is attached to them.
    """
    plan = _as_plan(plan)
    peft_model = None
    base = peft_base_model(model)
    if base is not None:
        peft_model, model = model, base
    if isinstance(model, DistributedDataParallel):
        raise ParallelizeError(
            "the model is wrapped in DistributedDataParallel: call parallelize on the model first, then wrap it "
            "(DDP must see the sharded parameters)"
        )
    if getattr(model, "_hp_parallelized", False):
        raise ParallelizeError(f"{type(model).__name__} was already parallelized; build a fresh model")
    refuse_axes(plan)  # cp or ep with pipeline stages: named before the mesh is read
    refuse_ranks_outside(mesh)  # before torch's get_group, which fails on such a rank alone
    axes = mesh_axes(plan, mesh, off=_toggle_axes(model, plan, mesh))
    on_mesh = tuple(axis for axis in plan.mesh_dim_names if axis in (mesh.mesh_dim_names or ()))
    # First, before any rank can refuse alone: ranks given different programs would hang or be wrong.
    check_ranks_agree(model, plan, mesh, on_mesh)
    try:
        _refuse_untrusted(plan, trust_plan_code, trusted_modules)  # before anything the plan names is imported
        stage = None
        if plan.pipeline is not None:  # the stage's modules only; to the other axes' code the pp axis is size one
            stage = survey_stage(model, plan, mesh)
            axes[plan.pipeline.axis] = AxisCollectives(None, plan.pipeline.axis)
        survey_context(model, axes)
        survey = _survey(model, plan, mesh, axes, generated_modules(model, generated), stage)
    except ParallelizeError as error:
        error = reworded(error, model, plan, mesh)  # a plan for another mesh size or model class says so
        raise_together(error, mesh, on_mesh)
        raise error from None
    raise_together(None, mesh, on_mesh)
    survey.peft_model = peft_model
    return survey


_PARALLELIZED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def parallelized_models() -> list[nn.Module]:
    """Every model ``parallelize`` has made that is still alive (``clip_grad_norm_`` finds parameters' layouts)."""
    return list(_PARALLELIZED)


def _checked_axes(check_inputs: bool | Iterable[str], plan: Plan) -> tuple[str, ...]:
    """The plan axes whose inputs are checked to agree (``check_inputs`` of :func:`parallelize`)."""
    if isinstance(check_inputs, bool):
        return tuple(plan.mesh_dim_names) if check_inputs else ()
    if isinstance(check_inputs, str):
        check_inputs = (check_inputs,)
    names = tuple(check_inputs)
    unknown = [name for name in names if name not in plan.mesh_dim_names]
    if unknown:
        raise ParallelizeError(
            f"check_inputs names {', '.join(map(repr, unknown))}, not an axis of the plan "
            f"({', '.join(plan.mesh_dim_names)})"
        )
    return names


def _refuse_untrusted(plan: Plan, trust_plan_code: bool, trusted_modules: str | Iterable[str]) -> None:
    try:
        untrusted = untrusted_target(plan, trust_plan_code=trust_plan_code, trusted_modules=trusted_modules)
    except ValueError as error:
        raise ParallelizeError(str(error)) from None
    if untrusted is not None:
        raise ParallelizeError(untrusted)


def _as_plan(plan: PlanLike) -> Plan:
    if isinstance(plan, Plan):
        return plan
    try:
        if isinstance(plan, Mapping):
            return plan_from_dict(dict(plan))
        return load_plan(plan)
    except HpgenError as error:
        raise ParallelizeError(f"invalid plan: {error}") from None


def mesh_axes(plan: Plan, mesh: DeviceMesh, off: tuple[str, ...] = ()) -> dict[str, AxisCollectives]:
    """The collectives of each plan axis, on the mesh dim of the same name (``off``: size one)."""
    names = tuple(mesh.mesh_dim_names or ())
    missing = [axis for axis in plan.mesh_dim_names if axis not in names and axis not in off]
    if missing:
        raise ParallelizeError(
            f"the plan's axes {', '.join(missing)} are not dims of the mesh (mesh_dim_names: "
            f"{', '.join(names) or 'none'}); build it with init_device_mesh(..., mesh_dim_names=...)"
        )
    return {
        axis: (ContextAxis if axis == CONTEXT_AXIS else AxisCollectives)(
            mesh.get_group(axis) if axis in names else None, axis
        )
        for axis in plan.mesh_dim_names
    }


def _toggle_axes(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> tuple[str, ...]:
    """Plan axes absent from the mesh that every generated class using them guards with ``<axis>_enable``."""
    names = tuple(mesh.mesh_dim_names or ())
    absent = [axis for axis in plan.mesh_dim_names if axis not in names]
    classes = {type(m) for m in model.modules() if hasattr(type(m), "_hp_boundary_form")}
    if not absent or not classes:
        return ()
    return tuple(
        axis
        for axis in absent
        if all(hasattr(cls, f"{axis}_enable") for cls in classes if hasattr(cls, f"_hp_{axis}"))
        and any(hasattr(cls, f"{axis}_enable") for cls in classes)
    )


@dataclass
class Survey:
    """Everything ``parallelize`` will do, checked: :meth:`shard`, then :meth:`install`, do it."""

    model: nn.Module
    plan: Plan
    mesh: DeviceMesh
    axes: dict[str, AxisCollectives]
    records: list[ModuleDecision]  # what each planned module is, decided once; the installers read these
    shards: list[ParamShard]
    biases: list[DeferredBias]
    grad_reduces: list[GradReduce]
    divides: list[tuple[nn.Module, str, int]]
    summed: list[SummedBlock]
    adapter_slots: list[Any]
    peft_model: nn.Module | None = None  # the peft model whose base model ``model`` is
    stage: StageCut | None = None  # this rank's pipeline stages (docs/pipeline.md)

    @property
    def on_mesh(self) -> tuple[str, ...]:
        """The plan's axes the mesh has (the others are toggle axes, off)."""
        return tuple(axis for axis in self.plan.mesh_dim_names if axis in (self.mesh.mesh_dim_names or ()))

    def shard_layouts(self) -> dict[str, ShardLayout]:
        """This rank's shard of each planned parameter that is split, under each of its names."""
        return {
            name: shard.shard_layout
            for shard in self.shards
            if shard.shard_layout.local_shape != shard.shard_layout.shape
            for name in shard.names
        }

    def shard(self) -> None:
        """Drop the other pipeline stages' modules; replace each planned parameter by its local chunk
        (on the meta device: a tensor of the local shape)."""
        if self.stage is not None:
            self.stage.keep(self.model)
        shard_params(self.shards)

    def install(self, *, checked: Iterable[str] | None = None) -> nn.Module:
        """Swap classes, bind collectives, attach the hooks; return the model ``parallelize`` returns.

        ``checked``: the plan axes whose ranks' inputs are checked to agree (``None``: all).
        Hooks go on the parameters registered now, so anything that replaces them (a
        checkpoint read into the shards) comes before."""
        model, plan, mesh, axes = self.model, self.plan, self.mesh, self.axes
        switched, hub = [], []
        for record in self.records:
            install_module(record, axes)
            why = fit_experts_kernel(record.module) if record.form != "identity" else None
            if why is not None:
                switched.append((record.fqn, why))
            dropped = fit_hub_functions(record.module) if record.form != "identity" else None
            if dropped is not None:
                hub.append((record.fqn, dropped))
        if hub and (not dist.is_initialized() or dist.get_rank() == 0):
            first, names = hub[0]
            more = f" and {len(hub) - 1} more like it" if len(hub) > 1 else ""
            print(
                f"hpgen: {first}{more} run the modeling file's {names} instead of the hub kernel kernelize bound, "
                "which would compute on this rank's shards past the plan's collectives",
                file=sys.stderr,
            )
        if switched and (not dist.is_initialized() or dist.get_rank() == 0):
            first, why = switched[0]
            more = f" and {len(switched) - 1} more like it" if len(switched) > 1 else ""
            print(f"hpgen: {first}{more} run the eager experts loop: the local shard {why}", file=sys.stderr)
        for bias in self.biases:
            bias.install(axes)
        for block in self.summed:
            block.install()
        install_grad_reduce(self.grad_reduces, axes, mesh)
        for module, attr, value in self.divides:
            setattr(module, attr, value)
        device = collective_device(mesh)
        for axis in self.on_mesh:
            axes[axis].find_native_ops(device)
        # random ops: one stream for replicated and partial values, one per rank for sharded ones
        branches = branch_fqns(record.item for record in self.records)
        install_streams(model, self.records, plan.mesh_dim_names, axes, device, branches)
        groups = [(axis, axes[axis].group) for axis in plan.mesh_dim_names if axes[axis].size > 1]
        staged = [self.stage.mesh.get_group(self.stage.axis)] if self.stage is not None else []  # sampling agrees on pp too
        bind_generate(model, [group for _, group in groups] + staged, device)
        # the other mesh axes are the data-parallel ones (pp is not: a pipeline's ranks share one batch)
        model._hp_mesh_axes = MeshAxes(mesh, self.on_mesh)
        if groups:  # a DDP over these ranks would overwrite shards: kept from them, and refused at its first
            # forward, before the input check (whose error such a DDP's data sharding would otherwise raise)
            listed = getattr(model, "_ddp_params_and_buffers_to_ignore", ())
            model._ddp_params_and_buffers_to_ignore = KeptFromDDP(groups, mesh, listed)
            model.register_forward_pre_hook(DataParallelCheck(groups, mesh))
            install_accelerate_check(model)  # a stock Trainer or Accelerator().prepare(model): refused at prepare
        checked = plan.mesh_dim_names if checked is None else tuple(checked)
        checked_groups = [(axis, group) for axis, group in groups if axis in checked]
        if checked_groups:
            model.register_forward_pre_hook(InputCheck(checked_groups, device), with_kwargs=True)
        # state_dict() as DTensors, load_state_dict of DTensors or full tensors, save_pretrained unsharded
        sharded = [(shard.owners, shard.names[0], shard.shard_layout) for shard in self.shards]
        recorder = install_state_dict_hooks(model, sharded, mesh, axes, plan.mesh_dim_names)
        # peft's adapters, there now (sharded here) or added later (adopted when first seen)
        model._hp_adapters = watch_adapters(model, self.adapter_slots, axes, recorder)
        bind_save_pretrained(model)
        scope_shard_sizes(model, axes.values())  # gathers reuse the sizes of shards made in the same forward
        planned = {record.fqn for record in self.records}
        install_context(model, axes, planned)  # cp: decode steps after a cp prefill run replicated; the loss on each rank's tokens
        model._hp_parallelized = True
        model._hp_mesh = mesh  # the ranks holding the model: clip_grad_norm_ sums its norm over them
        if self.stage is not None:
            install_stage(model, self.stage)  # model._hp_stage, the tied table's groups
            install_relay(model)  # model(input_ids), generate: stage after stage, the logits on every rank
        _PARALLELIZED.add(model)
        if self.peft_model is not None:
            self.peft_model._hp_parallelized = True
            return self.peft_model
        return model


def _survey(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh,
    axes: dict[str, AxisCollectives],
    generated: Sequence[GeneratedModule] = (),
    stage: StageCut | None = None,
) -> Survey:
    matched = resolve_tuner_names(match_modules(model, plan))  # q_proj.weight: q_proj.base_layer.weight under peft
    if stage is not None:  # every key was matched against the whole model; the stage's modules are installed
        matched = [item for item in matched if stage.holds(item.fqn)]
    refuse_replaced_stubs(model, matched)  # a fused kernel bound in place of the torch path the plan shards
    refuse_lone_batch_splits(matched, plan.mesh_dim_names)  # the rotary output or the mask left whole beside a split batch
    shards = survey_params(model, matched, axes, plan.mesh_dim_names)
    records = survey_modules(matched, plan, mesh, axes, shards, generated)  # the one place the entries are decided
    biases = survey_deferred_biases(records, frozenset(branch_fqns(matched)))
    summed = survey_summed(records, axes)
    grad_reduces = survey_grad_reduce(records, axes)
    divides = survey_attrs(records, axes)
    slots = survey_adapters(model, records)
    return Survey(model, plan, mesh, axes, records, shards, biases, grad_reduces, divides, summed, slots, stage=stage)


def match_modules(model: nn.Module, plan: Plan) -> list[Matched]:
    """Each module whose FQN a plan key matches; a key that matches nothing is an error."""
    matched = []
    used = set()
    for fqn, module in model.named_modules():
        entry = plan.entry_for(fqn) if fqn else None
        if entry is not None:
            matched.append(Matched(fqn, module, entry.key, entry))
            used.add(entry.key)
    unused = [key for key in plan.entries if key not in used]
    if unused:
        raise ParallelizeError(
            f"param_plan keys {', '.join(repr(key) + _close_paths(model, key) for key in unused)} match no module of "
            f"{type(model).__name__}; is this the plan for this model?"
        )
    return matched


def _close_paths(model: nn.Module, key: str) -> str:
    """`` (did you mean ...?)`` with the paths whose submodule is close to the segment of ``key`` that matches nothing."""
    current = [model]
    segments = key.split(".")
    for index, segment in enumerate(segments):
        children = [dict(module.named_children()) for module in current]
        found = [child for named in children for name, child in named.items() if segment in ("*", name)]
        if not found:
            names = [name for named in children for name in named]
            return did_you_mean(segment, names, shown=lambda name: ".".join([*segments[:index], name, *segments[index + 1 :]]))
        current = found
    return ""
