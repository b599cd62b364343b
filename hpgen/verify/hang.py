"""Where each rank waits: the collective it last entered and the module that entered it.

A collective that never completes (one rank took a branch its peers did not, or a rank
raised and left them waiting) shows in :func:`~hpgen.verify.spawn.run_distributed` only
as a rank that did not finish. While a :class:`CollectiveWatch` is on, every collective the
runtime issues notes, in the rank's shared slot, its name and axis and the innermost module
of the parallelized model running it, so that the timeout names them per rank::

    rank 1 of 2 failed:
    did not finish within 120s: in all_gather on ep (forward), entered by model.layers.0.mlp.experts
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from hpgen.runtime.forward.handback import watch_collectives
from hpgen.verify.spawn import note_where

__all__ = ["CollectiveWatch"]


class CollectiveWatch:
    """On (a context manager) for one parallelized ``model``: the names of its running modules kept
    as a stack by global module hooks, and each collective noted with the innermost one.

    ``axes``: the name of each process group (a mesh's axes); others read "the default group"
    or "a group".
    """

    def __init__(self, model: nn.Module, axes: Mapping[Any, str] | None = None) -> None:
        self._names = {id(module): fqn or type(module).__name__ for fqn, module in model.named_modules()}
        self._axes = dict(axes or {})
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> CollectiveWatch:
        self._handles = [register_module_forward_pre_hook(self._enter), register_module_forward_hook(self._leave)]
        watch_collectives(self._collective)
        return self

    def __exit__(self, *exc: object) -> None:
        watch_collectives(None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        note_where("")

    def _enter(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._stack.append(name)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name is not None and self._stack and self._stack[-1] == name:
            self._stack.pop()

    def _collective(self, name: str, group: Any) -> None:
        axis = self._axes.get(group) or ("the default group" if group is None else "a group")
        if torch._C._current_graph_task_id() != -1:  # inside autograd's backward
            note_where(f"in {name} on {axis} (backward)")
        else:
            module = self._stack[-1] if self._stack else "no module of the model"
            note_where(f"in {name} on {axis} (forward), entered by {module}")
