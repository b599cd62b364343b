"""Which values of one boundary are cut alike, so that one size lookup serves them all.

A gather of shards (``S(d) -> R``) must know every rank's size on ``d``; in general only
the senders know it, and finding it out is a host synchronisation. Within one boundary,
the generator knows which values are shards of one dim cut one way:

- inputs that take the very same transitions, in the same order, on every axis, and
  gather on ``(axis, d)``: the experts' ``hidden_states``, ``top_k_index`` and
  ``top_k_weights`` (all ``S(0) -> R`` on ``ep``, the router's tokens);
- an output gathered ``S(d) -> R`` on an axis and dim that the boundary's inputs were
  split on: the body's per-sequence outputs of the batch it was given
  (``last_hidden_state``). Such a boundary closes over its cut, and its body may cut the
  same dim another way (the batch's tokens, gathered into the experts on dim 0), so its
  split leaves no record for the gathers inside (hpgen.runtime.forward.shard_records);
  splits that no output of their boundary gathers back join no group and record as usual
  (the sequence split at a first decoder layer, which the attentions after it gather).

The generated ``forward`` finds the sizes once (``shard_sizes`` before gathers,
``split_sizes`` before splits) and hands them to every op of the group (``sizes=``)
instead of each gather finding them on its own (docs/generated-code.md). Only the static
forms do (an active input that arrives in ``**kwargs``, which may be absent, makes a
boundary generic); a gather whose full size the plan gives (``total``) needs no sizes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hpgen.core.transitions import Op, ValueOps

__all__ = ["SharedSizes", "shared_sizes"]

_CUTS = ("all_gather", "split")  # ops whose sizes a group shares


@dataclass(frozen=True)
class SharedSizes:
    """One op per member, on ``axis`` and ``dim``: the sizes are found from the inputs
    ``members`` (the first that is not ``None`` at run time) before their ``kind`` op, and
    every member's op, and each of ``outputs``' gathers, takes them."""

    axis: str
    dim: object
    kind: str  # all_gather (the members are shards) or split (they are whole)
    position: int  # index of the op into each member's ``ValueOps.ops``
    members: tuple[str, ...]
    outputs: tuple[tuple[str, int], ...] = ()  # (output, index of its gather into its ops)

    @property
    def leader(self) -> str:
        """The member whose lookup comes first (the first member that is not ``None`` answers)."""
        return self.members[0]


def shared_sizes(inputs: Iterable[ValueOps], outputs: Iterable[ValueOps] = ()) -> tuple[SharedSizes, ...]:
    """The groups whose ops share one size lookup: two or more ``inputs`` gathered alike, or
    the inputs split alike on a dim that an output is gathered from."""
    by_ops: dict[tuple[object, ...], list[ValueOps]] = {}
    for value in inputs:
        if not any(_cut(op) for op in value.ops):
            continue
        key = tuple((op.axis, op.kind, str(op.src), str(op.dst), op.args, op.backward) for op in value.ops)
        by_ops.setdefault(key, []).append(value)
    gathered_outputs = [
        (value.name, position, op) for value in outputs for position, op in enumerate(value.ops) if _cut(op, "all_gather")
    ]
    groups = []
    for values in by_ops.values():
        members = tuple(value.name for value in values)
        for position, op in enumerate(values[0].ops):
            if not _cut(op):
                continue
            if any(not earlier.is_identity for earlier in values[0].ops[:position]):
                break  # the sizes are found before the first member's op, when no member has moved yet
            dim = dict(op.args)["dim"]
            followers: tuple[tuple[str, int], ...] = ()
            if op.kind == "split":
                followers = tuple(
                    (name, at) for name, at, out in gathered_outputs if out.axis == op.axis and dict(out.args)["dim"] == dim
                )
            if followers or (op.kind == "all_gather" and len(members) > 1):
                groups.append(SharedSizes(op.axis, dim, op.kind, position, members, followers))
    # an output gathered after splits of two different groups on its dim follows none of them
    taken = [out for group in groups for out in group.outputs]
    found = []
    for g in groups:
        outputs = tuple(o for o in g.outputs if taken.count(o) == 1)
        if outputs or g.kind == "all_gather":
            found.append(SharedSizes(g.axis, g.dim, g.kind, g.position, g.members, outputs))
    return tuple(found)


def _cut(op: Op, kind: str | None = None) -> bool:
    """A gather of shards whose sizes the plan does not give, or a split of a whole value."""
    return op.kind in ((kind,) if kind else _CUTS) and "total" not in dict(op.args) and "dim" in dict(op.args)
