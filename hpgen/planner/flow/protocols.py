"""What one part of the interpreter asks of another, so that each imports only the parts below it.

A function body (:class:`~hpgen.planner.flow.statements.Frame`) calls modules through the run
it belongs to (:class:`~hpgen.planner.flow.runner.Runner`, which builds frames: the runner
imports the statements, not the reverse), and a tuple-returning function of the file
(:mod:`~hpgen.planner.flow.functions`) is interpreted in a frame of its caller's class. Each
side is typed by the protocol here.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any, Protocol

from hpgen.planner.flow.values import Flow, Val

__all__ = ["Body", "Interpreter"]


class Interpreter(Protocol):
    """One dataflow run as a frame sees it: the model, the record it fills, the calls under way."""

    model: Any
    names: Mapping[int, str]
    flow: Flow
    stack: list[tuple[str, str]]

    def call_module(
        self,
        fqn: str,
        module: Any,
        args: list[Val] | None,
        kwargs: Mapping[str, Val] | None,
        *,
        depth: int,
        markers: bool = False,
        method: str = "forward",
        nones: frozenset[str] = frozenset(),
    ) -> Val: ...


class Body(Protocol):
    """One interpreted function body as a call inside it sees it."""

    runner: Interpreter
    fqn: str
    module: Any
    env: dict[str, Val]
    depth: int

    def __init__(self, runner: Interpreter, fqn: str, module: Any, env: dict[str, Val], depth: int) -> None: ...

    def block(self, statements: list[ast.stmt]) -> None: ...

    def returned(self) -> Val: ...
