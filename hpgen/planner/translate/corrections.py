"""Where transformers' own plan is wrong for the code it shards, read from the source.

transformers' plans are written by hand, and a few give a style that the modeling code
does not follow; translating them as written gives wrong numbers. This module finds
such places in a class's ``forward`` so that the translator (:mod:`hpgen.planner.translate.translator`)
corrects the style (:func:`correct_packed_chunks` returns the rules corrected) and says so
in the plan's ``comments`` (``corrected``):

- a fused projection sharded ``colwise`` whose output the ``forward`` splits with
  ``.chunk(2, ...)`` (InklingExperts: ``linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)``)
  holds two packed blocks, gate and up: plain ``colwise`` gives one rank the gate half and
  the other the up half; ``packed_colwise`` (``SS(d,2)``) gives each rank its chunk of both.
  The blocks are read from the owner's dataflow as a derived plan reads a fused column's
  (:func:`hpgen.planner.derive.reshapes.packed_blocks`), not by a reading of their own.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hpgen.errors import HpgenError
from hpgen.planner.derive.column_layouts import UnequalBlocks
from hpgen.planner.derive.reshapes import PackedBlocks, packed_blocks
from hpgen.planner.model.modules import generic, is_linear, out_features
from hpgen.planner.translate.styles import Rule, StyleRules

if TYPE_CHECKING:
    from hpgen.planner.translate.forwards import Forwards

__all__ = ["correct_packed_chunks", "feature_statistics"]


def correct_packed_chunks(
    rules: StyleRules, modules: Mapping[str, Any], forwards: Forwards
) -> tuple[StyleRules, dict[str, str]]:
    """``colwise`` on a fused projection whose output ``forward`` splits into two packed blocks becomes
    ``packed_colwise``: the rules corrected, and each correction's why, by pattern.

    The blocks are read as a derived plan reads them (:func:`~hpgen.planner.derive.reshapes.packed_blocks`, the
    owner's dataflow), once per owner class; a split into another number of blocks, which ``packed_colwise``
    does not express, is refused rather than translated into wrong numbers.
    """
    corrected = dict(rules.rules)
    why: dict[str, str] = {}
    blocks_by_class: dict[tuple[type, str], PackedBlocks | None] = {}
    for fqn, rule in sorted(rules.rules.items()):
        if rule.style != "colwise" or rule.via_module:
            continue
        owner_fqn, _, attr = fqn.rpartition(".")
        owner = modules.get(owner_fqn)
        if owner is None:
            continue
        key = (type(owner), attr)
        if key not in blocks_by_class:
            blocks_by_class[key] = _packed(modules, owner_fqn, attr, forwards)
        blocks = blocks_by_class[key]
        if blocks is None:
            continue
        try:
            name = forwards.owner(owner, owner_fqn).name
        except HpgenError:  # no class of a modeling file runs its forward: nothing hpgen reads to correct
            continue
        if blocks.count != 2:
            raise HpgenError(
                f"{fqn}: transformers' plan says colwise, but {name}.forward splits its output into {blocks.count} "
                f"packed blocks with {blocks.says()}, which no style of transformers' plan shards; plan it with "
                "--from-source"
            )
        for other_name, other in list(corrected.items()):
            if other_name == fqn or (
                other_name.startswith(fqn + ".") and other.via_module and other.style == "colwise"
            ):
                corrected[other_name] = Rule("packed_colwise", other.axis, other.via_module)
        why[generic(fqn)] = (
            f"transformers' plan says colwise, but {name}.forward splits the output of {attr} with "
            f"{blocks.says()}: two packed blocks, so packed_colwise (each rank takes its chunk of both)"
        )
    return replace(rules, rules=corrected), why


def _packed(modules: Mapping[str, Any], owner_fqn: str, attr: str, forwards: Forwards) -> PackedBlocks | None:
    """The packed blocks the owner's code splits ``attr``'s output into (None: one run, or not read)."""
    import torch

    from hpgen.planner.flow import run_module

    owner = modules[owner_fqn]
    value = getattr(owner, attr, None)
    if isinstance(value, torch.Tensor):  # a weight the code applies itself: [..., out, in], as F.linear takes it
        features = value.shape[-2] if value.dim() >= 2 else None
    else:
        features = out_features(value) if is_linear(value) else None
    if features is None:
        return None
    try:
        path = forwards.source_of(type(owner))[0]
    except HpgenError:  # a class with no source to read (torch's own)
        return None
    flow = run_module(modules[""], owner_fqn, path, open_leaf=True)
    try:
        return packed_blocks(flow, owner_fqn, {attr: features}).get(attr)
    except UnequalBlocks as reason:
        raise HpgenError(f"{owner_fqn}.{attr}: transformers' plan says colwise, but {reason}") from None


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
