"""Where transformers' own plan is wrong for the code it shards, read from the source.

transformers' plans are written by hand, and a few give a style that the modeling code
does not follow; translating them as written gives wrong numbers. This module finds
such places in a class's ``forward`` so that the translator (:mod:`hpgen.planner.translator`)
corrects the style and says so in the plan's ``comments`` (``corrected``):

- a fused projection sharded ``colwise`` whose output the ``forward`` splits with
  ``.chunk(2, ...)`` (InklingExperts: ``linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)``)
  holds two packed blocks, gate and up: plain ``colwise`` gives one rank the gate half and
  the other the up half; ``packed_colwise`` (``SS(d,2)``) gives each rank its chunk of both.
"""

from __future__ import annotations

import ast
from typing import Any

from hpgen.errors import HpgenError
from hpgen.planner.boundary import generic
from hpgen.planner.styles import Rule

__all__ = ["PackedChunks", "chunked_attributes"]


class PackedChunks:
    """The correction step of a :class:`~hpgen.planner.translator.Translator`, run on its rules."""

    rules: dict[str, Rule]
    modules: dict[str, Any]
    corrected: dict[str, str]

    def _correct_packed_chunks(self) -> None:
        """``colwise`` on a fused projection whose output ``forward`` splits with ``chunk(2)``
        becomes ``packed_colwise``, noted in :attr:`corrected`."""
        for fqn, rule in sorted(self.rules.items()):
            if rule.style != "colwise" or rule.via_module:
                continue
            owner_fqn, _, attr = fqn.rpartition(".")
            owner = self.modules.get(owner_fqn)
            if owner is None:
                continue
            try:
                info = self._forward_owner(owner, owner_fqn)  # type: ignore[attr-defined]
                parsed = self._source_of(type(owner))[1]  # type: ignore[attr-defined]
            except HpgenError:  # a class with no source to read (torch's own)
                continue
            if attr not in chunked_attributes(parsed.tree, info.name):
                continue
            for name, other in list(self.rules.items()):
                if name == fqn or (name.startswith(fqn + ".") and other.via_module and other.style == "colwise"):
                    self.rules[name] = Rule("packed_colwise", other.axis, other.via_module)
            self.corrected[generic(fqn)] = (
                f"transformers' plan says colwise, but {info.name}.forward splits the output of {attr} with "
                "chunk(2): two packed blocks, so packed_colwise (each rank takes its chunk of both)"
            )


def _class_of(tree: ast.Module, class_name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)


def _methods(node: ast.ClassDef | None) -> dict[str, ast.FunctionDef]:
    return {s.name: s for s in (node.body if node is not None else ()) if isinstance(s, ast.FunctionDef)}


def _chunk_receivers(function: ast.FunctionDef, parts: int) -> list[ast.expr]:
    """The expressions split by ``.chunk(parts, ...)`` in ``function``."""
    found = []
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "chunk"):
            continue
        count = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "chunks"), None)
        if isinstance(count, ast.Constant) and count.value == parts:
            found.append(node.func.value)
    return found


def _self_attributes(node: ast.AST) -> set[str]:
    return {
        inner.attr
        for inner in ast.walk(node)
        if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self"
    }


def chunked_attributes(tree: ast.Module, class_name: str, parts: int = 2) -> set[str]:
    """Names ``X`` of ``self.X`` whose value ``class_name.forward`` splits into ``parts`` blocks.

    Either ``self.X`` is read inside the receiver of a ``.chunk(parts, ...)`` call, or inside an
    argument of a call of a method of the class (``self._apply_gate(linear(x, self.X[e]))``)
    whose parameter at that place is the receiver of such a call.
    """
    node = _class_of(tree, class_name)
    methods = _methods(node)
    forward = methods.get("forward")
    if forward is None:
        return set()
    found: set[str] = set()
    for receiver in _chunk_receivers(forward, parts):
        found |= _self_attributes(receiver)
    chunked_params: dict[str, set[int]] = {}  # method -> positions (after self) of chunked parameters
    for name, method in methods.items():
        params = [a.arg for a in method.args.args][1:]
        names = {n.id for r in _chunk_receivers(method, parts) for n in ast.walk(r) if isinstance(n, ast.Name)}
        chunked_params[name] = {i for i, p in enumerate(params) if p in names}
    for call in ast.walk(forward):
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "self"
        ):
            continue
        for position in chunked_params.get(call.func.attr, ()):
            if position < len(call.args):
                found |= _self_attributes(call.args[position])
    return found
