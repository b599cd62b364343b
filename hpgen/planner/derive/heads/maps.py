"""A leaf layer that applies one matrix to every head's features alone (a relative-position projection).

Some attentions view a column's output per head (``r.view(*shape, self.num_heads, -1)``)
and hand it to a small layer of their own that multiplies it by a parameter
(``relative_states @ self.proj``: the same ``[d, e]`` map for each head), then only moves
the result around per head (``transpose``, ``gather`` along the last dim, ``masked_fill``).
Such a layer works on whole heads, like a per-head norm: under head sharding each rank
runs it on its own heads with the whole (replicated) parameter, whose gradient the block
reduces. :func:`per_head_map` proves that from the flow and the layer's ``forward``:

- its data input is one column's output alone, viewed per head (``(..., heads, -1)`` with a head
  count read from a module attribute, or ``(..., -1, self.head_dim)``): its last dim is one head's
  features (``d``);
- every parameter is a matrix with ``d`` rows, used only as the right operand of a matmul
  whose left operand is the data input itself (``x @ self.p`` / ``torch.matmul(x, self.p)``);
- its other inputs carry no layer's output (positions, masks: ``in:`` markers);
- everything else the ``forward`` does to values computed from the product is elementwise
  or along the last dim: arithmetic, ``masked_fill``, ``clamp``, ``expand``, dtype casts,
  ``gather(-1, ...)``, and ``transpose`` of dims that are not the last (the per-head view
  of a ``[batch, seq]`` stream is 4-D, heads at dim 2: a transpose of dims 0-2 keeps the
  last dim the map's output); sizes read from it (``.shape``) are this rank's. Anything
  else (a reshape, a reduction, a subscript, a call taking it) refuses.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from hpgen.planner.derive.heads.per_head_params import view_sizes
from hpgen.planner.flow import Flow
from hpgen.planner.flow.runner import function_def
from hpgen.planner.model.modules import is_linear, out_features

__all__ = ["per_head_map"]

# methods of a value computed from the per-head product that keep each head's values to itself
_ELEMENTWISE = {"masked_fill", "clamp", "clamp_min", "clamp_max", "expand", "to", "float", "half", "type_as", "contiguous"}
_SIZES = {"shape", "dtype", "device", "ndim"}


def per_head_map(modules: Mapping[str, Any], fqn: str, flow: Flow) -> int | None:
    """The per-head feature size ``d`` when leaf ``fqn`` applies its parameters to each head's features alone.

    ``modules``: the model's modules by FQN; ``flow``: a run that calls ``fqn`` and its column.
    """
    module = modules.get(fqn)
    if module is None or any(True for _ in module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    if not params or any(p.dim() != 2 for p in params.values()):
        return None
    data = flow.inputs.get(fqn, set())
    columns = {o for o in data if o in flow.edges}
    if len(columns) != 1 or data - columns:
        return None
    others = flow.edges.get(fqn, set()) - data
    if any(not o.startswith("in:") for o in others):
        return None  # a layer's output reaches it other than as the per-head data
    (column,) = columns
    if not is_linear(modules.get(column)):
        return None
    sizes = view_sizes(flow, frozenset(data), out_features(modules[column]))
    size = next(iter(sizes)) if len(sizes) == 1 else None
    if size is None or any(p.shape[0] != size for p in params.values()):
        return None
    function = function_def(type(module), "forward")
    if function is None:
        return None
    positional = [a.arg for a in (*function.args.posonlyargs, *function.args.args)][1:]
    if not positional:
        return None
    try:
        _Body(positional[0], set(params)).run(function.body)
    except _NotPerHead:
        return None
    return size


class _NotPerHead(Exception):
    pass


class _Body:
    """Taint of the per-head product through a ``forward`` body; raises where it could mix heads."""

    def __init__(self, data: str, params: set[str]) -> None:
        self.data = data
        self.params = params
        self.tainted: set[str] = set()

    def run(self, body: list[ast.stmt]) -> None:
        for statement in body:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                continue  # the docstring
            if isinstance(statement, ast.Assign):
                tainted = self.value(statement.value)
                for target in statement.targets:
                    names = [target] if isinstance(target, ast.Name) else getattr(target, "elts", None)
                    if names is None or not all(isinstance(n, ast.Name) for n in names):
                        raise _NotPerHead  # a subscript or attribute assignment
                    for name in names:
                        if name.id == self.data:
                            raise _NotPerHead
                        (self.tainted.add if tainted else self.tainted.discard)(name.id)
            elif isinstance(statement, (ast.Return, ast.Expr)):
                if statement.value is not None:
                    self.value(statement.value)
            else:
                raise _NotPerHead  # branches, loops, augmented assignments: not followed

    def _param(self, node: ast.expr) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr in self.params
        )

    def _product(self, left: ast.expr, right: ast.expr) -> bool:
        return isinstance(left, ast.Name) and left.id == self.data and self._param(right)

    def value(self, node: ast.expr) -> bool:
        """Whether ``node`` is computed from the per-head product (raising where it would mix heads)."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult) and self._product(node.left, node.right):
            return True
        if isinstance(node, ast.Name):
            if node.id == self.data:
                raise _NotPerHead  # the data used other than as the left operand of the map
            return node.id in self.tainted
        if self._param(node):
            raise _NotPerHead  # the parameter used other than as the map
        if isinstance(node, ast.Constant):
            return False
        if isinstance(node, ast.Attribute):
            if node.attr in _SIZES:
                if not (isinstance(node.value, ast.Name) and node.value.id == self.data):
                    self.value(node.value)
                return False  # this rank's sizes
            if self.value(node.value):
                raise _NotPerHead  # ``.T``, ``.mT``: moves the last dim
            return False
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, ast.Subscript):
            if self.value(node.value):
                raise _NotPerHead  # indexes into the heads
            self.value(node.slice)
            return False
        if isinstance(node, ast.Starred):
            return self.value(node.value)
        if isinstance(node, (ast.BinOp, ast.BoolOp, ast.Compare, ast.UnaryOp, ast.Tuple, ast.List, ast.Slice)):
            return any([self.value(child) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr)])
        if any(isinstance(n, ast.Name) and (n.id == self.data or n.id in self.tainted) for n in ast.walk(node)):
            raise _NotPerHead
        return False

    def _call(self, node: ast.Call) -> bool:
        func = node.func
        args = [*node.args, *(k.value for k in node.keywords)]
        if isinstance(func, ast.Attribute) and func.attr == "matmul" and len(node.args) == 2 and not node.keywords:
            if self._product(node.args[0], node.args[1]):
                return True
        if isinstance(func, ast.Attribute) and func.attr in ("size", "dim"):
            if not (isinstance(func.value, ast.Name) and func.value.id == self.data):
                self.value(func.value)
            for arg in args:
                self.value(arg)
            return False
        receiver = self.value(func.value) if isinstance(func, ast.Attribute) else self.value(func)
        tainted_args = [self.value(arg) for arg in args]
        if not receiver:
            if any(tainted_args):
                raise _NotPerHead  # a function of the product (a softmax, a sum): may mix the heads
            return False
        method = func.attr  # type: ignore[union-attr]
        if method in _ELEMENTWISE:
            return True
        if method == "gather" and node.args and _const(node.args[0]) == -1:
            return True
        if method == "transpose" and len(node.args) == 2:
            dims = [_const(a) for a in node.args]
            if all(isinstance(d, int) and (0 <= d <= 2 or -4 <= d <= -2) for d in dims):
                return True
        raise _NotPerHead


def _const(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    return None
