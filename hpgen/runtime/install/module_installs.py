"""Doing what a :class:`~hpgen.runtime.install.module_decisions.ModuleDecision` says, module by module.

:func:`install_module` swaps ``__class__``, binds ``_hp_<axis>``, sets ``<axis>_enable`` in
toggle mode, binds a generic boundary's or an outside module's ``_hp_boundary``, a wrapper's
movers and vocab rows, a region's ``__hp_compute__``, and runs the region's set-up. It
decides nothing: the survey has checked everything before the model changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hpgen.runtime.forward.boundary import GenericBoundary, StaticMove
from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.runtime.install.kernels import route_dispatch
from hpgen.runtime.install.module_decisions import GENERATED_FORMS, ModuleDecision

__all__ = ["install_module"]


def install_module(record: ModuleDecision, axes: Mapping[str, AxisCollectives]) -> None:
    """Give ``record.module`` what its decision says (nothing for an identity)."""
    module = record.module
    if record.form == "identity":
        return
    if record.cls is not None and type(module) is not record.cls:
        module.__class__ = record.cls
    if record.form in GENERATED_FORMS:
        route_dispatch(type(module))  # transformers' kernel choice runs inside the generated forward
    for axis in record.mesh:
        setattr(module, f"_hp_{axis}", axes[axis])
        if hasattr(type(module), f"{axis}_enable"):
            setattr(module, f"{axis}_enable", axes[axis].size > 1)
    if record.form in ("generic", "outside") and record.movers_in is not None:
        module._hp_boundary = GenericBoundary(record.movers_in, record.movers_out or {})
    if record.form in ("embedding", "linear"):
        output = next(iter(record.movers_out or {}), None)
        module._hp_in = _unless_empty((record.movers_in or {}).get("input"))
        module._hp_out = _unless_empty((record.movers_out or {}).get(output)) if output is not None else None
        if record.vocab is not None:
            module._hp_vocab = record.vocab
    for name, value in record.bind.items():
        setattr(module, name, value)
    if record.form == "embedding":
        _fit_embedding(module)
    if record.prepare is not None:
        record.prepare()


def _unless_empty(mover: Any) -> Any:
    """``None`` for a mover with nothing to do, so the wrapper's forward skips the call."""
    return None if isinstance(mover, StaticMove) and not mover.steps else mover


def _fit_embedding(module: nn.Module) -> None:
    """Move ``padding_idx`` into the local rows (or drop it when another rank holds that row)."""
    vocab = getattr(module, "_hp_vocab", None)
    if vocab is None or module.padding_idx is None:
        return
    start, stop = vocab  # nn.Embedding keeps padding_idx non-negative
    module.padding_idx = module.padding_idx - start if start <= module.padding_idx < stop else None
