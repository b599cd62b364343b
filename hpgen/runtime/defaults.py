"""The class-level defaults that generated files bind before ``parallelize`` runs.

Every op of ``IDENTITY_AXIS`` and ``IDENTITY_BOUNDARY`` returns its input, so a
generated file used without ``parallelize`` computes exactly what the original did.
This module is what generated files import (as ``_hp_runtime``); it stays light.
"""

from __future__ import annotations

from typing import Any

from hpgen.runtime.forward.collectives import IDENTITY_AXIS


class IdentityBoundary:
    """The generic form's ``_hp_boundary`` before ``parallelize`` binds a real one."""

    def input(self, name: str, value: Any) -> Any:
        return value

    def output(self, name: str, outputs: Any, address: tuple[object, ...]) -> Any:
        return outputs


IDENTITY_BOUNDARY = IdentityBoundary()

__all__ = ["IDENTITY_AXIS", "IDENTITY_BOUNDARY", "IdentityBoundary"]
