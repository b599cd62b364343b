"""How lowering time grows with the size of the modeling file.

Builds the synthetic files of tests/generator/with_models/test_hardening_scale.py (the fixture's classes
repeated under new names, every tenth copy planned) at several sizes and prints, per
size: lines, seconds to lower, seconds per 1,000 lines, and the seconds libcst alone
takes to parse the same text. Each figure is the best of ``--repeat`` runs, in CPU
seconds of this process by default (steady on a shared machine; lowering is single
threaded, so on an idle machine it is the wall time), or wall seconds with ``--clock wall``.

    python benchmarks/scale.py [--sizes 2500 5000 10000 20000] [--repeat 1] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def best_of(repeat: int, action, clock) -> float:
    times = []
    for _ in range(repeat):
        start = clock()
        action()
        times.append(clock() - start)
    return min(times)


def main() -> None:
    sys.path.insert(0, str(ROOT))  # the synthetic files are built by the test that checks them
    import libcst as cst

    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from tests.generator.with_models.test_hardening_scale import synthetic_modeling_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2500, 5000, 10000, 20000])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"{args.clock} seconds, best of {args.repeat}")
    print(f"{'lines':>7}  {'lower s':>8}  {'s / 1k lines':>12}  {'libcst parse s':>14}  {'lower / parse':>13}")
    for size in args.sizes:
        text, document, _ = synthetic_modeling_file(size)
        plan = plan_from_dict(document, name="plan.json")
        lines = text.count("\n")
        lowering = best_of(args.repeat, partial(lower, text, plan, source_name="modeling_synthetic.py"), clock)
        parsing = best_of(args.repeat, partial(cst.parse_module, text), clock)
        print(f"{lines:>7}  {lowering:>8.2f}  {lowering / lines * 1000:>12.3f}  {parsing:>14.2f}  {lowering / parsing:>13.2f}")


if __name__ == "__main__":
    main()
