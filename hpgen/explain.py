"""``hpgen explain``: per class, its FQNs, form, each op and why, collectives per call."""

from __future__ import annotations

from typing import Any

from hpgen.classify import DEFAULT_BACKWARD, Contract, Op
from hpgen.lower import Analysis


def _op_record(op: Op) -> dict[str, Any]:
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
    return record


def _why(op: Op) -> str:
    if op.kind == "copy":
        return "the body is sharded on this axis, so the gradient of this replicated input is partial"
    return f"{op.axis} {op.src} -> {op.dst} lowers to {op.kind}"


def _contract_record(contract: Contract, class_name: str) -> dict[str, Any]:
    ops = [op for value in (*contract.inputs, *contract.outputs) for op in value.active]
    return {
        "class": class_name,
        "fqns": list(contract.keys),
        "form": contract.form,
        "contract": contract.signature,
        "reasons": list(contract.reasons),
        "region": contract.region_target,
        "ops": [_op_record(op) for op in ops],
        "collectives_per_call": contract.collectives_per_call(),
    }


def explain(analysis: Analysis) -> dict[str, Any]:
    """A JSON-ready description of what lowering does and why."""
    classes = []
    for name, lowering in analysis.classes.items():
        for contract, subclass in zip(lowering.contracts, [name, *lowering.subclass_names]):
            classes.append(_contract_record(contract, subclass))
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
                    "collectives_per_call": {},
                }
            )
    wrapped = [{"fqn": key, "class": found.name, "handled_by": "runtime wrapper"} for key, found in analysis.external.items()]
    return {
        "mesh_dim_names": list(analysis.plan.mesh_dim_names),
        "classes": classes,
        "wrapped": wrapped,
        "skipped": list(analysis.skipped),
    }


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
        for op in record["ops"]:
            args = ", ".join(f"{key}={value}" for key, value in op["args"].items())
            backward = f", backward {op['backward']}" if "backward" in op else ""
            call = f"{op['op']}({args})" if args else op["op"]
            lines.append(f"  {op['value']}: {op['axis']} {op['src']} -> {op['dst']} ==> {call}{backward}")
            lines.append(f"      why: {op['why']}")
        counts = record["collectives_per_call"]
        total = sum(counts.values())
        detail = ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))
        lines.append(f"  collectives per forward call: {total}" + (f" ({detail})" if detail else ""))
    for record in report["wrapped"]:
        lines.append("")
        lines.append(f"{record['fqn']}: {record['class']}, not in the source: wrapped by hpgen.runtime.parallelize")
    for key in report["skipped"]:
        lines.append("")
        lines.append(f"{key}: skip_source_lowering")
    return "\n".join(lines) + "\n"
