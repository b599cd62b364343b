"""Constants in the dataflow run: the Python value of a branch test, when module attributes decide it.

``self.multi_query``, ``self.config._attn_implementation == "sdpa"``, ``getattr(self,
"q_norm", None) is not None``: read on the live instance, so the run takes the branch
the instance takes. ``self.training`` and tensors stay unknown.
"""

from __future__ import annotations

import ast
from typing import Any

from hpgen.planner.flow.values import UNKNOWN

__all__ = ["Constants", "binop", "compare", "same_const", "self_path"]


class Constants:
    """Constant folding for a :class:`~hpgen.planner.flow.statements.Frame`."""

    module: Any
    consts: dict[str, Any]

    def const(self, node: ast.expr | None) -> Any:
        """The Python value of ``node`` when module attributes and constants decide it, else unknown."""
        if node is None:
            return UNKNOWN
        try:
            return self._const(node)
        except Exception:
            return UNKNOWN

    def _const(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.consts.get(node.id, UNKNOWN)
        path = self_path(node)
        if path is not None:
            obj: Any = self.module
            for part in path.split("."):
                obj = getattr(obj, part)
            if path == "training":
                return UNKNOWN
            import torch

            return UNKNOWN if isinstance(obj, torch.Tensor) else obj
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            value = self._const(node.operand)
            return UNKNOWN if value is UNKNOWN else not value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = self._const(node.operand)
            return UNKNOWN if value is UNKNOWN else -value
        if isinstance(node, ast.BoolOp):
            values = [self._const(v) for v in node.values]
            if isinstance(node.op, ast.And):
                if any(v is not UNKNOWN and not v for v in values):
                    return False
                return UNKNOWN if any(v is UNKNOWN for v in values) else values[-1]
            if any(v is not UNKNOWN and v for v in values):
                return True
            return UNKNOWN if any(v is UNKNOWN for v in values) else values[-1]
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = self._const(node.left), self._const(node.comparators[0])
            if left is UNKNOWN or right is UNKNOWN:
                return UNKNOWN
            return compare(node.ops[0], left, right)
        if isinstance(node, ast.BinOp):
            left, right = self._const(node.left), self._const(node.right)
            if left is UNKNOWN or right is UNKNOWN:
                return UNKNOWN
            return binop(node.op, left, right)
        if isinstance(node, ast.IfExp):
            test = self._const(node.test)
            if test is UNKNOWN:
                return UNKNOWN
            return self._const(node.body if test else node.orelse)
        if isinstance(node, (ast.Tuple, ast.List)):
            values = [self._const(e) for e in node.elts]
            return UNKNOWN if any(v is UNKNOWN for v in values) else tuple(values)
        if isinstance(node, ast.Slice):
            parts = [self._const(p) if p is not None else None for p in (node.lower, node.upper, node.step)]
            return UNKNOWN if any(p is UNKNOWN for p in parts) else slice(*parts)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = (
                self._const(node.args[0]) if self_path(node.args[0]) or isinstance(node.args[0], ast.Name) else UNKNOWN
            )
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self":
                target = self.module
            name = self._const(node.args[1])
            if target is UNKNOWN or not isinstance(name, str):
                return UNKNOWN
            if node.func.id == "hasattr":
                return hasattr(target, name)
            default = self._const(node.args[2]) if len(node.args) > 2 else UNKNOWN
            return getattr(target, name, default)
        return UNKNOWN


def self_path(node: ast.expr) -> str | None:
    """``self.a.b`` -> ``a.b``; anything else -> None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(reversed(parts))
    return None


def same_const(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def compare(op: ast.cmpop, left: Any, right: Any) -> Any:
    table = {
        ast.Eq: lambda: left == right,
        ast.NotEq: lambda: left != right,
        ast.Is: lambda: left is right,
        ast.IsNot: lambda: left is not right,
        ast.In: lambda: left in right,
        ast.NotIn: lambda: left not in right,
        ast.Lt: lambda: left < right,
        ast.LtE: lambda: left <= right,
        ast.Gt: lambda: left > right,
        ast.GtE: lambda: left >= right,
    }
    return bool(table[type(op)]()) if type(op) in table else UNKNOWN


def binop(op: ast.operator, left: Any, right: Any) -> Any:
    table = {
        ast.Add: lambda: left + right,
        ast.Sub: lambda: left - right,
        ast.Mult: lambda: left * right,
        ast.FloorDiv: lambda: left // right,
        ast.Div: lambda: left / right,
        ast.Mod: lambda: left % right,
    }
    return table[type(op)]() if type(op) in table else UNKNOWN
