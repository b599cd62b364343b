"""A torch.distributed backend without the single-tensor collectives, as some third-party backends are.

``refusing`` is registered with torch's own ``Backend.register_backend`` (how a backend
extension plugs in) and is a ``ProcessGroup`` of the installed torch that runs ``all_reduce``
and the list ``all_gather`` on gloo and has nothing else: ``all_gather_single``,
``reduce_scatter_single`` and ``all_to_all_single`` are refused by torch itself, as it
refuses them on any backend that lacks them. Call :func:`refusing_group` in every rank of a
spawned gloo run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

NAME = "refusing"


class _Refusing(dist.ProcessGroup):
    def __init__(self, rank: int, size: int, inner: Any) -> None:
        super().__init__(rank, size)
        self.inner = inner  # gloo, for the two collectives it has

    def getBackendName(self) -> str:
        return NAME

    def allreduce(self, tensors: Any, opts: Any) -> Any:
        return self.inner.allreduce(tensors, opts)

    def allgather(self, outputs: Any, inputs: Any, opts: Any) -> Any:
        return self.inner.allgather(outputs, inputs, opts)


def _create(store: Any, rank: int, size: int, timeout: Any) -> _Refusing:
    return _Refusing(rank, size, dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout))


def refusing_group(ranks: Sequence[int]) -> Any:
    """A new process group of ``ranks`` on the ``refusing`` backend (every rank of the world calls it)."""
    if not dist.is_backend_available(NAME):  # once per process
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    return dist.new_group(list(ranks), backend=NAME)
