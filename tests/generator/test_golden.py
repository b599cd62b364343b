"""Golden files: the generated code for every form and both modes on the bundled fixture.

To update them after an intended change to the generated code, run

    HPGEN_UPDATE_GOLDEN=1 python -m pytest tests/generator/test_golden.py

and review the diff of tests/golden/ like any other code change.
"""

import os

import pytest

from hpgen.generator.lower import lower
from hpgen.core.plan import load_plan

from tests.conftest import FIXTURES, GOLDEN, PLANS

CASES = {
    "tiny_tp": FIXTURES / "plan_tp.json",  # tp_collective; external Embedding/Linear boundaries
    "tiny_tp_sp": FIXTURES / "plan_tp_sp.json",  # split / all_gather / reduce_scatter; per-contract subclass
    "tiny_generic": PLANS / "tiny_generic.json",  # SS placement: generic form
    "tiny_region": PLANS / "tiny_region.json",  # injection: region form
    "tiny_2d": PLANS / "tiny_2d.json",  # two axes composed; all_to_all; P(max)
    # a parallel-residual block: its attention and MLP reduced once (summed reduction), on fixtures/modeling_tiny_parallel.py
    "tiny_parallel_summed": FIXTURES / "plan_tp_summed.json",
}
SOURCES = {"tiny_parallel_summed": FIXTURES / "modeling_tiny_parallel.py"}  # the others lower modeling_tiny.py
UPDATE = os.environ.get("HPGEN_UPDATE_GOLDEN") == "1"


@pytest.mark.parametrize("mode", ["default", "toggle"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case, mode, tiny_source):
    source = SOURCES[case].read_text() if case in SOURCES else tiny_source
    name = SOURCES[case].name if case in SOURCES else "modeling_tiny.py"
    generated = lower(source, load_plan(CASES[case]), mode=mode, source_name=name)
    golden = GOLDEN / f"{case}.{mode}.py"
    if UPDATE:
        golden.write_text(generated)
    assert golden.exists(), f"missing {golden.name}: run HPGEN_UPDATE_GOLDEN=1 python -m pytest {__file__}"
    assert generated == golden.read_text(), f"{golden.name} is stale: see the docstring of {__name__}"


def test_golden_files_are_all_in_use():
    expected = {f"{case}.{mode}.py" for case in CASES for mode in ("default", "toggle")}
    assert {path.name for path in GOLDEN.glob("*.py")} == expected
