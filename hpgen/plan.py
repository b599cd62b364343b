"""The frozen parallel plan (docs/plan-format.md): loading, validation and the plain data it becomes.

Everything the plan says is checked here, before any code is generated: every name that
can reach generated source is a validated identifier or dotted path, every placement
parses, every axis is a mesh axis. Errors carry the JSON path of the offending value,
for example ``param_plan["model.layers.*.mlp"].out_src.output.tp``.

This module needs nothing beyond the standard library, so the runtime can use it.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpgen.errors import HpgenError
from hpgen.placement import REPLICATE, Placement

PLAN_FORMAT = "hpgen.plan/1"

_TOP_LEVEL_KEYS = {"format", "model_class", "mesh_dim_names", "boundary_classes", "param_plan", "injections"}
_LAYOUT_KEYS = ("in_src", "in_dst", "out_src", "out_dst")
_ENTRY_KEYS = {
    *_LAYOUT_KEYS,
    "out_names",
    "params",
    "deferred_bias_params",
    "grad_reduce_params",
    "out_grad_partial",
    "in_grad_partial",
    "summed_reduction",
    "tp_divide_attrs",
    "divide_attrs",
    "is_boundary",
    "region_dispatch",
    "skip_source_lowering",
}
_INJECTION_KEYS = {"match", "local_compute_fn", "inner_wrapper"}
_SUMMED_KEYS = {"branches", "shared_input", "paired_input"}
# An axis's collectives live on a boundary module as ``_hp_<axis>``. hpgen's other ``_hp_``
# attributes (the generated class defaults, what the runtime binds) end in these names,
# so an axis called so would overwrite one of them.
RESERVED_AXIS_NAMES = frozenset(
    {"boundary", "boundary_form", "contract", "plan_keys", "runtime", "out", "vocab", "defer_bias", "parallelized"}
)


# --------------------------------------------------------------------------- names


def is_identifier(name: object) -> bool:
    """True for a Python identifier that is not a keyword (``hidden_states``, ``tp``)."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) and name.isascii()


def is_dotted_path(name: object) -> bool:
    """True for ``a.b.c`` where each part is an identifier (``hpgen.runtime.local.fn``)."""
    return isinstance(name, str) and all(is_identifier(part) for part in name.split("."))


def is_param_path(name: object) -> bool:
    """True for a parameter path relative to a module: identifiers and list indices."""
    return isinstance(name, str) and all(
        is_identifier(part) or (part.isdigit() and part.isascii()) for part in name.split(".")
    )


def is_fqn_pattern(name: object) -> bool:
    """True for a module FQN in which ``*`` may stand for exactly one segment."""
    return isinstance(name, str) and all(
        part == "*" or is_identifier(part) or (part.isdigit() and part.isascii()) for part in name.split(".")
    )


def fqn_matches(pattern: str, fqn: str) -> bool:
    """True when ``pattern`` (``*`` = one segment) matches the concrete or pattern ``fqn``."""
    left, right = pattern.split("."), fqn.split(".")
    return len(left) == len(right) and all(a == "*" or a == b for a, b in zip(left, right))


def patterns_overlap(first: str, second: str) -> bool:
    """True when some FQN is matched by both patterns."""
    left, right = first.split("."), second.split(".")
    return len(left) == len(right) and all(a == b or "*" in (a, b) for a, b in zip(left, right))


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Layout:
    """A tensor's placement on every mesh axis (axes the plan omits are ``R``)."""

    placements: tuple[tuple[str, Placement], ...]

    def on(self, axis: str) -> Placement:
        for name, placement in self.placements:
            if name == axis:
                return placement
        return REPLICATE

    def __str__(self) -> str:
        return ", ".join(f"{axis} {placement}" for axis, placement in self.placements)


@dataclass(frozen=True)
class Target:
    """A dotted path to a callable plus keyword arguments (``_target_`` style)."""

    path: str
    kwargs: tuple[tuple[str, str], ...] = ()  # (name, JSON text) pairs, sorted

    def kwargs_dict(self) -> dict[str, object]:
        return {name: json.loads(value) for name, value in self.kwargs}


@dataclass(frozen=True)
class Injection:
    """A local compute function that replaces a boundary's body (the region form)."""

    match: str
    local_compute_fn: Target
    inner_wrapper: Target | None = None


@dataclass(frozen=True)
class SummedReduction:
    """A parallel-residual block whose two branches' partial outputs are reduced once, summed.

    ``branches``: the two child modules (paths relative to the block) whose outputs the
    block's body adds; their entries leave those outputs ``P(sum)``. ``shared_input``: the
    child whose output both branches read (the norm before them), where their input's
    transition runs once; None when each branch keeps its own. ``paired_input``: where the
    second branch reads a second norm of the same block input (GPT-NeoX's two layer
    norms), that norm: ``shared_input``'s hook computes its output too and moves both
    through one collective (one reduction of both partial gradients in backward).
    """

    branches: tuple[str, str]
    shared_input: str | None = None
    paired_input: str | None = None


@dataclass(frozen=True)
class Entry:
    """One ``param_plan`` entry: the contract of the boundaries its key matches."""

    key: str
    in_src: Mapping[str, Layout]
    in_dst: Mapping[str, Layout]
    out_src: Mapping[str, Layout]
    out_dst: Mapping[str, Layout]
    out_names: tuple[str, ...] | None
    params: Mapping[str, Layout]
    deferred_bias_params: tuple[str, ...] = ()
    grad_reduce_params: tuple[str, ...] = ()
    # outputs whose caller computes on shards with them (Mamba's reduced x_proj output feeding the
    # channel-sharded scan): their gradient arrives partial, so the output's collective reduces it too
    out_grad_partial: tuple[str, ...] = ()
    # inputs whose gradient leaves the body partial: the caller reduces it (a summed
    # reduction's branches, whose shared input's transition runs once, on the norm's output)
    in_grad_partial: tuple[str, ...] = ()
    summed_reduction: SummedReduction | None = None
    tp_divide_attrs: tuple[str, ...] = ()
    divide_attrs: tuple[tuple[str, int], ...] = ()  # (attribute, divisor), sorted by attribute
    is_boundary: bool = True
    region_dispatch: bool = False
    skip_source_lowering: bool = False

    @property
    def input_names(self) -> tuple[str, ...]:
        """Declared inputs, sorted so that output does not depend on key order."""
        return tuple(sorted({*self.in_src, *self.in_dst}))

    @property
    def output_names(self) -> tuple[str, ...]:
        """Declared outputs in return order: ``out_names``, or the single out key."""
        if self.out_names is not None:
            return self.out_names
        return tuple(sorted({*self.out_src, *self.out_dst}))

    def input_layouts(self, name: str, mesh: tuple[str, ...]) -> tuple[Layout, Layout]:
        """(caller's layout, body's layout) of input ``name``."""
        return self.in_src.get(name, _replicated(mesh)), self.in_dst.get(name, _replicated(mesh))

    def output_layouts(self, name: str, mesh: tuple[str, ...]) -> tuple[Layout, Layout]:
        """(body's layout, caller's layout) of output ``name``."""
        return self.out_src.get(name, _replicated(mesh)), self.out_dst.get(name, _replicated(mesh))


@dataclass(frozen=True)
class Plan:
    """A validated plan. Entries are keyed by FQN pattern and kept in sorted order."""

    mesh_dim_names: tuple[str, ...]
    entries: Mapping[str, Entry]
    model_class: str | None = None
    boundary_classes: Mapping[str, str] = field(default_factory=dict)
    injections: tuple[Injection, ...] = ()
    name: str = "<plan>"
    sha256: str = ""

    def entry_for(self, fqn: str) -> Entry | None:
        """The entry whose key matches a concrete module FQN (at most one, by validation)."""
        for key, entry in self.entries.items():
            if fqn_matches(key, fqn):
                return entry
        return None

    def injection_for(self, key: str) -> Injection | None:
        """The injection whose ``match`` covers the entry key ``key``."""
        for injection in self.injections:
            if fqn_matches(injection.match, key):
                return injection
        return None

    def digest(self) -> str:
        """sha256 of what the plan says, whatever its file's formatting, key order or name."""
        return hashlib.sha256(_canonical_text(self).encode()).hexdigest()

    def boundary_class_for(self, key: str) -> str | None:
        """The class that ``boundary_classes`` names for an entry key, if any."""
        if key in self.boundary_classes:
            return self.boundary_classes[key]
        for pattern, class_name in self.boundary_classes.items():
            if fqn_matches(pattern, key):
                return class_name
        return None


def _canonical_text(plan: Plan) -> str:
    def plain(value: object) -> object:
        if isinstance(value, Placement):
            return str(value)
        if hasattr(value, "__dataclass_fields__"):
            return {name: plain(getattr(value, name)) for name in sorted(value.__dataclass_fields__)}
        if isinstance(value, Mapping):
            return {str(key): plain(item) for key, item in sorted(value.items())}
        if isinstance(value, (tuple, list)):
            return [plain(item) for item in value]
        return value

    fields = {name: plain(getattr(plan, name)) for name in sorted(plan.__dataclass_fields__)}
    del fields["name"], fields["sha256"]  # where it came from, not what it says
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def _replicated(mesh: tuple[str, ...]) -> Layout:
    return Layout(tuple((axis, REPLICATE) for axis in mesh))


# --------------------------------------------------------------------------- loading


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file; errors name the file and the JSON path."""
    name = os.fspath(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise HpgenError(f"cannot read plan: {exc.strerror or exc}", file=name) from None
    return parse_plan(data, name=name)


def parse_plan(data: bytes | str, *, name: str = "<plan>") -> Plan:
    """Parse and validate plan JSON text."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise HpgenError(f"not UTF-8 text (byte {exc.start})", file=name) from None
    try:
        document = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except _DuplicateKey as exc:
        raise HpgenError(f"duplicate key {exc.key!r} in one JSON object", file=name) from None
    except json.JSONDecodeError as exc:
        raise HpgenError(f"invalid JSON: {exc.msg}", file=name, where=f"{exc.lineno}:{exc.colno}") from None
    except RecursionError:
        raise HpgenError("invalid JSON: nested too deeply", file=name) from None
    except ValueError as exc:  # an integer literal longer than int's string limit (4300 digits)
        raise HpgenError(f"invalid JSON: {str(exc).split(':', 1)[0]}", file=name) from None
    return plan_from_dict(document, name=name, sha256=hashlib.sha256(raw).hexdigest())


def plan_from_dict(document: object, *, name: str = "<plan>", sha256: str | None = None) -> Plan:
    """Validate a decoded plan document and build the ``Plan``."""
    if sha256 is None:
        canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)
        sha256 = hashlib.sha256(canonical.encode()).hexdigest()
    try:
        return _PlanReader(name).read(document, sha256)
    except HpgenError as exc:
        raise exc.located(name) from None


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _path_join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if is_identifier(key):
        return f"{path}.{key}" if path else key
    # Readable non-ASCII, but no raw line or paragraph separator: a message is one line.
    return f"{path}[{json.dumps(key, ensure_ascii=not key.isprintable())}]"


class _PlanReader:
    """Walks a plan document, checking each value where it stands."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mesh: tuple[str, ...] = ()

    def fail(self, where: str, message: str) -> HpgenError:
        return HpgenError(message, file=self.name, where=where or None)

    # -- generic shapes

    def expect_object(self, value: object, where: str) -> dict[str, object]:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a JSON object, got {_json_type(value)}")
        return value

    def expect_list(self, value: object, where: str) -> list[object]:
        if not isinstance(value, list):
            raise self.fail(where, f"expected a JSON list, got {_json_type(value)}")
        return value

    def expect_bool(self, value: object, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"expected true or false, got {_json_type(value)}")
        return value

    def expect_name(self, value: object, where: str, check=is_identifier, what: str = "an identifier") -> str:
        if not check(value):
            shown = repr(value) if isinstance(value, str) else _json_type(value)
            raise self.fail(where, f"{shown} is not {what}")
        return value  # type: ignore[return-value]

    def name_list(self, value: object, where: str, check=is_identifier, what: str = "an identifier") -> tuple[str, ...]:
        items = self.expect_list(value, where)
        names = [self.expect_name(item, _path_join(where, index), check, what) for index, item in enumerate(items)]
        for index, item in enumerate(names):
            if item in names[:index]:
                raise self.fail(_path_join(where, index), f"{item!r} is listed twice")
        return tuple(names)

    def check_keys(self, obj: dict[str, object], allowed: set[str], where: str, what: str) -> None:
        for key in sorted(obj):
            if key not in allowed:
                raise self.fail(
                    _path_join(where, key), f"unknown key {key!r} in {what} (allowed: {', '.join(sorted(allowed))})"
                )

    # -- the document

    def read(self, document: object, sha256: str) -> Plan:
        top = self.expect_object(document, "")
        # Unknown top-level keys are ignored: hyper_parallel's codegen_meta.json carries more.
        if "format" in top and top["format"] != PLAN_FORMAT:
            raise self.fail("format", f"unsupported plan format {top['format']!r} (expected {PLAN_FORMAT!r})")
        if "mesh_dim_names" not in top:
            raise self.fail("", "missing required key 'mesh_dim_names'")
        if "param_plan" not in top:
            raise self.fail("", "missing required key 'param_plan'")
        self.mesh = self.name_list(top["mesh_dim_names"], "mesh_dim_names", what="an axis name (an identifier)")
        if not self.mesh:
            raise self.fail("mesh_dim_names", "needs at least one axis")
        for index, axis in enumerate(self.mesh):
            if axis in RESERVED_AXIS_NAMES:
                raise self.fail(
                    f"mesh_dim_names[{index}]", f"{axis!r} is reserved: _hp_{axis} is an attribute hpgen uses itself"
                )
            if axis.startswith("__"):  # Python would mangle ``self.__x_enable`` inside the class
                raise self.fail(f"mesh_dim_names[{index}]", f"{axis!r} starts with '__', which Python mangles in classes")

        model_class = top.get("model_class")
        if model_class is not None:
            model_class = self.expect_name(model_class, "model_class", what="a class name")

        boundary_classes = {}
        for key, value in sorted(self.expect_object(top.get("boundary_classes", {}), "boundary_classes").items()):
            where = _path_join("boundary_classes", key)
            self.expect_name(key, where, is_fqn_pattern, "a module FQN (identifiers, indices and '*')")
            boundary_classes[key] = self.expect_name(value, where, is_dotted_path, "a class name or dotted path")

        entries_doc = self.expect_object(top["param_plan"], "param_plan")
        entries = {}
        for key in sorted(entries_doc):
            where = _path_join("param_plan", key)
            self.expect_name(key, where, is_fqn_pattern, "a module FQN (identifiers, indices and '*')")
            entries[key] = self.entry(key, entries_doc[key], where)
        keys = list(entries)
        for index, first in enumerate(keys):
            for second in keys[index + 1 :]:
                if patterns_overlap(first, second):
                    raise self.fail(
                        _path_join("param_plan", second),
                        f"matches the same modules as {first!r}: an FQN may be matched by one key only",
                    )

        for key in keys:
            if entries[key].summed_reduction is not None:
                self.check_summed(entries, key)
        injections = tuple(
            self.injection(item, f"injections[{index}]", keys)
            for index, item in enumerate(self.expect_list(top.get("injections", []), "injections"))
        )
        matches = [injection.match for injection in injections]
        for index, match in enumerate(matches):
            if any(patterns_overlap(match, other) for other in matches[:index]):
                raise self.fail(f"injections[{index}].match", f"{match!r} overlaps an earlier injection")
        return Plan(
            mesh_dim_names=self.mesh,
            entries=entries,
            model_class=model_class,
            boundary_classes=boundary_classes,
            injections=tuple(sorted(injections, key=lambda injection: injection.match)),
            name=self.name,
            sha256=sha256,
        )

    def layout(self, value: object, where: str, *, params: bool = False) -> Layout:
        axes = self.expect_object(value, where)
        found = {}
        for axis, text in axes.items():
            axis_where = _path_join(where, axis)
            if axis not in self.mesh:
                raise self.fail(axis_where, f"unknown axis {axis!r} (mesh_dim_names: {', '.join(self.mesh)})")
            try:
                found[axis] = Placement.parse(text)
            except ValueError as exc:
                raise self.fail(axis_where, str(exc)) from None
            if found[axis].kind == "RS" and not params:
                # a replicated shard says where a parameter's chunks live; boundary values
                # move by collectives, and none of them reads or makes replicated chunks
                raise self.fail(
                    axis_where,
                    f"{found[axis]} is a parameter placement (params); inputs and outputs take R, S, P or SS",
                )
        return Layout(tuple((axis, found.get(axis, REPLICATE)) for axis in self.mesh))

    def layouts(
        self, value: object, where: str, check=is_identifier, what: str = "an identifier", *, params: bool = False
    ) -> dict[str, Layout]:
        names = self.expect_object(value, where)
        result = {}
        for name in sorted(names):
            name_where = _path_join(where, name)
            self.expect_name(name, name_where, check, what)
            result[name] = self.layout(names[name], name_where, params=params)
        return result

    def divisors(self, value: object, where: str) -> tuple[tuple[str, int], ...]:
        """``divide_attrs``: attribute name -> a positive integer it is divided by."""
        found = []
        for name, divisor in sorted(self.expect_object(value, where).items()):
            name_where = _path_join(where, name)
            self.expect_name(name, name_where, what="an attribute name (an identifier)")
            if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
                raise self.fail(name_where, f"expected a positive integer divisor, got {_json_type(divisor)}")
            found.append((name, divisor))
        return tuple(found)

    def entry(self, key: str, value: object, where: str) -> Entry:
        doc = self.expect_object(value, where)
        self.check_keys(doc, _ENTRY_KEYS, where, "a param_plan entry")
        layouts = {
            part: self.layouts(doc.get(part, {}), _path_join(where, part), what="a parameter or output name (an identifier)")
            for part in _LAYOUT_KEYS
        }
        out_names = None
        if "out_names" in doc:
            out_names = self.name_list(doc["out_names"], _path_join(where, "out_names"))
            for part in ("out_src", "out_dst"):
                for name in layouts[part]:
                    if name not in out_names:
                        raise self.fail(
                            _path_join(_path_join(where, part), name),
                            f"{name!r} is not in out_names ({', '.join(out_names) or 'empty'})",
                        )
        else:
            outputs = sorted({*layouts["out_src"], *layouts["out_dst"]})
            if len(outputs) > 1:
                raise self.fail(
                    where, f"several outputs ({', '.join(outputs)}) need 'out_names' to give their order in the return"
                )
        params_where = _path_join(where, "params")
        params = self.layouts(doc.get("params", {}), params_where, is_param_path, "a parameter path", params=True)
        lists = {
            part: self.name_list(doc.get(part, []), _path_join(where, part), is_param_path, "a parameter path")
            for part in ("deferred_bias_params", "grad_reduce_params")
        }
        partial_where = _path_join(where, "out_grad_partial")
        partial = self.name_list(doc.get("out_grad_partial", []), partial_where)
        declared = out_names if out_names is not None else tuple(sorted({*layouts["out_src"], *layouts["out_dst"]}))
        for name in partial:
            if name not in declared:
                raise self.fail(partial_where, f"{name!r} is not a declared output ({', '.join(declared) or 'none'})")
        in_partial = self.name_list(doc.get("in_grad_partial", []), _path_join(where, "in_grad_partial"))
        inputs = sorted({*layouts["in_src"], *layouts["in_dst"]})
        for name in in_partial:
            if name not in inputs:
                raise self.fail(
                    _path_join(where, "in_grad_partial"), f"{name!r} is not a declared input ({', '.join(inputs) or 'none'})"
                )
        summed = None
        if "summed_reduction" in doc:
            summed = self.summed(doc["summed_reduction"], _path_join(where, "summed_reduction"))
        divide = self.name_list(doc.get("tp_divide_attrs", []), _path_join(where, "tp_divide_attrs"))
        if divide and "tp" not in self.mesh:
            raise self.fail(_path_join(where, "tp_divide_attrs"), "needs a 'tp' axis in mesh_dim_names")
        divisors = self.divisors(doc.get("divide_attrs", {}), _path_join(where, "divide_attrs"))
        for name, _ in divisors:
            if name in divide:
                raise self.fail(
                    _path_join(_path_join(where, "divide_attrs"), name), f"{name!r} is in tp_divide_attrs too"
                )
        flags = {
            part: self.expect_bool(doc[part], _path_join(where, part))
            for part in ("is_boundary", "region_dispatch", "skip_source_lowering")
            if part in doc
        }
        has_io = any(layouts[part] for part in _LAYOUT_KEYS) or summed is not None
        return Entry(
            key=key,
            in_src=layouts["in_src"],
            in_dst=layouts["in_dst"],
            out_src=layouts["out_src"],
            out_dst=layouts["out_dst"],
            out_names=out_names,
            params=params,
            deferred_bias_params=tuple(sorted(lists["deferred_bias_params"])),
            grad_reduce_params=tuple(sorted(lists["grad_reduce_params"])),
            out_grad_partial=tuple(sorted(partial)),
            in_grad_partial=tuple(sorted(in_partial)),
            summed_reduction=summed,
            tp_divide_attrs=tuple(sorted(divide)),
            divide_attrs=divisors,
            is_boundary=flags.get("is_boundary", has_io),
            region_dispatch=flags.get("region_dispatch", False),
            skip_source_lowering=flags.get("skip_source_lowering", False),
        )

    def check_summed(self, entries: Mapping[str, Entry], key: str) -> None:
        """Each branch of a summed block is an entry leaving one output ``P(sum)``, on one common axis."""
        where = _path_join(_path_join("param_plan", key), "summed_reduction")
        try:
            summed_branches(entries, self.mesh, key)
        except ValueError as exc:
            raise self.fail(where, str(exc)) from None

    def summed(self, value: object, where: str) -> SummedReduction:
        """``summed_reduction``: two distinct branch paths and an optional shared input path."""
        doc = self.expect_object(value, where)
        self.check_keys(doc, _SUMMED_KEYS, where, "a summed_reduction")
        if "branches" not in doc:
            raise self.fail(where, "missing required key 'branches'")
        branches_where = _path_join(where, "branches")
        branches = self.name_list(doc["branches"], branches_where, is_dotted_path, "a child module path")
        if len(branches) != 2:
            raise self.fail(branches_where, f"needs exactly two branches, got {len(branches)}")
        shared = None
        if "shared_input" in doc:
            shared_where = _path_join(where, "shared_input")
            shared = self.expect_name(doc["shared_input"], shared_where, is_dotted_path, "a child module path")
            if shared in branches:
                raise self.fail(shared_where, f"{shared!r} is a branch; the shared input is the module both read")
        paired = None
        if "paired_input" in doc:
            paired_where = _path_join(where, "paired_input")
            paired = self.expect_name(doc["paired_input"], paired_where, is_dotted_path, "a child module path")
            if shared is None:
                raise self.fail(paired_where, "needs 'shared_input' (the norm the first branch reads)")
            if paired in branches or paired == shared:
                raise self.fail(paired_where, f"{paired!r} is a branch or the shared input; it is the second branch's norm")
        return SummedReduction((branches[0], branches[1]), shared, paired)

    def target(self, value: object, where: str) -> Target:
        if isinstance(value, str):
            return Target(self.expect_name(value, where, is_dotted_path, "a dotted path to a function"))
        doc = self.expect_object(value, where)
        if "_target_" not in doc:
            raise self.fail(where, "needs '_target_' (a dotted path to a function)")
        path = self.expect_name(doc["_target_"], _path_join(where, "_target_"), is_dotted_path, "a dotted path to a function")
        kwargs = []
        for name in sorted(doc):
            if name == "_target_":
                continue
            self.expect_name(name, _path_join(where, name), what="a keyword argument name (an identifier)")
            kwargs.append((name, json.dumps(doc[name], sort_keys=True)))
        return Target(path, tuple(kwargs))

    def injection(self, value: object, where: str, keys: list[str]) -> Injection:
        doc = self.expect_object(value, where)
        self.check_keys(doc, _INJECTION_KEYS, where, "an injection")
        for required in ("match", "local_compute_fn"):
            if required not in doc:
                raise self.fail(where, f"missing required key {required!r}")
        match = self.expect_name(doc["match"], f"{where}.match", is_fqn_pattern, "a module FQN (identifiers, indices and '*')")
        if not any(fqn_matches(match, key) for key in keys):
            raise self.fail(f"{where}.match", f"{match!r} matches no param_plan key")
        inner = doc.get("inner_wrapper")
        return Injection(
            match=match,
            local_compute_fn=self.target(doc["local_compute_fn"], f"{where}.local_compute_fn"),
            inner_wrapper=None if inner is None else self.target(inner, f"{where}.inner_wrapper"),
        )


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def iter_layouts(entry: Entry) -> Iterator[tuple[str, str, Layout]]:
    """Every (part, name, layout) of an entry's in/out layouts, in a stable order."""
    for part in _LAYOUT_KEYS:
        layouts = getattr(entry, part)
        for name in sorted(layouts):
            yield part, name, layouts[name]


@dataclass(frozen=True)
class SummedBranch:
    """One branch of a summed block: its entry key and the partial output the block adds."""

    path: str  # relative to the block
    key: str  # the branch's param_plan key
    output: str


def summed_branches(entries: Mapping[str, Entry], mesh: tuple[str, ...], key: str) -> tuple[str, tuple[SummedBranch, ...]]:
    """(the axis of the single reduction, both branches) of the summed block ``key``.

    Raises ``ValueError`` saying what is wrong: a branch without an entry, an output that is
    not left ``P(sum)``, branches partial on different axes.
    """
    summed = entries[key].summed_reduction
    assert summed is not None
    found, axes = [], set()
    for path in summed.branches:
        fqn = f"{key}.{path}"
        matching = [other for other in entries if fqn_matches(other, fqn)]
        if not matching:
            raise ValueError(f"branch {path!r}: no param_plan entry matches {fqn!r}")
        entry = entries[matching[0]]
        partial = []
        for name in entry.output_names:
            src, dst = entry.output_layouts(name, mesh)
            on = [axis for axis in mesh if src.on(axis).is_partial]
            if on:
                partial.append((name, on, dst))
        if len(partial) != 1 or len(partial[0][1]) != 1:
            raise ValueError(f"branch {path!r} ({matching[0]!r}) needs exactly one output P(sum) on one axis")
        name, (axis,), dst = partial[0]
        if str(entry.output_layouts(name, mesh)[0].on(axis)) != "P(sum)" or str(dst.on(axis)) != "P(sum)":
            raise ValueError(
                f"branch {path!r} ({matching[0]!r}): output {name!r} must stay P(sum) on {axis} (out_src and "
                "out_dst), the block reduces it"
            )
        axes.add(axis)
        found.append(SummedBranch(path, matching[0], name))
    if len(axes) != 1:
        raise ValueError(f"the branches are partial on different axes ({', '.join(sorted(axes))})")
    return axes.pop(), tuple(found)


def contract_signature(plan: Plan, key: str) -> str:
    """A canonical text of what a boundary's ``forward`` depends on (``params`` aside).

    Generated classes carry it as ``_hp_contract``; the runtime recomputes it from the
    plan to refuse a generated file that no longer matches (a stale file). Boundaries
    with equal signatures share one generated ``forward``.
    """
    entry = plan.entries[key]
    mesh = plan.mesh_dim_names
    parts = []
    for name in entry.input_names:
        src, dst = entry.input_layouts(name, mesh)
        partial = " (gradient partial)" if name in entry.in_grad_partial else ""
        parts.append(f"in {name}: " + ", ".join(f"{a} {src.on(a)}->{dst.on(a)}" for a in mesh) + partial)
    for name in entry.output_names:
        src, dst = entry.output_layouts(name, mesh)
        partial = " (gradient partial)" if name in entry.out_grad_partial else ""
        parts.append(f"out {name}: " + ", ".join(f"{a} {src.on(a)}->{dst.on(a)}" for a in mesh) + partial)
    sharded = [axis for axis in mesh if body_is_sharded(entry, axis)]
    if sharded:
        parts.append("sharded body: " + ", ".join(sharded))
    if entry.out_names is not None:
        parts.append("out_names: " + ", ".join(entry.out_names))
    if entry.summed_reduction is not None:
        summed = entry.summed_reduction
        shared = f" from {summed.shared_input}" if summed.shared_input else ""
        shared += f" paired with {summed.paired_input}" if summed.paired_input else ""
        parts.append(f"summed reduction: {' + '.join(summed.branches)}{shared}")
    injection = plan.injection_for(key)
    if injection is not None:
        parts.append(f"region: {injection.local_compute_fn.path}")
    elif entry.region_dispatch:
        parts.append("region: _forward_impl")
    return "; ".join(parts)


def body_is_sharded(entry: Entry, axis: str) -> bool:
    """True when the boundary's body computes on shards along ``axis``.

    Then a replicated input's gradient inside the body is partial (each rank sees only
    its shard's contribution) and must be all-reduced on the way back to the caller.
    """
    return any(layout.on(axis) != REPLICATE for layout in entry.in_dst.values()) or any(
        layout.on(axis) != REPLICATE for layout in (*entry.out_src.values(), *entry.params.values())
    )
