"""What a parallelized model knows of its mesh, and the refusal of a DDP that spans its plan axes.

:class:`MeshAxes` (``model._hp_mesh_axes``) records the mesh ``parallelize`` was given and the
plan axes hpgen owns on it; the other axes are the data-parallel ones, which
``hpgen.runtime.trainer.Trainer`` hands to DDP or FSDP2.

``DistributedDataParallel(model)`` over the whole world (what a stock ``transformers.Trainer``
and ``Accelerator().prepare`` do under torchrun) is wrong for a tensor-parallel model: its
constructor broadcasts rank 0's tensors over ranks that hold different shards (overwriting
them where the shapes agree), it averages gradients that hpgen has already summed, and the
data is sharded over ranks that must see the same batch. Two guards:

- :class:`KeptFromDDP` is the model's ``_ddp_params_and_buffers_to_ignore`` (the list DDP's
  constructor reads to leave parameters alone): read by a DDP being built over ranks of one
  plan-axis group, it names every sharded parameter, so that DDP neither broadcasts nor
  reduces them; read by a DDP on the other axes (the data-parallel one), it names only what
  the user listed. It finds the DDP being built in its caller's frame; where it cannot (a
  torch whose DDP reads the list elsewhere) it names only the user's list.
- :class:`DataParallelCheck`, a forward pre-hook of every parallelized model (on even with
  ``check_inputs=False``), stops the first forward run inside such a DDP, before any optimizer
  step, with the same error on every rank: it names the fix and says whether the shards were
  overwritten (it compares a digest of each sharded parameter across the DDP's ranks).

Both decide from every group of the plan's axes, read from the mesh (the same on every rank),
not from this rank's own: a DDP over some ranks of the world (a subgroup) then makes the same
decision on each of its ranks, so none is left in a collective the others skip.

One DDP spanning a plan axis is accepted: the one :func:`hpgen.runtime.training.data_parallel`
builds over ``dp x cp`` after handing the sum over ``cp`` to it (:class:`EngineGroups`, set on
both guards as ``handed``). Its ranks hold the same parameters (``cp`` replicates them), see
the same batch within each ``cp`` group, and hpgen's hooks no longer sum over ``cp``. Any other
DDP spanning ``cp``, or one spanning another plan axis, is refused as before.

A stock ``transformers.Trainer`` or ``Accelerator().prepare(model)`` is wrong even where no DDP
is built (accelerate sees one process on the CPU without ``use_cpu``, or the model presents
transformers' tensor-parallel attributes): it clips by each rank's local norm, which moves the
replicated weights apart, and scales the loss by its own process count. Each is stopped at the
first thing it reads of the model (:mod:`hpgen.runtime.install.stock_loops`); where accelerate's
``Accelerator.prepare_model`` is reached otherwise (called directly, or in a process that is not
distributed), its first act is to test ``model._is_accelerate_prepared``: :class:`AccelerateCheck`
is that attribute, and its truth test refuses, on every rank alike, before anything is moved or
stepped, unless ``hpgen.runtime.trainer.Trainer`` is the one preparing
(:func:`prepared_by_hpgen_trainer`).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from hpgen.runtime.forward.handback import all_gather_object
from hpgen.runtime.install.inputs import _tensor_digest
from hpgen.runtime.install.stock_loops import install_stock_loop_checks, prepared_by_hpgen_trainer, preparing, stock_loop_message

__all__ = [
    "AccelerateCheck",
    "DataParallelCheck",
    "EngineGroups",
    "KeptFromDDP",
    "MeshAxes",
    "install_accelerate_check",
    "mesh_axes_of",
    "prepared_by_hpgen_trainer",
]


@dataclass(frozen=True, eq=False)
class MeshAxes:
    """The mesh a model was parallelized on, and the plan axes (those hpgen owns) found on it."""

    mesh: DeviceMesh
    plan_axes: tuple[str, ...]

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh's other axes, left to DDP or FSDP2, in mesh order."""
        return tuple(axis for axis in self.mesh.mesh_dim_names or () if axis not in self.plan_axes)

    def size(self, axes: Sequence[str]) -> int:
        names = tuple(self.mesh.mesh_dim_names or ())
        size = 1
        for axis in axes:
            size *= self.mesh.size(names.index(axis))
        return size

    def __deepcopy__(self, memo: dict) -> MeshAxes:
        return self  # holds process groups: shared by copies of a model


def mesh_axes_of(model: nn.Module) -> MeshAxes | None:
    """The :class:`MeshAxes` of a parallelized model (through peft and DDP wrappers), or None."""
    seen = model
    for _ in range(8):
        found = seen.__dict__.get("_hp_mesh_axes")
        if isinstance(found, MeshAxes):
            return found
        if isinstance(seen, DistributedDataParallel):
            seen = seen.module
        elif hasattr(seen, "get_base_model"):  # peft's PeftModel
            seen = seen.get_base_model()
        else:
            return None
    return None


@dataclass(frozen=True)
class EngineGroups:
    """Plan axes whose gradient sums a data-parallel engine makes instead of hpgen (``cp``), and that
    engine's groups of global ranks (every group, sorted ranks each: the same on every rank)."""

    axes: tuple[str, ...]
    groups: frozenset[tuple[int, ...]]


def _spanned(
    groups: Sequence[tuple[str, tuple[int, ...]]], ranks: Sequence[int], handed: EngineGroups | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """The plan axes two or more of whose group's ranks are among ``ranks`` (a DDP's), but for the axes
    handed to an engine when the DDP is over exactly one of that engine's groups."""
    own = handed is not None and tuple(sorted(ranks)) in handed.groups
    return [
        (axis, members)
        for axis, members in groups
        if len(set(members) & set(ranks)) > 1 and not (own and axis in handed.axes)
    ]


def _every_group(groups: Sequence[tuple[str, Any]], mesh: DeviceMesh) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every group of each plan axis (global ranks), not only this rank's: read from the mesh, so that every rank
    of a DDP decides alike whether it spans one (an axis that is not one of the mesh's dimensions: this rank's)."""
    names = tuple(mesh.mesh_dim_names or ())
    found: list[tuple[str, tuple[int, ...]]] = []
    for axis, group in groups:
        if axis in names:
            dim = names.index(axis)
            rows = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim]).tolist()
            found += [(axis, tuple(row)) for row in rows]
        else:
            found.append((axis, tuple(dist.get_process_group_ranks(group))))
    return tuple(found)


class KeptFromDDP:
    """``model._ddp_params_and_buffers_to_ignore``: the sharded parameters, for a DDP spanning a plan axis."""

    def __init__(self, groups: Sequence[tuple[str, Any]], mesh: DeviceMesh, listed: Sequence[str] = ()) -> None:
        self.groups = _every_group(groups, mesh)
        self.listed = tuple(listed)  # what the user had set before parallelize
        self.handed: EngineGroups | None = None  # set by hpgen.runtime.training.data_parallel

    def __iter__(self) -> Any:
        # DistributedDataParallel.__init__, reading the list (`set(module._ddp_params_and_buffers_to_ignore)`).
        # Which DDP (which process group) reads it is found in the caller's frame, because torch (2.13) documents
        # no other place: the list is a plain attribute, its one setter
        # (DDP._set_params_and_buffers_to_ignore_for_model) is private and takes no group; DDP's documented hooks come too late or belong to the user
        # (register_comm_hook runs in backward, after the constructor's broadcast, and a DDP takes one; the Join
        # hooks run at the end of an uneven input); the constructor has no pre-hook. The answer differs per DDP,
        # so it cannot be set ahead either. Where the frame does not hold the DDP, only the user's list is named
        # and DataParallelCheck still refuses the forward, saying the shards were overwritten.
        # tests/runtime/install/test_wrapped.py checks against the installed torch that the frame holds it.
        caller = sys._getframe(1).f_locals
        ddp, module = caller.get("self"), caller.get("module")
        names = list(self.listed)
        if isinstance(ddp, DistributedDataParallel) and isinstance(module, nn.Module):
            ranks = dist.get_process_group_ranks(ddp.process_group)
            if _spanned(self.groups, ranks, self.handed):
                from hpgen.runtime.checkpoint.state_dict import sharded_params

                names += sorted(sharded_params(module))
        return iter(names)

    def __deepcopy__(self, memo: dict) -> KeptFromDDP:
        return self


class DataParallelCheck:
    """Forward pre-hook of the model: refuse to run inside a DDP whose ranks share a plan-axis group."""

    def __init__(self, groups: Sequence[tuple[str, Any]], mesh: DeviceMesh) -> None:
        self.groups = _every_group(groups, mesh)
        self.allowed: set[int] = set()  # id() of DDPs already found to span no plan axis
        self.handed: EngineGroups | None = None  # set by hpgen.runtime.training.data_parallel

    def __call__(self, module: nn.Module, args: Any) -> None:
        # Which DDP, if any, runs this forward: torch (2.13) documents no way to ask; DDP marks itself active around
        # its module's forward for torch.compile (`_get_active_ddp_module`, private, the accessor torch._dynamo
        # calls). A forward pre-hook on the DDP itself would need the DDP, which only KeptFromDDP's frame read finds:
        # the two guards would then fail together, where now each stands in for the other. (Under
        # torch._dynamo's optimize_ddp="python_reducer" DDP does not mark itself, and this check does not fire.)
        # tests/runtime/install/test_wrapped.py checks against the installed torch that a DDP's forward is seen.
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is None or id(ddp) in self.allowed:
            return None
        ranks = tuple(dist.get_process_group_ranks(ddp.process_group))
        if self.handed is not None and tuple(sorted(ranks)) not in self.handed.groups:
            raise RuntimeError(_not_the_engine_message(module, ranks, self.handed))
        spanned = _spanned(self.groups, ranks, self.handed)
        if not spanned:
            self.allowed.add(id(ddp))
            return None
        raise RuntimeError(_message(module, ranks, spanned, _overwritten(module, ddp, spanned)))

    def __deepcopy__(self, memo: dict) -> DataParallelCheck:
        return self


def _not_the_engine_message(module: nn.Module, ranks: Sequence[int], handed: EngineGroups) -> str:
    axes = ", ".join(repr(axis) for axis in handed.axes)
    return (
        f"hpgen: {type(module).__name__} runs inside DistributedDataParallel over global ranks "
        f"{', '.join(map(str, ranks))}, but hpgen.runtime.training.data_parallel handed the gradient sums over {axes} "
        "to an engine over other ranks: hpgen's hooks no longer make them, and this DDP does not either, so the "
        "gradients would be this rank's share only. Train the model data_parallel returned."
    )


def _overwritten(module: nn.Module, ddp: DistributedDataParallel, spanned: Sequence[tuple[str, tuple[int, ...]]]) -> list[str]:
    """Sharded parameters whose shards are now equal on two DDP ranks of one plan-axis group (rank 0's broadcast)."""
    from hpgen.runtime.checkpoint.state_dict import sharded_params

    params = dict(module.named_parameters(remove_duplicate=False))
    mine = {name: _tensor_digest(params[name]) for name in sorted(sharded_params(module)) if name in params}
    every = all_gather_object(mine, ddp.process_group)
    ranks = dist.get_process_group_ranks(ddp.process_group)
    index = {rank: position for position, rank in enumerate(ranks)}
    overwritten = set()
    for _, members in spanned:
        inside = [index[rank] for rank in members if rank in index]
        for name in mine:
            digests = [every[position].get(name) for position in inside]
            if len(set(digests)) < len(digests):
                overwritten.add(name)
    # the union of what each rank found, so that every rank raises the same error
    return sorted(set().union(*all_gather_object(sorted(overwritten), ddp.process_group)))


def _message(
    module: nn.Module, ranks: Sequence[int], spanned: Sequence[tuple[str, tuple[int, ...]]], overwritten: list[str]
) -> str:
    axes = ", ".join(repr(axis) for axis, _ in spanned)
    if overwritten:
        shown = ", ".join(overwritten[:4]) + (f" and {len(overwritten) - 4} more" if len(overwritten) > 4 else "")
        state = (
            f"DistributedDataParallel's constructor has OVERWRITTEN the shards of {len(overwritten)} parameters "
            f"({shown}) with those of global rank {ranks[0]}: this model's weights are now wrong. Build and parallelize the model "
            "again (or reload its checkpoint) before training it."
        )
    else:
        state = "The shards are unchanged (hpgen kept that DDP from them; no optimizer step was taken)."
    return (
        f"hpgen: {type(module).__name__} runs inside DistributedDataParallel over global ranks "
        f"{', '.join(map(str, ranks))}, which holds two or more ranks of one group of the plan's axis {axes}. Such a DDP "
        "broadcasts one rank's shards over the others, averages gradients hpgen already summed, and its data is "
        "sharded over ranks that must see the same batch (what a stock transformers.Trainer or "
        f"Accelerator().prepare(model) does under torchrun). {state}\nTrain it with hpgen.runtime.trainer.Trainer "
        "(transformers' Trainer: DDP or FSDP2 on the data-parallel mesh axis only, data sharded over those ranks, "
        "clipping by the whole model's norm), or in your own loop: DistributedDataParallel(model, "
        "process_group=mesh.get_group('dp')) on the data-parallel axis only, or "
        "hpgen.runtime.training.data_parallel(model) (DDP or FSDP2 over dp and cp), and hpgen.runtime.clip_grad_norm_ "
        "instead of torch.nn.utils.clip_grad_norm_."
    )


class AccelerateCheck:
    """``model._is_accelerate_prepared`` of a parallelized model: refuses a stock accelerate preparation.

    accelerate's ``prepare_model`` tests this attribute's truth before it moves, wraps or records the
    model, in every configuration that reaches it (DDP or none, ``ParallelismConfig``, evaluation
    only; FSDP2's preparation does not, and ``Accelerator.prepare`` is stopped earlier by
    ``stock_loops``): called directly, or in a process accelerate does not see as distributed.
    Inside :func:`prepared_by_hpgen_trainer` it answers whether that accelerator has prepared the model
    already (accelerate's own meaning); anywhere else it raises, the same message on every rank, since
    every rank prepares alike.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.prepared: weakref.WeakSet = weakref.WeakSet()  # the hpgen Trainers' accelerators that have

    def __bool__(self) -> bool:
        accelerator = preparing()
        if accelerator is None:
            raise RuntimeError(stock_loop_message(self.model_name, "accelerate's Accelerator.prepare_model"))
        return accelerator in self.prepared

    def __deepcopy__(self, memo: dict) -> AccelerateCheck:
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {"model_name": self.model_name}  # a pickled model: the accelerators it was prepared by are not kept

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model_name"])

    @staticmethod
    def restore(model: nn.Module, accelerator: Any) -> None:
        """After ``accelerator`` prepared ``model``: the check back where accelerate set ``_is_accelerate_prepared =
        True`` (the parallelized model, or a wrapper of it), recording that this accelerator has prepared it."""
        seen = model
        for _ in range(8):
            seen.__dict__.pop("_is_accelerate_prepared", None)
            check = seen.__dict__.get("_hp_accelerate_check")
            if isinstance(check, AccelerateCheck):
                check.prepared.add(accelerator)
                seen.__dict__["_is_accelerate_prepared"] = check
                return
            if isinstance(seen, DistributedDataParallel):
                seen = seen.module
            elif hasattr(seen, "get_base_model"):  # peft's PeftModel
                seen = seen.get_base_model()
            elif isinstance(getattr(seen, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
                seen = seen._orig_mod
            else:
                return


def install_accelerate_check(model: nn.Module) -> None:
    """Make ``model._is_accelerate_prepared`` an :class:`AccelerateCheck` (kept also as ``_hp_accelerate_check``), and
    put the checks of what a stock Trainer and ``Accelerator.prepare`` read first on its class (``stock_loops``)."""
    check = AccelerateCheck(type(model).__name__)
    model.__dict__["_hp_accelerate_check"] = check
    model.__dict__["_is_accelerate_prepared"] = check
    install_stock_loop_checks(type(model))
