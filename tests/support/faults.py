"""Fault injection for checkpoint writes: SIGKILL a process at its k-th file-system step.

:func:`kill_at` patches, in the calling process only, every step a save takes that
changes what is on disk: ``os.fsync`` (the end of each file's and folder's write),
``os.rename``/``os.replace``/``os.link``, ``shutil.rmtree``, the two-folder exchange
(:func:`hpgen.core.durable.exchange`), and, where transformers is imported, its safetensors
writer, which counts three steps per file: before it, half of its bytes on disk, after it. At the ``k``-th step the
process kills itself with SIGKILL: no ``finally``, no atexit, as when a job is killed.

:func:`kill_trials` runs ``write`` in a forked child once without a kill (counting its
steps), then once per step with a kill there, calling ``check`` in the parent after each:
a deterministic sweep over every point of the save.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any

from hpgen.core import durable



class _Counter:
    def __init__(self, kill: int | None) -> None:
        self.kill = kill
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_at(kill: int | None, *, exchange: bool = True) -> _Counter:
    """Count (and at step ``kill``, SIGKILL at) each file-system step; ``exchange=False``: no RENAME_EXCHANGE."""
    counter = _Counter(kill)

    def counted(function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counter.step()
            return function(*args, **kwargs)

        return wrapper

    for name in ("fsync", "rename", "replace", "link"):
        setattr(os, name, counted(getattr(os, name)))
    shutil.rmtree = counted(shutil.rmtree)
    original_exchange = durable.exchange
    durable.exchange = counted(original_exchange if exchange else (lambda first, second: False))
    modeling_utils = sys.modules.get("transformers.modeling_utils")  # only where a test already uses it
    if modeling_utils is None:
        return counter
    import safetensors.torch

    original_save = modeling_utils.safe_save_file

    def save_file(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        counter.step()  # before the file
        if counter.steps + 1 == counter.kill:  # inside it: half of the bytes written
            data = safetensors.torch.save(tensors, metadata=metadata)
            with open(filename, "wb") as stream:
                stream.write(data[: len(data) // 2])
                stream.flush()
                os.fsync(stream.fileno())  # the kill step
        original_save(tensors, filename, metadata=metadata)
        counter.step()  # after it

    modeling_utils.safe_save_file = save_file
    return counter


def _run_child(write: Callable[[], None], kill: int | None, exchange: bool) -> tuple[str, int]:
    """Fork; in the child, count steps (killing at ``kill``) around ``write()``. ("killed"|"done", steps)."""
    read, send = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        code = 0
        try:
            counter = kill_at(kill, exchange=exchange)
            write()
            os.write(send, str(counter.steps).encode())
        except BaseException:  # noqa: BLE001 - reported through the exit code
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(send)
    with os.fdopen(read) as stream:
        text = stream.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed", kill or 0
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "done", int(text)
    raise RuntimeError(f"the writing child failed (status {status})")


def kill_trials(
    write: Callable[[], None], check: Callable[[int], None], *, exchange: bool = True, every: int = 1
) -> tuple[int, int]:
    """Kill ``write`` (in a forked child) at every ``every``-th of its steps, ``check(step)`` after each.

    Returns (steps of an uninterrupted write, kills made).
    """
    outcome, steps = _run_child(write, None, exchange)
    assert outcome == "done"
    check(0)
    kills = 0
    for step in range(1, steps + 1, every):
        outcome, _ = _run_child(write, step, exchange)
        assert outcome == "killed", f"no kill at step {step} of {steps}"
        kills += 1
        check(step)
    return steps, kills
