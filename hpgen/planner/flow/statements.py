"""One interpreted function body of the dataflow run: its environment and its statements.

Assignments bind names (and constants, for later branch tests); ``if`` takes the branch
the instance takes when the test is known, else both, joined; loops run their body twice
so that values carried round the loop reach their uses; returns accumulate.
"""

from __future__ import annotations

import ast
from typing import Any

from hpgen.planner.flow.constants import Constants, same_const
from hpgen.planner.flow.expressions import Expressions
from hpgen.planner.flow.protocols import Interpreter
from hpgen.planner.flow.values import EMPTY, UNKNOWN, Val, as_items, loop_element, merge, union

__all__ = ["Frame"]


class Frame(Expressions, Constants):
    """One interpreted function body: its environment, constants and returns."""

    def __init__(self, runner: Interpreter, fqn: str, module: Any, env: dict[str, Val], depth: int) -> None:
        self.runner = runner
        self.fqn = fqn
        self.module = module
        self.env = env
        self.consts: dict[str, Any] = {}
        self.depth = depth
        self.returns: list[Val] = []

    def returned(self) -> Val:
        if not self.returns:
            return EMPTY
        value = self.returns[0]
        for other in self.returns[1:]:
            value = merge(value, other)
        return value

    # -- statements

    def block(self, statements: list[ast.stmt]) -> None:
        for statement in statements:
            self.statement(statement)

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign):
            value = self.expr(node.value)
            const = self.const(node.value)
            for target in node.targets:
                self.assign(target, value, const)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.assign(node.target, self.expr(node.value), self.const(node.value))
        elif isinstance(node, ast.AugAssign):
            value = self.expr(node.value)
            if isinstance(node.target, ast.Name):
                before = self.env.get(node.target.id, EMPTY)
                if isinstance(node.op, ast.Add) and before.items is not None:
                    self.env[node.target.id] = Val(items=before.items + as_items(value))
                else:
                    self.env[node.target.id] = union((before, value))
                self.consts.pop(node.target.id, None)
            else:
                self.assign(node.target, union((self.expr(node.target), value)), UNKNOWN)
        elif isinstance(node, ast.Return):
            self.returns.append(self.expr(node.value) if node.value is not None else EMPTY)
        elif isinstance(node, ast.Expr):
            self.expr(node.value)
        elif isinstance(node, ast.If):
            test = self.const(node.test)
            self.expr(node.test)
            if test is UNKNOWN:
                self.branches([node.body, node.orelse])
            else:
                self.block(node.body if test else node.orelse)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            iterated = self.expr(node.iter)
            for _ in range(2):
                self.branches([node.body, []], loop_target=(node.target, iterated))
            self.block(node.orelse)
        elif isinstance(node, ast.While):
            self.expr(node.test)
            for _ in range(2):
                self.branches([node.body, []])
            self.block(node.orelse)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                value = self.expr(item.context_expr)
                if item.optional_vars is not None:
                    self.assign(item.optional_vars, value, UNKNOWN)
            self.block(node.body)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            self.block(node.body)
            for handler in node.handlers:
                self.branches([handler.body, []])
            self.block(node.orelse)
            self.block(node.finalbody)
        elif isinstance(node, ast.Match):
            self.expr(node.subject)
            self.branches([case.body for case in node.cases] + [[]])
        elif isinstance(node, (ast.Raise, ast.Assert, ast.Pass, ast.Break, ast.Continue, ast.Delete, ast.Global)):
            return
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
            return
        else:
            self.runner.flow.unsupported.append(f"{self.fqn}: {type(node).__name__}")

    def branches(self, bodies: list[list[ast.stmt]], loop_target: tuple[ast.expr, Val] | None = None) -> None:
        """Run each body from the current state and join the results (returns accumulate)."""
        start_env, start_consts = dict(self.env), dict(self.consts)
        results = []
        for body in bodies:
            self.env, self.consts = dict(start_env), dict(start_consts)
            if loop_target is not None and body:
                target, iterated = loop_target
                self.assign(target, loop_element(iterated), UNKNOWN)
            self.block(body)
            results.append((self.env, self.consts))
        env: dict[str, Val] = {}
        for name in {name for result, _ in results for name in result}:
            values = [result[name] for result, _ in results if name in result]
            value = values[0]
            for other in values[1:]:
                value = merge(value, other)
            env[name] = value
        consts = {
            name: value
            for name, value in results[0][1].items()
            if all(name in other and same_const(other[name], value) for _, other in results[1:])
        }
        self.env, self.consts = env, consts

    def assign(self, target: ast.expr, value: Val, const: Any) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
            if const is UNKNOWN:
                self.consts.pop(target.id, None)
            else:
                self.consts[target.id] = const
        elif isinstance(target, (ast.Tuple, ast.List)):
            starred = [i for i, element in enumerate(target.elts) if isinstance(element, ast.Starred)]
            for index, element in enumerate(target.elts):
                if isinstance(element, ast.Starred):
                    self.assign(element.value, union([value]), UNKNOWN)
                elif starred and index > starred[0]:
                    self.assign(element, value.item(index - len(target.elts)), UNKNOWN)
                else:
                    self.assign(element, value.item(index), UNKNOWN)
        elif isinstance(target, ast.Subscript):
            base = target.value
            while isinstance(base, ast.Subscript):
                base = base.value
            if isinstance(base, ast.Name):
                self.env[base.id] = union((self.env.get(base.id, EMPTY), value))
        elif isinstance(target, ast.Starred):
            self.assign(target.value, value, UNKNOWN)
