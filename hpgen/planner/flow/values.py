"""The abstract values of the dataflow run, and what one run records (:class:`Flow`).

A :class:`Val` is the set of origins a value was computed from (leaf layers, ``in:<name>``
markers for ``forward`` parameters, ``param:<fqn>`` for parameters read directly), with
tuple items, attribute reads and module references kept where the code needs them;
:func:`union` mixes values and :func:`merge` joins two branches.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EMPTY",
    "MAX_DEPTH",
    "SIZE",
    "UNKNOWN",
    "Flow",
    "ShapeUse",
    "Val",
    "as_items",
    "loop_element",
    "merge",
    "method_name",
    "nothing",
    "size_of",
    "union",
]

MAX_DEPTH = 24  # how deep a run follows calls of interpreted modules and functions

UNKNOWN = object()  # a constant the interpreter cannot know (a branch test that takes both branches)


@dataclass(frozen=True)
class Val:
    """An abstract value: the origins it depends on, tuple items, attribute reads, or a module reference.

    ``reads`` are ``(module_fqn, attribute_path)`` pairs of module attributes the value's
    expression read (``self.num_heads`` -> ``("model.layers.0.self_attn", "num_heads")``),
    kept for integers that size a reshape. ``modules`` is set for a reference to child
    modules (``self.q_proj``, the elements of ``self.experts``), which only calls use.
    """

    origins: frozenset[str] = frozenset()
    items: tuple[Val, ...] | None = None
    reads: frozenset[tuple[str, str]] = frozenset()
    modules: tuple[str, ...] | None = None
    const: Any = None  # the Python value of a size expression, when module attributes decide it

    def whole(self) -> frozenset[str]:
        """Every origin, the items' included."""
        if self.items is None:
            return self.origins
        found = set(self.origins)
        for item in self.items:
            found |= item.whole()
        return frozenset(found)

    def all_reads(self) -> frozenset[tuple[str, str]]:
        if self.items is None:
            return self.reads
        found = set(self.reads)
        for item in self.items:
            found |= item.all_reads()
        return frozenset(found)

    def item(self, index: int) -> Val:
        if self.items is not None and -len(self.items) <= index < len(self.items):
            return self.items[index]
        return Val(self.whole(), reads=self.all_reads())


EMPTY = Val()


def union(values: Iterable[Val]) -> Val:
    """One value depending on everything the given values depend on (tuple structure dropped)."""
    origins: set[str] = set()
    reads: set[tuple[str, str]] = set()
    for value in values:
        origins |= value.whole()
        reads |= value.all_reads()
    # Reads matter only for sizes (``self.num_heads * self.head_dim``); a tensor drops them.
    return Val(frozenset(origins), reads=frozenset() if origins else frozenset(reads))


def merge(a: Val, b: Val) -> Val:
    """Join of two branches: item-wise where both are tuples of one length."""
    if a is b:
        return a
    if a.items is not None and b.items is not None:
        # a tuple of either length: item i merges both where both have it (``outputs += (attn_weights,)``)
        longer = a.items if len(a.items) >= len(b.items) else b.items
        common = tuple(merge(x, y) for x, y in zip(a.items, b.items))
        return Val(a.origins | b.origins, common + longer[len(common) :], a.reads | b.reads)
    if a.modules is not None and b.modules is not None:
        return Val(modules=tuple(dict.fromkeys((*a.modules, *b.modules))))
    if a.modules is not None and not b.whole():
        return a
    if b.modules is not None and not a.whole():
        return b
    return union((a, b))


@dataclass(frozen=True)
class ShapeUse:
    """One reshape-like call: where, on what, and with which size arguments."""

    module: str  # FQN of the module whose code made the call
    method: str  # view, reshape, split, chunk, ...
    receiver: frozenset[str]  # origins of the tensor reshaped
    args: tuple[ast.expr, ...]
    arg_vals: tuple[Val, ...]
    line: int
    dim: int | None = None  # a constant ``dim=`` keyword


@dataclass
class Flow:
    """What one abstract run found."""

    edges: dict[str, set[str]] = field(default_factory=dict)  # leaf FQN -> origins of its inputs
    inputs: dict[str, set[str]] = field(default_factory=dict)  # leaf FQN -> origins of its first (data) input
    leaf_calls: dict[str, int] = field(default_factory=dict)  # leaf FQN -> how many call sites
    shapes: list[ShapeUse] = field(default_factory=list)
    allocations: list[ShapeUse] = field(default_factory=list)  # torch.zeros(sizes, ...): states built from sizes
    raw_params: dict[str, set[str]] = field(default_factory=dict)  # module FQN -> parameters its code reads
    config_reads: dict[str, set[str]] = field(default_factory=dict)  # module FQN -> config.<attr> its code reads
    modules_run: set[str] = field(default_factory=set)  # modules whose forward in the source was interpreted
    result: Val = EMPTY
    first_input: str | None = None  # the first forward parameter of the module run (the residual stream)
    unsupported: list[str] = field(default_factory=list)


SIZE = "size"  # the module part of a read that records a tensor's size, not an attribute


def size_of(value: Val) -> Val:
    """``x.shape`` / ``x.size()``: no data, but it remembers whose size it is (``bsz, len, dim = x.size()``)."""
    origins = value.whole()
    return Val(reads=frozenset({(SIZE, ",".join(sorted(origins)))})) if origins else EMPTY


def nothing(value: Val) -> bool:
    return value.items is None and value.modules is None and not value.origins


def as_items(value: Val) -> tuple[Val, ...]:
    """The items a tuple gains from ``+ value``: its items, nothing for an empty value, else one unknown rest."""
    if value.items is not None:
        return value.items
    return () if nothing(value) else (union([value]),)


def loop_element(iterated: Val) -> Val:
    """What a loop over ``iterated`` binds: each module of a module list, or the mixed value."""
    if iterated.modules is not None:
        return iterated  # calls on it call each element (see Frame._Call)
    return union([iterated])


def method_name(value: Val) -> str | None:
    for _, path in value.reads:
        if path.startswith("method:"):
            return path[len("method:") :].rpartition(".")[2]
    return None
