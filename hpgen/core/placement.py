"""Placements: how one tensor is laid out along one mesh axis (docs/plan-format.md).

The grammar is ``R``, ``S(d)`` (negative ``d`` counts from the end, as in PyTorch),
``P(op)`` with op in sum/avg/max/min, ``SS(d,k)`` (dim ``d`` holds ``k`` packed blocks,
each sharded on its own) and ``RS(d,r)`` (dim ``d`` cut into ``size / r`` chunks, chunk
``i // r`` on rank ``i``: each chunk replicated on ``r`` consecutive ranks, as key/value
heads are when the axis is larger than their number). Parameters also take the
whole-unit forms: ``S(d,u)`` (dim ``d`` cut in whole units of ``u`` elements, whole
heads), ``S(d,u,g)`` (``g`` equal groups, each cut in whole units over its own set of
ranks: a GQA group's query heads kept with its key/value head) and ``B(d, n1:P1, ...)``
(dim ``d`` made of blocks of sizes ``n1, ...``, each with its own placement: Falcon's
fused ``[query heads | key | value]``). Placements are values: hashable, ordered, and
printed back in their canonical spelling, which is what generated comments show.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

PARTIAL_OPS = ("sum", "avg", "max", "min")

_INT = r"\s*(-?\d+)\s*"
_PATTERNS = {  # ASCII: "S(٣)" is not S(3)
    "R": re.compile(r"R"),
    "S": re.compile(rf"S\({_INT}(?:,{_INT}(?:,{_INT})?)?\)", re.ASCII),
    "P": re.compile(r"P\(\s*([a-z]+)\s*\)", re.ASCII),
    "SS": re.compile(rf"SS\({_INT},{_INT}\)", re.ASCII),
    "RS": re.compile(rf"RS\({_INT},{_INT}\)", re.ASCII),
}
_BLOCKS = re.compile(rf"B\({_INT},(.*)\)", re.ASCII | re.DOTALL)
_BLOCK = re.compile(r"\s*(\d+)\s*:(.*)", re.ASCII | re.DOTALL)
_EXPECTED = "R, S(d), S(d,u), S(d,u,g), P(op), SS(d,k), RS(d,r) or B(d, n1:P1, n2:P2, ...)"


@dataclass(frozen=True, order=True)
class Placement:
    """One axis of a layout: replicated, sharded, partial, strided-sharded, replicated-sharded or blocks."""

    kind: str  # "R" | "S" | "P" | "SS" | "RS" | "B"
    dim: int | None = None
    op: str | None = None
    blocks: int | None = None  # SS: packed blocks in dim
    replicas: int | None = None  # RS: consecutive ranks holding each chunk
    unit: int = 1  # S: cut in whole units of this many elements (S(d,u))
    groups: int = 1  # S: dim is this many equal groups, each on its own set of ranks (S(d,u,g))
    parts: tuple[tuple[int, Placement], ...] = ()  # B: (block size, the block's placement), in dim order

    @staticmethod
    def parse(text: object) -> Placement:
        """Parse one placement string; raise ``ValueError`` saying why it is not one."""
        if not isinstance(text, str):
            raise ValueError(f"{text!r} is not a placement (expected a string such as 'R' or 'S(0)')")
        stripped = text.strip()
        blocks = _BLOCKS.fullmatch(stripped)
        if blocks is not None:
            return _parse_blocks(text, int(blocks.group(1)), blocks.group(2))
        for kind, pattern in _PATTERNS.items():
            match = pattern.fullmatch(stripped)
            if match is None:
                continue
            if kind == "R":
                return REPLICATE
            if kind == "S":
                unit, groups = (int(g) if g is not None else 1 for g in match.group(2, 3))
                if unit < 1:
                    raise ValueError(f"{text!r} is not a placement: the unit size must be at least 1")
                if groups < 1:
                    raise ValueError(f"{text!r} is not a placement: the group count must be at least 1")
                return Placement("S", dim=int(match.group(1)), unit=unit, groups=groups)
            if kind == "P":
                op = match.group(1)
                if op not in PARTIAL_OPS:
                    raise ValueError(f"{text!r} is not a placement: partial op must be one of {', '.join(PARTIAL_OPS)}")
                return Placement("P", op=op)
            dim, count = int(match.group(1)), int(match.group(2))
            if kind == "RS":
                if count < 1:
                    raise ValueError(f"{text!r} is not a placement: the replica count must be at least 1")
                return Placement("RS", dim=dim, replicas=count)
            if count < 1:
                raise ValueError(f"{text!r} is not a placement: the block count must be at least 1")
            return Placement("SS", dim=dim, blocks=count)
        raise ValueError(f"{text!r} is not a placement (expected {_EXPECTED})")

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    @property
    def whole_units(self) -> bool:
        """A placement only parameters take: ``S(d,u)``/``S(d,u,g)`` with ``u`` or ``g`` above one, or ``B``.

        Boundary values (inputs, outputs) move by collectives, none of which cuts in units or blocks.
        """
        return self.kind == "B" or (self.kind == "S" and (self.unit > 1 or self.groups > 1))

    def __str__(self) -> str:
        if self.kind == "R":
            return "R"
        if self.kind == "S":
            if self.groups > 1:
                return f"S({self.dim},{self.unit},{self.groups})"
            return f"S({self.dim},{self.unit})" if self.unit > 1 else f"S({self.dim})"
        if self.kind == "P":
            return f"P({self.op})"
        if self.kind == "RS":
            return f"RS({self.dim},{self.replicas})"
        if self.kind == "B":
            return f"B({self.dim}," + ",".join(f"{size}:{inner}" for size, inner in self.parts) + ")"
        return f"SS({self.dim},{self.blocks})"

    def on_dim(self, dim: int) -> Placement:
        """The same placement naming ``dim`` (its blocks' placements too)."""
        parts = tuple((size, inner.on_dim(dim) if inner.dim is not None else inner) for size, inner in self.parts)
        return dataclasses.replace(self, dim=dim, parts=parts)


def _split_top_level(text: str) -> list[str]:
    """``text`` cut at the commas outside parentheses."""
    pieces, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            pieces.append(text[start:index])
            start = index + 1
    pieces.append(text[start:])
    return pieces


def _parse_blocks(text: str, dim: int, body: str) -> Placement:
    """``B(d, n1:P1, ...)``: positive sizes, each block's placement R, S or RS naming dim ``d``."""
    parts = []
    for piece in _split_top_level(body):
        match = _BLOCK.fullmatch(piece)
        if match is None:
            raise ValueError(f"{text!r} is not a placement: {piece.strip()!r} is not a block 'size:placement'")
        size = int(match.group(1))
        if size < 1:
            raise ValueError(f"{text!r} is not a placement: a block's size must be at least 1")
        inner = Placement.parse(match.group(2))
        if inner.kind not in ("R", "S", "RS"):
            raise ValueError(f"{text!r} is not a placement: a block takes R, S(d), S(d,u), S(d,u,g) or RS(d,r), not {inner}")
        if inner.dim is not None and inner.dim != dim:
            raise ValueError(f"{text!r} is not a placement: block {inner} names dim {inner.dim}, not the blocks' dim {dim}")
        parts.append((size, inner))
    return Placement("B", dim=dim, parts=tuple(parts))


REPLICATE = Placement("R")
PARTIAL_SUM = Placement("P", op="sum")


def shard(dim: int, unit: int = 1, groups: int = 1) -> Placement:
    """``S(dim)``, or ``S(dim,unit)`` / ``S(dim,unit,groups)`` in whole units."""
    return Placement("S", dim=dim, unit=unit, groups=groups)


def strided_shard(dim: int, blocks: int) -> Placement:
    """``SS(dim,blocks)``: ``blocks`` packed blocks in ``dim``, each sharded on its own."""
    return Placement("SS", dim=dim, blocks=blocks)


def replicated_shard(dim: int, replicas: int) -> Placement:
    """``RS(dim,replicas)``: each chunk of ``dim`` on ``replicas`` consecutive ranks."""
    return Placement("RS", dim=dim, replicas=replicas)


def block_placement(dim: int, parts: tuple[tuple[int, Placement], ...]) -> Placement:
    """``B(dim, n1:P1, ...)``: dim ``dim`` made of blocks of the given sizes, each laid out as its placement."""
    return Placement("B", dim=dim, parts=tuple(parts))
