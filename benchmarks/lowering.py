"""Lowering time per stage for transformers' modeling files, against a bare libcst parse.

    python benchmarks/lowering.py [--runs 5] [--only llama,qwen3] [--all] [--json out.json]

For each modeling file it times the pipeline of ``hpgen.generator.lower.lower`` stage by stage and
the write, and next to it ``libcst.parse_module`` of the same text (the floor for any
libcst-based rewrite), taking turns file by file and run by run.

The stages are timed from the outside: for the duration of a run, the functions that
``hpgen.generator.lower`` calls are replaced in that module's namespace by timing wrappers:

- parse: ``parse_source`` (CPython's ``ast.parse``, then ``libcst.parse_module``);
- index: ``index_module``; resolve: ``resolve_boundaries``; classify: ``_lower_class``;
- emit: "rewrite", ``rewrite_class`` (templates rendered and parsed into the boundary
  classes); "imports", ``_absolute_imports`` (relative imports made absolute); "text", the
  rest of ``lower()``: the module's text regenerated from the tree, and the header;
- compile: the builtin ``compile`` proving the generated code compiles;
- write: ``hpgen.generator.write.write_file`` into a temporary folder (temp file, fsync, rename).

Times are the thread's CPU time (``time.thread_time``: other processes on a shared machine
do not count), except the write, in wall time since it waits on fsync.

Files are lowered with ``package`` set, as ``hpgen lower -o`` does for an output outside the
source's package.

Plans come from ``hpgen plan`` (:func:`hpgen.planner.translate.translator.translated_plan`, tensor parallel, no
divisibility check): every model type whose config has a ``base_model_tp_plan`` and for
which it makes a plan, lowered from the file its model class comes from (one row per file;
the first model type wins). The others are listed with the reason.

The default set is the families the README names; ``--all`` takes every model type
(planning them all costs about a minute more).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import libcst
import transformers
from transformers.models.auto import configuration_auto

import hpgen.generator.lower
from hpgen.core.errors import HpgenError
from hpgen.core.plan import plan_from_dict
from hpgen.generator.write import write_file

DEFAULT_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "phi3",
    "starcoder2",
    "olmo2",
    "cohere",
)
STAGES = ("parse", "index", "resolve", "classify", "rewrite", "imports", "text", "compile", "write")
# The functions hpgen.generator.lower calls, by their name in its namespace -> the stage they time.
WRAPPED = {
    "parse_source": "parse",
    "index_module": "index",
    "resolve_boundaries": "resolve",
    "_lower_class": "classify",
    "rewrite_class": "rewrite",
    "_absolute_imports": "imports",
    "compile": "compile",
}
CLOCK = time.thread_time  # CPU time of this thread: other processes on a shared machine do not count


# --------------------------------------------------------------------------- the files and plans


@dataclass
class Case:
    """One modeling file and the plan it is lowered under."""

    model_type: str
    source: Path
    plan: dict  # from hpgen plan
    text: str
    package: str  # of the source: relative imports become absolute in it
    parse_s: list[float] = field(default_factory=list)  # bare libcst parses
    stage_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    @property
    def total_s(self) -> list[float]:
        return [sum(run) for run in zip(*(self.stage_s[stage] for stage in STAGES), strict=True)]


def collect_cases(model_types: list[str] | None) -> tuple[list[Case], dict[str, str]]:
    """The cases to time (one per modeling file) and the skipped model types with the reason.

    Several model types can share a file (``exaone`` and ``llama`` build ``LlamaForCausalLM``);
    the row is named after the type whose name the file carries, else the first one.
    """
    from hpgen.planner.model.load import load_config, meta_model, model_class_for
    from hpgen.planner.translate.translator import translated_plan

    by_source: dict[Path, list[Case]] = defaultdict(list)
    skipped = {}
    for model_type, config_name in configuration_auto.CONFIG_MAPPING_NAMES.items():
        if model_types is not None and model_type not in model_types:
            continue
        config_class = getattr(transformers, config_name, None)
        if config_class is None or not getattr(config_class, "base_model_tp_plan", None):
            if model_types is not None:
                skipped[model_type] = "its config has no base_model_tp_plan"
            continue
        try:
            config = load_config(model_type)
            model_class = model_class_for(config)
            plan = translated_plan(meta_model(config), name=model_type)
        except HpgenError as error:
            skipped[model_type] = f"hpgen plan: {str(error).splitlines()[0]}"
            continue
        source = Path(inspect.getsourcefile(model_class))
        package = model_class.__module__.rpartition(".")[0]
        by_source[source].append(Case(model_type, source, plan, "", package))
    cases = []
    for source, candidates in by_source.items():
        named = [case for case in candidates if source.name == f"modeling_{case.model_type}.py"]
        chosen = (named or candidates)[0]
        chosen.text = source.read_text()
        cases.append(chosen)
        for other in candidates:
            if other is not chosen:
                skipped[other.model_type] = f"same file as {chosen.model_type} ({source.name})"
    return cases, skipped


# --------------------------------------------------------------------------- timing


@contextlib.contextmanager
def stage_timers(sink: dict[str, float]) -> Iterator[None]:
    """Time the functions ``hpgen.generator.lower`` calls, by replacing them in its namespace.

    ``compile`` is the builtin: its wrapper goes into the module's globals, which shadow
    the builtins, and is deleted afterwards.
    """
    namespace = vars(hpgen.generator.lower)
    missing = [name for name in WRAPPED if name != "compile" and name not in namespace]
    if missing:
        raise SystemExit(f"hpgen.generator.lower no longer calls {', '.join(missing)}: update WRAPPED in {__file__}")
    saved = {name: namespace.get(name) for name in WRAPPED}

    def timed(function: Callable, stage: str) -> Callable:
        def wrapper(*args, **kwargs):
            start = CLOCK()
            try:
                return function(*args, **kwargs)
            finally:
                sink[stage] += CLOCK() - start

        return wrapper

    for name, stage in WRAPPED.items():
        namespace[name] = timed(saved[name] or compile, stage)
    try:
        yield
    finally:
        for name, function in saved.items():
            if function is None:
                del namespace[name]
            else:
                namespace[name] = function


def time_case(case: Case, folder: Path) -> None:
    """One run of the bare parse and one of the pipeline, appended to ``case``."""
    plan = plan_from_dict(case.plan, name=f"{case.model_type}.json")
    gc.collect()
    start = CLOCK()
    libcst.parse_module(case.text)
    case.parse_s.append(CLOCK() - start)

    gc.collect()
    sink = defaultdict(float)
    with stage_timers(sink):
        start = CLOCK()
        code = hpgen.generator.lower.lower(case.text, plan, source_name=case.source.name, package=case.package)
        total = CLOCK() - start
    target = folder / case.source.name
    target.unlink(missing_ok=True)  # write_file skips identical bytes; make it write
    start = time.perf_counter()  # wall time: the write waits on fsync
    write_file(target, code.encode())
    sink["write"] = time.perf_counter() - start
    sink["text"] = total - sum(sink[stage] for stage in WRAPPED.values())
    for stage in STAGES:
        case.stage_s[stage].append(sink[stage])


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per file (default 5)")
    parser.add_argument("--only", help="comma-separated model types (default: the README's families)")
    parser.add_argument("--all", action="store_true", help="every model type with a base_model_tp_plan")
    parser.add_argument("--json", type=Path, help="also write the raw times to this file")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()  # configs' warnings while planning
    started = time.perf_counter()
    wanted = None if args.all else (args.only.split(",") if args.only else list(DEFAULT_TYPES))
    cases, skipped = collect_cases(wanted)
    gc.collect()
    gc.freeze()  # what is alive now (torch, transformers, the texts) stays out of every later collection
    with tempfile.TemporaryDirectory(prefix="hpgen_lowering_") as folder:
        for case in list(cases):  # warm-up (imports, templates, caches) and the check that it lowers
            try:
                time_case(case, Path(folder))
            except HpgenError as error:
                skipped[case.model_type] = f"hpgen lower: {str(error).splitlines()[0]}"
                cases.remove(case)
            case.parse_s.clear()
            case.stage_s.clear()
        for _ in range(args.runs):
            for case in cases:
                time_case(case, Path(folder))
    print(report(cases, skipped, args.runs, wanted, time.perf_counter() - started))
    if args.json:
        args.json.write_text(
            json.dumps(
                {c.model_type: {"source": c.source.name, "libcst_parse": c.parse_s, **c.stage_s} for c in cases},
                indent=1,
            )
        )


def report(cases: list[Case], skipped: dict[str, str], runs: int, wanted: list[str] | None, wall_s: float) -> str:
    """Two tables: totals against the bare parse, then each stage; and what was left out."""
    ms = 1e3
    cases = sorted(cases, key=lambda c: c.model_type)
    lines = [
        f"### Lowering against a bare libcst parse ({runs} runs per file, ms of CPU time)",
        "",
        "Ratio: of the medians; paired: the median over runs of lower+write / parse, both in the same run.",
        "",
        "| model type | lines | plan keys | libcst parse p50 | lower+write p50 | p95 | max | ratio | paired |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for case in cases:
        total, parse = case.total_s, statistics.median(case.parse_s)
        paired = statistics.median(t / p for t, p in zip(total, case.parse_s, strict=True))
        ratios.append(paired)
        lines.append(
            f"| {case.model_type} | {case.text.count(chr(10))} | {len(case.plan['param_plan'])} | {parse * ms:.1f} | "
            f"{statistics.median(total) * ms:.1f} | {quantile(total, 0.95) * ms:.1f} | {max(total) * ms:.1f} | "
            f"{statistics.median(total) / parse:.2f} | {paired:.2f} |"
        )
    if not cases:
        return "\n".join(lines + ["", "no file to lower"])
    lines += [
        "",
        (
            f"{len(cases)} files; paired ratio median {statistics.median(ratios):.2f}, max {max(ratios):.2f}; "
            f"{sum(r <= 1.5 for r in ratios)} of {len(ratios)} within 1.5x. Benchmark wall time {wall_s:.0f} s."
        ),
        "",
        "### Stages (p50, ms)",
        "",
        "| model type | " + " | ".join(STAGES) + " |",
        "|---|" + "---:|" * len(STAGES),
    ]
    shares: dict[str, list[float]] = defaultdict(list)
    for case in cases:
        parse = statistics.median(case.parse_s)
        medians = {stage: statistics.median(case.stage_s[stage]) for stage in STAGES}
        for stage, value in medians.items():
            shares[stage].append(value / parse)
        lines.append(f"| {case.model_type} | " + " | ".join(f"{medians[s] * ms:.1f}" for s in STAGES) + " |")
    lines.append(
        "| *of the libcst parse (median over files)* | "
        + " | ".join(f"{statistics.median(shares[s]):.2f}x" for s in STAGES)
        + " |"
    )
    not_run = {t: why for t, why in skipped.items() if wanted is None or t in wanted}
    if not_run:
        lines += ["", "Not benchmarked:", ""]
        lines += [f"- {model_type}: {why}" for model_type, why in sorted(not_run.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
