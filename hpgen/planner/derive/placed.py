"""What a derivation decides: the plan entries it asks for and the notes explaining them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from hpgen.placement import Placement
from hpgen.planner.model.modules import generic

__all__ = ["BATCH_MAJOR", "SHARDING_KINDS", "Derivation", "HeadCut", "NoQueryHead", "Note", "Placed", "Refused"]

# How a per-head input made outside an attention is cut to a rank's heads: S(d) on its head dim, or
# BATCH_MAJOR where the heads are fused into the batch dim (a region's local compute cuts it).
BATCH_MAJOR = "batch_major"
HeadCut = Union[Placement, Literal["batch_major"]]

# Kinds of entries that shard something inside the decoder layers (not attrs, aliases, the vocabulary).
SHARDING_KINDS = ("block", "col_block", "col_leaf", "row_leaf", "reduce_leaf", "gather_leaf", "col_gather", "split_row")


@dataclass
class Placed:
    """One plan entry the derivation asks for (a concrete FQN)."""

    fqn: str
    kind: str  # block | col_block | col_leaf | row_leaf | gather_leaf | heads | lm_head | embedding | attrs | alias
    params: dict[str, Placement] = field(default_factory=dict)  # relative parameter name -> placement on tp
    deferred: set[str] = field(default_factory=set)
    inputs: tuple[str, ...] = ()  # forward parameters entering a block (R -> R)
    divide: set[str] = field(default_factory=set)  # tp_divide_attrs
    local_attrs: dict[str, LocalCount] = field(default_factory=dict)  # attribute -> its count on each rank
    grad_reduce: set[str] = field(default_factory=set)  # replicated parameters the sharded body runs through
    head_inputs: dict[str, HeadCut] = field(default_factory=dict)  # per-head inputs made outside: name -> its cut
    global_heads: int | None = None  # the query heads, for a batch_major head input's local compute
    why: str = ""


@dataclass(frozen=True)
class Note:
    """What the derivation did with one module (a ``*`` pattern), and why."""

    target: str
    sharded: bool
    text: str
    # the module that needs the group's sharded value whole: left replicated (see Contradicted), or, on a
    # sharded note, a gathered column (hpgen.planner.derive.gathered) that gathers it on entry
    needs_whole: str = ""


@dataclass
class Derivation:
    """The entries to write and the notes that explain them."""

    placed: dict[str, Placed] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    no_query_head: str = ""  # why an attention stays whole: --tp leaves a rank without a query head

    def note(self, target: str, sharded: bool, text: str, *, needs_whole: str = "") -> None:
        item = Note(generic(target), sharded, text, generic(needs_whole) if needs_whole else "")
        if item not in self.notes:
            self.notes.append(item)

    @property
    def layers_sharded(self) -> bool:
        return any(p.kind in SHARDING_KINDS for p in self.placed.values())


class Refused(Exception):
    """A group (or module) the derivation leaves replicated; the message says why."""


class NoQueryHead(Refused):
    """An attention whose query heads are fewer than ``--tp``: no cut gives every rank one. Where it is the reason an
    attention stays whole, ``hpgen plan`` refuses the ``--tp`` (:attr:`Derivation.no_query_head`)."""


class Contradicted(Refused):
    """A group whose sharding the source contradicts: a value computed from the sharded
    projections reaches a module that needs it whole (``consumer``, an FQN), not merely a
    layout the derivation does not recognise."""

    def __init__(self, message: str, consumer: str) -> None:
        super().__init__(message)
        self.consumer = consumer
