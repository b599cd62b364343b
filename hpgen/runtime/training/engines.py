"""DDP or FSDP2 over the data-parallel axes and ``cp``: the engine makes the gradient sums over ``cp``.

On a ``cp`` axis each rank computes its share of the tokens, so its gradient of every parameter
the layers use is a share; ``parallelize`` sums those shares in tensor hooks, one synchronous
all-reduce per parameter and micro-batch. :func:`data_parallel` folds ``cp`` into the group a
data-parallel engine reduces over instead (torchtitan's ``dp_shard_cp``): one group over the
``dp x cp`` ranks that share the other axes' coordinates (``tp`` and the like stay hpgen's), then
DDP over it, or FSDP2 (``fully_shard`` on each decoder layer and the root) on a one-dimensional
mesh of it. The sums are then bucketed and overlapped with backward, skipped while accumulating
(DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``), and FSDP2 shards parameters
and optimizer state over ``cp`` too.

The factors: both engines AVERAGE over their group, while ``cp`` wants a SUM (hpgen's loss is
the whole batch's on every cp rank, each rank's gradient a share of it). So the hooks hpgen keeps
multiply each share by the cp size (:meth:`~hpgen.runtime.install.hooks.GradAllReduce.hand_to_engine`),
and the head that runs on a rank's own tokens does the same in its backward
(:mod:`hpgen.runtime.context_logits`); parameters whose gradient is already whole on every
cp rank (the embeddings, which run before the sequence is cut) need nothing, since the average
of equal values is that value. The engines run with their defaults: no comm hook, no divide factor.
For ``cp`` 2 the scaling is by a power of two, so the result is one process's up to the order of
the sums.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpgen.runtime.install.hooks import reducers_of
from hpgen.runtime.install.wrapped import DataParallelCheck, EngineGroups, KeptFromDDP, MeshAxes, mesh_axes_of

__all__ = ["ENGINES", "data_parallel", "engine_mesh", "no_sync"]

ENGINES = ("ddp", "fsdp2")
HANDED_AXES = ("cp",)  # the plan axes whose gradient sums an engine can make: replicated parameters, a share each


def data_parallel(model: nn.Module, engine: str = "ddp", **options: Any) -> nn.Module:
    """``model`` (parallelized) under DDP or FSDP2 over its mesh's data-parallel axes and ``cp``.

    ``engine``: ``"ddp"`` returns ``DistributedDataParallel(model, process_group=<dp x cp group>, **options)``;
    ``"fsdp2"`` applies ``fully_shard(..., mesh=<dp x cp mesh>, **options)`` to each decoder layer (the classes
    of the model's ``_no_split_modules``) and to the root, and returns ``model``. Call it on every rank,
    after ``parallelize`` (and after ``get_peft_model``). Without a ``cp`` axis it is DDP or FSDP2 on the
    data-parallel axes, as one would build them by hand.
    """
    if engine not in ENGINES:
        raise ValueError(f"data_parallel: engine={engine!r}; one of {', '.join(map(repr, ENGINES))}")
    axes = mesh_axes_of(model)
    if axes is None:
        raise ValueError(
            f"data_parallel: {type(model).__name__} was not parallelized by hpgen (call hpgen.runtime.parallelize first)"
        )
    handed = tuple(axis for axis in axes.plan_axes if axis in HANDED_AXES and axes.size([axis]) > 1)
    over = tuple(axis for axis in axes.mesh.mesh_dim_names or () if axis in axes.data_axes or axis in handed)
    if not over:
        raise ValueError(
            f"data_parallel: the mesh {tuple(axes.mesh.mesh_dim_names or ())} has no data-parallel axis and no 'cp' "
            f"of more than one rank (hpgen's plan owns {', '.join(axes.plan_axes)}): there is nothing to reduce over"
        )
    flat, rows = engine_mesh(axes.mesh, over)
    if handed:
        _hand_over(model, axes, handed, rows)
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=flat.get_group(), **options)
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's PeftModel
    layers = set(getattr(base, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in layers:
            fully_shard(module, mesh=flat, **options)
    fully_shard(model, mesh=flat, **options)
    return model


@contextlib.contextmanager
def no_sync(wrapped: nn.Module) -> Iterator[None]:
    """No gradient sums by the engine inside the block (accumulate the micro-batches before the step's last
    one): DDP's ``no_sync()``, or FSDP2's ``set_requires_gradient_sync(False)`` (True again after it). A model
    under no engine sums every micro-batch in hpgen's hooks: the block changes nothing then."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(wrapped, DistributedDataParallel):
        with wrapped.no_sync():
            yield
    elif callable(getattr(wrapped, "set_requires_gradient_sync", None)):  # fully_shard's FSDPModule
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
    else:
        yield


def engine_mesh(mesh: DeviceMesh, over: tuple[str, ...]) -> tuple[DeviceMesh, list[tuple[int, ...]]]:
    """A one-dimensional mesh over this rank's ranks of ``mesh`` that differ only on the axes ``over``, and
    every such group (sorted global ranks). One axis is ``mesh[axis]``; several are flattened into one process
    group, made by its own ranks only (``new_group(..., use_local_synchronization=True)``), and a mesh of it
    by ``DeviceMesh.from_group`` (both public, unlike ``DeviceMesh._flatten``)."""
    names = tuple(mesh.mesh_dim_names or ())
    dims = [names.index(axis) for axis in over]
    others = [dim for dim in range(mesh.ndim) if dim not in dims]
    rows = mesh.mesh.permute(*others, *dims).reshape(-1, math.prod(mesh.size(dim) for dim in dims)).tolist()
    groups = [tuple(sorted(row)) for row in rows]
    if len(over) == 1:
        return mesh[over[0]], groups
    row = next(row for row in groups if dist.get_rank() in row)
    group = dist.new_group(list(row), use_local_synchronization=True)
    return DeviceMesh.from_group(group, mesh.device_type, mesh=list(row), mesh_dim_names=("_".join(over),)), groups


def _hand_over(model: nn.Module, axes: MeshAxes, handed: tuple[str, ...], rows: list[tuple[int, ...]]) -> None:
    """hpgen's sums over ``handed`` left to the engine: the hooks scale instead, the head too, the guards accept it."""
    for axis in handed:
        ranks = [int(rank) for rank in axes.mesh[axis].mesh.tolist()]
        size = len(ranks)
        for reducer in reducers_of(model):
            reducer.hand_to_engine(ranks)
        for module in model.modules():
            logits = module.__dict__.get("_hp_cp_logits")
            if logits is not None:
                logits.engine_scale = size
    engine = EngineGroups(handed, frozenset(rows))
    for module in model.modules():
        kept = module.__dict__.get("_ddp_params_and_buffers_to_ignore")
        if isinstance(kept, KeptFromDDP):
            kept.handed = engine
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, DataParallelCheck):
                hook.handed = engine
