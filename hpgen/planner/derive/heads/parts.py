"""Heads split into parts that work together (differential attention): the cut that keeps each group whole.

DiffLlama's attention chunks its heads in two (``torch.chunk(attn_output, 2, dim=2)`` over
the query heads, ``torch.chunk(value_states, 2, dim=1)`` over the key/value heads) and
combines query head ``i`` with head ``i + H/2``, value heads likewise. A rank holding
contiguous heads would hold half-groups. With the heads in ``k`` equal parts, rank ``r``
must hold the ``r``-th chunk of *every* part, which is ``SS(0,k)`` on each column
projection (its rows are the heads in order). Then, on every rank:

- ``chunk(k)`` over the local heads gives the ``r``-th chunk of each global part, and a
  ``repeat`` of a part along the heads copies it whole, as it does globally;
- grouped-query attention pairs local query head ``j`` with local key/value head
  ``j // groups`` exactly as the global code does part by part, when each part's key/value
  heads (``K/k``) divide over ``--tp``; where each part has a single key/value head
  (``K == k``) every rank needs all of them: the key/value projections are replicated
  (``RS(0,tp)``, their gradients summed) and ``num_key_value_groups`` is divided by ``tp``;
- the parts are combined element by element, so the row projection's input holds each
  group's features together and a rank's groups are contiguous: plain ``S(1)``.

Which dim of which call holds the heads is read from a forward on the meta device
(:func:`traced_calls`: shapes only, a batch and a sequence length that no head count is
mistaken for), matched to the reshapes of the source's dataflow by line. A concatenation
of the parts back along the heads (whose row input would be ``SS(1,k)``), a
``repeat_interleave`` over the heads, unequal parts, or parts whose heads do not divide
as above are refused.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpgen.core.placement import shard, strided_shard
from hpgen.planner.derive.column_layouts import ColumnLayout, dim_of, packed, replicated
from hpgen.planner.derive.derive_context import DeriveContext
from hpgen.planner.derive.heads.counts import Heads
from hpgen.planner.derive.heads.input_dims import TracedCall, meta_forward, probe_sizes
from hpgen.planner.derive.placed import Refused
from hpgen.planner.derive.projection_groups import Group
from hpgen.planner.model.modules import in_features, lca, out_features, relative

__all__ = ["Parts", "head_parts", "token_splits", "traced_calls"]

SPLITS = ("chunk", "split", "tensor_split")
JOINS = ("cat", "concat", "concatenate")
TRACED = (*SPLITS, *JOINS, "repeat_interleave")
SIZE_KEYWORDS = ("chunks", "split_size", "split_size_or_sections", "sections", "indices_or_sections", "repeats")


@dataclass
class Parts:
    """The heads of one attention group in ``k`` parts, and the placements that keep each group whole."""

    k: int
    lines: set[tuple[str, int]] = field(default_factory=set)  # (module FQN, line) of the splits over the heads
    layouts: dict[str, ColumnLayout] = field(default_factory=dict)  # column -> packed(k) | replicated(tp)
    divide: dict[str, set[str]] = field(default_factory=dict)  # module FQN -> attributes divided by tp
    why: str = ""


def head_parts(ctx: DeriveContext, group: Group, heads: Heads | None) -> Parts | None:
    """The parts of an attention group whose code splits its heads, or None when it splits none."""
    flow, cols, rows, layer = group.flow, group.cols, group.rows, group.layer
    if heads is None or not any(_may_split_heads(use, cols) for use in flow.shapes):
        return None
    q, kv, head_dim = heads
    common = lca(cols | rows)
    calls = _traced(ctx, q)
    if calls is None:
        return None  # the model does not run on the meta device: the reshape rules decide alone
    static = {(use.module, use.line) for use in flow.shapes if use.receiver & cols and use.method in SPLITS}
    inside = [c for c in calls if c.module == common or c.module.startswith(common + ".")]
    batch, length = probe_sizes(q)
    sizes = {q, kv}
    found: dict[tuple[str, int], int] = {}
    for call in inside:
        if call.op not in SPLITS or (call.module, call.line) not in static or call.dim in (None, 0):
            continue
        size = call.shapes[0][call.dim]
        if size not in sizes:
            continue
        where = f"{relative(call.module, layer) or 'the layer'} (line {call.line})"
        last = call.dim == len(call.shapes[0]) - 1
        if last and size == head_dim:
            continue  # the features of each head (the heads come before them)
        if size in (batch, length) or last:
            raise Refused(f"{where} {call.op}s a dim of size {size}: hpgen cannot tell whether it holds the heads")
        if call.parts is None or call.parts < 2:
            raise Refused(f"{where} splits the heads into unequal parts: no placement keeps each share whole")
        found[(call.module, call.line)] = call.parts
    if not found:
        return None
    if len(set(found.values())) > 1:
        counts = sorted(set(found.values()))
        raise Refused(f"the attention splits its heads into different numbers of parts {counts}")
    k = next(iter(found.values()))
    lines = ", ".join(str(line) for _, line in sorted(found))
    for call in inside:
        if call.dim is None or call.dim == len(call.shapes[0]) - 1:
            continue
        where = f"{relative(call.module, layer) or 'the layer'} (line {call.line})"
        if call.op in JOINS and sum(s[call.dim] for s in call.shapes) in sizes:
            raise Refused(
                f"{where} concatenates parts of the heads back along the heads (split at line {lines}): the row "
                "projection's input would be strided, which the derivation does not place"
            )
        if call.op == "repeat_interleave" and call.shapes[0][call.dim] in sizes | {q // k, kv // k}:
            raise Refused(f"{where} interleaves copies of the heads, which a strided cut of the parts breaks")
    return _parts_layouts(ctx, group, heads, k, set(found), lines)


def _parts_layouts(
    ctx: DeriveContext, group: Group, heads: Heads, k: int, lines: set[tuple[str, int]], at: str
) -> Parts:
    q, kv, head_dim = heads
    modules, cols, rows, layer = ctx.modules, group.cols, group.rows, group.layer
    tp = ctx.tp or 1
    if q % k or kv % k:
        raise Refused(f"{q} query and {kv} key/value heads do not split into the code's {k} parts (line {at})")
    if (q // k) % tp:
        raise Refused(
            f"the attention splits its {q} query heads into {k} parts (line {at}) whose {q // k} heads each do not "
            f"divide over --tp {tp}: a rank would hold part of a group"
        )
    if (kv // k) % tp == 0:
        kv_layout = packed(k)
    elif kv == k:
        kv_layout = replicated(tp)
    else:
        raise Refused(
            f"the attention splits its {kv} key/value heads into {k} parts (line {at}); {kv // k} per part neither "
            f"divide over --tp {tp} nor are one per part (which every rank could hold whole)"
        )
    parts = Parts(k, lines)
    for col in sorted(cols):
        n = out_features(modules[col])
        if n == q * head_dim:
            parts.layouts[col] = packed(k)
        elif n == kv * head_dim:
            parts.layouts[col] = kv_layout
        else:
            raise Refused(
                f"{relative(col, layer)} has {n} features, neither the query nor the key/value heads, in an "
                f"attention whose heads are split into {k} parts"
            )
    for row in sorted(rows):
        if in_features(modules[row]) != q * head_dim:
            raise Refused(f"{relative(row, layer)} does not read the {q} query heads' features")
    why = (
        f"the heads are split into {k} parts that work together (line {at}): each rank keeps its chunk of every "
        f"part ({strided_shard(0, k)}), whole groups, whose combined outputs reach the row projection contiguously "
        f"({shard(1)})"
    )
    if kv_layout.replicated:
        common = lca(cols | rows)
        module = modules.get(common)
        groups = getattr(module, "num_key_value_groups", None)
        if not isinstance(groups, int) or isinstance(groups, bool) or groups % tp:
            raise Refused(
                f"each of the {k} parts has one key/value head, which every rank needs, and "
                f"{relative(common, layer) or 'the layer'} has no num_key_value_groups dividing over --tp {tp}"
            )
        parts.divide[common] = {"num_key_value_groups"}
        why += f"; one key/value head per part, on every rank ({kv_layout.placement(0)}), num_key_value_groups divided"
    parts.why = why
    return parts


def token_splits(ctx: DeriveContext, group: Group, heads: Heads | None) -> frozenset[tuple[str, int]]:
    """``(module, line)`` of the group's splits that one meta-device forward shows cutting the batch or the
    sequence, not the heads (transformers 5.25's KimiDeltaAttention: ``tensor_split(query, [n], dim=1)`` of a
    ``(batch, seq, heads, head_dim)`` value at the cached positions): they say nothing of the heads' layout."""
    if heads is None or not any(_may_split_heads(use, group.cols) for use in group.flow.shapes):
        return frozenset()
    q, kv, _ = heads
    calls = _traced(ctx, q)
    if calls is None:
        return frozenset()
    tokens = set(probe_sizes(q)) - {q, kv}
    return frozenset(
        (call.module, call.line)
        for call in calls
        if call.op in SPLITS and call.dim is not None and call.shapes[0][call.dim] in tokens
    )


def _traced(ctx: DeriveContext, heads: int) -> list[TracedCall] | None:
    """The calls of one meta-device forward sized for ``heads`` query heads (one forward per count, cached)."""
    if heads not in ctx.traced:
        try:
            ctx.traced[heads] = traced_calls(ctx.model, heads)
        except RuntimeError:
            ctx.traced[heads] = None
    return ctx.traced[heads]


def _may_split_heads(use: Any, cols: frozenset[str]) -> bool:
    """A split of a value computed from the columns along a constant dim other than the last one."""
    if use.method not in SPLITS or not use.receiver & cols:
        return False
    dim = dim_of(use)
    return dim is not None and dim != -1


def traced_calls(model: Any, heads: int) -> list[TracedCall]:
    """The splits, joins and ``repeat_interleave`` calls of one forward of ``model`` on the meta device.

    ``RuntimeError`` where the model does not run there (see :func:`~hpgen.planner.derive.heads.input_dims.meta_forward`).
    """
    from torch.overrides import TorchFunctionMode

    names = {id(m): n for n, m in model.named_modules()}
    found: list[TracedCall] = []

    class _Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Mapping | None = None) -> Any:
            kwargs = dict(kwargs or {})
            op = getattr(func, "__name__", "")
            if op in TRACED:
                call = _call(op, args, kwargs, names)
                if call is not None:
                    found.append(call)
            return func(*args, **kwargs)

    batch, length = probe_sizes(heads)
    with _Record():
        meta_forward(model, batch, length)
    return found


def _call(op: str, args: tuple, kwargs: Mapping[str, Any], names: Mapping[int, str]) -> TracedCall | None:
    """The record of one call, made by the nearest caller frame whose ``self`` is a module of the model."""
    import torch

    frame = sys._getframe(2)  # past __torch_function__: the code that made the call
    while frame is not None and not isinstance(frame.f_locals.get("self"), torch.nn.Module):
        frame = frame.f_back
    if frame is None or id(frame.f_locals["self"]) not in names:
        return None
    module, line = names[id(frame.f_locals["self"])], frame.f_lineno
    if op in JOINS:
        tensors = args[0] if args else kwargs.get("tensors", ())
        shapes = tuple(tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor))
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        second = None
    else:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        shapes = (tuple(args[0].shape),)
        default = None if op == "repeat_interleave" else 0
        dim = args[2] if len(args) > 2 else kwargs.get("dim", default)
        second = args[1] if len(args) > 1 else next((kwargs[k] for k in SIZE_KEYWORDS if k in kwargs), None)
    if not shapes or not isinstance(dim, int):
        return TracedCall(module, line, op, shapes, None, None)
    rank = len(shapes[0])
    dim = dim + rank if dim < 0 else dim
    if not 0 <= dim < rank:
        return TracedCall(module, line, op, shapes, None, None)
    parts = _equal_parts(op, shapes[0][dim], second) if op in SPLITS else None
    return TracedCall(module, line, op, shapes, dim, parts)


def _equal_parts(op: str, size: int, second: Any) -> int | None:
    """The number of equal parts a split of ``size`` elements makes, or None for unequal ones."""
    if op == "chunk" and isinstance(second, int) and second > 0:
        return second if size % second == 0 else None
    if op == "split" and isinstance(second, int) and second > 0:
        return size // second if size % second == 0 else None
    if op == "tensor_split" and isinstance(second, int) and second > 0:
        return second if size % second == 0 else None
    if isinstance(second, (list, tuple)) and op == "split" and second and len(set(second)) == 1:
        return len(second)
    return None
