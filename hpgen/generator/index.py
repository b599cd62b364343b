"""A read-only index of a modeling file: classes, forwards, returns and imports.

The indexer walks the module's top level with libcst and fills in the plain records of
:mod:`hpgen.generator.index_records`; the walks through function bodies are
:mod:`hpgen.generator.body_scan` (a ``forward``) and :mod:`hpgen.generator.init_scan`
(what a class builds). Nothing here edits the tree. Line numbers for messages come from
the standard library's ``ast`` parse of the same text, which is an order of magnitude
cheaper than libcst's position metadata and gives the same lines for the statements we
point at.
"""

from __future__ import annotations

import ast
import re

import libcst as cst

from hpgen.core.errors import HpgenError
from hpgen.core.header import MARKER as GENERATED_MARKER
from hpgen.generator.body_scan import index_forward
from hpgen.generator.index_records import ClassInfo, ModuleIndex, ParsedSource, RelativeImport
from hpgen.generator.init_scan import index_children, index_param_dims, self_attributes

RUNTIME_IMPORT_TEXT = "import hpgen.runtime.defaults as _hp_runtime"


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
    info.attributes, info.dynamic_attributes = self_attributes(lines.classes.get(info.name))
    init_ast = lines.init_node(info.name)
    if init_ast is not None:
        info.children = index_children(init_ast)
        info.param_dims = index_param_dims(init_ast)
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
            info.forward = index_forward(statement, ast_node)
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
