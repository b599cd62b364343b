"""Head counts that do not divide 2, 4 and 8 among the causal LMs' default configs, and what ``hpgen plan`` does there.

    python benchmarks/coverage_heads.py            # rewrites its section of docs/coverage.md
    python benchmarks/coverage_heads.py --print    # prints the section instead

For every model type of :func:`coverage.architectures` (those with a causal-LM class), the
default config transformers gives it (its text config for a composite model): its query and
key/value head counts, and which of ``--tp`` 2, 4 and 8 they do not divide (query heads not a
multiple of the size, or key/value heads neither a multiple nor a divisor of it). For each
such (type, size), ``hpgen plan --tp N`` on the default config on the meta device
(:func:`hpgen.planner.entry.make.plan_model`; no weights): whether it writes a plan, the query
heads its sizing report gives each rank (none where the attention stays whole on every rank,
or is sharded in per-projection entries the report does not read heads from), the largest
rank's share of the parameters, or the first line of its refusal. The section sits
between ``HEADS_BEGIN`` and ``HEADS_END`` of the page; the rest of the page is
:mod:`coverage`'s. A few minutes (the default configs are full size, built on the meta device).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from coverage import HEADS_BEGIN, HEADS_END, TABLE, architectures, with_section
SIZES = (2, 4, 8)


def head_counts(model_type: str) -> tuple[int, int] | str:
    """(query heads, key/value heads) of the default config, or why there is no single count."""
    from transformers import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception as error:  # a config that needs arguments
        return f"no default config ({type(error).__name__})"
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
    except ValueError:  # several text configs (an encoder and a decoder)
        return "several text configs"
    try:
        heads = getattr(text, "num_attention_heads", None)
        kv = getattr(text, "num_key_value_heads", None)
    except Exception:  # heads that differ per layer
        return "heads differ per layer"
    if not isinstance(heads, int) or isinstance(heads, bool):
        return "no num_attention_heads"
    kv = kv if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 else heads
    return heads, kv


def divides(heads: int, kv: int, size: int) -> bool:
    """Whether plain ``S``/``RS`` cuts whole heads at ``size`` (what hpgen.plan/1 could express)."""
    return heads % size == 0 and (kv % size == 0 or size % kv == 0)


def planned(model_type: str, size: int) -> str:
    """What ``hpgen plan --tp size`` does with the default config: heads per rank, or its refusal."""
    from transformers import CONFIG_MAPPING

    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.entry.sizing_report import size_report

    try:
        model = meta_model(CONFIG_MAPPING[model_type]())
        plan = plan_model(model, tp=size, name=model_type)
        report = size_report(model, plan, tp=size, dtype="bfloat16")
    except Exception as error:
        return "refused: " + str(error).splitlines()[0].replace("|", "/")[:160]
    held = next(iter(report.heads.values()), None)
    share = max(report.rank_bytes) / report.total_bytes
    source = "transformers' plan" if plan.get("comments", {}).get("plan_source") == "transformers' plan" else "derived"
    if held is None:  # the attention kept whole on every rank, or heads the report does not read
        return f"plan ({source}), {share:.2f} of the model a rank"
    return f"plan ({source}), query heads {'/'.join(map(str, held.query))}, {share:.2f} of the model a rank"


def section() -> str:
    started = time.perf_counter()
    counts: dict[str, Any] = {}
    for model_type in architectures():
        counts[model_type] = head_counts(model_type)
    known = {t: c for t, c in counts.items() if isinstance(c, tuple)}
    rows, tally = [], {"heads": 0, "plan": 0, "refused": 0}
    for model_type, (heads, kv) in sorted(known.items()):
        failing = [size for size in SIZES if not divides(heads, kv, size)]
        if failing:
            found = [planned(model_type, size) for size in failing]
            for outcome in found:
                tally["refused" if outcome.startswith("refused") else "heads" if "query heads" in outcome else "plan"] += 1
            outcomes = "; ".join(f"--tp {size}: {outcome}" for size, outcome in zip(failing, found))
            rows.append(f"| {model_type} | {heads} | {kv} | {', '.join(map(str, failing))} | {outcomes} |")
    lines = [
        HEADS_BEGIN,
        "## Heads that do not divide `--tp` (default configs)",
        "",
        f"Generated by `python benchmarks/coverage_heads.py` ({time.perf_counter() - started:.0f} s). The default "
        f"config of each of the {len(counts)} causal-LM model types (full size, on the meta device): its query and "
        "key/value heads, the sizes 2, 4 and 8 they do not divide (query heads not a multiple; key/value heads "
        "neither a multiple nor a divisor), and what `hpgen plan --tp N` writes there (heads cut whole, the "
        "first ranks one more: `hpgen.plan/2`).",
        "",
    ]
    for size in SIZES:
        query = sum(1 for h, _ in known.values() if h % size)
        either = sum(1 for h, kv in known.values() if not divides(h, kv, size))
        lines.append(
            f"- `--tp {size}`: query heads do not divide for **{query}** of {len(known)} types with one head count; "
            f"query or key/value heads for **{either}**"
        )
    lines.append(
        f"- of these {sum(tally.values())} (type, size) pairs, `hpgen plan` now cuts the heads whole for "
        f"**{tally['heads']}** (the sizing report gives each rank's query heads), writes a plan whose heads the "
        f"report does not read for {tally['plan']} (the attention kept whole, or sharded per projection), and "
        f"refuses {tally['refused']} (a rank without a query head, or a config transformers will not build); "
        "before `hpgen.plan/2` every pair with a head-sharded attention was refused or kept its attention whole"
    )
    other = sorted(t for t, c in counts.items() if not isinstance(c, tuple))
    lines += [f"- no single head count in the default config: {len(other)} ({', '.join(other)})", ""]
    lines += ["| model type | query heads | key/value heads | not dividing | `hpgen plan --tp N` |", "|---|---|---|---|---|"]
    lines += rows
    lines.append(HEADS_END)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the section instead of rewriting the page")
    parser.add_argument("--table", type=Path, default=TABLE)
    args = parser.parse_args()
    import transformers

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    text = section()
    if args.print:
        print(text)
    else:
        args.table.write_text(with_section(args.table.read_text(), text, HEADS_BEGIN, HEADS_END))


if __name__ == "__main__":
    main()
