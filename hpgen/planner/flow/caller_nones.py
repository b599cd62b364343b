"""Which arguments a decoder layer's caller passes as None on the path the instance takes.

A layer's flow starts at the layer with a marker for each argument, so a branch on an
argument (Falcon's ``if alibi is None``, where FalconModel passes ``alibi = None`` unless
``config.alibi``) would be read both ways. This reads the owner's ``forward`` with the
flow's constant folding only (no module is interpreted): names bound to constants, ``if``
tests the instance decides, and the keyword arguments of the calls in its loops.
"""

from __future__ import annotations

import ast
from typing import Any

from hpgen.planner.flow.constants import Constants
from hpgen.planner.flow.runner import function_def
from hpgen.planner.flow.values import UNKNOWN

__all__ = ["caller_nones"]


def caller_nones(model: Any, layer: str) -> frozenset[str]:
    """Keyword names every call in a loop of the layer stack owner's ``forward`` passes as None."""
    parts = layer.split(".")
    if len(parts) < 2 or not parts[-1].isdigit():
        return frozenset()
    owner_fqn = ".".join(parts[:-2])
    try:
        owner = model.get_submodule(owner_fqn) if owner_fqn else model
    except AttributeError:
        return frozenset()
    function = function_def(type(owner), "forward")
    if function is None:
        return frozenset()
    walk = _Walk(owner, {})
    walk.block(function.body, in_loop=False)
    return frozenset.intersection(*walk.calls) if walk.calls else frozenset()


class _Walk(Constants):
    """Constant folding over a body's statements, collecting the None keywords of calls in loops."""

    def __init__(self, module: Any, consts: dict[str, Any]) -> None:
        self.module = module
        self.consts = consts
        self.calls: list[frozenset[str]] = []

    def block(self, statements: list[ast.stmt], *, in_loop: bool) -> None:
        for statement in statements:
            self.statement(statement, in_loop=in_loop)

    def statement(self, node: ast.stmt, *, in_loop: bool) -> None:
        if in_loop:  # the calls this statement makes itself: a compound one's bodies are statements of their own
            for expression in _own_expressions(node):
                self._collect(expression)
        if isinstance(node, ast.Assign):
            const = self.const(node.value)
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        self.consts.pop(name.id, None)
                if isinstance(target, ast.Name) and const is not UNKNOWN:
                    self.consts[target.id] = const
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name):
            self.consts.pop(node.target.id, None)
        elif isinstance(node, ast.If):
            test = self.const(node.test)
            if test is not UNKNOWN:
                self.block(node.body if test else node.orelse, in_loop=in_loop)
                return
            start = dict(self.consts)
            results = []
            for body in (node.body, node.orelse):
                self.consts = dict(start)
                self.block(body, in_loop=in_loop)
                results.append(self.consts)
            self.consts = {k: v for k, v in results[0].items() if k in results[1] and results[1][k] is v}
        elif isinstance(node, (ast.For, ast.While)):
            for inner in ast.walk(node):  # a name rebound anywhere in the loop differs on the next round
                if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    self.consts.pop(inner.id, None)
            self.block(node.body, in_loop=True)
        elif isinstance(node, (ast.With, ast.Try)):
            self.block(node.body, in_loop=in_loop)

    def _collect(self, expression: ast.AST) -> None:
        for call in ast.walk(expression):
            if isinstance(call, ast.Call) and call.keywords:
                self.calls.append(frozenset(kw.arg for kw in call.keywords if kw.arg and self._none(kw.value)))

    def _none(self, node: ast.expr) -> bool:
        return isinstance(node, (ast.Name, ast.Constant)) and self.const(node) is None


def _own_expressions(node: ast.stmt) -> list[ast.AST]:
    """What ``node`` evaluates itself: all of a simple statement; a compound one's test, iterable or context
    managers (its bodies are walked as statements, and a branch the folding rules out is not walked at all)."""
    if isinstance(node, (ast.If, ast.While)):
        return [node.test]
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return [node.iter]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return [item.context_expr for item in node.items]
    if isinstance(node, (ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match)):
        return []
    return [node]
