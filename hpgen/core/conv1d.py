"""transformers' ``Conv1D`` (GPT-2's transposed linear layer), recognized without importing it.

One test for the planner and the runtime, in the core (no torch at import: duck-typed).
A module is a ``Conv1D`` when its class is named ``Conv1D``, it has ``nx`` inputs and
``nf`` outputs, its weight is ``[nx, nf]`` and its ``forward`` is ``Conv1D``'s own. Both
layers read it as a linear layer with the weight transposed; a subclass that replaces
``forward`` may compute anything, so neither layer takes it for one (the planner's test
did before; the runtime's already did not). A weight of any other shape is not the layout
``Conv1D`` computes with, so neither does that (the runtime's test accepted any 2-D weight).
The runtime asks before it shards the weight, while ``nx`` and ``nf`` still describe it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_conv1d"]


def is_conv1d(module: Any) -> bool:
    """transformers' ``Conv1D``: ``nf`` outputs, ``nx`` inputs, weight ``[nx, nf]``, ``forward`` untouched."""
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    shape = getattr(getattr(module, "weight", None), "shape", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(nx, int)
        and isinstance(nf, int)
        and shape is not None
        and tuple(shape) == (nx, nf)
        and getattr(type(module).forward, "__qualname__", "") == "Conv1D.forward"
    )
