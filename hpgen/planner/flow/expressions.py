"""Expressions in the dataflow run: what each one's value depends on.

Names read the environment, ``self.<attr>`` a child module, a parameter read directly
or a plain attribute; calls of child modules run them (:mod:`~hpgen.planner.flow.runner`),
shape calls are recorded (:class:`~hpgen.planner.flow.values.ShapeUse`), and anything
else mixes its operands' origins.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping
from typing import Any

from hpgen.planner.flow.constants import self_path
from hpgen.planner.flow.functions import in_place, tuple_function
from hpgen.planner.flow.protocols import Interpreter
from hpgen.core.stubs import returns_none
from hpgen.planner.flow.values import (
    EMPTY,
    UNKNOWN,
    ShapeUse,
    Val,
    as_items,
    loop_element,
    merge,
    method_name,
    nothing,
    size_of,
    union,
)

__all__ = ["Expressions"]

# Tensor methods and torch functions that only reshape: their arguments are sizes.
SHAPE_METHODS = frozenset(
    {"view", "reshape", "split", "chunk", "unflatten", "expand", "repeat", "narrow", "tensor_split", "new_zeros"}
)
# Attribute reads that give metadata, not data: their value has no origin.
METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "T_"})
# Functions that call the method passed to them on chunks of the tensors after it and return
# only that method's (concatenated) result: transformers' ``apply_chunking_to_forward``.
CHUNKING_CALLS = frozenset({"apply_chunking_to_forward"})
METADATA_CALLS = frozenset({"size", "dim", "numel", "get_seq_length", "element_size", "stride", "is_contiguous"})
# torch functions that build a tensor from sizes alone (a state the code allocates): recorded in ``allocations``.
ALLOCATIONS = frozenset({"zeros", "ones", "empty", "full"})


class Expressions:
    """The expressions of a :class:`~hpgen.planner.flow.statements.Frame`."""

    runner: Interpreter
    fqn: str
    module: Any
    env: dict[str, Val]
    depth: int

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
        path = self_path(node)
        if path is not None:
            return self.self_attribute(path)
        value = self.expr(node.value)
        if node.attr in METADATA_ATTRS:
            return size_of(value)
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
            path = self_path(func)
            if path is not None:  # self.q_proj(x), self._split_heads(x), self.act_fn(x)
                callee = self.self_attribute(path)
                method = method_name(callee)
                if method is not None:
                    return self.runner.call_module(
                        self.fqn, self.module, args, kwargs, depth=self.depth + 1, method=method
                    )
                if callee.modules is not None:
                    return self._call_modules(callee.modules, args, kwargs, self.none_keywords(node))
                if any(read.startswith("missing:") for _, read in callee.reads):
                    return EMPTY  # self.q_attn(...) on an instance without q_attn: a branch it never takes
                if callee.origins:  # a method of a parameter read directly: self.conv1d.weight.squeeze(1)
                    return union([callee, *operands])
                return union(operands)
            receiver = self.expr(func.value)
            appends = func.attr in ("append", "extend", "insert") and isinstance(func.value, ast.Name)
            if appends and receiver.modules is None:
                # scan_outputs.append(y): the list now holds y too (torch.cat(scan_outputs) reads it)
                self.env[func.value.id] = union([receiver, *operands])
                return EMPTY
            if receiver.modules is not None:  # layer.forward(x) on a module reference
                return self._call_modules(receiver.modules, args, kwargs) if func.attr == "forward" else union(operands)
            if func.attr in METADATA_CALLS:
                return size_of(receiver)
            torch_name = torch_call(func)
            if torch_name is None and func.attr.endswith("_") and not func.attr.startswith("_") and operands:
                in_place(self, func.value, operands)  # key_states[..., :d].copy_(k_nope): key_states now holds it
            if func.attr in SHAPE_METHODS and torch_name is None:
                self._shape(func.attr, receiver, node, args)
            elif torch_name in SHAPE_METHODS and args:
                self._shape(torch_name, args[0], node, args[1:], skip=1)
            elif torch_name in ALLOCATIONS and args:
                sizes = args[:1] if torch_name == "full" else args  # torch.full(size, fill_value)
                self._shape(torch_name, Val(), node, sizes, record=self.runner.flow.allocations)
            return union([receiver, *operands])
        passed = [a for a in args if a.modules is not None and method_name(a) is not None]
        if passed:  # apply_chunking_to_forward(self.feed_forward_chunk, ..., x): the method runs on the tensors
            tensors = [a for a in args if a.whole()]
            results = [
                self.runner.call_module(
                    self.fqn, self.module, tensors, {}, depth=self.depth + 1, method=method_name(m) or ""
                )
                for m in passed
            ]
            if isinstance(func, ast.Name) and func.id in CHUNKING_CALLS:
                # it returns the method's result on chunks of the tensors, nothing of the tensors themselves
                return union([*results, *(Val(reads=a.all_reads()) for a in operands)])
            return union([*results, *operands])
        if isinstance(func, ast.Name):
            callee = self.env.get(func.id)
            if callee is not None and callee.modules is not None:  # a loop variable over a module list
                return self._call_modules(callee.modules, args, kwargs)
            if func.id in ("len", "isinstance", "hasattr", "getattr", "type", "id", "range"):
                return Val(reads=union(operands).all_reads())
            if func.id not in self.env and returns_none(self.module, func.id):
                return EMPTY  # a kernel stub whose torch fallback is ``return None`` (Mamba's mamba_inner_fn)
            if callee is None:  # a function of the file returning a tuple: item by item
                paired = tuple_function(self, func.id, args, kwargs)
                if paired is not None:
                    return paired
            return union([*operands, *self._passed_module_params(operands)])
        callee = self.expr(func)  # self.layers[i](x), a call's result called
        if callee.modules is not None:
            return self._call_modules(callee.modules, args, kwargs)
        return union([callee, *operands])

    def _passed_module_params(self, operands: list[Val]) -> list[Val]:
        """The own parameters of child modules handed to a function, read as ``self.<child>.<param>`` would be.

        transformers 5.25 moves a layer's short convolution into a module-level function that
        takes the layer (``causal_conv1d_forward(self.conv1d, x, ...)`` reads ``conv1d.weight``)
        where 5.24 read ``self.conv1d.weight`` in the ``forward``: the result depends on them,
        and they are the layer's raw parameters (Inkling's taps, sharded with the heads).
        """
        found = []
        for value in operands:
            if value.modules is None or method_name(value) is not None:
                continue
            for fqn in value.modules:
                if fqn == self.fqn or not fqn.startswith(f"{self.fqn}." if self.fqn else ""):
                    continue  # the module itself (its parameters are read by name) or not below it
                relative = fqn[len(self.fqn) + 1 :] if self.fqn else fqn
                own = [name for name, _ in self.runner.model.get_submodule(fqn).named_parameters(recurse=False)]
                for name in own:
                    self.runner.flow.raw_params.setdefault(self.fqn, set()).add(f"{relative}.{name}")
                found.append(Val(frozenset(f"param:{fqn}.{name}" for name in own)))
        return found

    def _call_modules(
        self, modules: tuple[str, ...], args: list[Val], kwargs: Mapping[str, Val], nones: frozenset[str] = frozenset()
    ) -> Val:
        result: Val | None = None
        for fqn in modules:
            module = self.runner.model.get_submodule(fqn) if fqn else self.runner.model
            value = self.runner.call_module(fqn, module, args, kwargs, depth=self.depth + 1, nones=nones)
            result = value if result is None else merge(result, value)
        return result if result is not None else EMPTY

    def none_keywords(self, node: ast.Call) -> frozenset[str]:
        """Keyword arguments of a call that are None on the path the instance takes (Falcon's ``alibi=alibi``
        where the model passes ``None`` for a rotary config): the callee's ``if alibi is None`` then folds."""
        return frozenset(
            kw.arg
            for kw in node.keywords
            if kw.arg is not None and isinstance(kw.value, (ast.Name, ast.Constant)) and self.const(kw.value) is None
        )

    def _shape(
        self, method: str, receiver: Val, node: ast.Call, args: list[Val], skip: int = 0, record: list | None = None
    ) -> None:
        (self.runner.flow.shapes if record is None else record).append(
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
            return Val(items=left.items + as_items(right))  # (out,) + rest: out stays item 0
        if isinstance(node.op, ast.Add) and right.items is not None and nothing(left):
            return right
        if isinstance(node.op, ast.Add) and right.items is not None and not left.whole():
            # x.size()[:-1] + (heads, 3 * head_size): a shape with an unknown prefix and known last sizes
            return Val(items=(union([left]), *right.items))
        return union((left, right))

    def _Lambda(self, node: ast.Lambda) -> Val:
        return EMPTY

    def _IfExp(self, node: ast.IfExp) -> Val:
        test = self.const(node.test)
        if test is UNKNOWN:
            return merge(self.expr(node.body), self.expr(node.orelse))
        return self.expr(node.body if test else node.orelse)

    def _NamedExpr(self, node: ast.NamedExpr) -> Val:
        value = self.expr(node.value)
        self.assign(node.target, value, self.const(node.value))
        return value

    def _ListComp(self, node: ast.ListComp) -> Val:
        for generator in node.generators:
            iterated = self.expr(generator.iter)
            self.assign(generator.target, loop_element(iterated), UNKNOWN)
        return Val(union([self.expr(node.elt)]).origins)

    _GeneratorExp = _ListComp
    _SetComp = _ListComp


def torch_call(func: ast.Attribute) -> str | None:
    """``torch.reshape`` -> ``reshape``."""
    if isinstance(func.value, ast.Name) and func.value.id == "torch":
        return func.attr
    return None
