"""What a ``forward`` body says, read from CPython's ast: its signature, its returns, what it hands on.

Walking the stdlib ``ast`` of a body costs a tenth of a libcst visitor, and the source was
parsed into it anyway (:class:`~hpgen.generator.index_records.ParsedSource`): the shapes
of its own ``return`` statements (nested scopes skipped), whether a return builds an
output record, and which parameters the body only passes, whole, to child modules.
"""

from __future__ import annotations

import ast

import libcst as cst

from hpgen.generator.index_records import ChildArgument, ForwardInfo, Parameter, ReturnShape


def index_forward(node: cst.FunctionDef, ast_node: ast.FunctionDef | ast.AsyncFunctionDef | None) -> ForwardInfo:
    params = node.params
    parameters: list[Parameter] = []
    parameters += [Parameter(p.name.value, "positional_only", p.default is not None) for p in params.posonly_params]
    parameters += [Parameter(p.name.value, "positional", p.default is not None) for p in params.params]
    if isinstance(params.star_arg, cst.Param):
        parameters.append(Parameter(params.star_arg.name.value, "var_positional", False))
    parameters += [Parameter(p.name.value, "keyword_only", p.default is not None) for p in params.kwonly_params]
    if params.star_kwarg is not None:
        parameters.append(Parameter(params.star_kwarg.name.value, "var_keyword", False))
    last = ast_node.body[-1] if ast_node is not None and ast_node.body else None
    return ForwardInfo(
        parameters=tuple(parameters),
        decorators=tuple(cst.Module([]).code_for_node(decorator.decorator) for decorator in node.decorators),
        docstring=node.get_docstring(clean=False),
        returns=tuple(_return_shape(found) for found in _own_returns(ast_node)) if ast_node is not None else (),
        line=ast_node.lineno if ast_node is not None else 0,
        is_async=node.asynchronous is not None,
        one_line=isinstance(node.body, cst.SimpleStatementSuite),
        falls_off_end=not isinstance(last, (ast.Return, ast.Raise)),
        handed_on=_handed_on(ast_node, [parameter.name for parameter in parameters[1:]]) if ast_node is not None else (),
    )


# Calls that can read a local variable without naming it.
_LOCALS_READERS = {"locals", "vars", "eval", "exec"}


def _handed_on(
    node: ast.FunctionDef | ast.AsyncFunctionDef, names: list[str]
) -> tuple[tuple[str, tuple[ChildArgument, ...]], ...]:
    """For each parameter of ``names`` that the body reads only as a whole argument of ``self.<attr>(...)``
    calls, those reads (see :attr:`ForwardInfo.handed_on`).

    Every occurrence of the name in the body counts, nested scopes included, so a name a lambda or an
    inner function shadows, or that the body rebinds or deletes, is not handed on: the check errs
    towards "the body reads it".
    """
    uses: dict[str, list[ChildArgument]] = {name: [] for name in names}
    other: set[str] = set()
    handed: dict[int, ChildArgument] = {}  # id of a Name node -> the child argument it is
    for statement in node.body:
        for found in ast.walk(statement):
            if isinstance(found, ast.Name) and found.id in _LOCALS_READERS:
                return ()
            if not isinstance(found, ast.Call):
                continue
            func = found.func
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
                continue
            for position, argument in enumerate(found.args):
                if isinstance(argument, ast.Starred):
                    break  # later positions are unknown
                if isinstance(argument, ast.Name):
                    handed[id(argument)] = ChildArgument(func.attr, position=position)
            for keyword in found.keywords:
                if isinstance(keyword.value, ast.Name):
                    handed[id(keyword.value)] = ChildArgument(func.attr, keyword=keyword.arg)
    for statement in node.body:
        for found in ast.walk(statement):
            if isinstance(found, ast.Name) and found.id in uses:
                child = handed.get(id(found))
                if child is None or not isinstance(found.ctx, ast.Load):
                    other.add(found.id)
                else:
                    uses[found.id].append(child)
            elif _bound_name(found) in uses:
                other.add(_bound_name(found))  # rebound: by a nested scope's parameter, an import, a def...
    return tuple((name, tuple(found)) for name, found in uses.items() if name not in other)


def _bound_name(node: ast.AST) -> str | None:
    """The name a node binds other than by assignment to an ``ast.Name``, if any."""
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, ast.alias):
        return node.asname or node.name.split(".")[0]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
        return node.name
    return None


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def own_nodes(node: ast.AST):
    """Every node inside ``node`` that belongs to its own scope (nested defs skipped)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _SCOPES):
            continue
        yield child
        yield from own_nodes(child)


def _own_returns(node: ast.AST) -> list[ast.Return]:
    """The ``return`` statements of ``node`` itself, in source order."""
    found = [child for child in own_nodes(node) if isinstance(child, ast.Return)]
    return sorted(found, key=lambda statement: (statement.lineno, statement.col_offset))


def _return_shape(statement: ast.Return) -> ReturnShape:
    value, line = statement.value, statement.lineno
    if value is None or (isinstance(value, ast.Constant) and value.value is None):
        return ReturnShape("none", line)
    if isinstance(value, ast.Tuple):
        starred = any(isinstance(element, ast.Starred) for element in value.elts)
        return ReturnShape("tuple", line, length=None if starred else len(value.elts))
    if is_record_call(value):
        return ReturnShape("record", line, keywords=tuple(keyword.arg for keyword in value.keywords))
    return ReturnShape("value", line)


def is_record_call(value: ast.AST) -> bool:
    """Whether ``value`` builds an output record: a class called with keyword arguments only.

    ``BaseModelOutputWithPast(last_hidden_state=...)`` or ``modeling_outputs.CausalLMOutput(...)``
    (a capitalised name, as classes are spelled); a method call with keywords only, such as
    ``hidden_states.to(dtype=input_dtype)``, returns a tensor, not a record with a ``dtype`` field.
    """
    if not (isinstance(value, ast.Call) and not value.args and value.keywords and all(k.arg for k in value.keywords)):
        return False
    func = value.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name[:1].isupper()
