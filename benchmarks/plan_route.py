"""Not a speed: the route of the plan through ``parallelize`` -- which hpgen functions it is handed to.

    python benchmarks/plan_route.py [--family llama] [--plan llama_tp_vocab]

One process, a gloo group of world size 1 (a 1-rank mesh on the plan's first axis): the
tiny config of a test family, its modeling file lowered under a plan of ``tests/plans``,
and one ``parallelize`` under ``sys.settrace``. A *stop* is a call of a function defined
in hpgen that receives the plan as an argument: the dict passed to ``parallelize`` or the
``Plan`` made from it (its own methods, ``Plan.entry_for``, count too; a last line leaves them
out). The report lists, per module, the stops and the functions stopped
at, and the totals (stops, modules entered). Run it before and after a refactor of the
runtime's install path to see whether the plan is asked fewer questions from fewer places.

A second table follows where the answers go instead: the calls that receive one of the
decision records the survey makes once (``hpgen.core.decision.EntryDecision``,
``hpgen.runtime.install.module_decisions.ModuleDecision``, alone or in a list), the
records' own properties left out. A plan that stops reaching an installer shows up there,
so a record cannot hide a stop.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support, run as a script from anywhere


RECORDS = ("EntryDecision", "ModuleDecision")


def _is_plan(value: Any, given: dict[str, Any]) -> bool:
    kind = type(value)
    return value is given or (kind.__name__ == "Plan" and kind.__module__.startswith("hpgen."))


def _is_record(value: Any) -> bool:
    """A decision record, or a list or tuple whose first item is one."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    kind = type(value)
    return kind.__name__ in RECORDS and kind.__module__.startswith("hpgen.")


def _arguments(frame: FrameType) -> list[Any]:
    """The values a call was handed: its parameters, ``*args`` spread."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:count])
    flags = code.co_flags
    if flags & 0x04:  # CO_VARARGS
        names.append(code.co_varnames[count])
        count += 1
    if flags & 0x08:  # CO_VARKEYWORDS
        names.append(code.co_varnames[count])
    found = []
    for name in names:
        value = frame.f_locals.get(name)
        found.extend(value if isinstance(value, tuple) else value.values() if isinstance(value, dict) and name.startswith("kw") else [value])
    return found


def route(plan_doc: dict[str, Any], run: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(module, function) of every stop of ``plan_doc``, and of every call handed a decision record, while ``run()`` runs."""
    package = str(ROOT / "hpgen")
    stops: list[tuple[str, str]] = []
    handed: list[tuple[str, str]] = []

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            values = _arguments(frame)
            where = (frame.f_globals.get("__name__", "?"), frame.f_code.co_qualname)
            if any(_is_plan(value, plan_doc) for value in values):
                stops.append(where)
            if not where[1].startswith(tuple(f"{name}." for name in RECORDS)) and any(map(_is_record, values)):
                handed.append(where)
        return None  # no line events: only calls are counted

    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
    return stops, handed


def _table(calls: list[tuple[str, str]], counted: str = "stops") -> dict[str, collections.Counter[str]]:
    by_module: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for module, function in calls:
        by_module[module][function] += 1
    print(f"| module | {counted} | functions (times) |\n|---|---|---|")
    for module, functions in sorted(by_module.items(), key=lambda item: (-sum(item[1].values()), item[0])):
        listed = ", ".join(f"{name} ({times})" if times > 1 else name for name, times in sorted(functions.items()))
        print(f"| {module} | {sum(functions.values())} | {listed} |")
    return by_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--plan", default="llama_tp_vocab", help="a plan of tests/plans, without .json")
    args = parser.parse_args()

    import torch.distributed as dist

    from hpgen.runtime import parallelize
    from tests.support.models import (
        generated_model,
        import_file,
        lower_family,
        load_plan_dict,
        make_config,
        reference_model,
    )
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        plan_doc = load_plan_dict(args.plan)
        with tempfile.TemporaryDirectory() as folder:
            path = lower_family(args.family, args.plan, Path(folder))
            config = make_config(args.family)
            model = generated_model(import_file(path), args.family, config, reference_model(args.family, config, 0))
            mesh = init_device_mesh("cpu", (1,), mesh_dim_names=(plan_doc["mesh_dim_names"][0],))
            stops, records = route(plan_doc, lambda: parallelize(model, plan_doc, mesh))
    finally:
        dist.destroy_process_group()

    print(f"plan route through parallelize ({args.family}, tests/plans/{args.plan}.json, 1 rank):")
    by_module = _table(stops)
    print(f"total: {len(stops)} stops in {len(by_module)} modules")
    handed = [(module, function) for module, function in stops if not function.startswith("Plan.")]
    print(f"the plan's own methods apart: {len(handed)} stops in {len({module for module, _ in handed})} modules")
    print("\ncalls handed a decision record (EntryDecision, ModuleDecision) instead:")
    by_module = _table(records, "calls")
    print(f"total: {len(records)} calls in {len(by_module)} modules")


if __name__ == "__main__":
    main()
