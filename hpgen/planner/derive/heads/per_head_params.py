"""Matrices the code between a group's projections reads per head: a per-head scale, a map shared by the heads.

Attentions that view a column's output per head (``x.view(..., heads, d)``) may read small
matrices there themselves:

- a learned scale of one row per head, ``[heads, d]``, multiplied elementwise into the
  per-head view (``x * self.scale``, broadcast over ``[..., heads, d]``): this rank's heads
  take their rows, ``S(0)``;
- a map of each head's ``d`` features, ``[d, e]``, applied by a matmul (``x @ self.proj``):
  the same for every head, it stays whole (``R``) and its gradient is reduced;
- a weight with one dim of a column's channels (a dynamic convolution's static taps
  ``[kernel, channels]``): sharded on that dim like the channels.

How a parameter is used comes from its owner's ``forward`` (:func:`param_use`); the
per-head sizes ``d`` from the views of the columns' outputs (:func:`per_head_view`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

from hpgen.core.placement import REPLICATE, Placement, shard
from hpgen.planner.derive.column_layouts import last_dim
from hpgen.planner.derive.heads.attr_names import HEAD_DIM_ATTRS, HEADS_ATTRS, KV_HEADS_ATTRS
from hpgen.planner.flow import Flow
from hpgen.planner.flow.runner import function_def

__all__ = ["head_matrix_placement", "param_use", "per_head_view", "view_sizes"]

_CASTS = {"float", "half", "to", "type_as", "contiguous"}


def view_sizes(flow: Flow, receiver: frozenset[str] | set[str], width: int | None = None) -> set[int]:
    """Last-dim sizes ``d`` of the per-head ``view``/``reshape`` calls of exactly ``receiver``'s value.

    A view is per head when its last dim is a constant read from a head-size attribute
    (``self.head_dim``), or ``-1`` right after a head count read from a module attribute
    (``self.num_heads``; then ``d = width / heads``).
    """
    found: set[int] = set()
    for use in flow.shapes:
        if use.method not in ("view", "reshape") or use.receiver != frozenset(receiver):
            continue
        values = list(use.arg_vals[0].items) if len(use.arg_vals) == 1 and use.arg_vals[0].items else list(use.arg_vals)
        last = last_dim(use)
        if last is None or len(values) < 2:
            continue
        if isinstance(last.const, int) and last.const > 0 and _reads(last.reads, HEAD_DIM_ATTRS):
            found.add(last.const)
            continue
        heads = values[-2]
        if last.const == -1 and isinstance(heads.const, int) and heads.const > 0 and width and width % heads.const == 0:
            if _reads(heads.reads, (*HEADS_ATTRS, *KV_HEADS_ATTRS)):
                found.add(width // heads.const)
    return found


def per_head_view(flow: Flow, fqn: str, widths: dict[str, int]) -> int | None:
    """``d`` when leaf ``fqn``'s data input is a per-head view (of one column's output, ``widths`` by column)."""
    data = frozenset(flow.inputs.get(fqn, set()))
    layers = {o for o in data if not o.startswith(("in:", "param:"))}
    width = widths.get(next(iter(layers))) if len(layers) == 1 else None
    sizes = view_sizes(flow, data, width)
    return next(iter(sizes)) if len(sizes) == 1 else None


def param_use(model: Any, name: str) -> str | None:
    """``map`` (every read is ``x @ self.p``), ``scale`` (every read multiplies elementwise), else None.

    Read from the ``forward`` of the parameter's owner; casts (``self.p.float()``) are looked through.
    """
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    function = function_def(type(module), "forward")
    if function is None:
        return None
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(function):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    uses: set[str] = set()
    for node in ast.walk(function):
        if not (
            isinstance(node, ast.Attribute)
            and node.attr == leaf
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            continue
        current: ast.AST = node
        parent = parents.get(id(current))
        while (  # self.p.float(): the call's value is the parameter still
            isinstance(parent, ast.Attribute)
            and parent.attr in _CASTS
            and isinstance(call := parents.get(id(parent)), ast.Call)
            and call.func is parent
        ):
            current = parents[id(parent)]
            parent = parents.get(id(current))
        if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.MatMult) and parent.right is current:
            uses.add("map")
        elif isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Mult):
            uses.add("scale")
        else:
            uses.add("other")
    return next(iter(uses)) if len(uses) == 1 and "other" not in uses else None


def head_matrix_placement(
    model: Any, name: str, param: Any, heads: Iterable[int], sizes: set[int], mixed_widths: set[int]
) -> Placement | None:
    """``S(0)`` for a per-head scale, ``R`` for a map shared by the heads, ``S(d)`` for a channels dim, else None.

    ``heads``: the group's query and key/value head counts; ``sizes``: the per-head sizes of its
    columns' views; ``mixed_widths``: the widths of the plainly sharded columns the parameter is
    computed with.
    """
    if param.dim() != 2:
        return None
    rows, cols = param.shape
    use = param_use(model, name)
    if use == "scale" and rows in set(heads) and cols in sizes:
        return shard(0)
    if use == "map" and rows in sizes:
        return REPLICATE
    if use != "map":
        dims = [d for d, size in enumerate(param.shape) if size in mixed_widths]
        if len(dims) == 1 and param.shape[1 - dims[0]] not in mixed_widths:
            return shard(dims[0])
    return None


def _reads(reads: Iterable[tuple[str, str]], names: Iterable[str]) -> bool:
    wanted = set(names)
    return any(attr.rpartition(".")[2] in wanted for _, attr in reads)
