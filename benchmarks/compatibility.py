"""The release table of docs/compatibility.md: transformers release x suite summary x coverage rows at parity.

For each release, give what a run with that release installed left behind: the suite's pytest
output (``python -m pytest -q > suite.log``, or ``-m releases``) and the folder of
``benchmarks/coverage.py``'s results (``--results DIR``: ``hpgen-coverage-<tp|sp|ep>.jsonl``)::

    python benchmarks/compatibility.py \\
        --release 5.24.0 --suite /tmp/suite-5.24.log --results /tmp/coverage-5.24 \\
        --release 5.25.0 --suite /tmp/suite-5.25.log --results /tmp/coverage-5.25

It rewrites the table between the ``COMPATIBILITY`` markers of docs/compatibility.md (``--page``
for another file, ``--print`` to print it only). TP rows count as benchmarks/coverage.py's
headline does (at parity with the decoder layers sharded, each rank at most its target share);
SP and EP rows count logits and every gradient equal. A release whose results are missing
gets ``not run`` in that cell: the table never shows a number nobody measured.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.coverage import at_target, load_results, results_path  # noqa: E402

BEGIN, END = "<!-- COMPATIBILITY BEGIN -->", "<!-- COMPATIBILITY END -->"
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|error|errors)\b.*?)\s*=*$")


def suite_summary(log: Path | None) -> str:
    """pytest's last summary line in ``log`` (``31 failed, 119 errors, 1176 passed in ...``), or ``not run``."""
    if log is None or not log.exists():
        return "not run"
    found = [m.group(1) for line in log.read_text(errors="replace").splitlines() if (m := SUMMARY.match(line.strip()))]
    return found[-1] if found else "no summary line"


def coverage_counts(results: Path | None) -> dict[str, str]:
    """TP / SP / EP rows at parity from a coverage results folder (``not run`` where a file is missing)."""
    counts: dict[str, str] = {}
    for variant in ("tp", "sp", "ep"):
        path = results_path(results, variant) if results is not None else None
        if path is None or not path.exists():
            counts[variant] = "not run"
            continue
        rows = list(load_results(path).values())
        if variant == "tp":
            counts[variant] = str(sum(at_target(row) for row in rows))
        else:
            counts[variant] = str(sum(bool(row.parity and row.grads_ok) for row in rows))
    return counts


def table(releases: list[tuple[str, Path | None, Path | None]]) -> str:
    lines = [
        "| transformers | suite | TP rows at parity | SP rows at parity | EP rows at parity |",
        "|---|---|---|---|---|",
    ]
    for name, suite, results in releases:
        counts = coverage_counts(results)
        lines.append(f"| {name} | {suite_summary(suite)} | {counts['tp']} | {counts['sp']} | {counts['ep']} |")
    return "\n".join(lines)


def write_page(page: Path, text: str) -> None:
    """Replace the table between the markers of ``page`` (the markers must be there)."""
    content = page.read_text()
    start, end = content.find(BEGIN), content.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{page}: no {BEGIN} ... {END} markers to write the table between")
    page.write_text(content[: start + len(BEGIN)] + "\n" + text + "\n" + content[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", action="append", required=True, help="a transformers release (a row)")
    parser.add_argument("--suite", action="append", default=[], help="its pytest output, one per --release")
    parser.add_argument("--results", action="append", default=[], help="its coverage results folder, one per --release")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "compatibility.md")
    parser.add_argument("--print", action="store_true", help="print the table, write nothing")
    args = parser.parse_args(argv)
    for flag in ("suite", "results"):
        if getattr(args, flag) and len(getattr(args, flag)) != len(args.release):
            parser.error(f"give --{flag} once per --release (or not at all)")
    suites = [Path(s) for s in args.suite] or [None] * len(args.release)
    results = [Path(r) for r in args.results] or [None] * len(args.release)
    text = table(list(zip(args.release, suites, results)))
    if args.print:
        print(text)
    else:
        write_page(args.page, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
