"""The plain data a validated plan becomes (:class:`Plan`, its :class:`Entry` objects), and what they answer.

Built by :mod:`hpgen.core.plan_reader` from a plan document; read by the generator, the
runtime and the planner. Needs nothing beyond the standard library.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from hpgen.core.placement import REPLICATE, Placement
from hpgen.core.plan_names import fqn_matches
from hpgen.core.shards import ShardLayout, block_ranges

__all__ = [
    "LAYOUT_KEYS",
    "PLAN_FORMAT",
    "PLAN_FORMATS",
    "PLAN_FORMAT_2",
    "Entry",
    "FunctionRef",
    "Injection",
    "Layout",
    "LocalCount",
    "PipelineStages",
    "Plan",
    "SummedBranch",
    "SummedReduction",
    "body_is_sharded",
    "contract_signature",
    "iter_layouts",
    "summed_branches",
]

LAYOUT_KEYS = ("in_src", "in_dst", "out_src", "out_dst")  # an entry's four layout maps, in document order

PLAN_FORMAT = "hpgen.plan/1"
# The first format with whole-unit placements (S(d,u), S(d,u,g), B(...)) and local_attrs. A plan
# that uses none of them is written as PLAN_FORMAT, byte for byte as before.
PLAN_FORMAT_2 = "hpgen.plan/2"
PLAN_FORMATS = (PLAN_FORMAT, PLAN_FORMAT_2)


@dataclass(frozen=True)
class Layout:
    """A tensor's placement on every mesh axis (axes the plan omits are ``R``)."""

    placements: tuple[tuple[str, Placement], ...]

    def on(self, axis: str) -> Placement:
        for name, placement in self.placements:
            if name == axis:
                return placement
        return REPLICATE

    @staticmethod
    def same(axes: Iterable[str], placement: Placement) -> Layout:
        """``placement`` on each of ``axes``, in their order."""
        return Layout(tuple((axis, placement) for axis in axes))

    def with_axis(self, axis: str, placement: Placement) -> Layout:
        """This layout with ``placement`` on ``axis``: replaced where it names the axis, else added last."""
        if all(name != axis for name, _ in self.placements):
            return Layout((*self.placements, (axis, placement)))
        return Layout(tuple((name, placement if name == axis else old) for name, old in self.placements))

    def document(self) -> dict[str, str]:
        """The layout as a plan document writes it: axis -> placement text, for the axes it names."""
        return {axis: str(placement) for axis, placement in self.placements}

    def __str__(self) -> str:
        return ", ".join(f"{axis} {placement}" for axis, placement in self.placements)


@dataclass(frozen=True)
class FunctionRef:
    """A dotted path to a callable plus keyword arguments (``_target_`` style)."""

    path: str
    kwargs: tuple[tuple[str, str], ...] = ()  # (name, JSON text) pairs, sorted

    def kwargs_dict(self) -> dict[str, object]:
        return {name: json.loads(value) for name, value in self.kwargs}


@dataclass(frozen=True)
class Injection:
    """A local compute function that replaces a boundary's body (the region form)."""

    match: str
    local_compute_fn: FunctionRef
    inner_wrapper: FunctionRef | None = None


@dataclass(frozen=True)
class PipelineStages:
    """The plan's ``pipeline``: the mesh axis whose ranks are pipeline stages, and each stage's modules.

    ``stages[i]`` are the module FQNs stage ``i`` keeps (ranges already expanded:
    ``model.layers.0-3`` is four FQNs). A module no stage names and that lies under none
    of them is kept by every stage (parameterless helpers such as a rotary embedding).
    """

    axis: str
    stages: tuple[tuple[str, ...], ...]

    def stage_of(self, fqn: str) -> int | None:
        """The stage holding ``fqn`` or a module above it; None for a module no stage names."""
        for index, modules in enumerate(self.stages):
            if any(fqn == name or fqn.startswith(name + ".") for name in modules):
                return index
        return None

    def document(self) -> dict[str, object]:
        """The ``pipeline`` value a plan document writes (consecutive indices as ``PREFIX.A-B``)."""
        return {"axis": self.axis, "stages": [compact_stage(modules) for modules in self.stages]}


def expand_stage_item(item: str) -> tuple[str, ...] | None:
    """``model.layers.0-3`` -> the four FQNs; a plain FQN -> itself; None for a range that is not one."""
    prefix, _, last = item.rpartition(".")
    if "-" not in last:
        return (item,)
    first, _, end = last.partition("-")
    if not (first.isdigit() and end.isdigit() and first.isascii() and end.isascii()) or int(end) < int(first):
        return None
    return tuple(f"{prefix}.{index}" if prefix else str(index) for index in range(int(first), int(end) + 1))


def compact_stage(modules: Iterable[str]) -> list[str]:
    """FQNs with runs of consecutive indices under one prefix written as ``PREFIX.A-B``."""
    result: list[str] = []
    run: tuple[str, int, int] | None = None
    for name in modules:
        prefix, _, last = name.rpartition(".")
        if last.isdigit() and run is not None and run[0] == prefix and int(last) == run[2] + 1:
            run = (prefix, run[1], int(last))
            continue
        if run is not None:
            result.append(_run_text(*run))
        run = (prefix, int(last), int(last)) if last.isdigit() else None
        if run is None:
            result.append(name)
    if run is not None:
        result.append(_run_text(*run))
    return result


def _run_text(prefix: str, first: int, last: int) -> str:
    head = f"{prefix}." if prefix else ""
    return f"{head}{first}" if first == last else f"{head}{first}-{last}"


@dataclass(frozen=True)
class SummedReduction:
    """A parallel-residual block whose two branches' partial outputs are reduced once, summed.

    ``branches``: the two child modules (paths relative to the block) whose outputs the
    block's body adds; their entries leave those outputs ``P(sum)``. ``shared_input``: the
    child whose output both branches read (the norm before them), where their input's
    transition runs once; None when each branch keeps its own. ``paired_input``: where the
    second branch reads a second norm of the same block input (GPT-NeoX's two layer
    norms), that norm: ``shared_input``'s hook computes its output too and moves both
    through one collective (one reduction of both partial gradients in backward).
    """

    branches: tuple[str, str]
    shared_input: str | None = None
    paired_input: str | None = None


@dataclass(frozen=True)
class LocalCount:
    """A ``local_attrs`` value: an int attribute's value on each rank, read from its shards.

    How many whole units of ``unit`` elements this rank holds of dim ``dim`` of parameter
    ``of`` (of block ``block`` of it, when that dim is laid out ``B``), times ``times`` (the
    query heads of whole key/value groups: 16 per group of Falcon-40B's fused projection);
    with ``per``, that count divided by ``per``'s (query heads per key/value head). Every
    division must be exact.
    """

    of: str
    dim: int
    unit: int = 1
    block: int | None = None
    per: LocalCount | None = None
    times: int = 1

    def value(self, shard_of: Callable[[str], ShardLayout]) -> int:
        """The value on the rank whose shard of each named parameter ``shard_of`` gives; ``ValueError``
        saying why where a count does not divide or the parameter has no such dim or block."""
        count = self._count(shard_of)
        if self.per is None:
            return count
        per = self.per.value(shard_of)
        if per == 0 or count % per:
            raise ValueError(f"{self.describe()}: {count} over {self.per.describe()} = {per} does not divide")
        return count // per

    def _count(self, shard_of: Callable[[str], ShardLayout]) -> int:
        layout = shard_of(self.of)
        ndim = len(layout.shape)
        if not -ndim <= self.dim < ndim:
            raise ValueError(f"{self.of} has no dim {self.dim} (shape {layout.shape})")
        dim = self.dim % ndim
        start, stop = 0, layout.shape[dim]
        if self.block is not None:
            blocks = [p for p in layout.placements if p.kind == "B" and p.dim is not None and p.dim % ndim == dim]
            if not blocks:
                raise ValueError(f"{self.of} dim {dim} is not laid out in blocks (B), so it has no block {self.block}")
            ranges = block_ranges(blocks[0])
            if not 0 <= self.block < len(ranges):
                raise ValueError(f"{self.of} dim {dim} has {len(ranges)} blocks ({blocks[0]}), no block {self.block}")
            start, stop = ranges[self.block][0]
        held = layout.held_count(dim, start, stop)
        if held % self.unit:
            raise ValueError(f"{self.describe()}: this rank holds {held} elements, not whole units of {self.unit}")
        return held // self.unit * self.times

    def describe(self) -> str:
        """The count in words, for messages: ``q_proj.weight dim 0 in units of 128``."""
        block = f" block {self.block}" if self.block is not None else ""
        unit = f" in units of {self.unit}" if self.unit > 1 else ""
        times = f" times {self.times}" if self.times > 1 else ""
        return f"{self.of} dim {self.dim}{block}{unit}{times}"

    def document(self) -> dict[str, object]:
        """The spec as a plan document writes it."""
        doc: dict[str, object] = {"of": self.of, "dim": self.dim}
        if self.unit != 1:
            doc["unit"] = self.unit
        if self.block is not None:
            doc["block"] = self.block
        if self.times != 1:
            doc["times"] = self.times
        if self.per is not None:
            doc["per"] = self.per.document()
        return doc

    def params(self) -> tuple[str, ...]:
        """The parameters it reads."""
        return (self.of, *(self.per.params() if self.per else ()))


@dataclass(frozen=True)
class Entry:
    """One ``param_plan`` entry: the contract of the boundaries its key matches."""

    key: str
    in_src: Mapping[str, Layout]
    in_dst: Mapping[str, Layout]
    out_src: Mapping[str, Layout]
    out_dst: Mapping[str, Layout]
    out_names: tuple[str, ...] | None
    params: Mapping[str, Layout]
    deferred_bias_params: tuple[str, ...] = ()
    grad_reduce_params: tuple[str, ...] = ()
    # (parameter, axes) where the plan names the axes its gradient is summed over; the others
    # of grad_reduce_params sum over every axis the body is sharded on
    grad_reduce_axes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # outputs whose caller computes on shards with them (Mamba's reduced x_proj output feeding the
    # channel-sharded scan): their gradient arrives partial, so the output's collective reduces it too
    out_grad_partial: tuple[str, ...] = ()
    # inputs whose gradient leaves the body partial: the caller reduces it (a summed
    # reduction's branches, whose shared input's transition runs once, on the norm's output)
    in_grad_partial: tuple[str, ...] = ()
    summed_reduction: SummedReduction | None = None
    tp_divide_attrs: tuple[str, ...] = ()
    divide_attrs: tuple[tuple[str, int], ...] = ()  # (attribute, divisor), sorted by attribute
    local_attrs: tuple[tuple[str, LocalCount], ...] = ()  # (attribute, its per-rank count), sorted by attribute
    is_boundary: bool = True
    region_dispatch: bool = False
    skip_source_lowering: bool = False

    @property
    def input_names(self) -> tuple[str, ...]:
        """Declared inputs, sorted so that output does not depend on key order."""
        return tuple(sorted({*self.in_src, *self.in_dst}))

    @property
    def output_names(self) -> tuple[str, ...]:
        """Declared outputs in return order: ``out_names``, or the single out key."""
        if self.out_names is not None:
            return self.out_names
        return tuple(sorted({*self.out_src, *self.out_dst}))

    def input_layouts(self, name: str, mesh: tuple[str, ...]) -> tuple[Layout, Layout]:
        """(caller's layout, body's layout) of input ``name``."""
        return self.in_src.get(name, _replicated(mesh)), self.in_dst.get(name, _replicated(mesh))

    def output_layouts(self, name: str, mesh: tuple[str, ...]) -> tuple[Layout, Layout]:
        """(body's layout, caller's layout) of output ``name``."""
        return self.out_src.get(name, _replicated(mesh)), self.out_dst.get(name, _replicated(mesh))


@dataclass(frozen=True)
class Plan:
    """A validated plan. Entries are keyed by FQN pattern and kept in sorted order."""

    mesh_dim_names: tuple[str, ...]
    entries: Mapping[str, Entry]
    model_class: str | None = None
    boundary_classes: Mapping[str, str] = field(default_factory=dict)
    injections: tuple[Injection, ...] = ()
    pipeline: PipelineStages | None = None  # pipeline stages over a mesh axis (docs/pipeline.md)
    name: str = "<plan>"
    sha256: str = ""
    planned_for: Mapping[str, int] = field(default_factory=dict)  # axis -> the size hpgen plan wrote it for

    def sizes_apart(self, sizes: Mapping[str, int]) -> list[tuple[str, int, int]]:
        """(axis, planned size, size in ``sizes``) of each axis whose size differs from the one the plan was written for."""
        return [
            (axis, planned, sizes[axis])
            for axis, planned in self.planned_for.items()
            if axis in sizes and sizes[axis] != planned
        ]

    def entry_for(self, fqn: str) -> Entry | None:
        """The entry whose key matches a concrete module FQN (at most one, by validation)."""
        for key, entry in self.entries.items():
            if fqn_matches(key, fqn):
                return entry
        return None

    def injection_for(self, key: str) -> Injection | None:
        """The injection whose ``match`` covers the entry key ``key``."""
        for injection in self.injections:
            if fqn_matches(injection.match, key):
                return injection
        return None

    def digest(self) -> str:
        """sha256 of what the plan says, whatever its file's formatting, key order or name."""
        return hashlib.sha256(_canonical_text(self).encode()).hexdigest()

    def required_format(self) -> str:
        """The oldest format that holds this plan: ``hpgen.plan/2`` where a parameter is laid out in whole
        units or blocks, or an entry has ``local_attrs``; else ``hpgen.plan/1``."""
        for entry in self.entries.values():
            if entry.local_attrs or any(
                placement.whole_units for layout in entry.params.values() for _, placement in layout.placements
            ):
                return PLAN_FORMAT_2
        return PLAN_FORMAT

    def boundary_class_for(self, key: str) -> str | None:
        """The class that ``boundary_classes`` names for an entry key, if any."""
        if key in self.boundary_classes:
            return self.boundary_classes[key]
        for pattern, class_name in self.boundary_classes.items():
            if fqn_matches(pattern, key):
                return class_name
        return None


def _canonical_text(plan: Plan) -> str:
    def plain(value: object) -> object:
        if isinstance(value, Placement):
            return str(value)
        if hasattr(value, "__dataclass_fields__"):
            return {name: plain(getattr(value, name)) for name in sorted(value.__dataclass_fields__)}
        if isinstance(value, Mapping):
            return {str(key): plain(item) for key, item in sorted(value.items())}
        if isinstance(value, (tuple, list)):
            return [plain(item) for item in value]
        return value

    fields = {name: plain(getattr(plan, name)) for name in sorted(plan.__dataclass_fields__)}
    del fields["name"], fields["sha256"]  # where it came from, not what it says
    if fields["pipeline"] is None:  # a plan without stages hashes as it did before stages existed
        del fields["pipeline"]
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def _replicated(mesh: tuple[str, ...]) -> Layout:
    return Layout(tuple((axis, REPLICATE) for axis in mesh))


def iter_layouts(entry: Entry) -> Iterator[tuple[str, str, Layout]]:
    """Every (part, name, layout) of an entry's in/out layouts, in a stable order."""
    for part in LAYOUT_KEYS:
        layouts = getattr(entry, part)
        for name in sorted(layouts):
            yield part, name, layouts[name]


@dataclass(frozen=True)
class SummedBranch:
    """One branch of a summed block: its entry key and the partial output the block adds."""

    path: str  # relative to the block
    key: str  # the branch's param_plan key
    output: str


def summed_branches(entries: Mapping[str, Entry], mesh: tuple[str, ...], key: str) -> tuple[str, tuple[SummedBranch, ...]]:
    """(the axis of the single reduction, both branches) of the summed block ``key``.

    Raises ``ValueError`` saying what is wrong: a branch without an entry, an output that is
    not left ``P(sum)``, branches partial on different axes.
    """
    summed = entries[key].summed_reduction
    assert summed is not None
    found, axes = [], set()
    for path in summed.branches:
        fqn = f"{key}.{path}"
        matching = [other for other in entries if fqn_matches(other, fqn)]
        if not matching:
            raise ValueError(f"branch {path!r}: no param_plan entry matches {fqn!r}")
        entry = entries[matching[0]]
        partial = []
        for name in entry.output_names:
            src, dst = entry.output_layouts(name, mesh)
            on = [axis for axis in mesh if src.on(axis).is_partial]
            if on:
                partial.append((name, on, dst))
        if len(partial) != 1 or len(partial[0][1]) != 1:
            raise ValueError(f"branch {path!r} ({matching[0]!r}) needs exactly one output P(sum) on one axis")
        name, (axis,), dst = partial[0]
        if str(entry.output_layouts(name, mesh)[0].on(axis)) != "P(sum)" or str(dst.on(axis)) != "P(sum)":
            raise ValueError(
                f"branch {path!r} ({matching[0]!r}): output {name!r} must stay P(sum) on {axis} (out_src and "
                "out_dst), the block reduces it"
            )
        axes.add(axis)
        found.append(SummedBranch(path, matching[0], name))
    if len(axes) != 1:
        raise ValueError(f"the branches are partial on different axes ({', '.join(sorted(axes))})")
    return axes.pop(), tuple(found)


def contract_signature(plan: Plan, key: str) -> str:
    """A canonical text of what a boundary's ``forward`` depends on (``params`` aside).

    Generated classes carry it as ``_hp_contract``; the runtime recomputes it from the
    plan to refuse a generated file that no longer matches (a stale file). Boundaries
    with equal signatures share one generated ``forward``.
    """
    entry = plan.entries[key]
    mesh = plan.mesh_dim_names
    parts = []
    for name in entry.input_names:
        src, dst = entry.input_layouts(name, mesh)
        partial = " (gradient partial)" if name in entry.in_grad_partial else ""
        parts.append(f"in {name}: " + ", ".join(f"{a} {src.on(a)}->{dst.on(a)}" for a in mesh) + partial)
    for name in entry.output_names:
        src, dst = entry.output_layouts(name, mesh)
        partial = " (gradient partial)" if name in entry.out_grad_partial else ""
        parts.append(f"out {name}: " + ", ".join(f"{a} {src.on(a)}->{dst.on(a)}" for a in mesh) + partial)
    sharded = [axis for axis in mesh if body_is_sharded(entry, axis)]
    if sharded:
        parts.append("sharded body: " + ", ".join(sharded))
    if entry.out_names is not None:
        parts.append("out_names: " + ", ".join(entry.out_names))
    if entry.summed_reduction is not None:
        summed = entry.summed_reduction
        shared = f" from {summed.shared_input}" if summed.shared_input else ""
        shared += f" paired with {summed.paired_input}" if summed.paired_input else ""
        parts.append(f"summed reduction: {' + '.join(summed.branches)}{shared}")
    injection = plan.injection_for(key)
    if injection is not None:
        parts.append(f"region: {injection.local_compute_fn.path}")
    elif entry.region_dispatch:
        parts.append("region: _forward_impl")
    return "; ".join(parts)


def body_is_sharded(entry: Entry, axis: str) -> bool:
    """True when the boundary's body computes on shards along ``axis``.

    Then a replicated input's gradient inside the body is partial (each rank sees only
    its shard's contribution) and must be all-reduced on the way back to the caller.
    """
    return any(layout.on(axis) != REPLICATE for layout in entry.in_dst.values()) or any(
        layout.on(axis) != REPLICATE for layout in (*entry.out_src.values(), *entry.params.values())
    )
