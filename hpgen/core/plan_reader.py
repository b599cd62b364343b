"""Validation of a decoded plan document: each value checked where it stands, then built into a :class:`~hpgen.core.plan.Plan`.

Every name that can reach generated source is a validated identifier or dotted path,
every placement parses, every axis is a mesh axis. Errors carry the JSON path of the
offending value, for example ``param_plan["model.layers.*.mlp"].out_src.output.tp``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from hpgen.core.errors import HpgenError
from hpgen.core.placement import REPLICATE, Placement
from hpgen.core.plan_entries import (
    LAYOUT_KEYS,
    PLAN_FORMAT,
    PLAN_FORMAT_2,
    PLAN_FORMATS,
    Entry,
    FunctionRef,
    Injection,
    Layout,
    LocalCount,
    PipelineStages,
    Plan,
    SummedReduction,
    expand_stage_item,
    summed_branches,
)
from hpgen.core.plan_names import fqn_matches, is_dotted_path, is_fqn_pattern, is_identifier, is_param_path, patterns_overlap

__all__ = [
    "ENTRY_KEYS",
    "INJECTION_KEYS",
    "PLAN_FORMAT",
    "PLAN_FORMATS",
    "PLAN_FORMAT_2",
    "RESERVED_AXIS_NAMES",
    "TOP_LEVEL_KEYS",
    "PlanReader",
]

TOP_LEVEL_KEYS = {
    "format", "model_class", "mesh_dim_names", "boundary_classes", "param_plan", "injections", "pipeline", "planned_for",
}
PIPELINE_KEYS = {"axis", "stages"}
ENTRY_KEYS = {
    *LAYOUT_KEYS,
    "out_names",
    "params",
    "deferred_bias_params",
    "grad_reduce_params",
    "out_grad_partial",
    "in_grad_partial",
    "summed_reduction",
    "tp_divide_attrs",
    "divide_attrs",
    "local_attrs",
    "is_boundary",
    "region_dispatch",
    "skip_source_lowering",
}
INJECTION_KEYS = {"match", "local_compute_fn", "inner_wrapper"}
SUMMED_KEYS = {"branches", "shared_input", "paired_input"}
LOCAL_COUNT_KEYS = {"of", "dim", "unit", "block", "times", "per"}
# An axis's collectives live on a boundary module as ``_hp_<axis>``. hpgen's other ``_hp_``
# attributes (the generated class defaults, what the runtime binds) end in these names,
# so an axis called so would overwrite one of them.
RESERVED_AXIS_NAMES = frozenset(
    {"boundary", "boundary_form", "contract", "plan_keys", "runtime", "out", "vocab", "defer_bias", "parallelized"}
)


def _path_join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if is_identifier(key):
        return f"{path}.{key}" if path else key
    # Readable non-ASCII, but no raw line or paragraph separator: a message is one line.
    return f"{path}[{json.dumps(key, ensure_ascii=not key.isprintable())}]"


class PlanReader:
    """Walks a plan document, checking each value where it stands."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mesh: tuple[str, ...] = ()
        self.format: str | None = None  # the document's "format", None when it says none
        self.pipeline_axis: str | None = None  # the axis of the plan's pipeline stages, if any

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

    def grad_reduce(self, value: object, where: str) -> tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]]:
        """``grad_reduce_params``: a list of parameter paths (summed over every axis the body is
        sharded on), or an object of parameter path -> the axes to sum over."""
        if not isinstance(value, dict):
            return self.name_list(value, where, is_param_path, "a parameter path"), ()
        axes = []
        for name, over in value.items():
            name_where = _path_join(where, name)
            self.expect_name(name, name_where, is_param_path, "a parameter path")
            listed = self.name_list(over, name_where, what="an axis name (an identifier)")
            if not listed:
                raise self.fail(name_where, "names no axis to sum over")
            for index, axis in enumerate(listed):
                if axis not in self.mesh:
                    raise self.fail(
                        _path_join(name_where, index), f"unknown axis {axis!r} (mesh_dim_names: {', '.join(self.mesh)})"
                    )
            axes.append((name, listed))
        return tuple(name for name, _ in axes), tuple(sorted(axes))

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
        if "format" in top:
            if top["format"] not in PLAN_FORMATS:
                expected = " or ".join(repr(name) for name in PLAN_FORMATS)
                raise self.fail("format", f"unsupported plan format {top['format']!r} (expected {expected})")
            self.format = top["format"]
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

        pipeline = self.pipeline(top["pipeline"], "pipeline") if "pipeline" in top else None

        model_class = top.get("model_class")
        if model_class is not None:
            model_class = self.expect_name(model_class, "model_class", what="a class name")

        planned_for = {}
        for axis, size in sorted(self.expect_object(top.get("planned_for", {}), "planned_for").items()):
            if axis not in self.mesh:
                raise self.fail(_path_join("planned_for", axis), f"unknown axis {axis!r} (mesh_dim_names: {', '.join(self.mesh)})")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise self.fail(_path_join("planned_for", axis), f"expected a size of at least 1, got {_json_type(size)}")
            planned_for[axis] = size

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
            pipeline=pipeline,
            name=self.name,
            sha256=sha256,
            planned_for=planned_for,
        )

    def pipeline(self, value: object, where: str) -> PipelineStages:
        """``pipeline``: ``{"axis": "pp", "stages": [[FQN or PREFIX.A-B, ...], ...]}``, each module on one stage."""
        doc = self.expect_object(value, where)
        self.check_keys(doc, PIPELINE_KEYS, where, "pipeline")
        for key in sorted(PIPELINE_KEYS - set(doc)):
            raise self.fail(where, f"missing required key {key!r}")
        axis = self.expect_name(doc["axis"], f"{where}.axis", what="an axis name (an identifier)")
        if axis not in self.mesh:
            raise self.fail(f"{where}.axis", f"unknown axis {axis!r} (mesh_dim_names: {', '.join(self.mesh)})")
        stages_where = f"{where}.stages"
        stages_doc = self.expect_list(doc["stages"], stages_where)
        if not stages_doc:
            raise self.fail(stages_where, "names no stage")
        stages: list[tuple[str, ...]] = []
        seen: dict[str, str] = {}
        for index, stage_doc in enumerate(stages_doc):
            stage_where = _path_join(stages_where, index)
            items = self.expect_list(stage_doc, stage_where)
            if not items:
                raise self.fail(stage_where, "a stage with no module")
            modules: list[str] = []
            for position, item in enumerate(items):
                item_where = _path_join(stage_where, position)
                expanded = expand_stage_item(item) if isinstance(item, str) else None
                if expanded is None or not all(is_param_path(name) for name in expanded):
                    shown = repr(item) if isinstance(item, str) else _json_type(item)
                    raise self.fail(item_where, f"{shown} is not a module FQN or a range PREFIX.A-B (model.layers.0-3)")
                for name in expanded:
                    for other, other_where in seen.items():
                        if name == other or name.startswith(other + ".") or other.startswith(name + "."):
                            raise self.fail(item_where, f"{name!r} is already on a stage ({other!r} at {other_where})")
                    seen[name] = item_where
                    modules.append(name)
            stages.append(tuple(modules))
        self.pipeline_axis = axis
        return PipelineStages(axis, tuple(stages))

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
            if axis == self.pipeline_axis and found[axis] != REPLICATE:
                # a stage holds whole modules: nothing is cut or reduced over the stages
                raise self.fail(axis_where, f"{found[axis]} on the pipeline axis {axis!r}: only R (stages hold whole modules)")
            if (found[axis].kind == "RS" or found[axis].whole_units) and not params:
                # a replicated shard, a cut in whole units or in blocks says where a parameter's
                # pieces live; boundary values move by collectives, and none of them reads or
                # makes such pieces
                raise self.fail(
                    axis_where,
                    f"{found[axis]} is a parameter placement (params); inputs and outputs take R, S(d), P or SS",
                )
            if found[axis].whole_units:
                self.require_format_2(axis_where, f"{found[axis]} (a placement in whole units or blocks)")
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

    def require_format_2(self, where: str, what: str) -> None:
        """A plan that says it is ``hpgen.plan/1`` cannot use what ``hpgen.plan/2`` added."""
        if self.format == PLAN_FORMAT:
            raise self.fail(
                where, f"{what} is new in {PLAN_FORMAT_2!r}, but the plan says \"format\": {PLAN_FORMAT!r}"
            )

    def expect_int(self, value: object, where: str, *, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"expected an integer, got {_json_type(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(where, f"expected an integer of at least {minimum}, got {value}")
        return value

    def local_count(self, value: object, where: str, *, nested: bool = False) -> LocalCount:
        """One ``local_attrs`` value: ``{"of", "dim", "unit"?, "block"?, "times"?, "per"?}``."""
        doc = self.expect_object(value, where)
        self.check_keys(doc, LOCAL_COUNT_KEYS - ({"per"} if nested else set()), where, "a local_attrs count")
        for required in ("of", "dim"):
            if required not in doc:
                raise self.fail(where, f"missing required key {required!r}")
        of = self.expect_name(doc["of"], _path_join(where, "of"), is_param_path, "a parameter path")
        dim = self.expect_int(doc["dim"], _path_join(where, "dim"))
        unit = self.expect_int(doc.get("unit", 1), _path_join(where, "unit"), minimum=1)
        times = self.expect_int(doc.get("times", 1), _path_join(where, "times"), minimum=1)
        block = None
        if "block" in doc:
            block = self.expect_int(doc["block"], _path_join(where, "block"), minimum=0)
        per = None
        if "per" in doc:
            per = self.local_count(doc["per"], _path_join(where, "per"), nested=True)
        return LocalCount(of, dim, unit, block, per, times)

    def local_attrs(self, value: object, where: str) -> tuple[tuple[str, LocalCount], ...]:
        """``local_attrs``: attribute name -> its per-rank count."""
        found = []
        for name, spec in sorted(self.expect_object(value, where).items()):
            name_where = _path_join(where, name)
            self.expect_name(name, name_where, what="an attribute name (an identifier)")
            found.append((name, self.local_count(spec, name_where)))
        if found:
            self.require_format_2(where, "local_attrs")
        return tuple(found)

    def entry(self, key: str, value: object, where: str) -> Entry:
        doc = self.expect_object(value, where)
        self.check_keys(doc, ENTRY_KEYS, where, "a param_plan entry")
        layouts = {
            part: self.layouts(doc.get(part, {}), _path_join(where, part), what="a parameter or output name (an identifier)")
            for part in LAYOUT_KEYS
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
            for part in ("deferred_bias_params",)
        }
        lists["grad_reduce_params"], grad_reduce_axes = self.grad_reduce(
            doc.get("grad_reduce_params", []), _path_join(where, "grad_reduce_params")
        )
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
        local = self.local_attrs(doc.get("local_attrs", {}), _path_join(where, "local_attrs"))
        for name, _ in local:
            if name in divide or name in dict(divisors):
                other = "tp_divide_attrs" if name in divide else "divide_attrs"
                raise self.fail(_path_join(_path_join(where, "local_attrs"), name), f"{name!r} is in {other} too")
        flags = {
            part: self.expect_bool(doc[part], _path_join(where, part))
            for part in ("is_boundary", "region_dispatch", "skip_source_lowering")
            if part in doc
        }
        has_io = any(layouts[part] for part in LAYOUT_KEYS) or summed is not None
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
            grad_reduce_axes=grad_reduce_axes,
            out_grad_partial=tuple(sorted(partial)),
            in_grad_partial=tuple(sorted(in_partial)),
            summed_reduction=summed,
            tp_divide_attrs=tuple(sorted(divide)),
            divide_attrs=divisors,
            local_attrs=local,
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
        self.check_keys(doc, SUMMED_KEYS, where, "a summed_reduction")
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

    def target(self, value: object, where: str) -> FunctionRef:
        if isinstance(value, str):
            return FunctionRef(self.expect_name(value, where, is_dotted_path, "a dotted path to a function"))
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
        return FunctionRef(path, tuple(kwargs))

    def injection(self, value: object, where: str, keys: list[str]) -> Injection:
        doc = self.expect_object(value, where)
        self.check_keys(doc, INJECTION_KEYS, where, "an injection")
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
