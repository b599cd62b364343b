"""peft's LoRA adapters on a parallelized model: each adapter laid out like its base layer.

The plan is the base model's, read through peft's ``base_layer`` (:mod:`hpgen.runtime.install.tuners`).

Each LoRA adapter pair (``lora_A`` [r, in], ``lora_B`` [out, r]) takes its base layer's
layout (:func:`adapter_layouts`), as Megatron's LoRA layers and vLLM's do:

- base sharded on its outputs (column-parallel): ``B`` sharded on its outputs like the
  base (in whole heads, or in blocks, alike), ``A`` replicated, and ``A``'s gradient,
  partial on each rank (``B``'s rows see only this rank's outputs), all-reduced over the
  axis; the rows of ``B`` in a replicated block of a ``B(...)`` base (Falcon's key and
  value) have their gradient summed over the axis, as the base's are;
- base sharded on its inputs (row-parallel): ``A`` sharded on its inputs, so ``B A x`` is a
  partial sum added to the base's partial output before the boundary's single reduction
  (no collective of its own); ``B`` replicated, its gradient (``A x`` is partial) all-reduced.

Nothing runs in the forward: peft's own ``forward`` computes on the local shards. The
adapters are adopted (:class:`AdapterWatch`) at ``parallelize`` when they exist already
(sharded then, from their full shape), and otherwise when first seen after
``get_peft_model`` or ``PeftModel.from_pretrained``: before the forward of the boundary
holding them, and before any ``state_dict()`` or ``load_state_dict()`` of the model.
Adopting a replicated adapter broadcasts it from the axis's first rank (peft draws ``A``
at random on each rank), hooks the gradient reductions, and records the sharded ones for
the state dict, where they appear as full tensors (gathered), so that peft's
``save_pretrained`` writes a normal adapter and one loaded on one process is sliced.

Methods whose arithmetic is not sharded like this are refused, naming the method
(:func:`hpgen.runtime.install.tuners.method_problem`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpgen.core.conv1d import is_conv1d
from hpgen.core.placement import REPLICATE
from hpgen.core.plan import Layout
from hpgen.runtime.checkpoint.state_dict import ShardRecorder
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.runtime.forward.handback import call
from hpgen.runtime.forward.streams import LayoutChange
from hpgen.runtime.install.hooks import FollowReducedParameters, GradAllReduce, block_regions
from hpgen.runtime.install.module_decisions import ModuleDecision
from hpgen.runtime.install.params import rank_shard
from hpgen.runtime.install.tuners import is_tuner_layer, method_problem
from hpgen.core.shards import ShardLayout, normalize_dim

__all__ = ["AdapterWatch", "adapter_layouts", "survey_adapters", "watch_adapters"]


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class AdapterLayout:
    """Where one adapter pair's tensors lie, and over which axes their gradients are summed."""

    a: Layout  # lora_A.weight [r, in]
    b: Layout  # lora_B.weight [out, r] (and lora_B.bias [out], on dim 0)
    a_reduce: tuple[str, ...]
    b_reduce: tuple[str, ...]
    sharded_inputs: tuple[str, ...]  # axes on which the base's inputs are sharded (row-parallel)
    unsupported: str | None = None  # why no adapter can go on this base layer (refused only if one does)


def adapter_layouts(base: Layout, axes: Sequence[str], *, transposed: bool, reduced: Sequence[str]) -> AdapterLayout:
    """The adapters' layout for a base weight laid out as ``base`` (``transposed``: Conv1D's [in, out]).

    ``reduced``: axes over which the plan already sums the base weight's gradient; the
    adapters' gradients are partial there too.
    """
    out_dim = 1 if transposed else 0
    a, b, a_reduce, b_reduce, sharded_in = [], [], list(reduced), list(reduced), []
    unsupported = None
    for axis in axes:
        p = base.on(axis)
        if p.kind == "R":
            continue
        dim = normalize_dim(p.dim, 2)
        replicated_blocks = p.kind == "B" and any(inner.kind != "S" for _, inner in p.parts)
        if p.kind not in ("S", "SS", "B") or any(inner.kind == "RS" for _, inner in p.parts):
            unsupported = (
                f"LoRA on a base weight laid out {p} on axis {axis!r} is not supported (only S(d), S(d,u,g), "
                "SS(d,k) and B of R and S blocks: a replicated shard's adapters would count each chunk's gradient "
                "once per replica)"
            )
            continue
        if dim == out_dim:
            # B's rows of a replicated block get their gradient summed like the base's (block_regions)
            b.append((axis, p.on_dim(0)))
            a_reduce.append(axis)
        elif replicated_blocks:
            unsupported = f"LoRA on a base weight laid out {p} on axis {axis!r} (replicated blocks of its inputs) is not supported"
        else:
            a.append((axis, p.on_dim(1)))
            b_reduce.append(axis)
            sharded_in.append(axis)
    return AdapterLayout(
        Layout(tuple(a)),
        Layout(tuple(b)),
        tuple(dict.fromkeys(a_reduce)),
        tuple(dict.fromkeys(b_reduce)),
        tuple(sharded_in),
        unsupported,
    )


# --------------------------------------------------------------------------- adoption


@dataclass
class _Slot:
    """A planned linear that peft may wrap: where it sits, the plan's layout of its weight."""

    where: str  # the linear's FQN
    boundary: nn.Module  # the planned module whose forward runs it
    parent: nn.Module
    attr: str
    base: nn.Module  # the (sharded) base layer
    weight_shape: tuple[int, ...]  # the base weight's full shape
    layout: AdapterLayout
    transposed: bool  # transformers' Conv1D: weight [in, out] (read before a deferred bias swaps its class)
    adopted: dict[str, nn.Module] = field(default_factory=dict)  # adapter name -> its lora_A, when adopted

    def layer(self) -> nn.Module | None:
        """The tuner layer wrapping the base layer now, or None."""
        current = self.parent._modules.get(self.attr)
        if current is None or current is self.base or not is_tuner_layer(current):
            return None
        base = current
        while is_tuner_layer(base):
            base = base.base_layer
        return current if base is self.base else None

    def has_adopted(self, layer: nn.Module, name: str) -> bool:
        """The adapter ``name`` of ``layer`` is the one adopted under that name (not one made anew since)."""
        lora_a = getattr(layer, "lora_A", None)
        return isinstance(lora_a, nn.ModuleDict) and name in lora_a and self.adopted.get(name) is lora_a[name]

    def problem(self, layer: nn.Module, name: str) -> None:
        """Refuse (the same on every rank: they hold the same peft config) an adapter that cannot be sharded."""
        problem = method_problem(layer, name, self.layout.sharded_inputs) or self.layout.unsupported
        made_boundary = any(getattr(self.base, mover, None) is not None for mover in ("_hp_in", "_hp_out"))
        if problem is None and made_boundary:
            problem = (
                f"peft wrapped a module that parallelize had already made a parallel boundary "
                f"({type(self.base).__name__}); call get_peft_model before parallelize to put LoRA on it"
            )
        if problem is not None:
            raise ParallelizeError(f"{self.where}: {problem}")


def _adapter_names(layer: nn.Module) -> tuple[str, ...]:
    """The adapters of a tuner layer (a LoRA layer's ``lora_A`` keys; a name for any other tuner)."""
    lora_a = getattr(layer, "lora_A", None)
    if isinstance(lora_a, nn.ModuleDict):
        return tuple(lora_a.keys())
    return ("<" + type(layer).__name__ + ">",)


class AdapterWatch:
    """Adopts the adapters peft puts on the planned linears of a parallelized model (see the module docstring)."""

    def __init__(
        self, slots: Sequence[_Slot], axes: Mapping[str, AxisCollectives], recorder: ShardRecorder, model: nn.Module
    ) -> None:
        self.slots = list(slots)
        self.axes = dict(axes)
        self.recorder = recorder
        self.model = model
        self.names = tuple(axes)

    def __deepcopy__(self, memo: dict) -> AdapterWatch:
        return self  # holds process groups

    def pending(self, slots: Sequence[_Slot] | None = None) -> list[tuple[_Slot, nn.Module, str]]:
        """(slot, tuner layer, adapter name) of every adapter of ``slots`` (default: all) not adopted yet."""
        found = []
        for slot in self.slots if slots is None else slots:
            layer = slot.layer()
            if layer is not None:
                found += [(slot, layer, name) for name in _adapter_names(layer) if not slot.has_adopted(layer, name)]
        return found

    def adopt(self, slots: Sequence[_Slot] | None = None) -> None:
        """Shard, align and hook every adapter of ``slots`` (default: all) not adopted yet (all ranks call
        it at the same point)."""
        pending = self.pending(slots)
        if not pending:
            return
        for slot, layer, name in pending:
            slot.problem(layer, name)
        for slot, layer, name in pending:
            self._adopt(slot, layer, name)
            slot.adopted[name] = layer.lora_A[name]
        ShardRecorder.hook_loading(self.model)

    def _adopt(self, slot: _Slot, layer: nn.Module, name: str) -> None:
        out_dim, in_dim = (1, 0) if slot.transposed else (0, 1)
        rank = layer.lora_A[name].weight.shape[0]
        out, inp = slot.weight_shape[out_dim], slot.weight_shape[in_dim]
        parts = [
            (layer.lora_A[name], "weight", (rank, inp), slot.layout.a, slot.layout.a_reduce, "lora_A"),
            (layer.lora_B[name], "weight", (out, rank), slot.layout.b, slot.layout.b_reduce, "lora_B"),
        ]
        if getattr(layer.lora_B[name], "bias", None) is not None:
            parts.append((layer.lora_B[name], "bias", (out,), slot.layout.b, slot.layout.b_reduce, "lora_B"))
        reduced: list[tuple[nn.Module, str, GradAllReduce]] = []
        for owner, attr, shape, layout, reduce, label in parts:
            where = f"{slot.where}.{label}.{name}.{attr}"
            shard_layout = rank_shard(shape, layout, self.axes, self.names)
            param = self._local(owner, attr, shard_layout, where)
            self._align(param, layout)
            groups = [self.axes[axis].group for axis in reduce if self.axes[axis].size > 1]
            regions = [  # the rows of B's replicated blocks (only R blocks reach here: RS is refused)
                (dim, start, stop, self.axes[axis].group)
                for dim, start, stop, axis, _ in block_regions(shard_layout, self.names)
                if axis not in reduce
            ]
            if groups or regions:
                reducer = GradAllReduce(groups, where, regions)
                frozen = not param.requires_grad  # a loaded adapter (is_trainable=False) may be unfrozen later
                param.requires_grad_(True)
                param.register_hook(reducer)
                param.requires_grad_(not frozen)
                param._hp_grad_reduce = reducer
                reduced.append((owner, attr, reducer))
            self.recorder.record([(owner, attr)], where, shard_layout, gathered=True)
        if reduced:  # FSDP2 registers parameters of its own for the forward: the reduction follows them
            layer.register_forward_pre_hook(FollowReducedParameters(f"{slot.where} ({name})", reduced))
        self._follow_streams(slot, layer, name)

    def _follow_streams(self, slot: _Slot, layer: nn.Module, name: str) -> None:
        """``lora_dropout`` draws from the stream of its input's layout (:mod:`hpgen.runtime.forward.streams`).

        peft runs the base layer first, whose hook has moved the body's stream to the layout
        of the base's *output*; the dropout is of its *input*: replicated on a column-parallel
        layer (one mask on every rank), sharded on a row-parallel one (a mask per rank). The
        stream is switched to the input's layout around the dropout, then back.
        """
        streams = getattr(self.model, "_hp_streams", None)
        dropouts = getattr(layer, "lora_dropout", None)
        dropout = dropouts[name] if isinstance(dropouts, nn.ModuleDict) and name in dropouts else None
        sharded = bool(slot.layout.sharded_inputs or slot.layout.b.placements)
        if streams is None or not isinstance(dropout, nn.modules.dropout._DropoutNd) or not sharded:
            return  # p == 0 (peft's nn.Identity), or a replicated base: the body's stream is already right
        row = bool(slot.layout.sharded_inputs)
        dropout.register_forward_pre_hook(_InputStream(streams, local=row))
        dropout.register_forward_hook(LayoutChange(streams, local=not row))
        streams.dropouts.append(dropout)  # the model's streams run when some dropout draws

    def _local(self, owner: nn.Module, attr: str, shard_layout: ShardLayout, where: str) -> nn.Parameter:
        """The parameter holding this rank's chunk: cut from the full one (peft made it before parallelize)."""
        param = owner._parameters[attr]
        dtensor = sys.modules.get("torch.distributed.tensor")  # nothing is a DTensor before it is imported
        if dtensor is not None and isinstance(param, dtensor.DTensor):
            raise ParallelizeError(
                f"{where} is already a DTensor: fully_shard ran before hpgen saw this adapter. Put the adapters on "
                "first: get_peft_model, then parallelize, then fully_shard"
            )
        shape, local = shard_layout.shape, shard_layout.local_shape
        current = tuple(param.shape)
        if current == local:
            return param
        if current != shape:
            raise ParallelizeError(
                f"{where} has shape {current}; its base layer's plan gives it {shape} (this rank: {local})"
            )
        with torch.no_grad():
            chunk = shard_layout.local_slice(param.detach()).clone(memory_format=torch.contiguous_format)
        new = nn.Parameter(chunk, requires_grad=param.requires_grad)
        setattr(owner, attr, new)
        if isinstance(owner, nn.Linear):
            owner.out_features, owner.in_features = owner.weight.shape
        return new

    def _align(self, param: Tensor, layout: Layout) -> None:
        """A tensor replicated on an axis takes the values of the axis's first rank (peft draws A per rank)."""
        for axis in self.names:
            ax = self.axes[axis]
            if layout.on(axis) == REPLICATE and ax.size > 1:
                with torch.no_grad():
                    call(dist.broadcast, param.data, group=ax.group, group_src=0)


def survey_adapters(model: nn.Module, records: Iterable[ModuleDecision]) -> list[_Slot]:
    """The planned linears of ``model`` that peft may wrap (or has wrapped), read before any shard is cut.

    Refuses, before ``parallelize`` touches anything, adapters present now that cannot be sharded.
    """
    slots: list[_Slot] = []
    modules = dict(model.named_modules())
    for record in records:
        item, mesh_names = record.item, record.mesh
        for name, layout in item.entry.params.items():
            path, _, leaf = name.rpartition(".")
            base = item.module.get_submodule(path) if path else item.module
            if leaf != "weight" or not isinstance(base, (nn.Linear, nn.Embedding)) and not is_conv1d(base):
                continue  # an nn.Embedding is watched too: peft's LoRA on it is refused
            fqn = f"{item.fqn}.{path}" if path else item.fqn
            parent_fqn, _, attr = fqn.rpartition(".")
            if attr == "base_layer" and is_tuner_layer(modules[parent_fqn]):  # get_peft_model came first
                fqn = parent_fqn
                parent_fqn, _, attr = fqn.rpartition(".")
            if parent_fqn not in modules:
                continue
            grad_reduced = name in item.entry.grad_reduce_params
            reduced = [axis for axis in mesh_names if grad_reduced and axis in record.decision.sharded_axes]
            transposed = is_conv1d(base)
            layouts = adapter_layouts(layout, mesh_names, transposed=transposed, reduced=reduced)
            slots.append(
                _Slot(fqn, item.module, modules[parent_fqn], attr, base, tuple(base.weight.shape), layouts, transposed)
            )
    for slot in slots:
        layer = slot.layer()
        for name in _adapter_names(layer) if layer is not None else ():
            slot.problem(layer, name)
    return slots


def watch_adapters(
    model: nn.Module, slots: Sequence[_Slot], axes: Mapping[str, AxisCollectives], recorder: ShardRecorder
) -> AdapterWatch:
    """Adopt the adapters present now; then new ones before each watched boundary's forward and
    before the model's ``state_dict()`` and ``load_state_dict()``."""
    watch = AdapterWatch(slots, axes, recorder, model)
    watch.adopt()
    if slots:
        by_boundary: dict[int, tuple[nn.Module, list[_Slot]]] = {}
        for slot in slots:
            by_boundary.setdefault(id(slot.boundary), (slot.boundary, []))[1].append(slot)
        for boundary, own in by_boundary.values():
            boundary.register_forward_pre_hook(_AdoptFirst(watch, own))
        model.register_state_dict_pre_hook(_AdoptBeforeStateDict(watch))
        model.register_load_state_dict_pre_hook(_AdoptBeforeLoad(watch))
    return watch


class _InputStream:
    """Forward pre-hook of an adapter's dropout: the body's stream is the one of the dropout's input."""

    def __init__(self, streams: Any, local: bool) -> None:
        self.streams = streams
        self.local = local

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.streams.active(module):
            self.streams.change(self.local)

    def __deepcopy__(self, memo: dict) -> _InputStream:
        return self


class _AdoptFirst:
    """Forward pre-hook of a boundary: adopt the adapters peft added to its linears since the last call."""

    def __init__(self, watch: AdapterWatch, slots: Sequence[_Slot] | None = None) -> None:
        self.watch = watch
        self.slots = slots

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.watch.adopt(self.slots)

    def __deepcopy__(self, memo: dict) -> _AdoptFirst:
        return self


class _AdoptBeforeStateDict(_AdoptFirst):
    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:  # type: ignore[override]
        self.watch.adopt()


class _AdoptBeforeLoad(_AdoptFirst):
    def __call__(self, module: nn.Module, *args: Any) -> None:  # type: ignore[override]
        self.watch.adopt()
