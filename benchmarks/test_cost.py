"""Not a speed of hpgen: what the test suite's files cost, wall time and CPU time, in two checkouts side by side.

    python benchmarks/test_cost.py --base /path/to/other/checkout tests/verify tests/runtime/forward/test_compile.py
    python benchmarks/test_cost.py --xdist tests/runtime/forward        # the same files, -n 2 --dist loadfile beside

Each run is ``python -m pytest -q -p no:cacheprovider PATHS`` in a checkout, started from a process that is a
child subreaper (Linux's ``PR_SET_CHILD_SUBREAPER``), so that the CPU time of every process the run starts is
counted: the gloo ranks forked by the session's forkserver, which outlives pytest and would otherwise be
reparented to init with their times lost, and the subprocesses of the CLI tests. On a machine shared with other
work the wall time follows the load; the CPU time much less, so compare CPU first. The runs alternate between
the checkouts (``--rounds``), each row the median of its rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def measured(command: list[str], cwd: Path) -> tuple[float, float, int]:
    """(wall s, CPU s of the whole process tree, exit code) of ``command`` run in ``cwd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    code = subprocess.call(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:  # the orphans reparented here (a forkserver and its ranks): reap them, so their times count
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="test files or folders, relative to each checkout")
    parser.add_argument("--base", type=Path, help="another checkout to run the same paths in (its tests, this venv)")
    parser.add_argument("--xdist", action="store_true", help="also run them with -n 2 --dist loadfile (pytest-xdist)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant, alternating")
    args = parser.parse_args()
    if ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("test_cost.py needs Linux's PR_SET_CHILD_SUBREAPER")
    here = Path(__file__).resolve().parents[1]
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    variants = {"this checkout": (here, pytest + args.paths)}
    if args.base is not None:
        variants["base"] = (args.base.resolve(), pytest + args.paths)
    if args.xdist:
        variants["this checkout, -n 2"] = (here, pytest + ["-n", "2", "--dist", "loadfile"] + args.paths)
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (cwd, command) in variants.items():
            runs[name].append(measured(command, cwd))
            print(f"{name}: wall {runs[name][-1][0]:.1f} s, CPU {runs[name][-1][1]:.1f} s, exit {runs[name][-1][2]}",
                  file=sys.stderr)  # fmt: skip
    first = next(iter(runs))
    print(f"pytest {' '.join(args.paths)} ({args.rounds} round(s), load average at the end {os.getloadavg()[0]:.1f})\n")
    print("| run | wall s | CPU s (whole tree) | wall / first | CPU / first | exit codes |")
    print("|---|---|---|---|---|---|")
    wall0 = statistics.median(r[0] for r in runs[first])
    cpu0 = statistics.median(r[1] for r in runs[first])
    for name, results in runs.items():
        wall, cpu = statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)
        codes = ",".join(str(r[2]) for r in results)
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {wall / wall0:.2f} | {cpu / cpu0:.2f} | {codes} |")


if __name__ == "__main__":
    main()
