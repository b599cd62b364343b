"""Run a function on several real processes joined in a ``torch.distributed`` group, on the CPU.

``hpgen verify`` runs its checks this way, and so do hpgen's own tests (``tests/support/dist.py``).
Each rank is a fresh process forked from a ``forkserver`` that has already imported torch,
transformers' model base classes and hpgen's runtime (:data:`PRELOAD`; a plain ``spawn``
where the platform has no forkserver), so a run does not pay those imports, about five
CPU seconds a rank, every time. Nothing of the caller's state is inherited: ``fn`` and
its arguments travel by pickle, so ``fn`` must be a module-level function of an importable
module (no lambdas, no nested functions), and its arguments and return value must be
picklable. The ranks
rendezvous through a file store in a temporary directory (no ports to race for) and use
one CPU thread each.

No failure hangs the caller: the first rank to raise has its traceback re-raised in the
parent as :class:`RankFailed` and the other ranks are killed (they may be stuck in a
collective waiting for it); a rank that dies without reporting, or a run that exceeds
``timeout``, fails the same way.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import multiprocessing as mp  # torch.multiprocessing's contexts are these; torch is imported in the ranks

__all__ = ["PRELOAD", "RankFailed", "note_where", "run_distributed", "start_server"]

# what every rank imports anyway; the forkserver imports it once, before its first fork (a
# module that fails to import there is imported by the rank that needs it instead)
PRELOAD = ("torch", "torch.distributed", "transformers.modeling_utils", "hpgen.runtime")

_WHERE_BYTES = 512
_where: Any = None  # in a rank: its slot of shared memory, read by the parent (see note_where)


def note_where(text: str) -> None:
    """In a rank of :func:`run_distributed`: keep ``text`` (where this rank is, e.g. the
    collective it last entered) in a slot the parent reads when the rank never reports, so
    that a hung collective is named per rank. A no-op outside a rank; costs one small copy."""
    if _where is not None:
        _where.value = text.encode("utf-8", "replace")[: _WHERE_BYTES - 1]


class RankFailed(RuntimeError):
    """A rank of :func:`run_distributed` raised, died, or did not finish in time.

    ``failures`` maps each failed rank to its traceback text (or what happened to it).
    """

    def __init__(self, failures: dict[int, str], world_size: int) -> None:
        self.failures = failures
        super().__init__(
            "\n".join(
                f"rank {rank} of {world_size} failed:\n{text}" for rank, text in sorted(failures.items())
            )
        )


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str | None = "gloo",
    timeout: float = 60.0,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank.

    ``fn`` must be a module-level function (see the module docstring). ``timeout`` (seconds)
    bounds the whole run from the ranks' start (their start-up included; the forkserver's own,
    once a process, not), and is also the process group's collective timeout. With ``backend="nccl"`` rank ``r`` uses ``cuda:r``; ``backend=None``
    calls ``init_process_group`` without one, as a user may (torch picks the machine's default).
    """
    try:
        pickle.dumps((fn, args))
    except Exception as error:
        raise TypeError(f"run_distributed needs a module-level fn and picklable args: {error}") from error
    context = _context()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="hpgen-dist-") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        processes, receivers, pipes = [], [], {}
        wheres = [context.Array("c", _WHERE_BYTES, lock=False) for _ in range(world_size)]
        try:
            for rank in range(world_size):
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(
                    target=_rank_main,
                    args=(rank, world_size, backend, init_method, timeout, fn, args, sender, wheres[rank]),
                    name=f"rank{rank}",
                    daemon=True,
                )
                process.start()
                sender.close()  # the rank holds the only writer: its exit reads as EOF here
                processes.append(process)
                receivers.append(receiver)
                pipes[rank] = receiver
            deadline = time.monotonic() + timeout  # (from the ranks' start: not the forkserver's own, once)
            return _collect(processes, pipes, deadline, timeout, wheres)
        finally:
            for process in processes:
                process.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
                if process.is_alive():
                    process.kill()
                    process.join()
            for receiver in receivers:
                receiver.close()


def start_server() -> None:
    """Start the forkserver now, so that its imports of :data:`PRELOAD` overlap the caller's own
    work before its first :func:`run_distributed` (``hpgen verify``: about 5 CPU seconds each)."""
    if _context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _context() -> Any:
    """A forkserver context that preloads :data:`PRELOAD`, or ``spawn`` where there is none.

    Never ``fork``: the caller may hold threads (a process group, gloo's workers) and locks
    that a plain fork would copy mid-use. The forkserver is started once, on first use, from
    a clean interpreter; CUDA is not initialized there (importing torch does not), so ranks
    can still pick their devices. Ranks see the environment variables the caller had when
    the server started.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # read when the server starts, ignored after
    return context


def _collect(
    processes: list[Any], pipes: dict[int, Connection], deadline: float, timeout: float, wheres: list[Any]
) -> list[Any]:
    """Read every rank's report; raise as soon as one rank failed (the caller kills the rest)."""
    world_size = len(processes)
    results: dict[int, Any] = {}
    while pipes:
        ready = wait(list(pipes.values()), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RankFailed(
                {rank: f"did not finish within {timeout:g}s{_where_text(wheres[rank])}" for rank in sorted(pipes)},
                world_size,
            )
        failures = {}
        for rank, pipe in list(pipes.items()):
            if pipe not in ready:
                continue
            del pipes[rank]
            try:
                status, value = pickle.loads(pipe.recv_bytes())
            except EOFError:
                processes[rank].join(timeout=1.0)
                status, value = "error", (
                    f"exited with code {processes[rank].exitcode} without reporting{_where_text(wheres[rank])}"
                )
            if status == "ok":
                results[rank] = value
            else:
                failures[rank] = value
        if failures:
            for process in processes:  # peers may be blocked in a collective with the failed rank
                if process.is_alive():
                    process.kill()
            raise RankFailed(failures, world_size)
    return [results[rank] for rank in range(world_size)]


def _where_text(where: Any) -> str:
    """What a rank last noted (:func:`note_where`), or a guess where it noted nothing."""
    text = bytes(where.value).decode("utf-8", "replace")
    return f": {text}" if text else " (a hung collective?)"


def _rank_main(
    rank: int,
    world_size: int,
    backend: str | None,
    init_method: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    pipe: Connection,
    where: Any,
) -> None:
    """Body of one rank: join the group, run ``fn``, report, leave the group."""
    import torch  # preloaded by the forkserver
    import torch.distributed as dist

    global _where
    _where = where
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        report = pickle.dumps(("ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        report = pickle.dumps(("error", traceback.format_exc()))
    pipe.send_bytes(report)  # before tearing down, so the parent hears of a failure at once
    pipe.close()
    if dist.is_initialized():
        dist.destroy_process_group()
