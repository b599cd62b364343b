"""What ``hpgen plan`` writes for every causal LM of the installed transformers, to prove a refactor changes nothing.

    python benchmarks/planner_snapshot.py before.jsonl             # on the old code (e.g. a git archive of main)
    python benchmarks/planner_snapshot.py after.jsonl              # on the new code
    python benchmarks/planner_snapshot.py --compare before.jsonl after.jsonl

For each model type with a causal-LM class (:func:`benchmarks.coverage.architectures`),
the tiny config of ``coverage.py`` on the meta device is planned with
:func:`hpgen.planner.entry.make.plan_model` under the variants of :data:`VARIANTS` (``--ep``
ones only where the config has an expert plan), and the default config once through
``hpgen plan``'s own path (:func:`hpgen.planner.entry.printout.plan_with_report`, ``--tp 2
--explain``). One JSON line per (model type, variant) holds the plan's JSON text, the
``--explain`` notes, the sizing report's text, or the error message. Two runs on the same
transformers, with the same ``PYTHONHASHSEED`` (so that output depending on set order, as a
refusal message of the derivation did until fixed, does not pass for a change), give byte-identical files when the
planner's behaviour is the same; ``--compare`` counts the records and lists the ones that
differ. It takes ~13 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS: dict[str, dict[str, Any]] = {
    # what coverage.py runs: tp, --sp, --ep 2, and the derivation forced
    "tp": {"tp": 2},
    "sp": {"tp": 2, "sp": True},
    "ep": {"tp": 2, "ep": 2},
    "from_source": {"tp": 2, "from_source": True},
    # beyond coverage.py: the experts on an axis of their own, more ranks than key/value heads
    "ep_axis": {"tp": 2, "ep": 2, "ep_axis": "ep"},
    "tp4": {"tp": 4},
    "from_source_tp4_sp": {"tp": 4, "sp": True, "from_source": True},
}


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _notes(plan: dict[str, Any]) -> list[str]:
    """The ``--explain`` lines of a plan's comments."""
    comments = plan.get("comments", {})
    lines = [comments.get("plan_source", "plan")]
    for heading, key in (("sharded", "sharded"), ("kept replicated", "replicated")):
        for pattern, text in sorted(comments.get(key, {}).items()):
            lines.append(f"  {heading}: {pattern}: {text}")
    return lines


def records(model_type: str) -> list[dict[str, Any]]:
    """The snapshot records of one model type."""
    from benchmarks.coverage import _has_expert_plan, tiny_config
    from hpgen.planner.entry.printout import plan_with_report
    from hpgen.planner.translate.document import dumps_plan
    from hpgen.planner.model.load import meta_model, model_and_config
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.entry.sizing_report import size_report

    found = []
    try:
        _, config = model_and_config(tiny_config(model_type))
        model = meta_model(config)
    except Exception as error:  # transformers cannot build the tiny config: recorded, as any outcome
        return [{"model_type": model_type, "variant": "config", "error": _error(error)}]
    for variant, options in VARIANTS.items():
        if "ep" in options and not _has_expert_plan(model_type):
            continue
        row: dict[str, Any] = {"model_type": model_type, "variant": variant}
        try:
            plan = plan_model(model, name=model_type, **options)
            row["plan"], row["notes"] = dumps_plan(plan), _notes(plan)
            if "ep" not in options:
                try:
                    row["size"] = size_report(model, plan, tp=options["tp"], dtype="bfloat16").text()
                except Exception as error:  # recorded: a refactor must fail the same way
                    row["size_error"] = _error(error)
        except Exception as error:  # recorded: a refactor must fail the same way
            row["error"] = _error(error)
            if not type(error).__module__.startswith("hpgen"):  # not a planned refusal: where it came from
                row["where"] = traceback.format_exc().strip().splitlines()[-3].strip()
        found.append(row)
    row = {"model_type": model_type, "variant": "cli_default_config"}
    try:
        text, messages = plan_with_report(
            model_type, tp=2, ep=None, sp=False, from_source=False, notes=True, dtype="bfloat16"
        )
        row["plan"], row["messages"] = text, messages
    except Exception as error:  # recorded: a refactor must fail the same way
        row["error"] = _error(error)
    found.append(row)
    return found


def snapshot(out: Path, wanted: list[str]) -> None:
    started = time.monotonic()
    with out.open("w") as stream:
        for model_type in wanted:
            for row in records(model_type):
                stream.write(json.dumps(row, sort_keys=True) + "\n")
            stream.flush()
            print(model_type, file=sys.stderr, flush=True)
    print(f"{len(wanted)} model types in {time.monotonic() - started:.0f} s -> {out}", file=sys.stderr)


def compare(before: Path, after: Path) -> int:
    """Print the counts per variant and outcome and the records that differ; 1 when any does."""
    old, new = before.read_bytes(), after.read_bytes()
    rows = {path: [json.loads(line) for line in text.splitlines()] for path, text in ((before, old), (after, new))}
    counts = collections.Counter((row["variant"], "error" if "error" in row else "plan") for row in rows[before])
    print("| variant | plans | errors |\n|---|---|---|")
    for variant in dict.fromkeys(variant for variant, _ in sorted(counts)):
        print(f"| {variant} | {counts[(variant, 'plan')]} | {counts[(variant, 'error')]} |")
    keyed = [{(row["model_type"], row["variant"]): row for row in rows[path]} for path in (before, after)]
    differ = sorted(key for key in keyed[0].keys() | keyed[1].keys() if keyed[0].get(key) != keyed[1].get(key))
    for model_type, variant in differ:
        print(f"differs: {model_type} {variant}")
    same = old == new
    print(
        f"{len(rows[before])} records, {len(old)} bytes before, {len(new)} after: "
        f"{'byte-identical' if same else f'{len(differ)} records differ'}"
    )
    return 0 if same else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="the JSON-lines file to write")
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if args.out is None:
        parser.error("give the output file, or --compare BEFORE AFTER")
    import transformers

    from benchmarks.coverage import architectures

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    snapshot(args.out, args.only.split(",") if args.only else architectures())


if __name__ == "__main__":
    main()
