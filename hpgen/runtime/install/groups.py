"""Process groups beyond the mesh's own: the replica groups of an ``RS(d,r)`` placement.

``RS(d,r)`` on an axis of ``size`` ranks gives rank ``i`` of the axis chunk ``i // r``,
so the ranks ``[c * r, (c + 1) * r)`` of every copy of the axis hold the same chunk. The
gradient of such a parameter is summed over those ``r`` ranks: each saw only its own part
of the activations (its query heads, for key/value heads). :func:`replica_group` returns
this rank's group of them.

``torch.distributed.new_group`` must be called by every rank of the default group, for
every group, in the same order. So every rank enumerates all of them — every copy of
the axis in the mesh (one per coordinate of the other dims), and every chunk in it —
in the same order, and keeps its own. Groups are cached per (mesh ranks, axis, r), so
several parameters and several models share one set.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["replica_group", "replica_rank_lists"]

_CACHE: dict[tuple[tuple[int, ...], tuple[int, ...], int, int], dist.ProcessGroup] = {}


def replica_rank_lists(mesh_ranks: list, axis_index: int, replicas: int) -> list[list[int]]:
    """Global ranks of every replica group of ``axis_index``, in a fixed order.

    ``mesh_ranks`` is the mesh as nested lists of global ranks (``mesh.mesh.tolist()``).
    The axis is moved last, so each row is one copy of the axis in axis order; each row
    is cut into runs of ``replicas`` consecutive ranks.
    """
    import torch

    grid = torch.tensor(mesh_ranks)
    rows = grid.movedim(axis_index, -1).reshape(-1, grid.shape[axis_index]).tolist()
    return [row[start : start + replicas] for row in rows for start in range(0, len(row), replicas)]


def replica_group(mesh: DeviceMesh, axis: str, replicas: int) -> dist.ProcessGroup:
    """This rank's group of the ``replicas`` consecutive ranks of ``axis`` holding its chunk.

    Every rank of the mesh must call it with the same arguments (it creates the groups of
    all ranks). ``replicas`` equal to the axis size is the axis's own group.
    """
    names = tuple(mesh.mesh_dim_names or ())
    index = names.index(axis)
    size = mesh.size(index)
    if size % replicas:
        raise ValueError(f"{replicas} replicas do not divide axis {axis!r} of size {size}")
    if replicas == size:
        return mesh.get_group(axis)
    ranks = mesh.mesh.tolist()
    key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), index, replicas)
    if key not in _CACHE:
        me = dist.get_rank()
        mine = None
        for members in replica_rank_lists(ranks, index, replicas):
            group = dist.new_group(members)
            if me in members:
                mine = group
        assert mine is not None, f"rank {me} is not in the mesh {key[0]}"
        _CACHE[key] = mine
    return _CACHE[key]
