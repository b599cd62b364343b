"""What a derivation decides: the plan entries it asks for and the notes explaining them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Union

from hpgen.core.placement import PARTIAL_SUM, REPLICATE, Placement, shard
from hpgen.core.plan_entries import Layout
from hpgen.planner.model.modules import generic

__all__ = ["BATCH_MAJOR", "Derivation", "HeadCut", "Kind", "NoQueryHead", "Note", "Placed", "Refused"]

# How a per-head input made outside an attention is cut to a rank's heads: S(d) on its head dim, or
# BATCH_MAJOR where the heads are fused into the batch dim (a region's local compute cuts it).
BATCH_MAJOR = "batch_major"
HeadCut = Union[Placement, Literal["batch_major"]]

# On the one axis of a derived plan: replicated, the last dim sharded, partial
_R = Layout.same(("tp",), REPLICATE)
_LAST = Layout.same(("tp",), shard(-1))
_PARTIAL = Layout.same(("tp",), PARTIAL_SUM)


class Kind(str, Enum):
    """What a derived entry is: the boundary it becomes, and a wrapped leaf's transitions (:attr:`leaf_transitions`).

    A block's transitions depend on its ``forward`` (its inputs ``R -> R``, its output ``P(sum) -> R``; a
    ``COL_BLOCK``'s output stays sharded), so :mod:`hpgen.planner.translate.derived_plan` writes them.
    """

    BLOCK = "block"  # a group's common module: replicated in, its row's reduced output out
    COL_BLOCK = "col_block"  # the columns' common module: its output stays sharded for the rows after it
    COL_LEAF = "col_leaf"  # a column nn.Linear on its own: the output stays sharded
    ROW_LEAF = "row_leaf"  # a row nn.Linear on its own: the sharded input arrives, the output is reduced
    REDUCE_LEAF = "reduce_leaf"  # a mixer's projection reading the sharded channels, its output reduced
    GATHER_LEAF = "gather_leaf"  # a column reading another column's output whole: gathered on entry
    COL_GATHER = "col_gather"  # a column whose output is gathered whole again (a mixer's pair around a scan)
    SPLIT_ROW = "split_row"  # a row on the gathered pair's replicated output, split on entry
    SPLIT_ROW_LEAF = "split_row_leaf"  # a row on its split replicated input (its columns cannot shard)
    LM_HEAD = "lm_head"  # the output projection, column-parallel on the vocabulary
    EMBEDDING = "embedding"  # a vocab-parallel embedding
    HEADS = "heads"  # the body between sharded leaves: only its per-head inputs are cut
    ATTRS = "attrs"  # sizes divided (or counted per rank) on a module that holds nothing sharded
    ALIAS = "alias"  # the same Parameter as a sharded one, placed alike

    def __str__(self) -> str:
        return self.value

    @property
    def boundary(self) -> str:
        """The kind of boundary the plan writes: ``block``, ``linear``, ``embedding`` or ``attrs``."""
        if self in (Kind.BLOCK, Kind.COL_BLOCK, Kind.HEADS):
            return "block"
        if self in (Kind.ATTRS, Kind.ALIAS):
            return "attrs"
        return "embedding" if self is Kind.EMBEDDING else "linear"

    @property
    def leaf_transitions(self) -> tuple[tuple[Layout, Layout] | None, tuple[Layout, Layout]] | None:
        """A wrapped leaf's input and output transitions (an embedding takes no input transition); None otherwise."""
        return _LEAF_TRANSITIONS.get(self)

    @property
    def holds_group(self) -> bool:
        """A block around a group's projections: the parameters read between them, the gradients to reduce."""
        return self in (Kind.BLOCK, Kind.COL_BLOCK)

    @property
    def shards_layers(self) -> bool:
        """It shards something inside the decoder layers (not sizes, aliases, the vocabulary or a body)."""
        return self in _SHARDING

    @property
    def self_contained(self) -> bool:
        """Replicated in, replicated out: it can complete transformers' plan on its own (:mod:`hpgen.planner.entry.make`)."""
        return self in (Kind.BLOCK, Kind.COL_GATHER, Kind.SPLIT_ROW, Kind.SPLIT_ROW_LEAF)

    @property
    def completes_with_its_block(self) -> bool:
        """It goes into transformers' plan with the self-contained entry around it (sizes, a reduced or gathered leaf)."""
        return self in (Kind.ATTRS, Kind.REDUCE_LEAF, Kind.GATHER_LEAF)

    @property
    def sharded_outside_a_block(self) -> bool:
        """A group's projection sharded outside a block of its own, which ``--sp`` cannot enter from sequence shards."""
        return self in (Kind.COL_BLOCK, Kind.COL_LEAF, Kind.ROW_LEAF, Kind.COL_GATHER, Kind.SPLIT_ROW)


_SHARDING = frozenset(
    {
        Kind.BLOCK,
        Kind.COL_BLOCK,
        Kind.COL_LEAF,
        Kind.ROW_LEAF,
        Kind.REDUCE_LEAF,
        Kind.GATHER_LEAF,
        Kind.COL_GATHER,
        Kind.SPLIT_ROW,
    }
)
_LEAF_TRANSITIONS: dict[Kind, tuple[tuple[Layout, Layout] | None, tuple[Layout, Layout]]] = {
    Kind.LM_HEAD: ((_R, _R), (_LAST, _R)),
    Kind.COL_GATHER: ((_R, _R), (_LAST, _R)),
    Kind.GATHER_LEAF: ((_LAST, _R), (_LAST, _LAST)),  # a sharded column's output gathered; one output per local head
    Kind.SPLIT_ROW: ((_R, _LAST), (_PARTIAL, _R)),
    Kind.SPLIT_ROW_LEAF: ((_R, _LAST), (_PARTIAL, _R)),  # a replicated input, split on entry (no communication)
    Kind.EMBEDDING: (None, (_PARTIAL, _R)),
    Kind.COL_LEAF: ((_R, _R), (_LAST, _LAST)),
    Kind.ROW_LEAF: ((_LAST, _LAST), (_PARTIAL, _R)),
    Kind.REDUCE_LEAF: ((_LAST, _LAST), (_PARTIAL, _R)),
}


@dataclass
class Placed:
    """One plan entry the derivation asks for (a concrete FQN)."""

    fqn: str
    kind: Kind
    params: dict[str, Placement] = field(default_factory=dict)  # relative parameter name -> placement on tp
    deferred: set[str] = field(default_factory=set)
    inputs: tuple[str, ...] = ()  # forward parameters entering a block (R -> R)
    divide: set[str] = field(default_factory=set)  # tp_divide_attrs
    local_attrs: dict[str, LocalCount] = field(default_factory=dict)  # attribute -> its count on each rank
    grad_reduce: set[str] = field(default_factory=set)  # replicated parameters the sharded body runs through
    head_inputs: dict[str, HeadCut] = field(default_factory=dict)  # per-head inputs made outside: name -> its cut
    global_heads: int | None = None  # the query heads, for a batch_major head input's local compute
    why: str = ""

    def __post_init__(self) -> None:
        self.kind = Kind(self.kind)  # its text (``"block"``) names the same kind


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
        return any(p.kind.shards_layers for p in self.placed.values())


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
