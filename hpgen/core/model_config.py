"""A transformers config's attribute read where it may be absent or defined per layer.

transformers' heterogeneous configs (Gemma 4's per-layer ``head_dim``) raise their own error
for a global read of a per-layer attribute instead of returning a value; the planner, the
runtime and ``hpgen verify`` read such attributes on models of every kind, and treat both
cases as "no single value".
"""

from __future__ import annotations

from typing import Any

__all__ = ["config_value"]


def config_value(config: Any, name: str) -> Any:
    """``config.<name>``, or None where it is absent or per layer (transformers raises then)."""
    try:
        return getattr(config, name, None)
    except Exception:  # AmbiguousGlobalPerLayerAttributeError, and any property that cannot answer globally
        return None
