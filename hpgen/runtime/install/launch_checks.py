"""Launch mistakes named as such, on every rank, before ``parallelize`` changes anything.

The mistakes a new user makes at launch otherwise surface deep inside torch or inside a
check that cannot see the cause:

- a rank outside the mesh (torchrun with 3 processes for a 2-rank mesh): torch's
  ``init_device_mesh`` accepts it and the third rank dies in ``get_group`` with an
  ``IndexError`` while the others go on (:func:`refuse_ranks_outside`);
- a plan written for another size (``hpgen plan --tp 4`` run at tp 2) or another model
  class (a Qwen2 plan on a Llama): the survey's first refusal is about a head count or a
  bias, so it is reworded to name the sizes or the classes (:func:`reworded`);
- a batch split at a boundary whose companion inputs (the rotary output, the mask, the
  positions) stay whole: every rank would pair its rows with the whole batch's, which
  works by broadcasting on a batch of one and fails in ``generate`` deep in the model
  (:func:`refuse_lone_batch_splits`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpgen.core.plan import Plan
from hpgen.runtime.errors import ParallelizeError

__all__ = ["BATCH_COMPANIONS", "BATCH_STREAMS", "refuse_lone_batch_splits", "refuse_ranks_outside", "reworded"]

# inputs that carry the batch on dim 0: splitting one of the first at a boundary splits the batch
BATCH_STREAMS = ("input_ids", "inputs_embeds", "hidden_states")
# and the inputs that must then be split with it (those a boundary's forward takes)
BATCH_COMPANIONS = (
    *BATCH_STREAMS,
    "attention_mask",
    "position_ids",
    "position_embeddings",
    "token_type_ids",
    "encoder_hidden_states",
    "encoder_attention_mask",
)


def _root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself when it was not)."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        return get_root()
    from torch.distributed.device_mesh import _mesh_resources  # torch before 2.9

    return _mesh_resources.get_root_mesh(mesh)


def refuse_ranks_outside(mesh: DeviceMesh) -> None:
    """Raise on every rank when the world has ranks outside the mesh (decided from the mesh and the world size
    alone, without a collective: the ranks outside cannot take part in one)."""
    if not dist.is_initialized():
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    root = _root_mesh(mesh)
    held = sorted(int(r) for r in root.mesh.flatten().tolist())
    if held == list(range(world)) and rank in [int(r) for r in mesh.mesh.flatten().tolist()]:
        return
    outside = [r for r in range(world) if r not in held]
    shape = " x ".join(f"{name}={size}" for name, size in zip(root.mesh_dim_names or (), root.mesh.shape))
    outside = outside or [rank]  # a mesh over the world that this rank is not in (a sliced mesh of others' ranks)
    what = f"rank {outside[0]} is" if len(outside) == 1 else f"ranks {', '.join(map(str, outside))} are"
    raise ParallelizeError(
        f"the mesh ({shape or tuple(root.mesh.shape)}) holds {len(held)} of the world's {world} ranks, so {what} outside it: "
        f"launch {len(held)} processes (torchrun --nproc-per-node {len(held)}), or build the mesh over all {world} ranks"
    )


def reworded(error: ParallelizeError, model: nn.Module, plan: Plan, mesh: DeviceMesh) -> ParallelizeError:
    """``error`` in one line that names the cause when the plan was written for another mesh size or model class."""
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape))
    apart = plan.sizes_apart({axis: int(size) for axis, size in sizes.items()})
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    names = {cls.__name__ for cls in type(model).__mro__}
    called = "the plan" if plan.name == "<plan>" else plan.name  # "<plan>": given as a dict
    if plan.model_class and plan.model_class not in names:
        return ParallelizeError(
            f"{called} is for {plan.model_class} (its model_class) and the model is a {type(model).__name__}: "
            f"write this model's plan (hpgen plan <its checkpoint or config.json> ...); the first problem: {first}"
        )
    if apart:
        written = ", ".join(f"{axis} {planned}" for axis, planned, _ in apart)
        here = ", ".join(f"{axis} {size}" for axis, _, size in apart)
        flags = " ".join(f"--{axis if axis in ('tp', 'cp', 'pp') else 'ep'} {size}" for axis, _, size in apart)
        return ParallelizeError(
            f"{called} was written for {written} (its planned_for) and this mesh has {here}: re-plan with "
            f"hpgen plan <checkpoint or config.json> {flags} (and the plan's other flags); the first problem: {first}"
        )
    return error


def _forward_inputs(module: nn.Module) -> list[str]:
    function = getattr(type(module), "_forward_impl", None) or type(module).forward
    try:
        return [name for name in inspect.signature(function).parameters if name != "self"]
    except (TypeError, ValueError):
        return []


def refuse_lone_batch_splits(matched: Iterable, axes: tuple[str, ...]) -> None:
    """Raise when a boundary splits the batch (an input of :data:`BATCH_STREAMS` ``R -> S(0)`` on an axis) and
    leaves inputs of :data:`BATCH_COMPANIONS` that its forward takes whole on that axis (``axes``: the plan's)."""
    for item in matched:
        entry = item.entry
        declared = entry.input_names
        for axis in axes:
            split = []
            for name in declared:
                src, dst = (layout.on(axis) for layout in entry.input_layouts(name, axes))
                if src.is_replicate and dst.is_shard and dst.dim == 0:
                    split.append(name)
            if not any(name in BATCH_STREAMS for name in split):
                continue
            whole = [name for name in _forward_inputs(item.module) if name in BATCH_COMPANIONS and name not in split]
            if whole:
                raise ParallelizeError(
                    f"{item.fqn}: param_plan[{item.key!r}] splits the batch over {axis!r} ({', '.join(split)} R -> S(0)) "
                    f"but leaves {', '.join(whole)} whole, which carry the batch too: each rank would pair its rows with "
                    f"the whole batch's (a shape error in generate). Split them as well (in_src R, in_dst S(0) on "
                    f"{axis!r}), or split the batch where they are made, at the inner model's entry (hpgen plan --ep N "
                    f"--attn-dp does)"
                )
