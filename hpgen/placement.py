"""Placements: how one tensor is laid out along one mesh axis (docs/plan-format.md).

The grammar is ``R``, ``S(d)`` (negative ``d`` counts from the end, as in PyTorch),
``P(op)`` with op in sum/avg/max/min, ``SS(d,k)`` (dim ``d`` holds ``k`` packed blocks,
each sharded on its own) and ``RS(d,r)`` (dim ``d`` cut into ``size / r`` chunks, chunk
``i // r`` on rank ``i``: each chunk replicated on ``r`` consecutive ranks, as key/value
heads are when the axis is larger than their number). Placements are values: hashable, ordered, and printed
back in their canonical spelling, which is what generated comments show.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PARTIAL_OPS = ("sum", "avg", "max", "min")

_INT = r"\s*(-?\d+)\s*"
_PATTERNS = {  # ASCII: "S(٣)" is not S(3)
    "R": re.compile(r"R"),
    "S": re.compile(rf"S\({_INT}\)", re.ASCII),
    "P": re.compile(r"P\(\s*([a-z]+)\s*\)", re.ASCII),
    "SS": re.compile(rf"SS\({_INT},{_INT}\)", re.ASCII),
    "RS": re.compile(rf"RS\({_INT},{_INT}\)", re.ASCII),
}


@dataclass(frozen=True, order=True)
class Placement:
    """One axis of a layout: replicated, sharded, partial, strided-sharded or replicated-sharded."""

    kind: str  # "R" | "S" | "P" | "SS" | "RS"
    dim: int | None = None
    op: str | None = None
    blocks: int | None = None  # SS: packed blocks in dim
    replicas: int | None = None  # RS: consecutive ranks holding each chunk

    @staticmethod
    def parse(text: object) -> Placement:
        """Parse one placement string; raise ``ValueError`` saying why it is not one."""
        if not isinstance(text, str):
            raise ValueError(f"{text!r} is not a placement (expected a string such as 'R' or 'S(0)')")
        stripped = text.strip()
        for kind, pattern in _PATTERNS.items():
            match = pattern.fullmatch(stripped)
            if match is None:
                continue
            if kind == "R":
                return REPLICATE
            if kind == "S":
                return Placement("S", dim=int(match.group(1)))
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
        raise ValueError(f"{text!r} is not a placement (expected R, S(d), P(op), SS(d,k) or RS(d,r))")

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    def __str__(self) -> str:
        if self.kind == "R":
            return "R"
        if self.kind == "S":
            return f"S({self.dim})"
        if self.kind == "P":
            return f"P({self.op})"
        if self.kind == "RS":
            return f"RS({self.dim},{self.replicas})"
        return f"SS({self.dim},{self.blocks})"


REPLICATE = Placement("R")
PARTIAL_SUM = Placement("P", op="sum")


def shard(dim: int) -> Placement:
    """``S(dim)``."""
    return Placement("S", dim=dim)


def strided_shard(dim: int, blocks: int) -> Placement:
    """``SS(dim,blocks)``: ``blocks`` packed blocks in ``dim``, each sharded on its own."""
    return Placement("SS", dim=dim, blocks=blocks)


def replicated_shard(dim: int, replicas: int) -> Placement:
    """``RS(dim,replicas)``: each chunk of ``dim`` on ``replicas`` consecutive ranks."""
    return Placement("RS", dim=dim, replicas=replicas)
