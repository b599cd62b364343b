"""The gradient norm of a parallelized model, and clipping by it: the unsharded model's, with one all-reduce.

``torch.nn.utils.clip_grad_norm_`` sees each rank's local tensors: on a parallelized model
its norm is of this rank's shards, each rank clips by a factor of its own, and replicated
parameters drift apart. :func:`grad_norm` and :func:`clip_grad_norm_` (torch's signature and
return value) compute the norm of the whole model instead. Each rank adds up the
``p``-th powers of the norms of the pieces it holds, each weighted by one over the number
of ranks of the model's mesh holding that same piece, and one all-reduce over the mesh
sums them (``inf``: the largest, no weights needed). Who holds what comes from the layouts
``parallelize`` records (:class:`~hpgen.runtime.checkpoint.sharded_param.ShardedParam`:
``S``, ``SS`` and expert pieces are distinct, ``RS(d,r)`` pieces held by ``r`` ranks,
peft's adapters like their base layers) and from DTensor placements (FSDP2 on ``dp``);
a parameter hpgen did not touch is replicated over the mesh (DDP's replicas too).
Non-finite gradients behave as torch's: ``nan`` and ``inf`` propagate into the norm, and
``error_if_nonfinite`` raises, on every rank alike since the norm is the same everywhere.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from hpgen.runtime.checkpoint.sharded_param import ShardedParam
from hpgen.runtime.checkpoint.state_dict import ShardRecorder
from hpgen.runtime.forward.handback import call
from hpgen.runtime.install.parallelize import parallelized_models

__all__ = ["clip_grad_norm_", "grad_norm"]

Parameters = Union[Tensor, nn.Module, Iterable[Tensor]]


@dataclass(frozen=True)
class _Reduction:
    """How the norms of some parameters' local gradients add up to the model's: a weight each, one group."""

    params: tuple[weakref.ref, ...]
    weights: tuple[float, ...]  # 1 / (ranks of the mesh holding the same piece), per parameter
    group: Any  # the model's whole mesh
    size: int  # ranks in the group
    generation: int  # ShardRecorder.generation when made: a layout recorded later makes it stale
    tensors: dict[tuple[int, ...], Tensor | None] = field(default_factory=dict, compare=False)

    def weights_of(self, order: list[int], like: Tensor) -> Tensor | None:
        """The weights of the parameters at positions ``order``, as a tensor like ``like`` (None: all one)."""
        key = tuple(order)
        if key not in self.tensors:
            weights = [self.weights[i] for i in order]
            self.tensors[key] = None if all(w == 1.0 for w in weights) else like.new_tensor(weights)
        return self.tensors[key]

    def fits(self, params: Sequence[Tensor]) -> bool:
        return self.generation == ShardRecorder.generation and all(
            ref() is param for ref, param in zip(self.params, params)
        )


_CACHE: dict[tuple[int, ...], _Reduction | None] = {}


def _as_list(parameters: Parameters) -> tuple[list[Tensor], nn.Module | None]:
    if isinstance(parameters, Tensor):
        return [parameters], None
    if isinstance(parameters, nn.Module):
        return list(parameters.parameters()), parameters
    is_generator = isinstance(parameters, types.GeneratorType)
    listed = list(parameters)
    if is_generator and not listed:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    return listed, None


def _models(module: nn.Module | None) -> list[nn.Module]:
    """The parallelized models: every one ``parallelize`` made, and any inside ``module`` (a copy of one)."""
    found = list(parallelized_models())
    if module is not None:
        found += [m for m in module.modules() if getattr(m, "_hp_mesh", None) is not None and m not in found]
    return found


def _index(models: Iterable[nn.Module]) -> dict[int, tuple[nn.Module, ShardedParam | None]]:
    """id(parameter) -> (its parallelized model, its recorded layout or None: replicated on the plan's axes)."""
    index: dict[int, tuple[nn.Module, ShardedParam | None]] = {}
    for model in models:
        for module in model.modules():
            sharded = module.__dict__.get("_hp_sharded", {})
            for attr, param in module._parameters.items():
                if param is not None and (id(param) not in index or index[id(param)][1] is None):
                    index[id(param)] = (model, sharded.get(attr))
    return index


def _plan_pieces(record: ShardedParam | None) -> int:
    """How many distinct pieces the plan's axes cut the parameter into (``RS(d,r)``: ``size / r``)."""
    if record is None:
        return 1
    pieces = 1
    for placement, _, size in record.shard_layout.shares:
        if size == 1 or placement.is_replicate:
            continue
        if placement.kind == "RS":
            pieces *= max(size // placement.replicas, 1)
        elif placement.kind in ("S", "SS"):
            pieces *= size
        else:
            raise ValueError(f"{record.name}: {placement} is not a parameter placement")
    return pieces


def _dtensor_pieces(param: Tensor, name: str) -> int:
    """How many distinct pieces a DTensor parameter's placements cut it into on its mesh (FSDP2's ``dp``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return 1
    pieces = 1
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):  # _StridedShard too
            pieces *= param.device_mesh.size(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"{name}: a DTensor parameter placed {placement} has no norm of its own pieces")
    return pieces


def _mesh_group(mesh: Any) -> tuple[Any, int]:
    """One process group over every rank of ``mesh``, made once per mesh."""
    if mesh.ndim == 1:
        return mesh.get_group(), mesh.size()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD, mesh.size()
    group = mesh.__dict__.get("_hp_whole_group")
    if group is None:
        ranks = sorted(int(rank) for rank in mesh.mesh.flatten().tolist())
        group = mesh._hp_whole_group = dist.new_group(ranks, use_local_synchronization=True)
    return group, mesh.size()


def _reduction(params: list[Tensor], module: nn.Module | None) -> _Reduction | None:
    """The weights and group for ``params``, or None when none belongs to a parallelized model."""
    key = tuple(map(id, params))
    cached = _CACHE.get(key)
    if cached is not None and cached.fits(params):
        return cached
    index = _index(_models(module))
    owners = [index.get(id(param)) for param in params]
    models = list({id(found[0]): found[0] for found in owners if found is not None}.values())
    if not models:
        return None
    mesh = models[0]._hp_mesh
    for model in models[1:]:
        if model._hp_mesh != mesh:
            raise ValueError(
                f"clip_grad_norm_: the parameters belong to models parallelized on different meshes "
                f"({mesh} and {model._hp_mesh}); clip each model's parameters in a call of its own"
            )
    group, size = _mesh_group(mesh)
    staged = {id(model): model._hp_stage.norm_weights(model) for model in models if hasattr(model, "_hp_stage")}
    weights = []
    for position, (param, found) in enumerate(zip(params, owners)):
        record = found[1] if found is not None else None
        name = record.name if record is not None else f"parameter {position}"
        pieces = _plan_pieces(record) * _dtensor_pieces(param, name)
        if size % pieces:
            raise ValueError(
                f"clip_grad_norm_: {name} is cut into {pieces} pieces, which the {size} ranks of the model's mesh "
                "do not hold evenly: is it sharded over a mesh other than the one given to parallelize?"
            )
        # pipeline stages: a parameter lives on one stage's ranks (a tied table on two), not on all of them
        stage = staged.get(id(found[0]), {}).get(id(param), 1.0) if found is not None else 1.0
        weights.append(pieces / size * stage)
    made = _Reduction(tuple(weakref.ref(p) for p in params), tuple(weights), group, size, ShardRecorder.generation)
    if len(_CACHE) > 64:
        _CACHE.clear()
    _CACHE[key] = made
    return made


def _local(grad: Tensor) -> Tensor:
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad


def _uses_foreach(tensors: list[Tensor], device: torch.device, foreach: bool | None) -> bool:
    if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


def _local_norms(
    params: list[Tensor], norm_type: float, foreach: bool | None
) -> tuple[Tensor | None, list[int], torch.dtype]:
    """Each local gradient's norm (one tensor, in float32 or wider), the parameters' positions in that order,
    and the dtype torch's norm would have (the gradients' promoted dtype): grouped by device and dtype, each
    group's norms in one foreach call where torch's ``clip_grad_norm_`` would make one."""
    held = [(i, _local(p.grad)) for i, p in enumerate(params) if p.grad is not None]
    dtype = functools.reduce(torch.promote_types, {g.dtype for _, g in held}) if held else torch.float32
    held = [(i, g) for i, g in held if g.numel()]  # an empty FSDP2 piece adds nothing
    if not held:
        return None, [], dtype
    grads = [g for _, g in held]
    accumulate = torch.promote_types(dtype, torch.float32)
    device = grads[0].device
    parts, order = [], []
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)
    for (group_device, _), ([tensors], indices) in grouped.items():
        if _uses_foreach(tensors, group_device, foreach):
            norms = torch._foreach_norm(tensors, norm_type)
        else:
            norms = [torch.linalg.vector_norm(t, norm_type) for t in tensors]
        stacked = torch.stack(norms)
        parts.append(stacked if stacked.dtype == accumulate and group_device == device else stacked.to(device, accumulate))
        order += [held[j][0] for j in indices]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), order, dtype


def _total_norm(
    params: list[Tensor], reduction: _Reduction, norm_type: float, error_if_nonfinite: bool, foreach: bool | None
) -> Tensor:
    norms, order, dtype = _local_norms(params, norm_type, foreach)
    accumulate = torch.promote_types(dtype, torch.float32)
    device = norms.device if norms is not None else (params[0].device if params else torch.device("cpu"))
    maximum = math.isinf(norm_type) and norm_type > 0
    minimum = math.isinf(norm_type) and norm_type < 0
    if maximum or minimum:
        # [the extreme, whether a nan was seen]: gloo's max and min drop nans, torch's keep them
        local = torch.tensor([0.0 if maximum else math.inf, 0.0], dtype=accumulate, device=device)
        if norms is not None:
            nan = norms.isnan().any().to(accumulate)
            local = torch.stack([norms.max(), nan]) if maximum else torch.stack([norms.min(), -nan])
        op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.MIN
    else:
        if norms is None:
            local = torch.zeros((), dtype=accumulate, device=device)
        else:
            powered = norms.pow(norm_type)
            weights = reduction.weights_of(order, powered)
            local = powered.sum() if weights is None else torch.dot(powered, weights)
        op = dist.ReduceOp.SUM
    if reduction.size > 1:
        call(dist.all_reduce, local, op=op, group=reduction.group)
    if maximum or minimum:
        total = torch.where(local[1] != 0, torch.full_like(local[0], math.nan), local[0])
    else:
        total = local.pow(1.0 / norm_type)
    total = total.to(dtype)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if norm_type == 0.0 or math.isnan(norm_type):
        raise ValueError(
            f"norm_type {norm_type}: the norm of a parallelized model's gradients is defined for p != 0 and "
            "+-inf (torch's 0-norm counts whole tensors, which sharding splits)"
        )
    return norm_type


@torch.no_grad()
def grad_norm(parameters: Parameters, norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
              foreach: bool | None = None) -> Tensor:
    """The ``norm_type`` norm of the gradients of ``parameters`` (a model, parameters, or one tensor), as the
    unsharded model's: the same on every rank. Every rank of the model's mesh calls it (one all-reduce).

    Parameters of no parallelized model: torch's ``get_total_norm`` of their gradients.
    """
    norm_type = _check_norm_type(norm_type)
    params, module = _as_list(parameters)
    reduction = _reduction(params, module)
    if reduction is None:
        grads = [p.grad for p in params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    return _total_norm(params, reduction, norm_type, error_if_nonfinite, foreach)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the unsharded model's norm: scale the gradients in place by
    ``min(max_norm / (norm + 1e-6), 1)`` and return the norm (:func:`grad_norm`).

    ``parameters``: the model (any module holding a parallelized one: DDP, peft), its ``parameters()``, or one
    tensor. Every rank of the model's mesh calls it; the norm and the factor are the same on each.
    """
    norm_type = _check_norm_type(norm_type)
    params, module = _as_list(parameters)
    reduction = _reduction(params, module)
    if reduction is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    total = _total_norm(params, reduction, norm_type, error_if_nonfinite, foreach)
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return total
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for (device, _), ([device_grads], _) in _group_tensors_by_device_and_dtype([grads]).items():
        scale = coefficient.to(device)
        if _uses_foreach(device_grads, device, foreach):
            torch._foreach_mul_(device_grads, scale)
        else:
            for grad in device_grads:
                grad.mul_(scale)
    return total
