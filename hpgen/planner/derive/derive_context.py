"""What every step of a derivation reads and none changes: the model, the files, ``--tp``, the dataflows.

One :class:`DeriveContext` is made per derivation (:func:`hpgen.planner.derive.derivation.derive`) and passed
to each step explicitly, as torchtitan passes the model and the mesh to ``apply_tp``; what
one step hands the next (a group, its layouts, its boundaries) is in the steps' signatures.
The dataflow of a module (:mod:`hpgen.planner.flow`) and the splits of a meta-device
forward (:mod:`hpgen.planner.derive.heads.parts`) are computed once and cached here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpgen.core.model_config import config_value
from hpgen.planner.flow import Flow, run_module
from hpgen.planner.flow.caller_nones import caller_nones

if TYPE_CHECKING:
    from hpgen.planner.derive.heads.input_dims import TracedCall

__all__ = ["DeriveContext"]


@dataclass(frozen=True)
class DeriveContext:
    """The model being derived and what its steps read (see the module docstring)."""

    model: Any
    tp: int | None
    source: Path  # the modeling file hpgen lower rewrites
    read: Path | tuple[Path, ...]  # the files whose forwards are interpreted (the source, maybe others)
    modules: Mapping[str, Any]  # FQN -> module
    names: Mapping[int, str]  # id(module) -> FQN (as the dataflow names them)
    text_config: Any  # the (text) config
    _flows: dict[str, Flow] = field(default_factory=dict, repr=False, compare=False)
    # query heads -> the splits of one meta-device forward sized for them (None: it does not run there)
    traced: dict[int, list[TracedCall] | None] = field(default_factory=dict, repr=False, compare=False)

    def config(self, name: str) -> Any:
        """A value of the (text) config, or None where it is absent or per layer (transformers raises then)."""
        return config_value(self.text_config, name)

    def flow(self, fqn: str) -> Flow:
        """The dataflow of the ``forward`` of the module at ``fqn``, with its callers' constant ``None`` arguments."""
        if fqn not in self._flows:
            nones = caller_nones(self.model, fqn)
            flow = run_module(self.model, fqn, self.read, names=self.names, nones=nones)  # type: ignore[arg-type]
            self._flows[fqn] = flow
        return self._flows[fqn]

    def leaf_flow(self, fqn: str) -> Flow:
        """The dataflow of a leaf's own ``forward``, opened (:mod:`hpgen.planner.derive.channels.state_leaves`)."""
        key = f"{fqn}#open"
        if key not in self._flows:
            self._flows[key] = run_module(self.model, fqn, self.read, names=self.names, open_leaf=True)
        return self._flows[key]
