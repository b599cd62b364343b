"""``hpgen explain``: per class, its FQNs, form, each op and why, collectives per call."""

from __future__ import annotations

from typing import Any

import libcst as cst

from hpgen.core.classify import Contract
from hpgen.core.decision import entry_decision
from hpgen.core.transitions import DEFAULT_BACKWARD, Op
from hpgen.core.context_coverage import CONTEXT_AXIS, GATHERED_KV_ATTENTION, HEAD_TAIL, gathered_kv_ops
from hpgen.generator.lower import Analysis
from hpgen.core.plan import Plan
from hpgen.core.plan_targets import import_path
from hpgen.core.shared_sizes import shared_sizes
from hpgen.generator.summed_edit import SummedSiteError, rewrite_summed

# Inputs the runtime's wrappers know (hpgen.runtime.install.module_decisions.KNOWN_INPUTS, kept apart
# because the generator never imports the runtime).
_KNOWN_INPUTS = {"Linear": ("input",), "Embedding": (), "Identity": ()}


def _op_record(op: Op, sizes: str | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {
        "value": op.name,
        "axis": op.axis,
        "src": str(op.src),
        "dst": str(op.dst),
        "op": op.kind,
        "args": dict(op.args),
    }
    if op.kind == "generic":
        record["why"] = op.reason
    else:
        record["backward"] = op.backward or DEFAULT_BACKWARD[op.kind]
        record["why"] = _why(op)
    if sizes is not None:
        record["sizes"] = sizes
    return record


# Ops that make a shard of a dim whose full size they know; the runtime's gathers on the
# same axis and dim later in the same forward take their sizes (hpgen.runtime.forward.collectives).
_MAKES_SHARD = {"split": "dim", "reduce_scatter": "dim", "all_to_all": "dst_dim"}
_RECEIVES_SHARD = {"all_gather": "dim", "all_to_all": "src_dim"}


def made_shards(plan: Plan) -> dict[tuple[str, object], set[str]]:
    """(axis, dim) -> the ops that make a shard of it somewhere in the plan and leave its sizes
    to the later gathers (a group's split hands its sizes on instead: hpgen.core.shared_sizes)."""
    made: dict[tuple[str, object], set[str]] = {}
    for key in plan.entries:
        decision = entry_decision(plan, key)
        inputs, outputs = decision.inputs, decision.outputs
        handed = {(name, g.position) for g in shared_sizes(inputs, outputs) if g.kind == "split" for name in g.members}
        for value in (*inputs, *outputs):
            for position, op in enumerate(value.ops):
                if op.kind in _MAKES_SHARD and not op.is_identity and (value.name, position) not in handed:
                    made.setdefault((op.axis, dict(op.args).get(_MAKES_SHARD[op.kind])), set()).add(op.kind)
    return made


def sizes_note(op: Op, made: dict[tuple[str, object], set[str]], *, features: bool = False) -> str | None:
    """How a gather learns every rank's shard size (exchanging them is a host synchronisation)."""
    if op.kind not in _RECEIVES_SHARD:
        return None
    dim = dict(op.args).get(_RECEIVES_SHARD[op.kind])
    if features and op.kind == "all_gather" and dim == -1:
        return "from the weight's shape (the module's features), no exchange"
    makers = made.get((op.axis, dim))
    if makers:
        return (
            f"recorded by the {' or '.join(sorted(makers))} of {op.axis} dim {dim} earlier in the same model "
            "forward, no exchange (exchanged when none did)"
        )
    return (
        "exchanged: one all-gather of an int64 per rank before each call (a host synchronisation on CUDA; "
        "torch.compile needs capture_scalar_outputs)"
    )


def shared_notes(contract: Contract, made: dict[tuple[str, object], set[str]]) -> dict[tuple[str, str, int], str]:
    """(side, value, op position) -> how an op of a group cut alike gets its sizes (the leader's
    gather says where it finds them; the others take those, or the entry split's)."""
    notes: dict[tuple[str, str, int], str] = {}
    if contract.form == "generic":
        return notes
    by_name = {value.name: value for value in contract.inputs}
    for group in shared_sizes(contract.inputs, contract.outputs):
        members = ", ".join(group.members)
        if group.kind == "split":
            for output, position in group.outputs:
                notes[("out", output, position)] = (
                    f"those of the split of {members} at this boundary's entry (split_sizes), no exchange"
                )
            continue
        leader = by_name[group.leader].ops[group.position]
        notes[("in", group.leader, group.position)] = f"found once for {members} (shard_sizes): {sizes_note(leader, made)}"
        for member in group.members[1:]:
            notes[("in", member, group.position)] = f"those found for {group.leader}'s gather, no exchange of its own"
    return notes


def _why(op: Op) -> str:
    if op.kind == "copy":
        return "the body is sharded on this axis, so the gradient of this replicated input is partial"
    if op.axis == CONTEXT_AXIS and op.kind in ("split", "all_gather"):
        return f"{op.axis} {op.src} -> {op.dst} lowers to {op.kind}, in the {HEAD_TAIL}"
    return f"{op.axis} {op.src} -> {op.dst} lowers to {op.kind}"


def _undeclared(contract: Contract) -> list[dict[str, Any]]:
    """``forward`` arguments the plan does not declare, of a body sharded on some axis: ``R`` there,
    copied in (gradient all-reduced) when they require grad, passed on untouched otherwise; or
    (``handed_on``) only handed to child boundaries, which own their gradients, so not copied."""
    names = [*contract.undeclared, *([f"**{contract.undeclared_kwargs}"] if contract.undeclared_kwargs else [])]
    return [{"value": name, "axes": list(contract.undeclared_axes), "handed_on": False} for name in names] + [
        {"value": name, "axes": list(contract.undeclared_axes), "handed_on": True} for name in contract.handed_on
    ]


def _contract_record(
    contract: Contract, class_name: str, made: dict[tuple[str, object], set[str]], plan: Plan
) -> dict[str, Any]:
    shared = shared_notes(contract, made)
    ops = [
        (op, shared.get((side, value.name, position)) or sizes_note(op, made))
        for side, values in (("in", contract.inputs), ("out", contract.outputs))
        for value in values
        for position, op in enumerate(value.ops)
        if not op.is_identity
    ]
    counts = contract.collectives_per_call()
    body_ops: list[dict[str, Any]] = []
    # the cp attention's gathers, inside the body (its plan name or its module's own path)
    if contract.region_target is not None and import_path(contract.region_target) == import_path(GATHERED_KV_ATTENTION):
        injection = entry_decision(plan, contract.keys[0]).injection
        axis = injection.local_compute_fn.kwargs_dict().get("axis", "cp") if injection is not None else "cp"
        body_ops = gathered_kv_ops(str(axis))
        counts = {**counts, "all_gather": counts.get("all_gather", 0) + 2}
    return {
        "class": class_name,
        "fqns": list(contract.keys),
        "form": contract.form,
        "contract": contract.signature,
        "reasons": list(contract.reasons),
        "region": contract.region_target,
        "ops": [_op_record(op, note) for op, note in ops],
        "body_ops": body_ops,
        "collectives_per_call": counts,
        "undeclared_inputs": _undeclared(contract),
        "summed": None,
    }


def _summed_record(contract: Contract, node: cst.ClassDef | None) -> dict[str, Any] | None:
    """A summed block's reduction, its shared input's op, and the one edited line of its body."""
    summed = contract.summed
    if summed is None:
        return None
    edit = None
    forward = _forward_node(node)
    if forward is not None:
        try:
            code = cst.Module([]).code_for_node(rewrite_summed(forward, summed))
        except SummedSiteError as exc:
            edit = f"none: {exc}"
        else:
            lines = code.splitlines()
            marker = next(i for i, line in enumerate(lines) if line.strip() == f"# {summed.comment()}")
            edit = lines[marker + 1].strip()
    return {
        "branches": list(summed.branches),
        "reduce": _op_record(summed.reduce),
        "shared_input": summed.shared_input,
        "paired_input": summed.paired_input,
        "shared": _op_record(summed.shared) if summed.shared is not None else None,
        "edit": edit,
    }


def _forward_node(node: cst.ClassDef | None) -> cst.FunctionDef | None:
    if node is None or not isinstance(node.body, cst.IndentedBlock):
        return None
    found = [s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "forward"]
    return found[-1] if found else None


def _wrapper_runs(plan: Plan, key: str, class_name: str) -> str:
    """What ``parallelize``'s wrapper of an outside class runs around the torch forward, and why."""
    entry = plan.entries[key]
    kind = class_name.rsplit(".", 1)[-1]
    weight = entry.params.get("weight")
    placements = [weight.on(axis) for axis in plan.mesh_dim_names] if weight is not None else []
    dims = {p.dim % 2 for p in placements if p.kind == "S"}
    if kind == "Embedding":
        if 0 in dims:
            return (
                "vocab-parallel lookup: ids outside this rank's rows are masked to row 0, looked up and their "
                "rows zeroed, so the ranks' outputs add up to the full lookup (P(sum)); then the output ops"
            )
        return "the lookup of this rank's embedding columns (S(-1)); then the output ops"
    if kind == "Linear":
        if 0 in dims:
            return (
                "column-parallel matmul: the input is copied in (its gradient, partial per rank, is all-reduced), "
                "each rank computes its output features (S(-1)); then the output ops"
            )
        if 1 in dims:
            return "row-parallel matmul: each rank multiplies its input features, giving a partial sum (P(sum))"
    if kind == "Identity":
        return (
            "identity expert: its output, the same on every rank, is divided by the axis size (R -> P(sum)), so "
            "the enclosing experts' all-reduce counts it once"
        )
    return "its own forward between the input and output ops (parallelize's generic wrapper of an outside class)"


def _external_record(plan: Plan, key: str, class_name: str, made: dict[tuple[str, object], set[str]]) -> dict[str, Any]:
    """An outside class: wrapped by the runtime (its own wrapper for nn.Linear, nn.Embedding; the generic one
    around any other class's forward) or left as it is (identity)."""
    known = _KNOWN_INPUTS.get(class_name.rsplit(".", 1)[-1], ())
    decision = entry_decision(plan, key, known_inputs=known)
    if decision.is_identity:
        entry = decision.entry
        reductions = ", ".join(entry.grad_reduce_params)
        runs = "nothing moves: the class is used as it is" + (
            f"; parallelize all-reduces the gradients of {reductions}" if reductions else ""
        )
        return {"fqn": key, "class": class_name, "handled_by": "identity", "runs": runs, "ops": []}
    ops = [op for value in (*decision.inputs, *decision.outputs) for op in value.active]
    if class_name.rsplit(".", 1)[-1] == "Identity":
        ops = []  # the wrapper divides by the axis size itself; no collective, no DTensor
    return {
        "fqn": key,
        "class": class_name,
        "handled_by": "runtime wrapper",
        "runs": _wrapper_runs(plan, key, class_name),
        "ops": [_op_record(op, sizes_note(op, made, features=True)) for op in ops],
    }


def explain(analysis: Analysis) -> dict[str, Any]:
    """A JSON-ready description of what lowering does and why."""
    classes = []
    made = made_shards(analysis.plan)
    nodes = {node.name.value: node for node in analysis.parsed.module.body if isinstance(node, cst.ClassDef)}
    for name, lowering in analysis.classes.items():
        for contract, subclass in zip(lowering.contracts, [name, *lowering.subclass_names]):
            record = _contract_record(contract, subclass, made, analysis.plan)
            record["summed"] = _summed_record(contract, nodes.get(name))
            classes.append(record)
        if lowering.identity_keys:
            classes.append(
                {
                    "class": name,
                    "fqns": list(lowering.identity_keys),
                    "form": "identity",
                    "contract": "",
                    "reasons": [],
                    "region": None,
                    "ops": [],
                    "body_ops": [],
                    "collectives_per_call": {},
                    "undeclared_inputs": [],
                    "summed": None,
                }
            )
    wrapped = [_external_record(analysis.plan, key, found.name, made) for key, found in analysis.external.items()]
    report: dict[str, Any] = {
        "mesh_dim_names": list(analysis.plan.mesh_dim_names),
        "classes": classes,
        "wrapped": wrapped,
        "skipped": list(analysis.skipped),
        "elsewhere": {key: found.name for key, found in analysis.elsewhere.items()},
    }
    whole_units = _whole_unit_records(analysis.plan)
    if whole_units:  # hpgen.plan/2 only: a plan/1 plan's report is unchanged
        report["whole_units"] = whole_units
    return report


def _whole_unit_records(plan: Plan) -> list[dict[str, Any]]:
    """The entries whose parameters are cut in whole units or blocks, or that set attributes per rank:
    their parameters' layouts and how each per-rank attribute is counted (``parallelize`` does both)."""
    found = []
    for key, entry in plan.entries.items():
        uneven = any(p.whole_units for layout in entry.params.values() for _, p in layout.placements)
        if not uneven and not entry.local_attrs:
            continue
        found.append(
            {
                "key": key,
                "params": {name: {axis: str(p) for axis, p in layout.placements} for name, layout in sorted(entry.params.items())},
                "local_attrs": {attr: count.describe() + (f" per {count.per.describe()}" if count.per else "") for attr, count in entry.local_attrs},
            }
        )
    return found


def _op_lines(ops: list[dict[str, Any]]) -> list[str]:
    lines = []
    for op in ops:
        args = ", ".join(f"{key}={value}" for key, value in op["args"].items())
        backward = f", backward {op['backward']}" if "backward" in op else ""
        call = f"{op['op']}({args})" if args else op["op"]
        lines.append(f"  {op['value']}: {op['axis']} {op['src']} -> {op['dst']} ==> {call}{backward}")
        lines.append(f"      why: {op['why']}")
        if "sizes" in op:
            lines.append(f"      sizes: {op['sizes']}")
    return lines


def explain_text(report: dict[str, Any]) -> str:
    """The same description, for people."""
    lines = [f"mesh: {', '.join(report['mesh_dim_names'])}"]
    for record in report["classes"]:
        lines.append("")
        lines.append(f"{record['class']}: {record['form']}")
        lines.append(f"  fqns: {', '.join(record['fqns'])}")
        if record["region"]:
            lines.append(f"  local compute: {record['region']}")
        for reason in record["reasons"]:
            lines.append(f"  generic because {reason}")
        lines += _op_lines(record["ops"])
        if record.get("body_ops"):
            lines.append("  inside the body (the local compute function):")
            lines += _op_lines(record["body_ops"])
        summed = record.get("summed")
        if summed:
            lines.append(f"  summed reduction of {' + '.join(summed['branches'])}, once (the one edit in the body):")
            lines.append(f"      {summed['edit']}")
            lines += _op_lines([summed["reduce"]])
            if summed["shared"] is not None:
                if summed.get("paired_input"):
                    lines.append(
                        f"  {summed['shared_input']}'s and {summed['paired_input']}'s outputs, one for each branch, "
                        "moved together (a hook of parallelize):"
                    )
                else:
                    lines.append(f"  {summed['shared_input']}'s output, read by both branches (a hook of parallelize):")
                lines += _op_lines([summed["shared"]])
        for value in record["undeclared_inputs"]:
            axes = ", ".join(value["axes"])
            if value["handed_on"]:
                lines.append(
                    f"  {value['value']}: not declared in the plan: R on {axes}, handed on to child boundaries only "
                    "(or never read), which give back its whole gradient: not copied"
                )
                continue
            lines.append(
                f"  {value['value']}: not declared in the plan: R on {axes}, copied into the sharded body (its "
                "gradient all-reduced) when it is a tensor, or a tuple/list of tensors, that requires grad; "
                "otherwise passed on untouched"
            )
        counts = record["collectives_per_call"]
        total = sum(counts.values())
        detail = ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))
        lines.append(f"  collectives per forward call: {total}" + (f" ({detail})" if detail else ""))
    for record in report["wrapped"]:
        lines.append("")
        if record["handled_by"] == "identity":
            lines.append(f"{record['fqn']}: {record['class']}, not in the source: identity")
        else:
            lines.append(f"{record['fqn']}: {record['class']}, not in the source: wrapped by hpgen.runtime.parallelize")
        lines.append(f"  runs: {record['runs']}")
        lines += _op_lines(record["ops"])
    for record in report.get("whole_units", []):
        lines.append("")
        lines.append(f"{record['key']}: parameters cut in whole units or blocks (by hpgen.runtime.parallelize)")
        for name, layout in record["params"].items():
            lines.append(f"  {name}: {', '.join(f'{axis} {p}' for axis, p in layout.items())}")
        for attr, count in record["local_attrs"].items():
            lines.append(f"  {attr} per rank: {count}")
    for key in report["skipped"]:
        lines.append("")
        lines.append(f"{key}: skip_source_lowering")
    for key, name in report.get("elsewhere", {}).items():
        lines.append("")
        lines.append(f"{key}: {name}, a class of another modeling file: lowered with that file")
    return "\n".join(lines) + "\n"
