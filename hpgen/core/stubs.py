"""Kernel stubs: module-level functions of a modeling file whose torch fallback returns ``None``.

transformers' Mamba files call a fused kernel first (``mamba_inner_fn``,
``mamba2_split_conv1d_scan_combined``) and run their torch path when it returns ``None``,
which the file's own stub always does. Its decorator
(``use_kernel_func_from_hub_with_fallback``) binds the name to a wrapper that calls an
installed package's kernel (``mamba_ssm``) instead where there is one. Where the stub
itself runs, a call of it has no value, so ``if fused_output is not None: return
fused_output`` adds nothing to what the module returns; where a kernel runs, it is an
ordinary call that mixes its operands (and :mod:`hpgen.runtime.install.replaced_stubs` refuses to
parallelize it). In the core, with no torch and no libcst: the planner's derivation and the
runtime's check both import it.
"""

from __future__ import annotations

import ast
import inspect
import sys
from functools import lru_cache
from typing import Any

__all__ = ["hub_layer_function", "returns_none", "runs_stub", "stub_lines"]


def returns_none(module: Any, name: str) -> bool:
    """Whether ``name``, as the module's own file binds it now, runs the file's ``return None`` stub."""
    try:
        path = inspect.getsourcefile(type(module))
    except TypeError:
        return False
    if path is None or name not in stub_lines(path):
        return False
    return runs_stub(getattr(sys.modules.get(type(module).__module__), name, None), path, name)


def runs_stub(live: Any, path: str, name: str) -> bool:
    """Whether calling ``live`` runs the stub ``name`` of the file at ``path`` (not a kernel bound in its place).

    transformers' fallback wrapper keeps the function it calls as ``implementation`` (the
    stub itself where no package provides the kernel); any other wrapper is taken to run
    something else.
    """
    lines = stub_lines(path).get(name, ())
    for _ in range(4):  # the stub, or transformers' wrapper around the stub
        if _is_stub(live, path, lines):
            return True
        if not inspect.isfunction(live):
            live = hub_layer_function(live)  # with ``kernels`` installed the wrapper is a function layer
            if live is None:
                return False
            continue
        try:
            nonlocals = inspect.getclosurevars(live).nonlocals
        except (TypeError, ValueError):
            return False
        if "implementation" not in nonlocals:
            return False
        live = nonlocals["implementation"]
    return False


def hub_layer_function(live: Any) -> Any:
    """The function a kernels-hub function layer calls, or ``None`` where ``live`` is not one or runs a kernel.

    With the ``kernels`` package installed, transformers' ``use_kernel_forward_from_hub`` turns a
    module-level function into an instance of a small ``nn.Module`` class (``kernel_layer_name``
    on the class) whose ``forward`` calls the function it closes over as ``func``; ``kernelize``
    replaces that ``forward`` on the instance with a hub kernel.
    """
    if inspect.isfunction(live) or not hasattr(type(live), "kernel_layer_name") or "forward" in vars(live):
        return None
    try:
        function = inspect.getclosurevars(type(live).forward).nonlocals.get("func")
    except (TypeError, ValueError):
        return None
    return function if inspect.isfunction(function) else None


def _is_stub(function: Any, path: str, lines: tuple[int, ...]) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and code.co_filename == path and code.co_firstlineno in lines


@lru_cache(maxsize=64)
def stub_lines(path: str) -> dict[str, tuple[int, ...]]:
    """Module-level functions of the file whose body only returns ``None`` -> their first lines (decorators too)."""
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[str, tuple[int, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and _only_returns_none(node):
            found[node.name] = (node.lineno, *(d.lineno for d in node.decorator_list))
    return found


def _only_returns_none(node: ast.FunctionDef) -> bool:
    body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return bool(body) and all(
        isinstance(n, ast.Return) and (n.value is None or isinstance(n.value, ast.Constant) and n.value.value is None)
        for n in body
    )
