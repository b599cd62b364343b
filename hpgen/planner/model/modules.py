"""Small questions about modules and names the planner asks: is it a linear layer, which way its weight
points, where two module paths meet, what a name is relative to another."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from hpgen.core.conv1d import is_conv1d

_DIGITS = re.compile(r"\.\d+(?=\.|$)")  # a list index segment

__all__ = [
    "attr_value",
    "between",
    "generic",
    "in_features",
    "is_conv1d",
    "is_linear",
    "is_nn_linear",
    "join",
    "lca",
    "out_features",
    "positive_int",
    "prefixes",
    "relative",
]


def is_linear(module: Any) -> bool:
    import torch.nn as nn

    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_nn_linear(module: Any) -> bool:
    import torch.nn as nn

    return isinstance(module, nn.Linear)


def out_features(module: Any) -> int:
    return module.nf if is_conv1d(module) else module.out_features


def in_features(module: Any) -> int:
    return module.nx if is_conv1d(module) else module.in_features


def positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def lca(fqns: Iterable[str]) -> str:
    parts = [f.split(".") for f in fqns]
    if not parts:
        return ""
    common = []
    for segments in zip(*parts):
        if len(set(segments)) != 1:
            break
        common.append(segments[0])
    return ".".join(common)


def prefixes(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def between(cols: Iterable[str], top: str) -> list[str]:
    """Modules from the columns' parents up to ``top``, nearest first."""
    found: list[str] = []
    for col in sorted(cols):
        path = col.rpartition(".")[0]
        while path and (path == top or path.startswith(top + ".") or not top):
            if path not in found:
                found.append(path)
            if path == top:
                break
            path = path.rpartition(".")[0]
    return found


def relative(fqn: str, base: str) -> str:
    return fqn[len(base) + 1 :] if base and fqn.startswith(base + ".") else ("" if fqn == base else fqn)


def attr_value(modules: Mapping[str, Any], fqn: str, attr: str) -> Any:
    """The value of ``self.<attr>`` (dotted) of the module at ``fqn``, None where it has none."""
    obj: Any = modules.get(fqn)
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def generic(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp`` (transformers' wildcard form)."""
    return _DIGITS.sub(".*", name)
