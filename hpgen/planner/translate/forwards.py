"""Each module's ``forward``, read from its class's modeling file: its parameters and what it returns.

:class:`Forwards` reads the modeling files (each once, with :mod:`hpgen.generator.index`): a
boundary's input is the first parameter of its class's ``forward`` (and the routing
weights of an experts module), its outputs follow the ``return`` (``attn_output,
attn_weights``). Both planners' steps ask it (:class:`~hpgen.planner.translate.plan_context.PlanContext`
holds one).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpgen.core.errors import HpgenError
from hpgen.generator.body_scan import is_record_call
from hpgen.planner.model.load import index_source, source_file

if TYPE_CHECKING:
    from hpgen.generator.index_records import ClassInfo, ModuleIndex, ParsedSource

__all__ = ["Forwards", "return_names", "self_calls"]


class Forwards:
    """The ``forward`` each module runs, read from its class's modeling file, each file parsed and indexed once.

    :attr:`source` (:attr:`parsed`, :attr:`index`) is the model class's own file; a
    language model built through ``AutoModel`` brings classes from another model's file,
    read when first asked about. ``name`` is the model's name in messages.
    """

    def __init__(self, model_class: type, name: str) -> None:
        self.name = name
        self.source = Path(source_file(model_class))
        self.parsed, self.index = index_source(self.source)
        self._files: dict[Path, tuple[ParsedSource, ModuleIndex]] = {self.source.resolve(): (self.parsed, self.index)}

    def source_of(self, cls: type) -> tuple[Path, ParsedSource, ModuleIndex]:
        """The modeling file defining ``cls``, parsed and indexed."""
        path = Path(source_file(cls)).resolve()
        if path not in self._files:
            self._files[path] = index_source(path)
        return (path, *self._files[path])

    def class_info(self, module: Any, fqn: str) -> ClassInfo:
        """The module's class in its modeling file (a top-level class there, or an error)."""
        cls = type(module)
        path, _, index = self.source_of(cls)
        info = index.class_named(cls.__name__)
        if info is None:
            raise HpgenError(f"{self.name}: {fqn}: {cls.__qualname__} is not a top-level class of {path.name}")
        return info

    def owner(self, module: Any, fqn: str) -> ClassInfo:
        """The class (in the module's modeling file) whose ``forward`` the module runs."""
        info = self.class_info(module, fqn)
        path, _, index = self.source_of(type(module))
        pending, seen = [info], set()
        while pending:
            current = pending.pop(0)
            if current.name in seen:
                continue
            seen.add(current.name)
            if current.forward is not None:
                return current
            pending.extend(index.classes[base] for base in current.bases if base in index.classes)
        raise HpgenError(f"{self.name}: {fqn} ({info.name}) has no forward in {path.name}")

    def parameters(self, module: Any, fqn: str) -> list[str]:
        """The positional parameters of the module's ``forward`` after ``self``."""
        forward = self.owner(module, fqn).forward
        assert forward is not None
        names = [p.name for p in forward.parameters if p.kind in ("positional_only", "positional")][1:]
        if not names:
            raise HpgenError(f"{self.name}: {fqn} ({type(module).__name__}).forward takes no tensor input")
        return names

    def keyword_names(self, module: Any, fqn: str) -> set[str]:
        """Every parameter name of the module's ``forward``, keyword-only ones included."""
        forward = self.owner(module, fqn).forward
        return {p.name for p in forward.parameters} if forward is not None else set()

    def required_after_first(self, module: Any, fqn: str) -> list[str]:
        """The positional ``forward`` parameters after the first that have no default and that the
        body multiplies into its values (gating weights); not position embeddings or masks."""
        owner = self.owner(module, fqn)
        forward = owner.forward
        assert forward is not None
        positional = [p for p in forward.parameters if p.kind in ("positional_only", "positional")][2:]
        scaled = _multiplied_names(self.source_of(type(module))[1], owner.name)
        return [p.name for p in positional if not p.has_default and p.name in scaled]

    def first_input(self, module: Any, fqn: str) -> str:
        """The module's input: the first parameter of its ``forward`` after ``self``."""
        return self.parameters(module, fqn)[0]

    def outputs(self, module: Any, fqn: str) -> tuple[str, ...]:
        """Output names in return order: the tuple's element names, or ``output``."""
        owner = self.owner(module, fqn)
        return return_names(self.source_of(type(module))[1], owner.name)


def _multiplied_names(parsed: ParsedSource, class_name: str) -> set[str]:
    """Names that ``<class_name>.forward`` uses as an operand of ``*``."""
    node = next((n for n in parsed.tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    forward = next(
        (s for s in (node.body if node is not None else ()) if isinstance(s, ast.FunctionDef) and s.name == "forward"),
        None,
    )
    found: set[str] = set()
    for item in ast.walk(forward) if forward is not None else ():
        if isinstance(item, ast.BinOp) and isinstance(item.op, ast.Mult):
            found |= {side.id for side in (item.left, item.right) if isinstance(side, ast.Name)}
    return found


def return_names(parsed: ParsedSource, class_name: str) -> tuple[str, ...]:
    """Names of what ``<class_name>.forward`` returns: tuple items in order, else ``("output",)``.

    An item that is a plain name keeps it (``attn_output``); others are ``output_<i>``.
    Returns of different tuple lengths or kinds leave the single name ``output`` (the
    classifier then picks the generic form if it must).
    """
    node = next((n for n in parsed.tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    forward = None
    for statement in node.body if node is not None else ():
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == "forward":
            forward = statement
    if forward is None:
        return ("output",)
    returns = [r for r in _own_returns(forward) if r.value is not None and not _is_none(r.value)]
    tuples = [r.value for r in returns if isinstance(r.value, ast.Tuple)]
    if not returns or len(tuples) != len(returns):
        records = [r.value for r in returns if is_record_call(r.value)]
        if records and len(records) == len(returns):
            return (records[0].keywords[0].arg,)
        return ("output",)
    lengths = {len(t.elts) for t in tuples}
    if len(lengths) != 1 or any(isinstance(e, ast.Starred) for t in tuples for e in t.elts):
        return ("output",)
    names: list[str] = []
    for position in range(lengths.pop()):
        found = {t.elts[position].id for t in tuples if isinstance(t.elts[position], ast.Name)}
        name = found.pop() if len(found) == 1 else f"output_{position}"
        names.append(name if name not in names else f"output_{position}")
    return tuple(names) if names else ("output",)


def self_calls(parsed: ParsedSource, class_name: str, attr: str) -> int:
    """How many times ``<class_name>.forward`` calls ``self.<attr>(...)``."""
    node = next((n for n in parsed.tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    forward = next(
        (n for n in (node.body if node else ()) if isinstance(n, ast.FunctionDef) and n.name == "forward"), None
    )
    if forward is None:
        return 0
    return sum(
        1
        for call in ast.walk(forward)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == attr
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "self"
    )


def _own_returns(function: ast.AST) -> Iterable[ast.Return]:
    """The ``return`` statements of ``function`` itself (nested functions and classes skipped)."""
    for child in ast.iter_child_nodes(function):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(child, ast.Return):
            yield child
        yield from _own_returns(child)


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None
