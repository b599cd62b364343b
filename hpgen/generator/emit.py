"""Emitters: render the jinja2 templates and splice the results into the libcst tree.

A rewritten boundary class keeps its original ``forward`` byte for byte as
``_forward_impl`` (decorators move to the new ``forward``), gains class-level identity
defaults at the top of its body, and gets the new ``forward`` right after
``_forward_impl``. The new ``forward`` takes the original's parameters, return
annotation and decorators as nodes, not as re-printed text, and its body is rendered
with the indentation and newline that the source itself uses.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

import jinja2
import libcst as cst

from hpgen.core.classify import Contract
from hpgen.core.transitions import ValueOps
from hpgen.core.header import Header
from hpgen.core.shared_sizes import SharedSizes, shared_sizes
from hpgen.generator.summed_edit import rewrite_summed


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The template environment: strict, and values go in validated or through repr."""
    folder = resources.files("hpgen.templates")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(folder)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["py"] = python_literal
    return env


def python_literal(value: object) -> str:
    """A Python literal for a str / int / bool / None / tuple, in double quotes, ASCII only.

    JSON string escapes are valid Python escapes, and ensure_ascii keeps every line
    break and control character escaped: nothing can leave the literal.
    """
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, (tuple, list)):
        items = [python_literal(item) for item in value]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    raise TypeError(f"no literal for {type(value).__name__}")


def render(template: str, **values: object) -> str:
    return environment().get_template(template).render(**values)


@dataclass(frozen=True)
class Style:
    """How the source writes code: indent unit, newline, and the parser config."""

    indent: str
    newline: str
    config: cst.PartialParserConfig

    @staticmethod
    def of(module: cst.Module) -> Style:
        return Style(module.default_indent, module.default_newline, module.config_for_parsing)

    def parse_statements(self, text: str, indent: str | None = None) -> list[cst.BaseStatement]:
        """Parse rendered code (written with ``\\n``) in the source's own style.

        ``indent`` is the unit the text's blocks were rendered with. libcst stores a block
        indented like the first block of the text as "the module's default", which is only
        right when ``indent`` is the module's: otherwise every block keeps it explicitly.
        """
        converted = text.replace("\n", self.newline)
        statements = list(cst.parse_module(converted, config=self.config).body)
        if indent is None or indent == self.indent:
            return statements
        explicit = _ExplicitIndent(indent)
        return [statement.visit(explicit) for statement in statements]


class _ExplicitIndent(cst.CSTTransformer):
    """Gives every block that uses the default indent an explicit ``indent``."""

    def __init__(self, indent: str) -> None:
        self.indent = indent

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> cst.IndentedBlock:
        return updated_node.with_changes(indent=self.indent) if updated_node.indent is None else updated_node


# --------------------------------------------------------------------------- forwards


def _call_arguments(params: cst.Parameters) -> tuple[str, str, str | None]:
    """(name of self, the argument list passing every parameter on, name of **kwargs)."""
    positional = [*params.posonly_params, *params.params]
    self_name = positional[0].name.value
    pieces = [param.name.value for param in positional[1:]]
    if isinstance(params.star_arg, cst.Param):
        pieces.append(f"*{params.star_arg.name.value}")
    pieces += [f"{param.name.value}={param.name.value}" for param in params.kwonly_params]
    kwargs_name = params.star_kwarg.name.value if params.star_kwarg is not None else None
    if kwargs_name is not None:
        pieces.append(f"**{kwargs_name}")
    return self_name, ", ".join(pieces), kwargs_name


def _fresh_name(preferred: str, taken: set[str]) -> str:
    name, count = preferred, 0
    while name in taken:
        count += 1
        name = f"_hp_{preferred}" if count == 1 else f"_hp_{preferred}_{count}"
    return name


@dataclass(frozen=True)
class _Value:
    """A declared input/output as the templates see it."""

    name: str
    ops: tuple[object, ...]
    address: tuple[object, ...]
    in_kwargs: bool
    transition: str


@dataclass(frozen=True)
class _TemplateOp:
    axis: str
    kind: str
    arguments: str
    comment: str
    # a group's leader: the statement that looks up the sizes every member's gather takes, and its comment
    lookup: str = ""
    lookup_comment: str = ""


_Sizes = dict[tuple[str, int], tuple[SharedSizes, str]]
# what finds a group's sizes: every rank's shard sizes before gathers, the split's sizes before splits
_LOOKUP = {"all_gather": "shard_sizes", "split": "split_sizes"}


def _template_value(
    value: ValueOps,
    parameters: set[str],
    *,
    generic: bool,
    sizes: _Sizes,
    self_name: str,
    side: str,
) -> _Value:
    shown = []
    for position, op in enumerate(value.ops):
        if op.is_identity and not generic:
            continue
        arguments, lookup, lookup_comment = op.call_arguments(), "", ""
        shared = sizes.get((value.name, position))
        if shared is not None:
            group, name = shared
            arguments += f", sizes={name}"
            if side == "in" and value.name == group.leader:
                found = f"{self_name}._hp_{op.axis}.{_LOOKUP[group.kind]}({', '.join(group.members)}, dim={group.dim!r})"
                lookup = f"{name} = {found}"
                followers = "".join(f", then {output}'s gather" for output, _ in group.outputs)
                lookup_comment = (
                    f"{', '.join(group.members)}: {op.axis} {op.src} -> {op.dst} alike{followers} ==> "
                    "their sizes found once"
                )
        shown.append(_TemplateOp(op.axis, op.kind, arguments, op.comment(), lookup, lookup_comment))
    transition = "; ".join(op.comment().split(": ", 1)[1] for op in value.ops if not op.is_identity)
    return _Value(value.name, tuple(shown), value.address, value.name not in parameters, transition or "identity")


def render_forward(
    contract: Contract, original: cst.FunctionDef, style: Style, *, mode: str, class_indent: str | None = None
) -> cst.FunctionDef:
    """The new ``forward`` of one contract, calling ``_forward_impl`` inside collectives.

    Its body is indented like the original's, or like its class for a one-line forward.
    """
    self_name, call_args, kwargs_name = _call_arguments(original.params)
    parameters = {
        param.name.value
        for param in (*original.params.posonly_params, *original.params.params, *original.params.kwonly_params)
    }
    generic = contract.form == "generic"
    taken = parameters | {p.name.value for p in (original.params.star_arg, original.params.star_kwarg) if isinstance(p, cst.Param)}
    sizes, output_sizes = _size_names(contract, taken) if not generic else ({}, {})
    inputs = [
        _template_value(value, parameters, generic=generic, sizes=sizes, self_name=self_name, side="in")
        for value in contract.inputs
    ]
    outputs = [
        _template_value(value, parameters, generic=generic, sizes=output_sizes, self_name=self_name, side="out")
        for value in contract.outputs
    ]
    inputs = [value for value in inputs if value.ops]
    outputs = [value for value in outputs if value.ops]
    body_block = original.body
    indent = class_indent or style.indent
    if isinstance(body_block, cst.IndentedBlock):
        indent = body_block.indent or style.indent
    values = dict(
        i=indent,
        self_name=self_name,
        form=contract.form,
        keys_comment=", ".join(f'param_plan["{key}"]' for key in contract.keys),
        inputs=inputs,
        outputs=outputs,
        call_args=call_args,
        kwargs_name=kwargs_name or "",
        result=_fresh_name("outputs", taken),
        region_target=contract.region_target,
        gate_failures=contract.gate_failures,
        summed_notes=_summed_notes(contract),
        **_undeclared_values(contract, parameters, kwargs_name),
    )
    if generic:
        text = render("generic.py.j2", **values)
    elif mode == "toggle":
        text = render(
            "toggle.py.j2",
            inputs_by_axis=_by_axis(inputs, contract.axes),
            outputs_by_axis=_by_axis(outputs, tuple(reversed(contract.axes))),
            **values,
        )
    else:
        text = render("tp_collective.py.j2", **values)
    (function,) = style.parse_statements(text, indent)
    assert isinstance(function, cst.FunctionDef)
    body = list(function.body.body)
    docstring = _docstring_statement(original)
    if docstring is not None:
        body.insert(0, docstring)
    return function.with_changes(
        params=original.params,
        returns=original.returns,
        decorators=original.decorators,
        asynchronous=original.asynchronous,
        body=function.body.with_changes(body=body),
        whitespace_before_params=original.whitespace_before_params,
        lines_after_decorators=original.lines_after_decorators,
        leading_lines=[cst.EmptyLine(indent=False)],
    )


def _size_names(contract: Contract, taken: set[str]) -> tuple[_Sizes, _Sizes]:
    """For the inputs, then the outputs: (value, op position) -> the group of values cut alike
    it belongs to and the local that holds their sizes (:mod:`hpgen.core.shared_sizes`)."""
    inputs: _Sizes = {}
    outputs: _Sizes = {}
    for group in shared_sizes(contract.inputs, contract.outputs):
        name = _fresh_name(f"_hp_{group.axis}_sizes", taken)
        taken.add(name)
        for member in group.members:
            inputs[(member, group.position)] = (group, name)
        for output, position in group.outputs:
            outputs[(output, position)] = (group, name)
    return inputs, outputs


def _summed_notes(contract: Contract) -> list[str]:
    """What a summed block's forward says about the reduction in its body and its shared input."""
    summed = contract.summed
    if summed is None:
        return []
    notes = [f"summed reduction: {' + '.join(summed.branches)} reduced once, in _forward_impl (marked there)"]
    if summed.shared_input is not None and summed.shared is not None:
        paired = f" (with {summed.paired_input}'s, one collective)" if summed.paired_input else ""
        notes.append(
            f"{summed.shared_input} output{paired}: {summed.axis} {summed.shared.src} -> {summed.shared.dst} ==> "
            f"{summed.shared.described()} for both branches, run in the norm's forward by parallelize"
        )
    return notes


def _undeclared_values(contract: Contract, parameters: set[str], kwargs_name: str | None) -> dict[str, object]:
    """What the templates need to copy the undeclared arguments into a sharded body."""
    names = tuple(name for name in contract.undeclared if name in parameters)
    kwargs = contract.undeclared_kwargs if contract.undeclared_kwargs == kwargs_name else None
    # Declared inputs that arrive in **kwargs get their own op (generic form): not copied twice.
    skip = tuple(sorted(value.name for value in contract.inputs if value.name not in parameters))
    return dict(
        undeclared=names,
        undeclared_kwargs=kwargs or "",
        kwargs_skip=f", skip={python_literal(skip)}" if skip and kwargs else "",
        undeclared_axes=contract.undeclared_axes if names or kwargs else (),
    )


def _by_axis(values: list[_Value], axes: tuple[str, ...]) -> list[tuple[str, list[tuple[_Value, _TemplateOp]]]]:
    grouped = []
    for axis in axes:
        pairs = [(value, op) for value in values for op in value.ops if op.axis == axis]
        if pairs:
            grouped.append((axis, pairs))
    return grouped


def _docstring_statement(function: cst.FunctionDef) -> cst.BaseStatement | None:
    if not isinstance(function.body, cst.IndentedBlock) or function.get_docstring(clean=False) is None:
        return None
    return function.body.body[0]


# --------------------------------------------------------------------------- classes


def _defaults_values(contract: Contract, mode: str) -> dict[str, object]:
    # The generic form moves declared values through _hp_boundary; undeclared ones still use _hp_<axis>.
    undeclared = contract.undeclared_axes if contract.undeclared or contract.undeclared_kwargs else ()
    static_axes = contract.axes if contract.form != "generic" else undeclared
    return dict(
        form=contract.form,
        signature=contract.signature,
        keys=tuple(contract.keys),
        axes=static_axes,
        toggles=static_axes if mode == "toggle" else (),
    )


def class_defaults(contract: Contract, style: Style, *, mode: str) -> list[cst.BaseStatement]:
    """``_hp_boundary_form``, ``_hp_contract`` and identity defaults for each axis used."""
    return style.parse_statements(render("class_defaults.py.j2", **_defaults_values(contract, mode)))


def rewrite_class(
    node: cst.ClassDef, contracts: list[Contract], subclass_names: list[str], style: Style, *, mode: str
) -> list[cst.BaseStatement]:
    """The class with its first contract, followed by one subclass per further contract."""
    assert isinstance(node.body, cst.IndentedBlock)
    statements = list(node.body.body)
    position = max(
        index
        for index, statement in enumerate(statements)
        if isinstance(statement, cst.FunctionDef) and statement.name.value == "forward"
    )
    original = statements[position]
    assert isinstance(original, cst.FunctionDef)
    base = contracts[0]
    # Comments between the decorators and the def travel with the decorators.
    impl = original.with_changes(name=cst.Name("_forward_impl"), decorators=(), lines_after_decorators=())
    if base.summed is not None:  # the one edit inside a body (lower checks every contract agrees)
        impl = rewrite_summed(impl, base.summed)
    replacement: list[cst.BaseStatement] = [impl]
    if any(contract.region_target for contract in contracts):
        # Region instances run the body through __hp_compute__; by default it is the body itself.
        (alias,) = style.parse_statements("__hp_compute__ = _forward_impl\n")
        replacement.append(alias.with_changes(leading_lines=[cst.EmptyLine(indent=False)]))
    class_indent = node.body.indent or style.indent
    replacement.append(render_forward(base, original, style, mode=mode, class_indent=class_indent))
    statements[position : position + 1] = replacement
    docstring_end = 1 if node.get_docstring(clean=False) is not None else 0
    defaults = class_defaults(base, style, mode=mode)
    if docstring_end:
        defaults[0] = defaults[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    following = statements[docstring_end]
    if not following.leading_lines:
        statements[docstring_end] = following.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    statements[docstring_end:docstring_end] = defaults
    result: list[cst.BaseStatement] = [node.with_changes(body=node.body.with_changes(body=statements))]
    for contract, name in zip(contracts[1:], subclass_names):
        head = render(
            "subclass.py.j2", name=name, base=node.name.value, i=class_indent, **_defaults_values(contract, mode)
        )
        (subclass,) = style.parse_statements(head, class_indent)
        assert isinstance(subclass, cst.ClassDef) and isinstance(subclass.body, cst.IndentedBlock)
        forward = render_forward(contract, original, style, mode=mode, class_indent=class_indent)
        subclass = subclass.with_changes(
            body=subclass.body.with_changes(body=[*subclass.body.body, forward]),
            leading_lines=[cst.EmptyLine(indent=False), cst.EmptyLine(indent=False)],
        )
        result.append(subclass)
    return result


# --------------------------------------------------------------------------- module


def header_text(header: Header, newline: str) -> str:
    """The generated file's header lines, in the source's newline."""
    return render("header.py.j2", **header.values()).replace("\n", newline)


class AbsoluteImports(cst.CSTTransformer):
    """Rewrites ``from ..x import y`` to ``from pkg.x import y`` for the given package."""

    def __init__(self, package: str) -> None:
        self.package = package.split(".")
        self.failure: tuple[int, str] | None = None

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
        level = len(updated_node.relative)
        if level == 0:
            return updated_node
        keep = len(self.package) - (level - 1)
        if keep <= 0:
            raise ValueError(f"a relative import of level {level} goes above the package {'.'.join(self.package)!r}")
        parts = self.package[:keep]
        if updated_node.module is not None:
            parts = parts + cst.Module([]).code_for_node(updated_node.module).split(".")
        dotted: cst.Attribute | cst.Name = cst.Name(parts[0])
        for part in parts[1:]:
            dotted = cst.Attribute(value=dotted, attr=cst.Name(part))
        return updated_node.with_changes(relative=(), module=dotted, whitespace_after_from=cst.SimpleWhitespace(" "))
