"""From placements to operations: one value's move on one axis, and every value's moves of an entry.

``transition`` is the per-axis table: one (src, dst) pair of placements becomes one
``Op``; ``value_ops`` gives the ops of every declared input and output of a boundary,
``summed_ops`` the one reduction of a parallel-residual block. :mod:`hpgen.core.decision`
answers them once per entry; :mod:`hpgen.core.classify` picks the form from them.

The backward of each op is its conjugate collective (Megatron's pairs), chosen from the
placement the gradient has when it arrives: a replicated value consumed by a body that
is sharded on the axis gets a partial gradient back, so it must be all-reduced; a value
handed to a replicated caller gets a replicated gradient, so a gather's backward is a
local split, not a reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpgen.core.placement import REPLICATE, Placement
from hpgen.core.plan import Plan, body_is_sharded, summed_branches


# Each collective's default backward, as the runtime's AxisCollectives defines it.
DEFAULT_BACKWARD = {
    "all_reduce": "identity",
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "split": "all_gather",
    "all_to_all": "all_to_all",
    "copy": "all_reduce",
}
# Ops that move data between ranks in forward (``split`` and ``copy`` keep local data).
COMMUNICATING = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}



@dataclass(frozen=True)
class Op:
    """What one declared value needs on one axis: a collective, a local op, or generic."""

    axis: str
    name: str
    src: Placement
    dst: Placement
    kind: str  # identity | copy | all_reduce | all_gather | reduce_scatter | split | all_to_all | generic
    args: tuple[tuple[str, object], ...] = ()
    backward: str | None = None  # set only when it differs from DEFAULT_BACKWARD[kind]
    reason: str = ""  # why a generic op cannot be lowered statically

    @property
    def is_identity(self) -> bool:
        return self.kind == "identity"

    @property
    def communicates(self) -> bool:
        return self.kind in COMMUNICATING

    def described(self) -> str:
        """``all_gather(dim=1)`` / ``copy (backward all_reduce)`` as comments show it."""
        if self.kind == "generic":
            return f"generic ({self.reason})"
        if self.kind == "all_reduce":
            text = f"all_reduce({dict(self.args).get('op', 'sum')})"
        else:
            inner = ", ".join(f"{key}={value}" for key, value in self.args)
            text = f"{self.kind}({inner})" if inner or self.kind != "copy" else "copy"
        backward = self.backward or DEFAULT_BACKWARD.get(self.kind)
        if self.kind == "copy" or self.backward:
            text += f" (backward {backward})"
        return text

    def comment(self) -> str:
        return f"{self.name}: {self.axis} {self.src} -> {self.dst} ==> {self.described()}"

    def call_arguments(self) -> str:
        """The keyword arguments after the tensor in the generated call."""
        pieces = []
        for key, value in self.args:
            if key == "op" and value == "sum":
                continue
            pieces.append(f"{key}={_literal(value)}")
        if self.backward is not None:
            pieces.append(f"backward={_literal(self.backward)}")
        return "".join(f", {piece}" for piece in pieces)


def _literal(value: object) -> str:
    """Strings in double quotes, as the rest of the generated code writes them."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def transition(
    axis: str,
    name: str,
    src: Placement,
    dst: Placement,
    *,
    side: str,
    sharded_body: bool,
    partial_caller: bool = False,
) -> Op:
    """The op that moves a value from ``src`` to ``dst`` on one axis.

    ``side`` is ``in`` (caller → body) or ``out`` (body → caller); with ``sharded_body``
    it fixes the gradient's placement on arrival and so the conjugate in backward.
    ``partial_caller`` (outputs in ``out_grad_partial``): the caller computes on shards
    with the replicated output, so its gradient arrives partial, as an input's does in a
    sharded body.
    """
    into_shards = side == "in" and sharded_body or side == "out" and partial_caller
    op = _forward_op(axis, name, src, dst, into_shards=into_shards)
    if op.kind in ("identity", "generic"):
        return op
    # The gradient arrives at dst as the dual of dst: partial when a replicated value
    # feeds a sharded body (or a sharded caller), otherwise with the value's own placement.
    partial_grad = into_shards and dst.is_replicate
    backward = _backward_for(op.kind, partial_grad)
    if backward != DEFAULT_BACKWARD[op.kind]:
        op = Op(op.axis, op.name, op.src, op.dst, op.kind, op.args, backward=backward)
    return op


def _forward_op(axis: str, name: str, src: Placement, dst: Placement, *, into_shards: bool) -> Op:
    """The forward op; ``into_shards``: the value lands, replicated, in code computing on shards."""
    def make(kind: str, *args: tuple[str, object], reason: str = "") -> Op:
        return Op(axis, name, src, dst, kind, tuple(args), reason=reason)

    if src == dst:
        if src.is_replicate and into_shards:
            return make("copy")
        return make("identity")
    if "SS" in (src.kind, dst.kind):
        return make("generic", reason="strided shards (SS) have no static lowering")
    if src.is_shard and dst.is_replicate:
        return make("all_gather", ("dim", src.dim))
    if src.is_partial and dst.is_replicate:
        return make("all_reduce", ("op", src.op))
    if src.is_partial and dst.is_shard:
        if src.op != "sum":
            return make("generic", reason=f"reduce-scatter of P({src.op}) has no collective")
        return make("reduce_scatter", ("dim", dst.dim))
    if src.is_replicate and dst.is_shard:
        return make("split", ("dim", dst.dim))
    if src.is_shard and dst.is_shard:
        return make("all_to_all", ("src_dim", src.dim), ("dst_dim", dst.dim))
    if dst.is_partial:
        return make("generic", reason=f"{src} -> {dst} makes a partial value, which needs DTensor")
    return make("generic", reason=f"{src} -> {dst} has no static lowering")


def _backward_for(kind: str, partial_grad: bool) -> str:
    """The collective that takes the gradient from the dst side back to the src side."""
    if kind == "copy":
        return "all_reduce"
    if kind == "all_reduce":  # grad of P(op) wants R
        return "all_reduce" if partial_grad else "identity"
    if kind == "all_gather":  # grad of S(d) wants S(d)
        return "reduce_scatter" if partial_grad else "split"
    return DEFAULT_BACKWARD[kind]  # split, reduce_scatter, all_to_all: grad is sharded at dst


@dataclass(frozen=True)
class ValueOps:
    """The ops of one declared input or output, in the order they run."""

    name: str
    ops: tuple[Op, ...]
    # Outputs only: how the value is found in the return: ("whole",), ("index", i) or ("attr", name).
    address: tuple[object, ...] = ("whole",)

    @property
    def active(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if not op.is_identity)


@dataclass(frozen=True)
class SummedOps:
    """The summed reduction of a parallel-residual block: which branches, and the one collective.

    ``reduce`` takes the sum of both branches' partial outputs to the layout of the block's
    stream (``all_reduce``, or ``reduce_scatter`` on a sequence-sharded stream); ``shared``
    is the op the branches' shared input gets once, on the output of ``shared_input``
    (``copy``, or ``all_gather`` from the sequence-sharded stream); None without one. With
    ``paired_input`` the same op moves both norms' outputs at once (concatenated).
    """

    axis: str
    branches: tuple[str, str]
    outputs: tuple[str, str]  # each branch's partial output
    reduce: Op
    shared_input: str | None
    shared: Op | None
    paired_input: str | None = None  # a second norm of the same input, moved with shared_input's output

    def comment(self) -> str:
        """The marker comment written above the edited expression."""
        return (
            f"hpgen summed reduction: {self.branches[0]} + {self.branches[1]} on {self.axis} "
            f"P(sum) -> {self.reduce.dst} ==> {self.reduce.described()} once"
        )


def summed_ops(plan: Plan, key: str) -> SummedOps | None:
    """The summed reduction of the block entry ``key``, or None when it has none.

    The stream's layout on the axis is the block body's layout of its declared input
    (``S(1)`` with sequence parallelism), ``R`` when it declares none.
    """
    entry = plan.entries[key]
    summed = entry.summed_reduction
    if summed is None:
        return None
    mesh = plan.mesh_dim_names
    axis, branches = summed_branches(plan.entries, mesh, key)
    stream = REPLICATE
    for name in entry.input_names:
        layout = entry.input_layouts(name, mesh)[1].on(axis)
        if not layout.is_replicate:
            stream = layout
    reduce = transition(axis, " + ".join(summed.branches), Placement.parse("P(sum)"), stream, side="out", sharded_body=True)
    shared = None
    if summed.shared_input is not None:
        shared = transition(axis, f"{summed.shared_input} output", stream, REPLICATE, side="in", sharded_body=True)
    outputs = (branches[0].output, branches[1].output)
    return SummedOps(axis, summed.branches, outputs, reduce, summed.shared_input, shared, summed.paired_input)


def value_ops(
    plan: Plan, key: str, *, known_inputs: tuple[str, ...] = ()
) -> tuple[tuple[ValueOps, ...], tuple[ValueOps, ...]]:
    """Ops for every declared input (mesh order) and output (reverse mesh order).

    ``known_inputs`` are inputs the caller knows the module has even where the plan does
    not declare them (``input`` of a wrapped ``nn.Linear``): an undeclared one is ``R`` on
    every axis (docs/plan-format.md), so it still gets its ``copy`` into a sharded body.
    """
    entry = plan.entries[key]
    mesh = plan.mesh_dim_names
    sharded = {axis: body_is_sharded(entry, axis) for axis in mesh}
    inputs = []
    for name in sorted({*entry.input_names, *known_inputs}):
        src, dst = entry.input_layouts(name, mesh)
        # in_grad_partial: the gradient leaves partial, for the caller to reduce (no copy)
        into_shards = {axis: sharded[axis] and name not in entry.in_grad_partial for axis in mesh}
        ops = tuple(
            transition(axis, name, src.on(axis), dst.on(axis), side="in", sharded_body=into_shards[axis]) for axis in mesh
        )
        inputs.append(ValueOps(name, ops))
    outputs = []
    for name in entry.output_names:
        src, dst = entry.output_layouts(name, mesh)
        ops = tuple(
            transition(
                axis,
                name,
                src.on(axis),
                dst.on(axis),
                side="out",
                sharded_body=sharded[axis],
                partial_caller=name in entry.out_grad_partial,
            )
            for axis in reversed(mesh)
        )
        outputs.append(ValueOps(name, ops))
    return tuple(inputs), tuple(outputs)
