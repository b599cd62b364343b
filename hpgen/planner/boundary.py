"""The record of one boundary the translator builds, and the names it is keyed by.

A :class:`Boundary` is a concrete module (``model.layers.3.mlp``) with the placements of
its inputs, outputs and parameters on each mesh axis as the steps fill them in;
:meth:`Boundary.entry` is its plan entry. :func:`generic` gives the ``*`` form that
groups the layers' boundaries into one key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Boundary"]



@dataclass
class Boundary:
    """One concrete boundary module and the entry it is getting."""

    fqn: str
    module: Any
    kind: str  # block | experts | linear | embedding | identity | sp
    inputs: dict[str, tuple[dict[str, str], dict[str, str]]] = field(default_factory=dict)  # name -> (src, dst)
    outputs: dict[str, tuple[dict[str, str], dict[str, str]]] = field(default_factory=dict)
    out_names: tuple[str, ...] | None = None
    params: dict[str, dict[str, str]] = field(default_factory=dict)
    deferred: set[str] = field(default_factory=set)
    grad_reduce: set[str] = field(default_factory=set)
    divide_attrs: dict[str, int] = field(default_factory=dict)
    axes: set[str] = field(default_factory=set)
    injection_axis: str | None = None
    wrapped_as: str | None = None  # "nn.Linear" / "nn.Embedding" for modules parallelize wraps
    sp_input: bool = False  # a block entered from the sequence-sharded residual stream (--sp)

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        for part, values in (("in", self.inputs), ("out", self.outputs)):
            if values:
                entry[f"{part}_src"] = {name: dict(src) for name, (src, _) in values.items()}
                entry[f"{part}_dst"] = {name: dict(dst) for name, (_, dst) in values.items()}
        if self.out_names is not None:
            entry["out_names"] = list(self.out_names)
        if self.params:
            entry["params"] = {name: dict(layout) for name, layout in self.params.items()}
        if self.deferred:
            entry["deferred_bias_params"] = sorted(self.deferred)
        if self.grad_reduce:
            entry["grad_reduce_params"] = sorted(self.grad_reduce)
        if self.divide_attrs:
            entry["divide_attrs"] = dict(self.divide_attrs)
        return entry
