"""Kernel stubs: module-level functions of a modeling file whose torch fallback returns ``None``.

transformers' Mamba files call a fused kernel first (``mamba_inner_fn``,
``mamba2_split_conv1d_scan_combined``) and fall back to the torch path when it returns
``None``, which the file's own stub always does. A call of such a stub has no value, so
the ``if fused_output is not None: return fused_output`` branch adds nothing to what the
module returns.
"""

from __future__ import annotations

import ast
import inspect
import sys
from typing import Any

__all__ = ["returns_none"]


def returns_none(module: Any, name: str) -> bool:
    """Whether ``name``, as the module's own file binds it now, is a plain function that returns ``None`` only.

    The live object is checked, not the text: where an installed package (mamba_ssm) has
    replaced the stub with a real kernel, the call mixes its operands as any other call.
    """
    function = getattr(sys.modules.get(type(module).__module__), name, None)
    if not inspect.isfunction(function):
        return False
    try:
        tree = ast.parse(inspect.getsource(function).strip())
    except (OSError, TypeError, SyntaxError):
        return False
    definition = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if definition is None:
        return False
    returns = [n for n in ast.walk(definition) if isinstance(n, ast.Return)]
    if not returns or any(not _is_none(r.value) for r in returns):
        return False
    body = [n for n in definition.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return all(isinstance(n, (ast.Return, ast.Pass)) for n in body)  # nothing but the return (and a docstring)


def _is_none(value: ast.expr | None) -> bool:
    return value is None or (isinstance(value, ast.Constant) and value.value is None)
