"""Which layer feeds which: an abstract run of the ``forward`` bodies of a module tree.

The derived planner needs to know, inside one decoder layer, that ``o_proj`` consumes
what ``q_proj``/``k_proj``/``v_proj`` produced (through the attention), that ``fc2``
consumes ``fc1`` (through an activation), and whether a module's return value comes from
its output projection alone or also from its input (a residual added inside). This
module answers that from the source, without running any tensor code:

- :func:`run_module` interprets a module's ``forward`` (and the methods of its own class
  it calls) over abstract values: each value is the set of *origins* it was computed
  from, an origin being a leaf layer (``nn.Linear``, ``Conv1D``, a norm: a module whose
  ``forward`` is not in the modeling file, or one that holds parameters of its own) or a
  marker ``in:<name>`` for a ``forward`` parameter. Arithmetic, tensor methods and
  functions (the attention kernel, activations, rotary) mix their operands' origins; a
  call of a child module defined in the file is interpreted in turn, with its own
  instance, so ``self.mlp(x)`` is followed into ``mlp.down_proj``.
- Every call of a leaf is an *edge* (origins of its input -> the leaf); every shape call
  (``view``, ``reshape``, ``split``, ``chunk``...) is recorded with the origins of the
  tensor it reshapes and the module attributes its arguments read (``self.num_heads``),
  which is how the planner finds a fused projection's layout and the attributes that hold
  global head counts.
- ``if`` tests that read only module attributes and constants (``self.multi_query``,
  ``self.config._attn_implementation == "sdpa"``) take the branch the instance takes;
  other tests take both, merged.

The interpretation over-approximates (a value may list an origin it does not depend on),
never the reverse for the constructs it understands; an unknown construct mixes all its
operands. torch is imported only for ``isinstance`` checks on the live instance.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpgen.planner.load import defined_in

__all__ = ["Flow", "ShapeUse", "Val", "leaf_kind", "run_module"]

# Tensor methods and torch functions that only reshape: their arguments are sizes.
SHAPE_METHODS = frozenset(
    {"view", "reshape", "split", "chunk", "unflatten", "expand", "repeat", "narrow", "tensor_split", "new_zeros"}
)
# Attribute reads that give metadata, not data: their value has no origin.
METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "T_"})
METADATA_CALLS = frozenset({"size", "dim", "numel", "get_seq_length", "element_size", "stride", "is_contiguous"})
_UNKNOWN = object()
_MAX_DEPTH = 24


@dataclass(frozen=True)
class Val:
    """An abstract value: the origins it depends on, tuple items, attribute reads, or a module reference.

    ``reads`` are ``(module_fqn, attribute_path)`` pairs of module attributes the value's
    expression read (``self.num_heads`` -> ``("model.layers.0.self_attn", "num_heads")``),
    kept for integers that size a reshape. ``modules`` is set for a reference to child
    modules (``self.q_proj``, the elements of ``self.experts``), which only calls use.
    """

    origins: frozenset[str] = frozenset()
    items: tuple[Val, ...] | None = None
    reads: frozenset[tuple[str, str]] = frozenset()
    modules: tuple[str, ...] | None = None
    const: Any = None  # the Python value of a size expression, when module attributes decide it

    def whole(self) -> frozenset[str]:
        """Every origin, the items' included."""
        if self.items is None:
            return self.origins
        found = set(self.origins)
        for item in self.items:
            found |= item.whole()
        return frozenset(found)

    def all_reads(self) -> frozenset[tuple[str, str]]:
        if self.items is None:
            return self.reads
        found = set(self.reads)
        for item in self.items:
            found |= item.all_reads()
        return frozenset(found)

    def item(self, index: int) -> Val:
        if self.items is not None and -len(self.items) <= index < len(self.items):
            return self.items[index]
        return Val(self.whole(), reads=self.all_reads())


EMPTY = Val()


def union(values: Iterable[Val]) -> Val:
    """One value depending on everything the given values depend on (tuple structure dropped)."""
    origins: set[str] = set()
    reads: set[tuple[str, str]] = set()
    for value in values:
        origins |= value.whole()
        reads |= value.all_reads()
    # Reads matter only for sizes (``self.num_heads * self.head_dim``); a tensor drops them.
    return Val(frozenset(origins), reads=frozenset() if origins else frozenset(reads))


def merge(a: Val, b: Val) -> Val:
    """Join of two branches: item-wise where both are tuples of one length."""
    if a is b:
        return a
    if a.items is not None and b.items is not None:
        # a tuple of either length: item i merges both where both have it (``outputs += (attn_weights,)``)
        longer = a.items if len(a.items) >= len(b.items) else b.items
        common = tuple(merge(x, y) for x, y in zip(a.items, b.items))
        return Val(a.origins | b.origins, common + longer[len(common) :], a.reads | b.reads)
    if a.modules is not None and b.modules is not None:
        return Val(modules=tuple(dict.fromkeys((*a.modules, *b.modules))))
    if a.modules is not None and not b.whole():
        return a
    if b.modules is not None and not a.whole():
        return b
    return union((a, b))


@dataclass(frozen=True)
class ShapeUse:
    """One reshape-like call: where, on what, and with which size arguments."""

    module: str  # FQN of the module whose code made the call
    method: str  # view, reshape, split, chunk, ...
    receiver: frozenset[str]  # origins of the tensor reshaped
    args: tuple[ast.expr, ...]
    arg_vals: tuple[Val, ...]
    line: int
    dim: int | None = None  # a constant ``dim=`` keyword


@dataclass
class Flow:
    """What one abstract run found."""

    edges: dict[str, set[str]] = field(default_factory=dict)  # leaf FQN -> origins of its inputs
    inputs: dict[str, set[str]] = field(default_factory=dict)  # leaf FQN -> origins of its first (data) input
    leaf_calls: dict[str, int] = field(default_factory=dict)  # leaf FQN -> how many call sites
    shapes: list[ShapeUse] = field(default_factory=list)
    raw_params: dict[str, set[str]] = field(default_factory=dict)  # module FQN -> parameters its code reads
    config_reads: dict[str, set[str]] = field(default_factory=dict)  # module FQN -> config.<attr> its code reads
    modules_run: set[str] = field(default_factory=set)  # modules whose forward in the source was interpreted
    result: Val = EMPTY
    first_input: str | None = None  # the first forward parameter of the module run (the residual stream)
    unsupported: list[str] = field(default_factory=list)


def leaf_kind(module: Any, source: Path) -> str:
    """``source`` when the module's ``forward`` is interpreted, ``sequential``, ``container`` or ``leaf``.

    A leaf is a layer: an ``nn.Linear`` or ``nn.Embedding`` (whatever its forward, as
    FalconLinear's), a module holding parameters of its own and no children (a norm, an
    experts module with its 3-D weights), or one whose ``forward`` is not in the file. A
    module with parameters *and* children (an attention with per-head scales, a Mamba
    mixer with ``A_log``) is interpreted; its code's direct reads of those parameters show
    up as ``param:<fqn>`` origins.
    """
    import torch.nn as nn

    if isinstance(module, nn.Sequential):
        return "sequential"
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return "container"
    own = any(True for _ in module.parameters(recurse=False))
    if isinstance(module, (nn.Linear, nn.Embedding)) or (own and not any(True for _ in module.children())):
        return "leaf"
    if _is_norm(module) and not any(True for _ in module.children()):
        return "leaf"  # a norm without weights (an L2 norm) still mixes what it normalises
    owner = _forward_owner(type(module), "forward")
    if owner is None or not defined_in(owner, source):
        return "leaf"
    return "source"


def run_module(
    model: Any,
    fqn: str,
    source: Path,
    *,
    inputs: Mapping[str, Val] | None = None,
    names: Mapping[int, str] | None = None,
) -> Flow:
    """Interpret ``model.get_submodule(fqn).forward`` with ``in:<param>`` markers (or ``inputs``)."""
    if names is None:
        names = module_names(model)
    flow = Flow()
    module = model.get_submodule(fqn) if fqn else model
    runner = _Runner(model, source, names, flow)
    flow.result = runner.call_module(fqn, module, None, inputs, depth=0, markers=inputs is None)
    return flow


def module_names(model: Any) -> dict[int, str]:
    """id(module) -> its first FQN."""
    found: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        found.setdefault(id(module), name)
    return found


# --------------------------------------------------------------------------- the interpreter


class _Runner:
    def __init__(self, model: Any, source: Path, names: Mapping[int, str], flow: Flow) -> None:
        self.model = model
        self.source = source
        self.names = names
        self.flow = flow
        self.stack: list[tuple[str, str]] = []

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
    ) -> Val:
        """The value a call of ``module`` (at ``fqn``) returns."""

        kind = leaf_kind(module, self.source) if method == "forward" else "source"
        if kind == "sequential":
            value = union([*(args or []), *(kwargs or {}).values()])
            for name, child in module.named_children():
                value = self.call_module(f"{fqn}.{name}" if fqn else name, child, [value], {}, depth=depth + 1)
            return value
        if kind == "container":
            return union([*(args or []), *(kwargs or {}).values()])
        if kind == "leaf":
            incoming = union([*(args or []), *(kwargs or {}).values()])
            if not any(True for _ in module.parameters(recurse=True)) and not _is_norm(module):
                return Val(incoming.whole())  # an activation, a dropout, a rotary table: transparent
            self.flow.edges.setdefault(fqn, set()).update(incoming.whole())
            first = (args or [None])[0] if args else next(iter((kwargs or {}).values()), None)
            self.flow.inputs.setdefault(fqn, set()).update(first.whole() if first is not None else ())
            self.flow.leaf_calls[fqn] = self.flow.leaf_calls.get(fqn, 0) + 1
            return Val(frozenset({fqn}))
        function = _function(type(module), method)
        if function is None or depth > _MAX_DEPTH or (fqn, method) in self.stack:
            return union([*(args or []), *(kwargs or {}).values()])
        self.flow.modules_run.add(fqn)
        env = self._bind(function, args, kwargs, markers)
        if markers and depth == 0:
            spec = function.args
            positional = [a.arg for a in (*spec.posonlyargs, *spec.args)][1:]
            self.flow.first_input = positional[0] if positional else None
        self.stack.append((fqn, method))
        try:
            frame = _Frame(self, fqn, module, env, depth)
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


class _Frame:
    """One interpreted function body: its environment, constants and returns."""

    def __init__(self, runner: _Runner, fqn: str, module: Any, env: dict[str, Val], depth: int) -> None:
        self.runner = runner
        self.fqn = fqn
        self.module = module
        self.env = env
        self.consts: dict[str, Any] = {}
        self.depth = depth
        self.returns: list[Val] = []

    def returned(self) -> Val:
        if not self.returns:
            return EMPTY
        value = self.returns[0]
        for other in self.returns[1:]:
            value = merge(value, other)
        return value

    # -- statements

    def block(self, statements: list[ast.stmt]) -> None:
        for statement in statements:
            self.statement(statement)

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign):
            value = self.expr(node.value)
            const = self.const(node.value)
            for target in node.targets:
                self.assign(target, value, const)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.assign(node.target, self.expr(node.value), self.const(node.value))
        elif isinstance(node, ast.AugAssign):
            value = self.expr(node.value)
            if isinstance(node.target, ast.Name):
                before = self.env.get(node.target.id, EMPTY)
                if isinstance(node.op, ast.Add) and before.items is not None:
                    self.env[node.target.id] = Val(items=before.items + _as_items(value))
                else:
                    self.env[node.target.id] = union((before, value))
                self.consts.pop(node.target.id, None)
            else:
                self.assign(node.target, union((self.expr(node.target), value)), _UNKNOWN)
        elif isinstance(node, ast.Return):
            self.returns.append(self.expr(node.value) if node.value is not None else EMPTY)
        elif isinstance(node, ast.Expr):
            self.expr(node.value)
        elif isinstance(node, ast.If):
            test = self.const(node.test)
            self.expr(node.test)
            if test is _UNKNOWN:
                self.branches([node.body, node.orelse])
            else:
                self.block(node.body if test else node.orelse)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            iterated = self.expr(node.iter)
            for _ in range(2):
                self.branches([node.body, []], loop_target=(node.target, iterated))
            self.block(node.orelse)
        elif isinstance(node, ast.While):
            self.expr(node.test)
            for _ in range(2):
                self.branches([node.body, []])
            self.block(node.orelse)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                value = self.expr(item.context_expr)
                if item.optional_vars is not None:
                    self.assign(item.optional_vars, value, _UNKNOWN)
            self.block(node.body)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            self.block(node.body)
            for handler in node.handlers:
                self.branches([handler.body, []])
            self.block(node.orelse)
            self.block(node.finalbody)
        elif isinstance(node, ast.Match):
            self.expr(node.subject)
            self.branches([case.body for case in node.cases] + [[]])
        elif isinstance(node, (ast.Raise, ast.Assert, ast.Pass, ast.Break, ast.Continue, ast.Delete, ast.Global)):
            return
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
            return
        else:
            self.runner.flow.unsupported.append(f"{self.fqn}: {type(node).__name__}")

    def branches(self, bodies: list[list[ast.stmt]], loop_target: tuple[ast.expr, Val] | None = None) -> None:
        """Run each body from the current state and join the results (returns accumulate)."""
        start_env, start_consts = dict(self.env), dict(self.consts)
        results = []
        for body in bodies:
            self.env, self.consts = dict(start_env), dict(start_consts)
            if loop_target is not None and body:
                target, iterated = loop_target
                self.assign(target, _element(iterated), _UNKNOWN)
            self.block(body)
            results.append((self.env, self.consts))
        env: dict[str, Val] = {}
        for name in {name for result, _ in results for name in result}:
            values = [result[name] for result, _ in results if name in result]
            value = values[0]
            for other in values[1:]:
                value = merge(value, other)
            env[name] = value
        consts = {
            name: value
            for name, value in results[0][1].items()
            if all(name in other and _same(other[name], value) for _, other in results[1:])
        }
        self.env, self.consts = env, consts

    def assign(self, target: ast.expr, value: Val, const: Any) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
            if const is _UNKNOWN:
                self.consts.pop(target.id, None)
            else:
                self.consts[target.id] = const
        elif isinstance(target, (ast.Tuple, ast.List)):
            starred = [i for i, element in enumerate(target.elts) if isinstance(element, ast.Starred)]
            for index, element in enumerate(target.elts):
                if isinstance(element, ast.Starred):
                    self.assign(element.value, union([value]), _UNKNOWN)
                elif starred and index > starred[0]:
                    self.assign(element, value.item(index - len(target.elts)), _UNKNOWN)
                else:
                    self.assign(element, value.item(index), _UNKNOWN)
        elif isinstance(target, ast.Subscript):
            base = target.value
            while isinstance(base, ast.Subscript):
                base = base.value
            if isinstance(base, ast.Name):
                self.env[base.id] = union((self.env.get(base.id, EMPTY), value))
        elif isinstance(target, ast.Starred):
            self.assign(target.value, value, _UNKNOWN)

    # -- expressions

    def expr(self, node: ast.expr | None) -> Val:
        if node is None:
            return EMPTY
        method = getattr(self, f"_{type(node).__name__}", None)
        if method is not None:
            value = method(node)
        else:
            value = union(self.expr(child) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr))
        if value.items is None and value.modules is None and not value.origins:
            const = self.const(node)
            if isinstance(const, (int, float, tuple, list)) and not isinstance(const, bool):
                value = Val(reads=value.reads, const=const)
        return value

    def _Constant(self, node: ast.Constant) -> Val:
        return EMPTY

    def _Name(self, node: ast.Name) -> Val:
        if node.id == "self":
            return Val(modules=(self.fqn,))
        return self.env.get(node.id, EMPTY)

    def _Tuple(self, node: ast.Tuple) -> Val:
        return Val(items=tuple(self._element_value(e) for e in node.elts))

    _List = _Tuple

    def _element_value(self, node: ast.expr) -> Val:
        if isinstance(node, ast.Starred):
            return union([self.expr(node.value)])
        return self.expr(node)

    def _Attribute(self, node: ast.Attribute) -> Val:
        path = _self_path(node)
        if path is not None:
            return self.self_attribute(path)
        value = self.expr(node.value)
        if node.attr in METADATA_ATTRS:
            return _size_of(value)
        return union([value]) if value.modules is None else value

    def self_attribute(self, path: str) -> Val:
        """``self.<path>``: a child module, a parameter read directly, or a plain attribute."""
        import torch
        import torch.nn as nn

        obj: Any = self.module
        walked = []
        for part in path.split("."):
            if isinstance(obj, nn.Module) and part in obj._parameters:
                owner = self._name_of(obj)
                full = f"{owner}.{part}" if owner else part
                self.runner.flow.raw_params.setdefault(self.fqn, set()).add(".".join([*walked, part]))
                return Val(frozenset({f"param:{full}"}))
            try:
                obj = getattr(obj, part)
            except Exception:  # an attribute this instance does not have: code that cannot run on it
                return Val(reads=frozenset({(self.fqn, f"missing:{path}")}))
            walked.append(part)
            if walked[0] == "config" and len(walked) == 2:
                self.runner.flow.config_reads.setdefault(self.fqn, set()).add(part)
        if isinstance(obj, nn.Module):
            return Val(modules=(self._name_of(obj),))
        if isinstance(obj, torch.Tensor):  # a buffer
            return EMPTY
        if inspect.ismethod(obj) and getattr(obj, "__self__", None) is self.module:
            return Val(modules=(self.fqn,), reads=frozenset({(self.fqn, f"method:{path}")}))
        return Val(reads=frozenset({(self.fqn, path)}))

    def _name_of(self, module: Any) -> str:
        return self.runner.names.get(id(module), "")

    def _Subscript(self, node: ast.Subscript) -> Val:
        value = self.expr(node.value)
        index = self.const(node.slice)
        if value.modules is not None:
            return self._module_item(value, index)
        if isinstance(index, int) and not isinstance(index, bool):
            return value.item(index)
        if isinstance(index, slice) and value.items is not None:
            return Val(items=value.items[index])
        return union((value, Val(reads=self.expr(node.slice).all_reads())))

    def _module_item(self, value: Val, index: Any) -> Val:
        import torch.nn as nn

        found: list[str] = []
        for fqn in value.modules or ():
            container = self.runner.model.get_submodule(fqn) if fqn else self.runner.model
            children = list(container.named_children()) if isinstance(container, (nn.ModuleList, nn.Sequential)) else []
            if isinstance(container, nn.ModuleDict):
                children = list(container.items())
                if isinstance(index, str):
                    children = [(k, v) for k, v in children if k == index]
            elif isinstance(index, int) and not isinstance(index, bool) and children:
                children = [children[index]] if -len(children) <= index < len(children) else []
            elif isinstance(index, slice) and children:
                children = children[index]
            found += [f"{fqn}.{name}" if fqn else name for name, _ in children]
        return Val(modules=tuple(found))

    def _Call(self, node: ast.Call) -> Val:
        func = node.func
        args: list[Val] = []
        for arg in node.args:  # f(*shape) with a known tuple: its items are the arguments
            value = self.expr(arg.value) if isinstance(arg, ast.Starred) else None
            if value is not None and value.items is not None:
                args.extend(value.items)
            else:
                args.append(self._element_value(arg))
        kwargs = {kw.arg: self.expr(kw.value) for kw in node.keywords if kw.arg is not None}
        spread = [self.expr(kw.value) for kw in node.keywords if kw.arg is None]
        operands = [*args, *kwargs.values(), *spread]
        if spread:
            kwargs["**"] = union(spread)  # reaches the callee's **kwargs
        if isinstance(func, ast.Attribute):
            path = _self_path(func)
            if path is not None:  # self.q_proj(x), self._split_heads(x), self.act_fn(x)
                callee = self.self_attribute(path)
                method = _method_name(callee)
                if method is not None:
                    return self.runner.call_module(
                        self.fqn, self.module, args, kwargs, depth=self.depth + 1, method=method
                    )
                if callee.modules is not None:
                    return self._call_modules(callee.modules, args, kwargs)
                if any(read.startswith("missing:") for _, read in callee.reads):
                    return EMPTY  # self.q_attn(...) on an instance without q_attn: a branch it never takes
                if callee.origins:  # a method of a parameter read directly: self.conv1d.weight.squeeze(1)
                    return union([callee, *operands])
                return union(operands)
            receiver = self.expr(func.value)
            if receiver.modules is not None:  # layer.forward(x) on a module reference
                return self._call_modules(receiver.modules, args, kwargs) if func.attr == "forward" else union(operands)
            if func.attr in METADATA_CALLS:
                return _size_of(receiver)
            torch_name = _torch_call(func)
            if torch_name is None and func.attr.endswith("_") and not func.attr.startswith("_") and operands:
                self._in_place(func.value, operands)  # key_states[..., :d].copy_(k_nope): key_states now holds it
            if func.attr in SHAPE_METHODS and torch_name is None:
                self._shape(func.attr, receiver, node, args)
            elif torch_name in SHAPE_METHODS and args:
                self._shape(torch_name, args[0], node, args[1:], skip=1)
            return union([receiver, *operands])
        passed = [a for a in args if a.modules is not None and _method_name(a) is not None]
        if passed:  # apply_chunking_to_forward(self.feed_forward_chunk, ..., x): the method runs on the tensors
            tensors = [a for a in args if a.whole()]
            results = [
                self.runner.call_module(
                    self.fqn, self.module, tensors, {}, depth=self.depth + 1, method=_method_name(m) or ""
                )
                for m in passed
            ]
            return union([*results, *operands])
        if isinstance(func, ast.Name):
            callee = self.env.get(func.id)
            if callee is not None and callee.modules is not None:  # a loop variable over a module list
                return self._call_modules(callee.modules, args, kwargs)
            if func.id in ("len", "isinstance", "hasattr", "getattr", "type", "id", "range"):
                return Val(reads=union(operands).all_reads())
            if callee is None:
                paired = self._tuple_function(func.id, args, kwargs)
                if paired is not None:
                    return paired
            return union(operands)
        callee = self.expr(func)  # self.layers[i](x), a call's result called
        if callee.modules is not None:
            return self._call_modules(callee.modules, args, kwargs)
        return union([callee, *operands])

    def _in_place(self, target: ast.expr, operands: list[Val]) -> None:
        """An in-place tensor method (``x[..., :d].copy_(y)``, ``x.add_(y)``): the variable it writes into
        depends on the operands from now on."""
        while isinstance(target, (ast.Subscript, ast.Attribute)) and not _self_path(target):
            target = target.value
        if isinstance(target, ast.Name) and target.id in self.env:
            self.env[target.id] = union((self.env[target.id], *operands))

    def _tuple_function(self, name: str, args: list[Val], kwargs: Mapping[str, Val]) -> Val | None:
        """A call of a function of the module's file that returns a tuple (``apply_rotary_pos_emb(q, k, ...)``):
        interpreted, so that each item keeps its own origins (``k_embed`` does not depend on ``q``).
        Other functions mix their operands, as any unknown call."""
        try:
            path = inspect.getsourcefile(type(self.module))
        except TypeError:
            return None
        function = _module_functions(path).get(name) if path else None
        if function is None or self.depth > _MAX_DEPTH or ("", name) in self.runner.stack:
            return None
        spec = function.args
        names = [a.arg for a in (*spec.posonlyargs, *spec.args)]
        if spec.vararg is not None or len(args) > len(names):
            return None
        env = dict(zip(names, args))
        known = set(names) | {a.arg for a in spec.kwonlyargs}
        env.update({key: value for key, value in kwargs.items() if key in known})
        if spec.kwarg is not None:
            env[spec.kwarg.arg] = union(value for key, value in kwargs.items() if key not in known)
        shapes = len(self.runner.flow.shapes)
        self.runner.stack.append(("", name))
        try:
            frame = _Frame(self.runner, self.fqn, self.module, env, self.depth + 1)
            frame.block(function.body)
            value = frame.returned()
        finally:
            self.runner.stack.pop()
            del self.runner.flow.shapes[shapes:]  # its reshapes are of its own locals, not of the caller's values
        return value if value.items is not None else None

    def _call_modules(self, modules: tuple[str, ...], args: list[Val], kwargs: Mapping[str, Val]) -> Val:
        result: Val | None = None
        for fqn in modules:
            module = self.runner.model.get_submodule(fqn) if fqn else self.runner.model
            value = self.runner.call_module(fqn, module, args, kwargs, depth=self.depth + 1)
            result = value if result is None else merge(result, value)
        return result if result is not None else EMPTY

    def _shape(self, method: str, receiver: Val, node: ast.Call, args: list[Val], skip: int = 0) -> None:
        self.runner.flow.shapes.append(
            ShapeUse(
                self.fqn,
                method,
                receiver.whole(),
                tuple(node.args[skip:])
                + tuple(kw.value for kw in node.keywords if kw.arg in ("split_size", "chunks", "sections")),
                tuple(args),
                node.lineno,
                next(
                    (
                        self.const(kw.value)
                        for kw in node.keywords
                        if kw.arg == "dim" and isinstance(self.const(kw.value), int)
                    ),
                    None,
                ),
            )
        )

    def _BinOp(self, node: ast.BinOp) -> Val:
        left, right = self.expr(node.left), self.expr(node.right)
        if isinstance(node.op, ast.Add) and left.items is not None:
            return Val(items=left.items + _as_items(right))  # (out,) + rest: out stays item 0
        if isinstance(node.op, ast.Add) and right.items is not None and _nothing(left):
            return right
        if isinstance(node.op, ast.Add) and right.items is not None and not left.whole():
            # x.size()[:-1] + (heads, 3 * head_size): a shape with an unknown prefix and known last sizes
            return Val(items=(union([left]), *right.items))
        return union((left, right))

    def _Lambda(self, node: ast.Lambda) -> Val:
        return EMPTY

    def _IfExp(self, node: ast.IfExp) -> Val:
        test = self.const(node.test)
        if test is _UNKNOWN:
            return merge(self.expr(node.body), self.expr(node.orelse))
        return self.expr(node.body if test else node.orelse)

    def _NamedExpr(self, node: ast.NamedExpr) -> Val:
        value = self.expr(node.value)
        self.assign(node.target, value, self.const(node.value))
        return value

    def _ListComp(self, node: ast.ListComp) -> Val:
        for generator in node.generators:
            iterated = self.expr(generator.iter)
            self.assign(generator.target, _element(iterated), _UNKNOWN)
        return Val(union([self.expr(node.elt)]).origins)

    _GeneratorExp = _ListComp
    _SetComp = _ListComp

    # -- constants (for branch tests)

    def const(self, node: ast.expr | None) -> Any:
        """The Python value of ``node`` when module attributes and constants decide it, else unknown."""
        if node is None:
            return _UNKNOWN
        try:
            return self._const(node)
        except Exception:
            return _UNKNOWN

    def _const(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.consts.get(node.id, _UNKNOWN)
        path = _self_path(node)
        if path is not None:
            obj: Any = self.module
            for part in path.split("."):
                obj = getattr(obj, part)
            if path == "training":
                return _UNKNOWN
            import torch

            return _UNKNOWN if isinstance(obj, torch.Tensor) else obj
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            value = self._const(node.operand)
            return _UNKNOWN if value is _UNKNOWN else not value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = self._const(node.operand)
            return _UNKNOWN if value is _UNKNOWN else -value
        if isinstance(node, ast.BoolOp):
            values = [self._const(v) for v in node.values]
            if isinstance(node.op, ast.And):
                if any(v is not _UNKNOWN and not v for v in values):
                    return False
                return _UNKNOWN if any(v is _UNKNOWN for v in values) else values[-1]
            if any(v is not _UNKNOWN and v for v in values):
                return True
            return _UNKNOWN if any(v is _UNKNOWN for v in values) else values[-1]
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = self._const(node.left), self._const(node.comparators[0])
            if left is _UNKNOWN or right is _UNKNOWN:
                return _UNKNOWN
            return _compare(node.ops[0], left, right)
        if isinstance(node, ast.BinOp):
            left, right = self._const(node.left), self._const(node.right)
            if left is _UNKNOWN or right is _UNKNOWN:
                return _UNKNOWN
            return _binop(node.op, left, right)
        if isinstance(node, ast.IfExp):
            test = self._const(node.test)
            if test is _UNKNOWN:
                return _UNKNOWN
            return self._const(node.body if test else node.orelse)
        if isinstance(node, (ast.Tuple, ast.List)):
            values = [self._const(e) for e in node.elts]
            return _UNKNOWN if any(v is _UNKNOWN for v in values) else tuple(values)
        if isinstance(node, ast.Slice):
            parts = [self._const(p) if p is not None else None for p in (node.lower, node.upper, node.step)]
            return _UNKNOWN if any(p is _UNKNOWN for p in parts) else slice(*parts)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = (
                self._const(node.args[0])
                if _self_path(node.args[0]) or isinstance(node.args[0], ast.Name)
                else _UNKNOWN
            )
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self":
                target = self.module
            name = self._const(node.args[1])
            if target is _UNKNOWN or not isinstance(name, str):
                return _UNKNOWN
            if node.func.id == "hasattr":
                return hasattr(target, name)
            default = self._const(node.args[2]) if len(node.args) > 2 else _UNKNOWN
            return getattr(target, name, default)
        return _UNKNOWN


# --------------------------------------------------------------------------- helpers


SIZE = "size"  # the module part of a read that records a tensor's size, not an attribute


def _size_of(value: Val) -> Val:
    """``x.shape`` / ``x.size()``: no data, but it remembers whose size it is (``bsz, len, dim = x.size()``)."""
    origins = value.whole()
    return Val(reads=frozenset({(SIZE, ",".join(sorted(origins)))})) if origins else EMPTY


def _is_norm(module: Any) -> bool:
    """A normalisation (with or without weights): it mixes the features it normalises, never transparent."""
    import torch.nn as nn

    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def _nothing(value: Val) -> bool:
    return value.items is None and value.modules is None and not value.origins


def _as_items(value: Val) -> tuple[Val, ...]:
    """The items a tuple gains from ``+ value``: its items, nothing for an empty value, else one unknown rest."""
    if value.items is not None:
        return value.items
    return () if _nothing(value) else (union([value]),)


def _element(iterated: Val) -> Val:
    """What a loop over ``iterated`` binds: each module of a module list, or the mixed value."""
    if iterated.modules is not None:
        return iterated  # calls on it call each element (see _Frame._Call)
    return union([iterated])


def _method_name(value: Val) -> str | None:
    for _, path in value.reads:
        if path.startswith("method:"):
            return path[len("method:") :].rpartition(".")[2]
    return None


def _self_path(node: ast.expr) -> str | None:
    """``self.a.b`` -> ``a.b``; anything else -> None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(reversed(parts))
    return None


def _torch_call(func: ast.Attribute) -> str | None:
    """``torch.reshape`` -> ``reshape``."""
    if isinstance(func.value, ast.Name) and func.value.id == "torch":
        return func.attr
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def _compare(op: ast.cmpop, left: Any, right: Any) -> Any:
    table = {
        ast.Eq: lambda: left == right,
        ast.NotEq: lambda: left != right,
        ast.Is: lambda: left is right,
        ast.IsNot: lambda: left is not right,
        ast.In: lambda: left in right,
        ast.NotIn: lambda: left not in right,
        ast.Lt: lambda: left < right,
        ast.LtE: lambda: left <= right,
        ast.Gt: lambda: left > right,
        ast.GtE: lambda: left >= right,
    }
    return bool(table[type(op)]()) if type(op) in table else _UNKNOWN


def _binop(op: ast.operator, left: Any, right: Any) -> Any:
    table = {
        ast.Add: lambda: left + right,
        ast.Sub: lambda: left - right,
        ast.Mult: lambda: left * right,
        ast.FloorDiv: lambda: left // right,
        ast.Div: lambda: left / right,
        ast.Mod: lambda: left % right,
    }
    return table[type(op)]() if type(op) in table else _UNKNOWN


def _forward_owner(cls: type, method: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``method``."""
    for klass in cls.__mro__:
        if method in vars(klass):
            return klass
    return None


def _function(cls: type, method: str) -> ast.FunctionDef | None:
    """The ast of ``method`` as ``cls`` resolves it (through its MRO), or None when not Python source."""
    owner = _forward_owner(cls, method)
    if owner is None or owner.__module__.startswith(("torch.", "builtins")):
        return None
    try:
        path = inspect.getsourcefile(owner)
    except TypeError:
        return None
    if path is None:
        return None
    for node in _class_nodes(path).get(owner.__qualname__, ()):
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == method:
                return statement  # type: ignore[return-value]
    return None


@lru_cache(maxsize=64)
def _module_functions(path: str) -> dict[str, ast.FunctionDef]:
    """Top-level functions of ``path`` every ``return`` of which returns a tuple display."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    found: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            if returns and all(isinstance(r.value, ast.Tuple) for r in returns):
                found[node.name] = node
    return found


@lru_cache(maxsize=64)
def _class_nodes(path: str) -> dict[str, tuple[ast.ClassDef, ...]]:
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    found: dict[str, list[ast.ClassDef]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            found.setdefault(node.name, []).append(node)
    return {name: tuple(nodes[-1:]) for name, nodes in found.items()}  # the last definition wins
