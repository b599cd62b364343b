"""What a class builds, read from CPython's ast of its methods: children, attributes, parameter dims.

``__init__``'s ``self.x = Cls(...)`` (or inside an ``nn.ModuleList``) are the class's
children, its ``self.x = nn.Parameter(torch.empty(a, b))`` the parameters whose dims are
known without running it, and every ``self.<attr>`` any method assigns the attributes a
plan may name.
"""

from __future__ import annotations

import ast

from hpgen.generator.body_scan import own_nodes
from hpgen.generator.index_records import Child


def index_children(init: ast.FunctionDef) -> dict[str, tuple[Child, ...]]:
    """``self.x = Cls(...)`` and ``self.x = nn.ModuleList([Cls(...) ...])`` in ``__init__``."""
    children: dict[str, list[Child]] = {}
    assignments = [node for node in own_nodes(init) if isinstance(node, (ast.Assign, ast.AnnAssign))]
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


def self_attributes(node: ast.ClassDef | None) -> tuple[frozenset[str], bool]:
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


def index_param_dims(init: ast.FunctionDef) -> dict[str, tuple[int, int]]:
    """``self.x = nn.Parameter(torch.empty(a, b))`` in ``__init__``: ``x`` -> (2, line).

    Only where every assignment of the attribute (``None`` aside) is such a call whose dims
    can be counted, and they agree; an attribute also assigned otherwise is left out.
    """
    found: dict[str, set[tuple[int, int]]] = {}
    unknown: set[str] = set()
    for node in own_nodes(init):
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
