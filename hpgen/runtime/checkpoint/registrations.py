"""Each parameter and buffer of a model once, under every name and (module, attribute) holding it.

Tied weights are one tensor registered under several names; checking a plan's layouts
(every name of a tied parameter must agree) and reading a checkpoint (one read per tensor,
put in place under all its names) both need the tensors grouped that way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Registration", "registrations"]


@dataclass
class Registration:
    """One parameter or buffer and every place it is registered, in ``named_modules`` order."""

    tensor: torch.Tensor
    is_param: bool
    persistent: bool  # in the state dict: every parameter, and buffers not registered persistent=False
    names: list[str] = field(default_factory=list)  # every FQN (several when tied)
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)  # (module, attribute) for each name


def registrations(model: nn.Module, *, buffers: bool = True) -> list[Registration]:
    """Every parameter (and, with ``buffers``, every buffer) of ``model`` once, with all its names."""
    found: dict[int, Registration] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        kinds = [(True, module._parameters)] + ([(False, module._buffers)] if buffers else [])
        for is_param, tensors in kinds:
            for attr, tensor in tensors.items():
                if tensor is None:
                    continue
                fqn = f"{prefix}.{attr}" if prefix else attr
                persistent = is_param or attr not in module._non_persistent_buffers_set
                entry = found.setdefault(id(tensor), Registration(tensor, is_param, persistent))
                if fqn not in entry.names:
                    entry.names.append(fqn)
                    entry.owners.append((module, attr))
    return list(found.values())
