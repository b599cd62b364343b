"""A parameter held by two pipeline stages (a tied embedding and ``lm_head``): its gradient summed between them.

Megatron and DeepSpeed keep a tied table on the first and on the last stage and add the
two gradients over those ranks; so does hpgen. Each table's holders form one process
group per position on the other mesh axes (the ``tp`` rank ``j`` of the first stage with
the ``tp`` rank ``j`` of the last: both hold the same rows). The groups are made by
``parallelize`` on every rank, in the same order, as ``torch.distributed.new_group``
requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TiedParam", "sum_tied_grads", "tied_params"]


@dataclass
class TiedParam:
    """One parameter several stages hold: its name on this rank (None where this rank holds none) and its group."""

    name: str | None
    group: dist.ProcessGroup | None
    holders: int = 1  # the pipeline ranks holding it


def tied_params(model: nn.Module, mesh: DeviceMesh, axis: str, holders: list[list[int]], names: list[list[str]]) -> list[TiedParam]:
    """The groups of each tied parameter; ``holders``: the pp ranks holding each, ``names`` its names."""
    dims = list(mesh.mesh_dim_names or ())
    ranks = mesh.mesh.movedim(dims.index(axis), 0).reshape(mesh.size(dims.index(axis)), -1)
    mine = dist.get_rank()
    local = dict(model.named_parameters(remove_duplicate=False))
    found = []
    for held, aliases in zip(holders, names):
        group_here = None
        for column in range(ranks.shape[1]):  # every rank makes every group, in the same order
            members = sorted(int(ranks[pp, column]) for pp in held)
            group = dist.new_group(members)
            if mine in members:
                group_here = group
        name = next((alias for alias in aliases if alias in local), None)
        found.append(TiedParam(name, group_here if name is not None else None, len(held)))
    return found


def sum_tied_grads(model: nn.Module, tied: list[TiedParam]) -> None:
    """Add each tied parameter's gradient over the stages holding it (after the backward of every microbatch)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for item in tied:
        if item.name is None or item.group is None:
            continue
        param = params[item.name]
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=item.group)
        param.grad = grad
