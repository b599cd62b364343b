"""What torchrun gives a script, on the ranks of :func:`tests.support.dist.run_distributed`; the commands a reader
types (``python``, ``hpgen``, ``torchrun``) as this interpreter runs them."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

__all__ = ["as_under_torchrun", "shims"]


def as_under_torchrun(rank: int, world_size: int) -> None:
    """Leave the harness's process group and set the variables torchrun sets (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, a free ``MASTER_PORT``...): a script then makes its own group from them."""
    import torch.distributed as dist

    port = [None]
    if rank == 0:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = [free.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()  # the script makes its own, from the environment, as under torchrun
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]),
    )  # fmt: skip


def shims(folder: Path) -> Path:
    """``python``, ``hpgen`` and ``torchrun`` on PATH as this interpreter runs them (the venv need not be active)."""
    folder.mkdir()
    for name, args in (("python", ""), ("hpgen", " -m hpgen"), ("torchrun", " -m torch.distributed.run")):
        shim = folder / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return folder
