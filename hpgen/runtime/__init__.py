"""hpgen's runtime: what generated files call, and ``parallelize``.

Importable without libcst. ``parallelize`` is loaded on first use so that generated
files, which import ``hpgen.runtime.defaults``, do not pay for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["parallelize"]


def __getattr__(name: str) -> Any:
    if name == "parallelize":
        from hpgen.runtime.install import parallelize

        return parallelize
    raise AttributeError(f"module 'hpgen.runtime' has no attribute {name!r}")
