"""The DDP guards of :mod:`hpgen.runtime.install.wrapped` against the installed torch's DistributedDataParallel.

Both read what torch does not document (see their comments): ``KeptFromDDP`` finds the DDP
being built in its caller's frame, ``DataParallelCheck`` the DDP running a forward where DDP
marks itself active. A torch that changes either fails here, with the part that changed named,
rather than in a user's run; ``test_data_parallel.py`` runs the same guards on parallelized models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.support.dist import run_distributed


def _guarded_ddp(rank: int, world_size: int) -> dict[str, Any]:
    """A Linear whose weight stands for a tp shard (each rank its own) and whose bias is replicated, under both
    guards, in a DDP over tp; the user listed a buffer for DDP to leave alone."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from hpgen.runtime.install.wrapped import DataParallelCheck, KeptFromDDP

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    groups = [("tp", mesh.get_group("tp"))]
    model = nn.Linear(3, 3)
    model.register_buffer("steps", torch.zeros(1))
    with torch.no_grad():
        model.weight.fill_(float(rank + 1))  # the shard this rank holds
        model.bias.fill_(float(rank + 1))  # DDP's broadcast makes it rank 0's
    model.__dict__["_hp_sharded"] = {"weight": None}  # what parallelize records of a sharded parameter
    model._ddp_params_and_buffers_to_ignore = KeptFromDDP(groups, mesh, ["steps"])
    model.register_forward_pre_hook(DataParallelCheck(groups, mesh))
    ddp = DistributedDataParallel(model, process_group=mesh.get_group("tp"))
    found: dict[str, Any] = {
        "ignored": sorted(ddp.parameters_to_ignore),
        "weight": model.weight[0, 0].item(),
        "bias": model.bias[0].item(),
    }
    try:
        ddp(torch.ones(1, 3))
    except RuntimeError as error:
        found["refused"] = str(error)
    dist.barrier()
    return found


def test_the_ddp_guards_find_the_ddp_in_the_installed_torch() -> None:
    found = run_distributed(_guarded_ddp, world_size=2, timeout=120)
    for rank, seen in enumerate(found):
        # the ignore list found the DDP being built: the shard is left out of its broadcast, the user's entry kept
        assert seen["ignored"] == ["steps", "weight"], seen
        assert seen["weight"] == rank + 1 and seen["bias"] == 1, seen
        # the forward pre-hook found the DDP running it, and refused it with the shards unchanged
        assert "runs inside DistributedDataParallel over global ranks 0, 1" in seen.get("refused", ""), seen
        assert "The shards are unchanged" in seen["refused"], seen
