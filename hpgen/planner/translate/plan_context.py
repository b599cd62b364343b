"""What every step of a plan reads and none changes: the model, its modules, its modeling files, the mesh.

:func:`~hpgen.planner.translate.translator.translated_draft` and
:func:`~hpgen.planner.translate.derived_plan.derived_plan` build one :class:`PlanContext` and pass it
to each step they call, as torchtitan passes the model and the mesh to ``apply_tp``: what a
step produces (rules, boundaries, a draft plan) is its return value or the boundary records
it is given, never state on an object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from hpgen.planner.translate.forwards import Forwards

__all__ = ["PlanContext"]


@dataclass(frozen=True)
class PlanContext:
    """The model being planned (``name`` in messages), its modules by FQN, the ``forward`` each runs, the mesh axes."""

    model: nn.Module
    name: str
    modules: Mapping[str, nn.Module]
    forwards: Forwards
    mesh: tuple[str, ...]

    @property
    def config(self) -> Any:
        """The model's config (None for a bare module)."""
        return getattr(self.model, "config", None)
