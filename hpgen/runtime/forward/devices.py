"""The device whose tensors a mesh's or a process group's collectives take.

Read from the mesh's ``device_type`` or from the group's backend configuration, never from
the backend's name: ``dist.init_process_group()`` with no backend names none
(``dist.get_backend()`` is ``'undefined'``) and, on a CPU-only machine, runs gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["collective_device"]


def collective_device(where: DeviceMesh | dist.ProcessGroup | None = None) -> torch.device:
    """The device for the collectives of ``where``: a mesh (its ``device_type``), or a process
    group (``None``: the default group), whose backend takes CPU tensors when it can."""
    kind = where.device_type if isinstance(where, DeviceMesh) else _group_device_type(where)
    if kind in ("cpu", "meta"):
        return torch.device("cpu")
    module = getattr(torch, kind, None)  # torch.cuda, torch.xpu, ...: this rank's current device
    current = getattr(module, "current_device", None)
    return torch.device(kind, current()) if callable(current) else torch.device(kind)


def _group_device_type(group: dist.ProcessGroup | None) -> str:
    """The CPU if the group's backend takes CPU tensors, else the first device type it takes.

    ``get_backend_config`` reads ``device:backend`` pairs (``cpu:gloo,cuda:gloo`` for gloo,
    ``cuda:nccl`` for NCCL, ``cpu:gloo`` for no backend on a CPU-only machine).
    """
    pairs = [part.split(":", 1) for part in dist.get_backend_config(group).split(",") if ":" in part]
    kinds = [kind.strip() for kind, _ in pairs]
    if "cpu" in kinds or not kinds:
        return "cpu"
    return kinds[0]
