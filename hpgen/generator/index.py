"""A read-only index of a modeling file: classes, forwards, returns and imports.

The indexer is a libcst visitor that produces plain dataclasses; nothing here edits the
tree. Line numbers for messages come from the standard library's ``ast`` parse of the
same text, which is an order of magnitude cheaper than libcst's position metadata and
gives the same lines for the statements we point at.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import libcst as cst

from hpgen.core.errors import HpgenError
from hpgen.core.header import MARKER as GENERATED_MARKER

RUNTIME_IMPORT_TEXT = "import hpgen.runtime.defaults as _hp_runtime"


@dataclass(frozen=True)
class Parameter:
    """One parameter of ``forward``. ``kind`` follows ``inspect.Parameter`` naming."""

    name: str
    kind: str  # positional_only | positional | var_positional | keyword_only | var_keyword
    has_default: bool


@dataclass(frozen=True)
class ReturnShape:
    """What one ``return`` statement of ``forward`` returns.

    ``kind`` is ``none`` (bare ``return`` / ``return None``), ``tuple`` (a tuple display,
    ``length`` known unless it has a starred item), ``record`` (a call with keyword
    arguments only, such as ``BaseModelOutputWithPast(last_hidden_state=...)``; its
    keywords are the field names) or ``value`` (anything else).
    """

    kind: str
    line: int
    length: int | None = None
    keywords: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChildArgument:
    """One read of a ``forward`` parameter that hands it, whole, to a child module:
    ``self.<attr>(..., value, ...)`` at ``position`` (counted after ``self``), ``self.<attr>(name=value)``
    by ``keyword``, or ``self.<attr>(**value)`` (both None: the ``**kwargs`` mapping passed on)."""

    attr: str
    position: int | None = None
    keyword: str | None = None


@dataclass(frozen=True)
class ForwardInfo:
    """The ``forward`` of one class as the classifier and emitters need it."""

    parameters: tuple[Parameter, ...]
    decorators: tuple[str, ...]
    docstring: str | None
    returns: tuple[ReturnShape, ...]
    line: int
    is_async: bool
    one_line: bool  # ``def forward(self, x): return x``
    falls_off_end: bool  # the last statement is not a return/raise: an implicit ``None``
    # Parameters whose every read in the body hands them, whole, to a child module call (none: an unread
    # parameter); parameters the body reads otherwise, or rebinds, are not here.
    handed_on: tuple[tuple[str, tuple[ChildArgument, ...]], ...] = ()

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return tuple(parameter.name for parameter in self.parameters)

    def parameter(self, name: str) -> Parameter | None:
        for parameter in self.parameters:
            if parameter.name == name:
                return parameter
        return None

    @property
    def has_var_positional(self) -> bool:
        return any(parameter.kind == "var_positional" for parameter in self.parameters)

    @property
    def has_var_keyword(self) -> bool:
        return any(parameter.kind == "var_keyword" for parameter in self.parameters)


@dataclass(frozen=True)
class Child:
    """A submodule that ``__init__`` assigns: ``self.<attr> = <class_name>(...)``."""

    class_name: str  # as written: ``LlamaMLP`` or ``nn.Linear``
    is_list: bool  # built inside nn.ModuleList([...])
    line: int


@dataclass
class ClassInfo:
    """A top-level class of the module."""

    name: str
    bases: tuple[str, ...]
    line: int
    forward: ForwardInfo | None = None
    forward_lines: tuple[int, ...] = ()  # every top-level ``forward`` binding in the body
    forward_is_function: bool = True  # False for ``forward = something``
    children: dict[str, tuple[Child, ...]] = field(default_factory=dict)
    nested_classes: tuple[str, ...] = ()
    definition_lines: tuple[int, ...] = ()  # every top-level ``class <name>`` of the module; the last wins
    members: dict[str, int] = field(default_factory=dict)  # names the class body binds -> first line
    # ``self.<attr> = nn.Parameter(torch.empty(a, b))`` in ``__init__``: attr -> (dims, line), where the
    # factory's arguments say how many dims (every such assignment agreeing)
    param_dims: dict[str, tuple[int, int]] = field(default_factory=dict)
    # every ``self.<attr>`` any method assigns (``self.x = ...``, ``setattr(self, "x", ...)``,
    # ``self.register_buffer("x", ...)``...), and whether some method sets one under a computed
    # name (``setattr(self, name, ...)``), so that the full set is not known
    attributes: frozenset[str] = frozenset()
    dynamic_attributes: bool = False


@dataclass(frozen=True)
class RelativeImport:
    line: int
    level: int
    module: str | None


@dataclass
class ModuleIndex:
    """Everything the later stages read about one source file."""

    classes: dict[str, ClassInfo]
    docstring: str | None
    last_import_index: int | None  # index in Module.body of the import block's last statement
    relative_imports: tuple[RelativeImport, ...]
    is_generated: bool

    def class_named(self, name: str) -> ClassInfo | None:
        return self.classes.get(name)

    def lineage(self, info: ClassInfo) -> Iterator[ClassInfo]:
        """``info`` and then its base classes defined in this file, breadth first, once each."""
        seen: set[str] = set()
        pending = [info]
        while pending:
            current = pending.pop(0)
            if current.name in seen:
                continue
            seen.add(current.name)
            yield current
            pending.extend(self.classes[base] for base in current.bases if base in self.classes)


@dataclass(frozen=True)
class ParsedSource:
    """One source parsed twice: libcst for the rewrite, CPython's ast for line numbers."""

    module: cst.Module
    tree: ast.Module
    text: str


def parse_source(source: str, *, name: str = "<source>") -> ParsedSource:
    """Parse ``source``; a syntax error becomes an ``HpgenError`` at line:column.

    CPython's parser runs first: it is fast and its messages ("'(' was never closed")
    are the ones Python users know.
    """
    try:
        tree = ast.parse(source, filename=name)
    except SyntaxError as exc:
        line, column = exc.lineno, exc.offset
        if line is None and "\0" in source:  # CPython gives no position for a NUL byte
            lines = re.split(r"\r\n|\r|\n", source[: source.index("\0")])
            line, column = len(lines), len(lines[-1]) + 1
        where = f"{line}:{column or 1}" if line is not None else None
        raise HpgenError(f"source does not parse: {exc.msg}", file=name, where=where) from None
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, absurd nesting
        raise HpgenError(f"source does not parse: {exc}", file=name) from None
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:  # CPython accepted it: a construct libcst lacks
        message = exc.message.splitlines()[0] if exc.message else "invalid syntax"
        raise HpgenError(f"libcst cannot parse: {message}", file=name, where=f"{exc.raw_line}:{exc.raw_column + 1}") from None
    except (ValueError, RecursionError) as exc:
        raise HpgenError(f"libcst cannot parse: {exc}", file=name) from None
    return ParsedSource(module, tree, source)


def index_module(parsed: ParsedSource) -> ModuleIndex:
    """Index a parsed source."""
    module = parsed.module
    lines = _LineTable(parsed.tree)
    classes: dict[str, ClassInfo] = {}
    last_import_index = None
    seen_definition = False
    for index, statement in enumerate(module.body):
        if isinstance(statement, cst.ClassDef):
            seen_definition = True
            info = _index_class(statement, lines)
            classes[info.name] = info
        elif isinstance(statement, (cst.FunctionDef,)):
            seen_definition = True
        if _is_import_statement(statement):
            if not seen_definition:
                last_import_index = index
    return ModuleIndex(
        classes=classes,
        docstring=module.get_docstring(clean=False),
        last_import_index=last_import_index,
        relative_imports=tuple(lines.relative_imports),
        is_generated=GENERATED_MARKER in _header_text(module) or RUNTIME_IMPORT_TEXT in parsed.text,
    )


# --------------------------------------------------------------------------- helpers
#
# What needs a walk through function bodies (return shapes, ``__init__`` assignments)
# reads CPython's ast, which the source was parsed into anyway: walking it costs a tenth
# of a libcst visitor. What the rewrite reuses (signatures, decorators, docstrings, the
# import block) is read from the libcst tree itself.


class _LineTable:
    """Facts from the stdlib ``ast``, looked up by class name."""

    def __init__(self, tree: ast.Module) -> None:
        self.classes: dict[str, ast.ClassDef] = {}
        self.definitions: dict[str, list[int]] = {}
        self.relative_imports: list[RelativeImport] = []
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
                self.definitions.setdefault(node.name, []).append(node.lineno)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                self.relative_imports.append(RelativeImport(node.lineno, node.level, node.module))
        self.relative_imports.sort(key=lambda found: found.line)

    def class_line(self, name: str) -> int:
        node = self.classes.get(name)
        return node.lineno if node else 0

    def forward_nodes(self, class_name: str) -> list[ast.stmt]:
        node = self.classes.get(class_name)
        if node is None:
            return []
        return [
            statement
            for statement in node.body
            if (isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == "forward")
            or (isinstance(statement, (ast.Assign, ast.AnnAssign)) and "forward" in _assigned_names(statement))
        ]

    def members(self, class_name: str) -> dict[str, int]:
        """The names the class body binds at its top level (defs, classes, assignments)."""
        node = self.classes.get(class_name)
        found: dict[str, int] = {}
        for statement in node.body if node else ():
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = {statement.name}
            elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            else:
                continue
            for name in names:
                found.setdefault(name, statement.lineno)
        return found

    def init_node(self, class_name: str) -> ast.FunctionDef | None:
        node = self.classes.get(class_name)
        for statement in node.body if node else ():
            if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
                return statement
        return None


def _assigned_names(statement: ast.stmt) -> set[str]:
    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
    return {target.id for target in targets if isinstance(target, ast.Name)}


def _is_import_statement(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in statement.body
    )


def _header_text(module: cst.Module) -> str:
    return "".join(line.comment.value + "\n" for line in module.header if line.comment)


def _dotted(node: cst.BaseExpression | None) -> str | None:
    if node is None:
        return None
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def _index_class(node: cst.ClassDef, lines: _LineTable) -> ClassInfo:
    info = ClassInfo(
        name=node.name.value,
        bases=tuple(name for name in (_dotted(arg.value) for arg in node.bases if arg.keyword is None) if name),
        line=lines.class_line(node.name.value),
    )
    forward_ast = lines.forward_nodes(info.name)
    info.forward_lines = tuple(statement.lineno for statement in forward_ast)
    info.definition_lines = tuple(lines.definitions.get(info.name, ()))
    info.members = lines.members(info.name)
    info.attributes, info.dynamic_attributes = _self_attributes(lines.classes.get(info.name))
    init_ast = lines.init_node(info.name)
    if init_ast is not None:
        info.children = _index_children(init_ast)
        info.param_dims = _index_param_dims(init_ast)
    nested = []
    body = node.body.body if isinstance(node.body, cst.IndentedBlock) else ()
    for statement in body:
        if isinstance(statement, cst.ClassDef):
            nested.append(statement.name.value)
        elif isinstance(statement, cst.FunctionDef) and statement.name.value == "forward":
            # The last binding wins at class creation, as in Python.
            ast_node = next(
                (n for n in reversed(forward_ast) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None
            )
            info.forward = _index_forward(statement, ast_node)
            info.forward_is_function = True
        elif isinstance(statement, cst.SimpleStatementLine) and _binds_forward(statement):
            info.forward_is_function = False
    info.nested_classes = tuple(nested)
    return info


def _binds_forward(statement: cst.SimpleStatementLine) -> bool:
    for small in statement.body:
        targets = []
        if isinstance(small, cst.Assign):
            targets = [target.target for target in small.targets]
        elif isinstance(small, cst.AnnAssign):
            targets = [small.target]
        if any(isinstance(target, cst.Name) and target.value == "forward" for target in targets):
            return True
    return False


def _index_forward(node: cst.FunctionDef, ast_node: ast.FunctionDef | ast.AsyncFunctionDef | None) -> ForwardInfo:
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


def _own_nodes(node: ast.AST):
    """Every node inside ``node`` that belongs to its own scope (nested defs skipped)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _SCOPES):
            continue
        yield child
        yield from _own_nodes(child)


def _own_returns(node: ast.AST) -> list[ast.Return]:
    """The ``return`` statements of ``node`` itself, in source order."""
    found = [child for child in _own_nodes(node) if isinstance(child, ast.Return)]
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


def _index_children(init: ast.FunctionDef) -> dict[str, tuple[Child, ...]]:
    """``self.x = Cls(...)`` and ``self.x = nn.ModuleList([Cls(...) ...])`` in ``__init__``."""
    children: dict[str, list[Child]] = {}
    assignments = [node for node in _own_nodes(init) if isinstance(node, (ast.Assign, ast.AnnAssign))]
    for node in sorted(assignments, key=lambda statement: (statement.lineno, statement.col_offset)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        found = _constructed_class(node.value) if node.value is not None else None
        if found is None:
            continue
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                children.setdefault(target.attr, []).append(Child(found[0], found[1], node.lineno))
    return {attr: tuple(found) for attr, found in children.items()}


# Calls that set an attribute of ``self`` by a name given as a string: ``setattr(self, name, ...)``
# and nn.Module's registering methods ``self.<method>(name, ...)``.
_NAMED_SETTERS = {"register_buffer", "register_parameter", "add_module", "register_module"}


def _self_attributes(node: ast.ClassDef | None) -> tuple[frozenset[str], bool]:
    """The ``self.<attr>`` names the class's methods assign, and whether one is assigned by a computed name."""
    names: set[str] = set()
    dynamic = False
    for child in ast.walk(node) if node is not None else ():
        if isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = child.targets if isinstance(child, ast.Assign) else [child.target]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                        names.add(part.attr)
        elif isinstance(child, ast.Call):
            func = child.func
            is_setattr = isinstance(func, ast.Name) and func.id == "setattr" and child.args
            is_setattr = is_setattr and isinstance(child.args[0], ast.Name) and child.args[0].id == "self"
            is_register = (
                isinstance(func, ast.Attribute)
                and func.attr in _NAMED_SETTERS
                and isinstance(func.value, ast.Name)
                and func.value.id == "self"
            )
            if is_setattr or is_register:
                named = child.args[1] if is_setattr and len(child.args) > 1 else child.args[0] if child.args else None
                if isinstance(named, ast.Constant) and isinstance(named.value, str):
                    names.add(named.value)
                else:
                    dynamic = True
        elif isinstance(child, ast.Attribute) and child.attr in ("__dict__", "__setattr__"):
            dynamic = True  # ``self.__dict__.update(...)``, ``object.__setattr__(self, name, ...)``
        elif isinstance(child, ast.Name) and child.id == "vars":
            dynamic = True
    return frozenset(names), dynamic


def _index_param_dims(init: ast.FunctionDef) -> dict[str, tuple[int, int]]:
    """``self.x = nn.Parameter(torch.empty(a, b))`` in ``__init__``: ``x`` -> (2, line).

    Only where every assignment of the attribute (``None`` aside) is such a call whose dims
    can be counted, and they agree; an attribute also assigned otherwise is left out.
    """
    found: dict[str, set[tuple[int, int]]] = {}
    unknown: set[str] = set()
    for node in _own_nodes(init):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        if isinstance(node.value, ast.Constant) and node.value.value is None:
            continue  # ``self.bias = None`` when there is none: the parameter, where it exists, is the other one
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        dims = _parameter_dims(node.value)
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                if dims is None:
                    unknown.add(target.attr)
                else:
                    found.setdefault(target.attr, set()).add((dims, node.lineno))
    return {
        attr: min(values, key=lambda item: item[1])
        for attr, values in found.items()
        if attr not in unknown and len({dims for dims, _ in values}) == 1
    }


_PARAMETER_NAMES = {"Parameter", "nn.Parameter", "torch.nn.Parameter"}
_SIZED_FACTORIES = {"empty", "zeros", "ones", "randn", "rand"}  # torch.<factory>(*size) or (size_tuple)


def _parameter_dims(value: ast.expr) -> int | None:
    """The dims of ``nn.Parameter(torch.empty(a, b, ...))`` (or zeros, ones, randn, rand), else None."""
    if not (isinstance(value, ast.Call) and _ast_dotted(value.func) in _PARAMETER_NAMES and value.args):
        return None
    inner = value.args[0]
    if not isinstance(inner, ast.Call):
        return None
    factory = _ast_dotted(inner.func) or ""
    module, _, name = factory.rpartition(".")
    if module != "torch" or name not in _SIZED_FACTORIES or any(k.arg in (None, "size") for k in inner.keywords):
        return None
    args = inner.args
    if len(args) == 1:
        if isinstance(args[0], (ast.Tuple, ast.List)):
            args = args[0].elts
        elif not isinstance(args[0], (ast.Constant, ast.BinOp)):
            return None  # torch.ones(shape): a name may hold a whole size tuple
    if not args or any(isinstance(arg, ast.Starred) for arg in args):
        return None
    return len(args)


_MODULE_LIST_NAMES = {"ModuleList", "nn.ModuleList", "torch.nn.ModuleList"}


def _ast_dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _ast_dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _constructed_class(value: ast.expr) -> tuple[str, bool] | None:
    """The class a constructor call builds, and whether it sits in an nn.ModuleList.

    A call counts as a constructor when the callee's last name starts with a capital
    letter (``LlamaMLP(...)``, ``nn.Linear(...)``), as classes are named in this style.
    """
    if not isinstance(value, ast.Call):
        return None
    callee = _ast_dotted(value.func)
    if callee is None:
        return None
    if callee in _MODULE_LIST_NAMES:
        items = value.args[0] if value.args else None
        element = None
        if isinstance(items, (ast.ListComp, ast.GeneratorExp)):
            element = items.elt
        elif isinstance(items, (ast.List, ast.Tuple)) and items.elts:
            names = {_ast_dotted(e.func) if isinstance(e, ast.Call) else None for e in items.elts}
            if len(names) == 1 and None not in names:
                element = items.elts[0]
        if isinstance(element, ast.Call):
            inner = _ast_dotted(element.func)
            if inner is not None:
                return inner, True
        return None
    if callee.rsplit(".", 1)[-1][:1].isupper():
        return callee, False
    return None
