"""The records a modeling file's index is made of: classes, their forwards, returns, children and imports.

Plain frozen dataclasses (and the two parses of one source, :class:`ParsedSource`) that
:mod:`hpgen.generator.index` fills in and every later stage reads; nothing here reads a
tree.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

import libcst as cst


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
