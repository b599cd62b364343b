"""Whether a refused ``parallelize`` left the model exactly as it was: a snapshot, then what differs from it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["snapshot", "untouched"]


def snapshot(model: nn.Module) -> dict[str, Any]:
    """The model's Parameter objects with a copy of their values, and each module's class."""
    return {
        "params": {name: (param, param.detach().clone()) for name, param in model.named_parameters()},
        "classes": {name: type(module) for name, module in model.named_modules()},
    }


def untouched(model: nn.Module, before: dict[str, Any]) -> list[str]:
    """What differs from the snapshot (empty when nothing changed): parameters, hooks, classes, bound attributes."""
    changes = []
    params = dict(model.named_parameters())
    for name, (param, value) in before["params"].items():
        if params.get(name) is not param or not torch.equal(param.detach(), value):
            changes.append(f"parameter {name}")
        if param._backward_hooks:
            changes.append(f"hook on {name}")
    for name, module in model.named_modules():
        if type(module) is not before["classes"][name]:
            changes.append(f"class of {name}")
        if any(key.startswith("_hp_") or key == "__hp_compute__" for key in vars(module)) or module._forward_hooks:
            changes.append(f"bound on {name}")
    return changes
