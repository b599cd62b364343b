"""CPU collectives that return only once the backend has let go of their tensors.

gloo runs each collective on a worker thread, which wakes the caller when the data has
moved and only then drops its own references to the tensors it was given. When the caller's
last Python reference to one of them is gone first (a temporary, a result nobody kept), the
worker's drop frees the Python object from that thread, so it must take the GIL. During
interpreter shutdown a thread asking for the GIL is ended on the spot; for gloo's worker
that ends in ``std::terminate``, and a job that finished its work exits with SIGABRT
("terminate called without an active exception"; the worker's stack reads
``~AsyncAllgatherWork`` -> ``THPVariable_dealloc`` -> ``take_gil``). On a loaded machine it
took about one run of README's two-rank example in ten (torch 2.13).

So every collective hpgen's runtime issues goes through :func:`call` (objects through
:func:`all_gather_object` and :func:`broadcast_object`, whose tensors ``torch.distributed``'s
own object collectives make and drop inside), which keeps the caller's
references until the worker has dropped its own: after the collective returns it waits (a
thread yield, needed in about a third of calls) until each CPU tensor it passed is back to
the reference count it had before. The worker needs no GIL for a drop that leaves the Python
object alive, so the wait cannot deadlock; it is bounded all the same, and a backend that
keeps references for longer is not waited for again. CUDA tensors are not waited for: NCCL's
work is released by its watchdog once the GPU is done, and waiting would stall the stream.

Being the one door, :func:`call` also tells a watcher set with :func:`watch_collectives`
of each collective as it starts (``hpgen verify`` names where a rank waits that way).
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hpgen.runtime.forward.devices import collective_device

__all__ = ["all_gather_object", "broadcast_object", "call", "watch_collectives"]

_BUDGET_S = 1.0  # a worker drops its references microseconds after the data moved, unless descheduled
_YIELDS = 50  # then sleep in small steps rather than spin
_waiting = hasattr(Tensor, "_use_count")  # off for good once the budget runs out


# Told of each collective as it starts: hpgen verify keeps the last one per rank, to say
# where a rank waits when a collective never completes (see watch_collectives).
_watch: Callable[[str, Any], None] | None = None


def watch_collectives(watch: Callable[[str, Any], None] | None) -> None:
    """Call ``watch(name, group)`` as each collective :func:`call` runs starts (``name``: the
    ``torch.distributed`` function's, ``group``: the ``group=`` it was given, ``None`` for the
    default group), or stop with ``None``. For tools such as ``hpgen verify`` that name where
    a rank waits when a collective never completes; otherwise one ``None`` check a call."""
    global _watch
    _watch = watch


def call(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``collective(*args, **kwargs)`` (a synchronous ``torch.distributed`` call), returning
    once the backend holds no reference to the CPU tensors in ``args`` (or in lists there)."""
    if _watch is not None:
        _watch(getattr(collective, "__name__", "a collective"), kwargs.get("group"))
    tensors = [t for t in _tensors(args) if t.device.type == "cpu"] if _waiting else []
    counts = [t._use_count() for t in tensors]
    result = collective(*args, **kwargs)
    if tensors:
        _await_release(tensors, counts)
    return result


def _tensors(args: tuple[Any, ...]) -> Iterator[Tensor]:
    for arg in args:
        if isinstance(arg, Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            yield from (t for t in arg if isinstance(t, Tensor))


def _await_release(tensors: list[Tensor], counts: list[int]) -> None:
    global _waiting
    deadline = None
    spins = 0
    for tensor, count in zip(tensors, counts, strict=True):
        while tensor._use_count() > count:
            spins += 1
            if spins <= _YIELDS:
                os.sched_yield()
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + _BUDGET_S
            elif now > deadline:
                _waiting = False  # something else holds them: waiting would only cost time
                return
            time.sleep(1e-4)


def all_gather_object(
    obj: Any, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> list[Any]:
    """Every rank's ``obj`` (picklable), in group rank order, as ``dist.all_gather_object`` gives them.

    ``device``: where the bytes travel (the mesh's device); by default what the group's backend takes.
    """
    mine = _pickled(obj, group, device)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=mine.device) for _ in range(size)]
    call(dist.all_gather, lengths, torch.tensor([mine.numel()], dtype=torch.int64, device=mine.device), group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=mine.device)
    padded[: mine.numel()] = mine
    every = [torch.empty_like(padded) for _ in range(size)]
    call(dist.all_gather, every, padded, group=group)
    return [_unpickled(t[: int(n)]) for t, n in zip(every, lengths, strict=True)]


def broadcast_object(
    obj: Any, src: int = 0, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> Any:
    """Global rank ``src``'s ``obj`` (picklable) on every rank of ``group`` (``device`` as in
    :func:`all_gather_object`)."""
    mine = _pickled(obj, group, device)
    length = torch.tensor([mine.numel()], dtype=torch.int64, device=mine.device)
    call(dist.broadcast, length, src=src, group=group)
    data = mine if dist.get_rank() == src else torch.empty(int(length), dtype=torch.uint8, device=mine.device)
    call(dist.broadcast, data, src=src, group=group)
    return _unpickled(data)


def _pickled(obj: Any, group: dist.ProcessGroup | None, device: torch.device | None) -> Tensor:
    """``obj`` as bytes, on ``device`` or else the device the group's backend takes."""
    where = collective_device(group) if device is None else device
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(where)


def _unpickled(data: Tensor) -> Any:
    return pickle.loads(bytes(data.cpu().tolist()))
