"""Module calls in the dataflow run: leaves, interpreted ``forward`` bodies, and where their source is.

:func:`run_module` starts a run at one module. A call of a leaf layer records an edge;
a call of a module whose ``forward`` is in the modeling file binds the arguments and
interprets the body in a :class:`~hpgen.planner.flow.statements.Frame` (at most
``MAX_DEPTH`` deep, never recursively). :func:`function_def` finds a method's ``ast``
through the class's MRO.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpgen.planner.flow.module_level import module_level
from hpgen.planner.flow.statements import Frame
from hpgen.planner.flow.values import EMPTY, MAX_DEPTH, Flow, Val, union
from hpgen.planner.model.load import defined_in

__all__ = ["Runner", "function_def", "is_norm", "leaf_kind", "module_names", "run_module"]


def leaf_kind(module: Any, source: Path | tuple[Path, ...]) -> str:
    """``source`` when the module's ``forward`` is interpreted, ``sequential``, ``container`` or ``leaf``.

    A leaf is a layer: an ``nn.Linear`` or ``nn.Embedding`` (whatever its forward, as
    FalconLinear's), a module holding parameters of its own and no children (a norm, an
    experts module with its 3-D weights), or one whose ``forward`` is not in the file. A
    module with parameters *and* children (an attention with per-head scales, a Mamba
    mixer with ``A_log``) is interpreted; its code's direct reads of those parameters show
    up as ``param:<fqn>`` origins. ``source`` may be several files (a composite model's
    language model in a file of its own).
    """
    import torch.nn as nn

    if isinstance(module, nn.Sequential):
        return "sequential"
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return "container"
    own = any(True for _ in module.parameters(recurse=False))
    if isinstance(module, (nn.Linear, nn.Embedding)) or (own and not any(True for _ in module.children())):
        return "leaf"
    if is_norm(module) and not any(True for _ in module.children()):
        return "leaf"  # a norm without weights (an L2 norm) still mixes what it normalises
    owner = forward_owner(type(module), "forward")
    sources = source if isinstance(source, tuple) else (source,)
    if owner is None or not any(defined_in(owner, path) for path in sources):
        return "leaf"
    return "source"


def run_module(
    model: Any,
    fqn: str,
    source: Path,
    *,
    inputs: Mapping[str, Val] | None = None,
    names: Mapping[int, str] | None = None,
    open_leaf: bool = False,
    nones: frozenset[str] = frozenset(),
) -> Flow:
    """Interpret ``model.get_submodule(fqn).forward`` with ``in:<param>`` markers (or ``inputs``).

    ``open_leaf`` interprets the module's own ``forward`` even when it is a leaf (a module of
    the file holding parameters and no children, such as a recurrence with its gates): its
    direct parameter reads and reshapes are then recorded instead of one opaque edge.
    ``nones``: arguments known to be None (what the caller passes, see :mod:`~hpgen.planner.flow.caller_nones`).
    """
    if names is None:
        names = module_names(model)
    flow = Flow()
    module = model.get_submodule(fqn) if fqn else model
    runner = Runner(model, source, names, flow)
    runner.open_top = open_leaf
    flow.result = runner.call_module(fqn, module, None, inputs, depth=0, markers=inputs is None, nones=nones)
    return flow


def module_names(model: Any) -> dict[int, str]:
    """id(module) -> its first FQN."""
    found: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        found.setdefault(id(module), name)
    return found


class Runner:
    """One dataflow run: the model, its modeling file, the record it fills and the calls under way."""

    def __init__(self, model: Any, source: Path, names: Mapping[int, str], flow: Flow) -> None:
        self.model = model
        self.source = source
        self.names = names
        self.flow = flow
        self.stack: list[tuple[str, str]] = []
        self.open_top = False  # interpret the module the run starts at, even a leaf (see run_module)

    # -- calls

    def call_module(
        self,
        fqn: str,
        module: Any,
        args: list[Val] | None,
        kwargs: Mapping[str, Val] | None,
        *,
        depth: int,
        markers: bool = False,
        method: str = "forward",
        nones: frozenset[str] = frozenset(),
    ) -> Val:
        """The value a call of ``module`` (at ``fqn``) returns; ``nones``: its parameters known to be None."""

        kind = leaf_kind(module, self.source) if method == "forward" else "source"
        if kind == "leaf" and depth == 0 and self.open_top and function_def(type(module), method) is not None:
            kind = "source"
        if kind == "sequential":
            value = union([*(args or []), *(kwargs or {}).values()])
            for name, child in module.named_children():
                value = self.call_module(f"{fqn}.{name}" if fqn else name, child, [value], {}, depth=depth + 1)
            return value
        if kind == "container":
            return union([*(args or []), *(kwargs or {}).values()])
        if kind == "leaf":
            incoming = union([*(args or []), *(kwargs or {}).values()])
            if not any(True for _ in module.parameters(recurse=True)) and not is_norm(module):
                return Val(incoming.whole())  # an activation, a dropout, a rotary table: transparent
            self.flow.edges.setdefault(fqn, set()).update(incoming.whole())
            first = (args or [None])[0] if args else next(iter((kwargs or {}).values()), None)
            self.flow.inputs.setdefault(fqn, set()).update(first.whole() if first is not None else ())
            self.flow.leaf_calls[fqn] = self.flow.leaf_calls.get(fqn, 0) + 1
            return Val(frozenset({fqn}))
        function = function_def(type(module), method)
        if function is None or depth > MAX_DEPTH or (fqn, method) in self.stack:
            return union([*(args or []), *(kwargs or {}).values()])
        self.flow.modules_run.add(fqn)
        env = self._bind(function, args, kwargs, markers)
        if markers and depth == 0:
            spec = function.args
            positional = [a.arg for a in (*spec.posonlyargs, *spec.args)][1:]
            self.flow.first_input = positional[0] if positional else None
        self.stack.append((fqn, method))
        try:
            frame = Frame(self, fqn, module, env, depth)
            spec = function.args
            frame.consts.update(
                {a.arg: None for a in (*spec.posonlyargs, *spec.args, *spec.kwonlyargs) if a.arg in nones}
            )
            frame.block(function.body)
            return frame.returned()
        finally:
            self.stack.pop()

    def _bind(
        self, function: ast.FunctionDef, args: list[Val] | None, kwargs: Mapping[str, Val] | None, markers: bool
    ) -> dict[str, Val]:
        spec = function.args
        positional = [a.arg for a in (*spec.posonlyargs, *spec.args)][1:]  # after self
        env: dict[str, Val] = {}
        if markers:
            for name in (*positional, *(a.arg for a in spec.kwonlyargs)):
                env[name] = Val(frozenset({f"in:{name}"}))
            if spec.vararg is not None:
                env[spec.vararg.arg] = Val(frozenset({f"in:{spec.vararg.arg}"}))
            if spec.kwarg is not None:
                env[spec.kwarg.arg] = Val(frozenset({f"in:{spec.kwarg.arg}"}))
            if kwargs:
                env.update(kwargs)
            return env
        args = list(args or [])
        kwargs = dict(kwargs or {})
        for name, value in zip(positional, args):
            env[name] = value
        extra = args[len(positional) :]
        if spec.vararg is not None:
            env[spec.vararg.arg] = Val(items=tuple(extra)) if extra else EMPTY
        names = set(positional) | {a.arg for a in spec.kwonlyargs}
        rest = {}
        for name, value in kwargs.items():
            if name in names:
                env[name] = value
            else:
                rest[name] = value
        if spec.kwarg is not None:
            env[spec.kwarg.arg] = union(rest.values())
        return env


def is_norm(module: Any) -> bool:
    """A normalisation (with or without weights): it mixes the features it normalises, never transparent."""
    import torch.nn as nn

    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def forward_owner(cls: type, method: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``method``."""
    for klass in cls.__mro__:
        if method in vars(klass):
            return klass
    return None


def function_def(cls: type, method: str) -> ast.FunctionDef | None:
    """The ast of ``method`` as ``cls`` resolves it (through its MRO), or None when not Python source."""
    owner = forward_owner(cls, method)
    if owner is None or owner.__module__.startswith(("torch.", "builtins")):
        return None
    try:
        path = inspect.getsourcefile(owner)
    except TypeError:
        return None
    if path is None:
        return None
    for node in class_nodes(path).get(owner.__qualname__, ()):
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == method:
                return statement  # type: ignore[return-value]
    return None


@lru_cache(maxsize=64)
def class_nodes(path: str) -> dict[str, tuple[ast.ClassDef, ...]]:
    """Module-level classes by name, those defined under a module-level ``if``/``try`` too."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    found: dict[str, list[ast.ClassDef]] = {}
    for node in module_level(tree.body):
        if isinstance(node, ast.ClassDef):
            found.setdefault(node.name, []).append(node)
    return {name: tuple(nodes[-1:]) for name, nodes in found.items()}  # the last definition wins
