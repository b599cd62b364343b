"""Which modules this rank's pipeline stage keeps, checked, and the model trimmed to them.

``parallelize`` on a plan with ``pipeline`` (docs/pipeline.md) first surveys the stages
(:func:`survey_stage`: every check, the model untouched), then :meth:`StageCut.keep` removes
what the other stages hold: the decoder layers of other stages leave the layer list, which
becomes a :class:`StageLayers` keyed by the layers' original indices (so every parameter
keeps the unsharded model's name, as torchtitan keeps its ``layers`` a dict); the other
stage modules (the embedding off the first stage, the final norm and ``lm_head`` off the
last) become ``nn.Identity``. Their parameters are gone, not merely unused; a model built
on the meta device never allocates them.

Each kept layer's ``layer_idx`` is renumbered from 0 within its stage: each stage's own
KV cache then holds only its layers, and transformers' cache reads the sequence length
from the stage's first layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpgen.core.plan_entries import PipelineStages, Plan
from hpgen.core.plan_names import fqn_matches
from hpgen.runtime.errors import ParallelizeError

__all__ = ["StageCut", "StageLayers", "refuse_axes", "survey_stage"]

# Plan axes whose engines do not run inside a pipeline stage yet: refused by name.
NOT_WITH_STAGES = {"cp": "context parallelism (cp)", "ep": "experts sharded by expert (ep)"}


class StageLayers(nn.Module):
    """The decoder layers one stage keeps, under their original indices (``model.layers.5`` stays ``5``).

    It reads like the ``nn.ModuleList`` it replaces where transformers' code reads it:
    iteration and ``len`` over the kept layers, ``[i]`` by original index, and a slice
    (``self.layers[: config.num_hidden_layers]``) over the original indices, giving the kept
    layers inside it.
    """

    def __init__(self, kept: dict[int, nn.Module], total: int) -> None:
        super().__init__()
        self.total = total  # the unsharded model's layer count
        for index, layer in sorted(kept.items()):
            self.add_module(str(index), layer)
        # while one of several stages of this rank runs (interleaved schedules): its layers' indices
        self.__dict__["active"] = None

    def indices(self) -> list[int]:
        return [int(name) for name in self._modules]

    def _running(self) -> list[tuple[int, nn.Module]]:
        active = self.__dict__["active"]
        return [(int(name), layer) for name, layer in self._modules.items() if active is None or int(name) in active]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(layer for _, layer in self._running())

    def __len__(self) -> int:
        return len(self._running())

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            wanted = set(range(self.total)[index])
            return [layer for i, layer in self._running() if i in wanted]
        if str(index) not in self._modules:
            raise IndexError(f"decoder layer {index} is on another pipeline stage (this stage holds {self.indices()})")
        return self._modules[str(index)]


@dataclass
class StageCut:
    """This rank's stages, checked against the model: :meth:`keep` trims the model to them."""

    pipeline: PipelineStages
    mesh: DeviceMesh
    stages: tuple[int, ...]  # the stage indices this rank holds (one, or several for interleaved schedules)
    layer_lists: dict[str, int] = field(default_factory=dict)  # FQN of each staged layer list -> its length
    # modules of other stages kept here as well: all their parameters are this rank's, tied (lm_head
    # on the first stage, the embedding on the last: the table under both names, as unsharded)
    tied_modules: tuple[str, ...] = ()
    tied: list[list[str]] = field(default_factory=list)  # names of each parameter several pp ranks hold
    tied_holders: list[list[int]] = field(default_factory=list)  # the pp ranks holding each
    plan_axes: tuple[str, ...] = ()  # the plan's mesh axes: the mesh's others are data-parallel (FSDP2, DDP)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh dims the plan does not name: torch's data-parallel engines own them."""
        return tuple(name for name in self.mesh.mesh_dim_names or () if name not in self.plan_axes)

    @property
    def size(self) -> int:
        """The ranks on the pipeline axis."""
        return self.mesh.size(list(self.mesh.mesh_dim_names or ()).index(self.pipeline.axis))

    @property
    def axis(self) -> str:
        return self.pipeline.axis

    @property
    def num_stages(self) -> int:
        return len(self.pipeline.stages)

    def holds(self, fqn: str) -> bool:
        """Whether this rank keeps the module ``fqn`` (modules no stage names are kept everywhere)."""
        stage = self.pipeline.stage_of(fqn)
        if stage is None or stage in self.stages:
            return True
        return any(fqn == name or fqn.startswith(name + ".") for name in self.tied_modules)

    def elsewhere(self, name: str) -> bool:
        """Whether the tensor or module ``name`` (a checkpoint key) belongs to another rank's stages only."""
        return not self.holds(name.rpartition(".")[0] if name.count(".") else name)

    def keep(self, model: nn.Module) -> None:
        """Remove from ``model`` every staged module that this rank's stages do not hold."""
        modules = dict(model.named_modules())
        for fqn, length in self.layer_lists.items():
            kept = {i: modules[f"{fqn}.{i}"] for i in range(length) if self.holds(f"{fqn}.{i}")}
            for stage in self.stages:
                mine = [i for i in sorted(kept) if self.pipeline.stage_of(f"{fqn}.{i}") == stage]
                for position, index in enumerate(mine):
                    for sub in kept[index].modules():
                        if isinstance(getattr(sub, "layer_idx", None), int):
                            sub.layer_idx = position  # each stage's KV cache holds its own layers only
            _set(model, fqn, StageLayers(kept, length))
        for stage in self.pipeline.stages:
            for fqn in stage:
                parent = fqn.rpartition(".")[0]
                if parent in self.layer_lists or self.holds(fqn):
                    continue
                _set(model, fqn, nn.Identity())

    @contextlib.contextmanager
    def running(self, model: nn.Module, stage: int) -> Iterator[None]:
        """Run ``model``'s forward as stage ``stage`` alone, where this rank holds several stages.

        Its layer lists yield that stage's layers only, and this rank's modules of its other
        stages (the final norm when stage 1 of 4 runs on the rank that also holds stage 3)
        are ``nn.Identity`` for the while. With one stage a rank, nothing changes."""
        if len(self.stages) == 1:
            yield
            return
        mine = set(self.pipeline.stages[stage])
        lists = [(model.get_submodule(fqn), fqn) for fqn in self.layer_lists]
        swapped = [
            (fqn, model.get_submodule(fqn))
            for other in self.stages
            if other != stage
            for fqn in self.pipeline.stages[other]
            if fqn.rpartition(".")[0] not in self.layer_lists and fqn not in mine
        ]
        try:
            for layers, fqn in lists:
                layers.__dict__["active"] = {int(name.rpartition(".")[2]) for name in mine if name.startswith(fqn + ".")}
            for fqn, _ in swapped:
                _set(model, fqn, nn.Identity())
            yield
        finally:
            for layers, _ in lists:
                layers.__dict__["active"] = None
            for fqn, module in swapped:
                _set(model, fqn, module)

    def tied_names(self, model: nn.Module) -> list[list[str]]:
        """Parameters held under names of several stages (a tied embedding and ``lm_head``): each one's names."""
        names: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        return [found for found in names.values() if len({self.pipeline.stage_of(n) for n in found}) > 1]


def _set(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def refuse_axes(plan: Plan) -> None:
    """Plan axes whose engines do not run inside pipeline stages yet, refused by name (before the mesh is read)."""
    for axis, what in NOT_WITH_STAGES.items():
        if plan.pipeline is not None and axis in plan.mesh_dim_names:
            raise ParallelizeError(f"pipeline stages with {what} are not covered yet: plan the model without --pp or without {axis}")


def survey_stage(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> StageCut:
    """Every check of the plan's stages against ``model`` and ``mesh``; the model is left untouched."""
    pipeline = plan.pipeline
    assert pipeline is not None
    names = tuple(mesh.mesh_dim_names or ())
    if pipeline.axis not in names:
        raise ParallelizeError(
            f"the plan's pipeline axis {pipeline.axis!r} is not a dim of the mesh (mesh_dim_names: {', '.join(names) or 'none'})"
        )
    refuse_axes(plan)
    size = mesh.size(names.index(pipeline.axis))
    count = len(pipeline.stages)
    if count % size:
        raise ParallelizeError(
            f"the plan has {count} pipeline stages for {size} ranks on axis {pipeline.axis!r}: "
            "give as many stages as ranks (or a multiple, for an interleaved schedule)"
        )
    rank = mesh.get_local_rank(pipeline.axis)
    stages = tuple(range(rank, count, size))  # stage i on rank i % size: torch's looped layout
    modules = dict(model.named_modules())
    missing = [fqn for stage in pipeline.stages for fqn in stage if fqn not in modules]
    if missing:
        raise ParallelizeError(
            f"pipeline stages name {', '.join(map(repr, missing[:3]))}{' ...' if len(missing) > 3 else ''}, "
            f"not modules of {type(model).__name__}"
        )
    layer_lists = _layer_lists(pipeline, modules)
    for fqn, module in modules.items():
        if fqn and pipeline.stage_of(fqn) is None and any(True for _ in module.parameters(recurse=False)):
            raise ParallelizeError(f"{fqn} holds parameters but no pipeline stage names it (or a module above it)")
    _refuse_sharded_stream(plan, layer_lists)
    kinds = _layer_types(model)
    if kinds is not None and len(set(kinds)) > 1:
        raise ParallelizeError(
            f"pipeline stages of {type(model).__name__}: layers of several attention types ({', '.join(sorted(set(kinds)))}) "
            "are not covered yet (each stage's KV cache is numbered from its first layer)"
        )
    for fqn, module in modules.items():
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj") and "ep" in plan.mesh_dim_names:
            raise ParallelizeError(f"{fqn}: experts sharded by expert across pipeline stages are not covered yet")
    cut = StageCut(pipeline, mesh, stages, layer_lists, plan_axes=tuple(plan.mesh_dim_names))
    cut.tied_modules = _tied_modules(model, cut)
    for names in cut.tied_names(model):
        holders = sorted({stage % size for stage in (pipeline.stage_of(name) for name in names) if stage is not None})
        if len(holders) > 1:
            cut.tied.append(names)
            cut.tied_holders.append(holders)
    return cut


def _tied_modules(model: nn.Module, cut: StageCut) -> tuple[str, ...]:
    """Staged modules of other stages whose parameters are all tensors this rank's own modules hold."""
    held: set[int] = set()
    for fqn, module in model.named_modules():
        if fqn and cut.holds(fqn):
            held.update(id(param) for param in module.parameters(recurse=False))
    found = []
    for stage in cut.pipeline.stages:
        for fqn in stage:
            if cut.holds(fqn) or fqn.rpartition(".")[0] in cut.layer_lists:
                continue
            params = list(model.get_submodule(fqn).parameters())
            if params and all(id(param) in held for param in params):
                found.append(fqn)
    return tuple(found)


def _refuse_sharded_stream(plan: Plan, layer_lists: dict[str, int]) -> None:
    """A residual stream cut between decoder layers (``--sp``): a stage would hand on its shard of the
    sequence, and the next stage's rotary embedding and mask are built from what it receives."""
    for key, entry in plan.entries.items():
        if not any(fqn_matches(key, f"{fqn}.0") for fqn in layer_lists):
            continue
        for part in ("in_src", "out_dst"):
            for name, layout in getattr(entry, part).items():
                if any(not placement.is_replicate for _, placement in layout.placements):
                    raise ParallelizeError(
                        f"pipeline stages with a sequence-sharded residual stream ({key} {part} {name}: {layout}; "
                        "hpgen plan --sp) are not covered yet: plan without --sp"
                    )


def _layer_lists(pipeline: PipelineStages, modules: dict[str, nn.Module]) -> dict[str, int]:
    """Each ``nn.ModuleList`` whose items the stages name, with its length; all its items must be staged."""
    lists: dict[str, int] = {}
    for stage in pipeline.stages:
        for fqn in stage:
            parent, _, last = fqn.rpartition(".")
            if last.isdigit() and isinstance(modules.get(parent), nn.ModuleList):
                lists[parent] = len(modules[parent])
    for parent, length in lists.items():
        unstaged = [i for i in range(length) if pipeline.stage_of(f"{parent}.{i}") is None]
        if unstaged:
            raise ParallelizeError(f"pipeline stages leave {parent}.{unstaged[0]} on no stage: every decoder layer needs one")
    return lists


def _layer_types(model: nn.Module) -> list[str] | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None)
    return list(kinds) if isinstance(kinds, (list, tuple)) else None
