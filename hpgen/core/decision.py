"""One answer per plan entry: what the plan says of a boundary, decided once and kept.

The generator (classify, lower, resolve, explain) and the runtime's survey ask the same
questions of an entry -- its values' ops, whether it is an identity contract, its
contract signature, its injection, the axes its body is sharded on. :func:`entry_decision`
answers them all the first time and keeps the :class:`EntryDecision` in a table of the
plan, so that every later question about the same entry is a lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpgen.core.plan import Entry, Injection, Plan, body_is_sharded, contract_signature
from hpgen.core.transitions import SummedOps, ValueOps, summed_ops, value_ops

__all__ = ["EntryDecision", "entry_decision"]

# The per-plan table's attribute. A Plan is a frozen dataclass; the table is kept in the instance's
# ``__dict__`` (as ``functools.cached_property`` keeps its value), outside its fields, so it takes no
# part in equality, the digest or ``dataclasses.replace`` (a replaced plan starts a table of its own).
_TABLE = "_hp_entry_decisions"


@dataclass(frozen=True)
class EntryDecision:
    """Everything the plan decides about entry ``key``, for a module whose forward also takes ``known_inputs``.

    ``known_inputs`` (``input`` of a wrapped ``nn.Linear``) are inputs the module has where the
    plan declares none: each is ``R`` on every axis, so it gets its ``copy`` into a sharded body
    (:func:`hpgen.core.transitions.value_ops`).
    """

    key: str
    entry: Entry
    mesh: tuple[str, ...]  # the plan's mesh_dim_names
    known_inputs: tuple[str, ...]
    inputs: tuple[ValueOps, ...]  # mesh order
    outputs: tuple[ValueOps, ...]  # reverse mesh order
    signature: str  # contract_signature: what the generated forward was lowered for
    injection: Injection | None
    sharded_axes: tuple[str, ...]  # the axes the body computes on shards along (body_is_sharded)
    summed: SummedOps | None  # a parallel-residual block's one reduction
    is_identity: bool  # no value moves on any axis and no injection, region or summed edit (form identity)

    @property
    def region_target(self) -> str | None:
        """The local compute function's dotted path, ``_forward_impl`` for a region dispatch, else None."""
        if self.injection is not None:
            return self.injection.local_compute_fn.path
        return "_forward_impl" if self.entry.region_dispatch else None


def entry_decision(plan: Plan, key: str, *, known_inputs: tuple[str, ...] = ()) -> EntryDecision:
    """The decision for ``plan``'s entry ``key`` (made on first request, then looked up)."""
    known = tuple(sorted(set(known_inputs)))
    table: dict[tuple[str, tuple[str, ...]], EntryDecision] = plan.__dict__.setdefault(_TABLE, {})
    found = table.get((key, known))
    if found is None:
        found = table[(key, known)] = _decide(plan, key, known)
    return found


def _decide(plan: Plan, key: str, known: tuple[str, ...]) -> EntryDecision:
    entry = plan.entries[key]
    inputs, outputs = value_ops(plan, key, known_inputs=known)
    injection = plan.injection_for(key)
    summed = summed_ops(plan, key)
    # A ``copy`` is not identity: it moves nothing forward, but its backward all-reduces the
    # partial gradient of a replicated input, so the class must be rewritten for it.
    identity = (
        injection is None
        and not entry.region_dispatch
        and summed is None
        and all(op.is_identity for value in (*inputs, *outputs) for op in value.ops)
    )
    return EntryDecision(
        key=key,
        entry=entry,
        mesh=plan.mesh_dim_names,
        known_inputs=known,
        inputs=inputs,
        outputs=outputs,
        signature=contract_signature(plan, key),
        injection=injection,
        sharded_axes=tuple(axis for axis in plan.mesh_dim_names if body_is_sharded(entry, axis)),
        summed=summed,
        is_identity=identity,
    )
