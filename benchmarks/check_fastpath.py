"""`hpgen check` on 20 fresh targets, with and without the verified-header fast path.

    python benchmarks/check_fastpath.py [--targets 20] [--rounds 5]

Runs the real command in fresh interpreters, interleaving the variants round by round,
and prints medians next to the interpreter start-up and `hpgen --version` (import cost).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(command: list[str], cwd: Path, expect: int = 0) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != expect:
        raise SystemExit(f"{command} exited {done.returncode}: {done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        project = Path(folder)
        (project / "gen").mkdir()
        shutil.copy(ROOT / "fixtures" / "modeling_tiny.py", project / "modeling_tiny.py")
        shutil.copy(ROOT / "fixtures" / "plan_tp_sp.json", project / "plan.json")
        rows = "\n".join(
            f'  {{ source = "modeling_tiny.py", plan = "plan.json", output = "gen/tiny_{i}.py" }},'
            for i in range(args.targets)
        )
        (project / "pyproject.toml").write_text(f"[tool.hpgen]\ntargets = [\n{rows}\n]\n")
        hpgen = [sys.executable, "-m", "hpgen"]
        timed([*hpgen, "lower"], project)
        variants = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "hpgen --version": [*hpgen, "--version"],
            f"hpgen check ({args.targets} fresh, fast path)": [*hpgen, "check"],
            f"hpgen check --full ({args.targets} fresh)": [*hpgen, "check", "--full"],
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, command in variants.items():
                times[name].append(timed(command, project))
    medians = {name: statistics.median(values) for name, values in times.items()}
    startup = medians["hpgen --version"]
    print(f"{'command':<42} {'median s':>9} {'minus hpgen start-up s':>23}")
    for name, median in medians.items():
        print(f"{name:<42} {median:>9.3f} {median - startup:>23.3f}")
    fast, full = list(medians.values())[2:]
    print(f"fast path speed-up: {full / fast:.1f}x")


if __name__ == "__main__":
    main()
