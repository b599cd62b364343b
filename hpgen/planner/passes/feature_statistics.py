"""How a block's ``forward`` reduces the features of a column-sharded value, read from its class's source.

A value computed from a column-parallel layer holds this rank's features only; a mean, a
standard deviation, a top-k or a softmax over its last dim would give each rank its own
statistics. :func:`feature_statistics` finds such a reduction in a class's ``forward`` (or a
method it passes the value to), for :func:`hpgen.planner.passes.crosscheck.drop_feature_statistics`,
which keeps those block instances replicated (Gemma3n's sparse MLPs).
"""

from __future__ import annotations

import ast

__all__ = ["feature_statistics"]


def _class_of(tree: ast.Module, class_name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)


def _methods(node: ast.ClassDef | None) -> dict[str, ast.FunctionDef]:
    return {s.name: s for s in (node.body if node is not None else ()) if isinstance(s, ast.FunctionDef)}


# Reductions over a tensor's features: on a column-sharded value each rank would reduce its own shard.
_FEATURE_REDUCTIONS = frozenset(
    {"mean", "std", "var", "std_mean", "var_mean", "sum", "amax", "amin", "norm", "topk", "logsumexp", "softmax"}
)


def _is_last_dim(call: ast.Call, position: int) -> bool:
    """Whether the call's ``dim`` (keyword, or the positional argument at ``position``) is -1."""
    value = next((k.value for k in call.keywords if k.arg == "dim"), None)
    if value is None and len(call.args) > position:
        value = call.args[position]
    return (
        isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.USub) and isinstance(value.operand, ast.Constant)
        and value.operand.value == 1
    )


def _reduced_names(function: ast.FunctionDef) -> set[str]:
    """Names whose last dim ``function`` reduces: ``torch.mean(x, dim=-1)``, ``x.std(-1)``..."""
    found = set()
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in _FEATURE_REDUCTIONS:
            continue
        receiver = node.func.value
        if isinstance(receiver, ast.Name) and receiver.id in ("torch", "F") or isinstance(receiver, ast.Attribute):
            target, position = (node.args[0] if node.args else None), 1  # torch.mean(x, -1)
        else:
            target, position = receiver, 0  # x.mean(-1)
        if target is not None and _is_last_dim(node, position):
            found |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return found


def _attribute_test(test: ast.expr, instance: object) -> bool | None:
    """The value of ``self.attr <op> constant`` on ``instance``; None for any other test."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and len(test.comparators) == 1):
        return None
    left, right = test.left, test.comparators[0]
    if not (
        isinstance(left, ast.Attribute) and isinstance(left.value, ast.Name) and left.value.id == "self"
        and isinstance(right, ast.Constant)
    ):
        return None
    value = getattr(instance, left.attr, None)
    operations = {ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b, ast.Lt: lambda a, b: a < b,
                  ast.LtE: lambda a, b: a <= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
    operation = operations.get(type(test.ops[0]))
    try:
        return bool(operation(value, right.value)) if operation is not None and value is not None else None
    except TypeError:
        return None


def feature_statistics(tree: ast.Module, class_name: str, columns: set[str], instance: object) -> str | None:
    """How ``class_name.forward`` reduces the features of a column layer's output, or None.

    A value computed from ``self.<column>(...)`` (a column-parallel layer: its features are
    sharded) whose last dim is reduced (a mean, a standard deviation, a top-k, a softmax),
    directly or in a method of the class it is passed to, holds this rank's features only:
    each rank would compute its own statistics. An ``if self.attr <op> constant`` around
    the reduction is evaluated on ``instance`` (Gemma3n sparsifies only some layers).
    """
    methods = _methods(_class_of(tree, class_name))
    forward = methods.get("forward")
    if forward is None:
        return None
    reducing = {
        name: {i for i, arg in enumerate(m.args.args[1:]) if arg.arg in _reduced_names(m)} for name, m in methods.items()
    }
    tainted: dict[str, str] = {}  # local name -> the column it comes from
    found: list[str] = []

    def origin(node: ast.AST) -> str | None:
        for inner in ast.walk(node):
            if isinstance(inner, ast.Name) and inner.id in tainted:
                return tainted[inner.id]
            if (
                isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                and isinstance(inner.func.value, ast.Name) and inner.func.value.id == "self"
                and inner.func.attr in columns
            ):
                return inner.func.attr
        return None

    def visit(statements: list[ast.stmt]) -> None:
        for statement in statements:
            if isinstance(statement, ast.If):
                taken = _attribute_test(statement.test, instance)
                if taken is not False:
                    visit(statement.body)
                if taken is not True:
                    visit(statement.orelse)
                continue
            for node in ast.walk(statement):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                    for position in reducing.get(func.attr, ()):
                        source = origin(node.args[position]) if position < len(node.args) else None
                        if source is not None:
                            found.append(f"{class_name}.{func.attr} reduces the features of {source}'s output")
            reduced = _reduced_names(ast.FunctionDef(name="_", args=forward.args, body=[statement], decorator_list=[]))
            for name in reduced:
                if name in tainted:
                    found.append(f"{class_name}.forward reduces the features of {tainted[name]}'s output")
            if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
                source = origin(statement.value)
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and source is not None:
                            tainted[name.id] = source

    visit(forward.body)
    return found[0] if found else None
