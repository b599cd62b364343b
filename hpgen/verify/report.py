"""A verdict as the user reads it: the checks, and where the plan is wrong, what it declares there.

The located module (the first whose output or input gradient departs, the owner of a
differing gradient, or the module that raised) is named by FQN and class, with the plan's
entry for it (its own, or the nearest one above it that names it) and, where ``hpgen plan``
reads the source otherwise (:func:`planner_plan`: the planner's plan for the same tiny
config, with ``--sp`` where the user's plan has it), what the planner would declare there.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from hpgen.core.context_coverage import CONTEXT_AXIS
from hpgen.verify.run import Verdict

__all__ = ["Finding", "finding", "planner_plan", "report_json", "report_text"]

ENTRY_FIELDS = ("in_src", "in_dst", "out_names", "out_src", "out_dst", "params", "grad_reduce_params",
                "deferred_bias_params", "tp_divide_attrs", "divide_attrs")


class Finding(dict):
    """The located module: ``fqn``, ``cls``, ``side``, ``message``, ``entry`` (the plan's key) and
    ``planner`` (what hpgen plan would declare there, field by field)."""


def finding(verdict: Verdict, planner: dict[str, Any] | None) -> Finding | None:
    """Where the plan is wrong, or None for an exact plan."""
    from hpgen.core.plan import plan_from_dict

    if verdict.exact:
        return None
    plan = plan_from_dict(verdict.case.plan, name=verdict.case.plan_name)
    if verdict.spawn_error:
        return Finding(fqn="", cls="", side="ranks", message=f"the ranks failed: {verdict.spawn_error}", entry=None)
    if verdict.reference_error:
        return Finding(fqn="", cls="", side="reference", message=verdict.reference_error, entry=None)
    raised = verdict.raised
    if raised is not None and raised.refused:
        return Finding(fqn="", cls="", side="parallelize", message=f"parallelize refused the plan: {raised.error}",
                       entry=None)
    if raised is not None:
        fqn = raised.fqn
        key, entry_fqn = _entry_of(plan, fqn)
        where = f"{fqn} ({raised.cls})" if fqn else "the model"
        message = f"{where}: the {raised.stage} raised {raised.error}"
        focus = ("prefix", fqn[len(entry_fqn) + 1 :] + ".") if entry_fqn and fqn != entry_fqn else None
        return _with_plan(Finding(fqn=fqn, cls=raised.cls, side=raised.stage, message=message), plan, key,
                          entry_fqn, fqn, planner, focus)
    located = verdict.forward or verdict.backward
    if located is not None:
        kind = "output" if located.side == "forward" else "gradient of input"
        message = (f"{located.fqn} ({located.cls}): {located.side}: {kind} {located.what} differs "
                   f"(max {located.err:.3g}, tolerance {located.tol:.3g})")
        key, entry_fqn = _entry_of(plan, located.fqn)
        focus = ("out", located.what) if located.side == "forward" else ("in", located.what)
        return _with_plan(Finding(fqn=located.fqn, cls=located.cls, side=located.side, message=message), plan, key,
                          entry_fqn, located.fqn, planner, focus)
    if verdict.params:
        first = verdict.params[0]
        name = first.what.split(" ")[0]
        err = "" if first.err == float("inf") else f" (max {first.err:.3g}, tolerance {first.tol:.3g})"
        others = len(verdict.params) - 1
        message = (f"{first.fqn} ({first.cls}): backward: the gradient of {first.what}{err} differs"
                   + (f", and {others} more" if others else "") + "; outputs and input gradients agree")
        key, entry_fqn = _entry_of(plan, first.fqn)
        return _with_plan(Finding(fqn=first.fqn, cls=first.cls, side="backward", message=message), plan, key,
                          entry_fqn, first.fqn, planner, ("param", name[len(entry_fqn) + 1 :] if entry_fqn else name))
    failed = [check.name for check in verdict.checks if not check.ok]
    if failed == ["train mode, dropout 0"] or failed == ["train mode, dropout 0", "train mode, dropout 0.1"]:
        detail = next(check.detail for check in verdict.checks if check.name == failed[0])
        return Finding(fqn="", cls="", side="train", entry=None, message=(
            f"train mode: exact in eval mode, but not in train mode without dropout ({detail}): a path only "
            "training takes differs (a deferred bias shared before the reduction, a module's own train branch)"))
    if failed == ["train mode, dropout 0.1"]:
        detail = next(check.detail for check in verdict.checks if check.name == failed[0])
        return Finding(fqn="", cls="", side="train", entry=None, message=(
            f"train mode: exact without dropout, but with dropout the ranks disagree ({detail}): a random op draws "
            "different numbers on ranks where its value is replicated or a partial sum"))
    return Finding(fqn="", cls="", side="", message=f"{', '.join(failed)} differ; no boundary departs before the output",
                   entry=None)


def _entry_of(plan: Any, fqn: str) -> tuple[str | None, str]:
    """The plan key of ``fqn``'s own entry, or of the nearest module above it with one (and that module)."""
    parts = fqn.split(".") if fqn else []
    for cut in range(len(parts), 0, -1):
        candidate = ".".join(parts[:cut])
        entry = plan.entry_for(candidate)
        if entry is not None:
            return entry.key, candidate
    return None, ""


def _with_plan(found: Finding, plan: Any, key: str | None, entry_fqn: str, fqn: str,
               planner: dict[str, Any] | None, focus: tuple[str, str] | None) -> Finding:
    from hpgen.core.plan import plan_from_dict

    found["entry"] = key
    declared = _declared(plan.entries[key]) if key else {}
    found["declares"] = declared
    if key is None:
        found["message"] += "; the plan has no entry for it or any module above it"
    else:
        found["message"] += f"; the plan's entry {key!r} declares {_text(_focused(declared, focus))}"
    if planner is None:
        return found
    theirs_plan = plan_from_dict(planner, name="hpgen plan")
    theirs_entry = theirs_plan.entry_for(entry_fqn or fqn)
    theirs = _declared(theirs_entry) if theirs_entry is not None else {}
    changed = {name: value for name, value in theirs.items() if declared.get(name) != value}
    changed.update({name: None for name in declared if name not in theirs})
    found["planner"] = changed
    if theirs_entry is None and key is not None:
        found["message"] += "; hpgen plan has no entry there (it leaves the module replicated)"
    elif changed:
        found["message"] += f"; hpgen plan would declare {_text(_focused(changed, focus, keep_all=True))}"
        hint = _hint(declared, changed, theirs_entry)
        if hint:
            found["message"] += f": did you mean {hint}?"
    return found


def _declared(entry: Any) -> dict[str, Any]:
    """An entry's fields as plain values ({name: {axis: placement}}, lists), empty ones left out."""
    result: dict[str, Any] = {}
    for name in ENTRY_FIELDS:
        value = getattr(entry, name)
        if name in ("in_src", "in_dst", "out_src", "out_dst", "params"):
            value = {key: {axis: str(p) for axis, p in layout.placements} for key, layout in sorted(value.items())}
        elif value is not None:
            value = list(value)
        if value:
            result[name] = value
    return result


def _focused(fields: dict[str, Any], focus: tuple[str, str] | None, keep_all: bool = False) -> dict[str, Any]:
    """The fields about the value in focus (an output, an input, a parameter); all where none is."""
    if focus is None:
        return fields
    kind, name = focus
    wanted = {"out": ("out_src", "out_dst", "out_names"), "in": ("in_src", "in_dst")}.get(kind, ())
    picked: dict[str, Any] = {}
    for field_name, value in fields.items():
        if field_name in wanted and isinstance(value, dict):
            if name in value:
                picked[field_name] = {name: value[name]}
        elif field_name in wanted:
            picked[field_name] = value
        elif kind == "param" and field_name == "params" and isinstance(value, dict) and name in value:
            picked[field_name] = {name: value[name]}
        elif kind == "param" and field_name in ("grad_reduce_params", "deferred_bias_params"):
            picked[field_name] = value
        elif kind == "prefix" and field_name == "params" and isinstance(value, dict):
            inside = {key: layout for key, layout in value.items() if key.startswith(name)}
            if inside:
                picked[field_name] = inside
    if kind == "param" and not keep_all:
        picked.setdefault("grad_reduce_params", None)
    if keep_all:
        picked.update({k: v for k, v in fields.items() if k not in picked})
    return picked or fields


def _text(fields: dict[str, Any]) -> str:
    parts = []
    for name, value in fields.items():
        if value is None or value == []:
            parts.append(f"no {name}")
        elif isinstance(value, dict):
            inner = ", ".join(f"{key} {' '.join(f'{a} {p}' for a, p in layout.items()) if isinstance(layout, dict) else layout}"
                              for key, layout in value.items())
            parts.append(f"{name} {{{inner}}}")
        else:
            parts.append(f"{name} {value}")
    return "; ".join(parts) or "nothing for it"


def _hint(declared: dict[str, Any], changed: dict[str, Any], theirs_entry: Any) -> str:
    """One short correction: the first field the planner declares otherwise, with its reason where known."""
    for name in ("out_src", "out_names", "params", "grad_reduce_params", "deferred_bias_params", "in_src", "out_dst",
                 "in_dst"):
        if name not in changed:
            continue
        theirs, mine = changed[name], declared.get(name)
        if isinstance(theirs, dict):
            mine = mine or {}
            for key, layout in theirs.items():
                if mine.get(key) != layout:
                    text = f"{name} {key} {' '.join(f'{a} {p}' for a, p in layout.items())}"
                    if name == "out_src" and any(p.startswith("P(") for p in layout.values()):
                        rows = _row_parallel(theirs_entry)
                        if rows:
                            text += f" (the body returns a partial sum: {', '.join(rows)} row-parallel)"
                    return text
        return f"no {name}" if theirs is None else f"{name} {theirs}"
    return ""


def _row_parallel(entry: Any) -> list[str]:
    """The projections of an entry whose weights are cut on their input features (``nn.Linear`` S(1))."""
    names = []
    for name, layout in entry.params.items():
        if name.endswith(".weight") and any(p.kind == "S" and p.dim in (1, -1) for _, p in layout.placements):
            names.append(name[: -len(".weight")])
    return names


# --------------------------------------------------------------------------- the planner's reading


_PLANS: dict[str, dict[str, Any]] = {}


def planner_plan(verdict: Verdict) -> dict[str, Any] | None:
    """hpgen plan's plan for the case's tiny config, with ``--sp`` where the user's plan cuts the stream
    by tokens (an input ``S(1)``), ``--ep`` on an ``ep`` axis or where it injects an experts region
    (then the nearer of the two); None where the planner cannot plan the model."""
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    case = verdict.case
    sizes = dict(case.mesh)
    user = plan_from_dict(case.plan, name=case.plan_name)
    cp = sizes.get(CONTEXT_AXIS)  # --cp: the sequence cut on its own axis (with --tp where there is a tp axis)
    tp = sizes.get("tp", None if cp else max(sizes.values()))
    sharded_stream = any(
        placement.kind == "S" and placement.dim == 1 and axis != CONTEXT_AXIS
        for entry in user.entries.values() for layout in entry.in_src.values() for axis, placement in layout.placements
    )
    options: list[dict[str, Any]] = [{"sp": True} if sharded_stream else {}]
    if cp:
        options = [{**options[0], "cp": cp}]
    elif "ep" in sizes:
        options = [{**options[0], "ep": sizes["ep"], "ep_axis": "ep"}]
    elif user.injections:
        options.append({"ep": tp})
    best, best_score = None, None
    for extra in options:  # the user's plan's own flags first; the nearest of the plans that load
        key = json.dumps([case.class_name, case.config.to_json_string(), tp, extra], sort_keys=True, default=str)
        if key not in _PLANS:
            try:
                _PLANS[key] = plan_model(meta_model(case.config), tp=tp, name=case.name, **extra)
            except Exception:  # noqa: BLE001 - no planner opinion for this variant
                _PLANS[key] = {}
        plan = _PLANS[key]
        if not plan or list(plan.get("mesh_dim_names", [])) != list(user.mesh_dim_names):
            continue
        score = _distance(user, plan_from_dict(plan, name="hpgen plan"))
        if best_score is None or score < best_score:
            best, best_score = plan, score
    return best


def _distance(user: Any, planned: Any) -> int:
    """How many entry fields of the two plans differ (keys of either one)."""
    count = 0
    for key in {*user.entries, *planned.entries}:
        mine, theirs = user.entries.get(key), planned.entries.get(key)
        if mine is None or theirs is None:
            count += 3
            continue
        a, b = _declared(mine), _declared(theirs)
        count += sum(1 for name in {*a, *b} if a.get(name) != b.get(name))
    return count


# --------------------------------------------------------------------------- output


def report_json(verdict: Verdict, found: Finding | None, seconds: float | None = None) -> dict[str, Any]:
    """The verdict for CI: exact, each check, the finding."""
    return {
        "plan": verdict.case.plan_name,
        "model_class": verdict.case.class_name,
        "mesh": dict(verdict.case.mesh),
        "attn_implementation": _attention(verdict.case),
        "layers": list(verdict.case.layers),
        "exact": verdict.exact,
        "checks": [asdict(check) for check in verdict.checks],
        "finding": dict(found) if found else None,
        "differing_gradients": [d.what for d in verdict.params],
        **({"seconds": round(seconds, 1)} if seconds is not None else {}),
    }


def _stands_for(layers: tuple[str, ...], fqn: str) -> str:
    """Which layers of the user's model a tiny folded layer stands for (``model.layers.1-31``)."""
    for index, name in enumerate(layers):
        path = name.rpartition(".")[0]
        tiny = f"{path}.{index}"
        if name != tiny and (fqn == tiny or fqn.startswith(tiny + ".")):
            return f" (tiny {tiny} stands for {name})"
    return ""


def _attention(case: Any) -> str | None:
    """The attention implementation the case's config asks for (``None``: transformers' default)."""
    return getattr(case.config, "_attn_implementation", None)


def report_text(verdict: Verdict, found: Finding | None) -> str:
    """The verdict as lines: one a check, then where the plan is wrong."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in verdict.case.mesh)
    attention = _attention(verdict.case)
    lines = [f"{verdict.case.plan_name}: {verdict.case.class_name} (tiny config"
             + (f", {attention} attention" if attention else "") + f") on {mesh} gloo ranks "
             "against the unsharded model (tolerance 1e-5 + 1e-4 x max |reference|)"]
    if verdict.case.layers:
        lines.append(f"  numbered layers folded to one tiny layer per distinct contract: {', '.join(verdict.case.layers)}")
    for check in verdict.checks:
        mark = "ok" if check.ok else "DIFFERS"
        lines.append(f"  {check.name}: {mark}: max {check.err:.3g} (tolerance {check.tol:.3g})"
                     + (f"; {check.detail}" if check.detail else ""))
    if found is not None:
        text = found["message"]
        for marker in ("; the plan's entry", "; the plan has no entry", "; hpgen plan "):  # one clause a line
            text = text.replace(marker, "\n    " + marker[2:])
        first, _, rest = text.partition("\n")
        lines.append("  " + first + _stands_for(verdict.case.layers, found.get("fqn", "")) + (f"\n{rest}" if rest else ""))
        more = [d.what for d in verdict.params[1:6]]
        if more:
            lines.append(f"  other gradients that differ: {', '.join(more)}" + (" ..." if len(verdict.params) > 6 else ""))
    lines.append("exact" if verdict.exact else "NOT exact")
    return "\n".join(lines) + "\n"
