"""A small planner snapshot: what ``hpgen plan`` writes for a dozen model types, so a refactor of the planner has a fast net.

Each model type's records are those of ``benchmarks/planner_snapshot.py`` (the same
function, :func:`benchmarks.planner_snapshot.records`): the plan's JSON text, the
``--explain`` notes, the sizing report, or the refusal, under every variant (``--tp 2``,
``--sp``, ``--ep``, ``--ep-axis``, ``--tp 4``, the derivation forced, ``hpgen plan``'s own
path on the default config). The types are chosen to cover the planner's paths:

- transformers' plan translated: llama; qwen3_moe (its experts with ``--ep``, ``--ep-axis``);
- derived from the source: gpt2 (Conv1D), gpt_neox (parallel residual: summed, norms
  paired), falcon, opt, bloom (ALiBi), phi, gptj, mpt, gpt_bigcode (multi-query: the
  derivation keeps its attention replicated, with the reason); bloom, mpt and opt refuse
  ``--sp``;
- ``--sp`` and ``--tp 4`` (more ranks than key/value heads: replicated-sharded layouts) for each.

After an intended change to what the planner writes, update the expected records and
review their diff like any other code change (tests/planner/snapshot/README.md):

    HPGEN_UPDATE_PLANNER_SNAPSHOT=1 python -m pytest tests/planner/test_snapshot.py
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

EXPECTED = Path(__file__).resolve().parent / "snapshot"
MODEL_TYPES = (
    "llama",
    "qwen3_moe",
    "gpt2",
    "gpt_neox",
    "falcon",
    "opt",
    "bloom",
    "phi",
    "gptj",
    "mpt",
    "gpt_bigcode",
)
VERSION = EXPECTED / "transformers_version.txt"  # the transformers the records were made with
UPDATE = os.environ.get("HPGEN_UPDATE_PLANNER_SNAPSHOT") == "1"


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_planner_writes_what_it_wrote(model_type):
    from benchmarks.planner_snapshot import records

    import transformers

    text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in records(model_type))
    expected = EXPECTED / f"{model_type}.jsonl"
    if UPDATE:
        expected.write_text(text)
        VERSION.write_text(transformers.__version__ + "\n")
    assert expected.exists(), f"missing {expected.name}: run HPGEN_UPDATE_PLANNER_SNAPSHOT=1 python -m pytest {__file__}"
    made_with = VERSION.read_text().strip()
    assert text == expected.read_text(), (
        f"{model_type}: the planner's output changed (snapshot made with transformers {made_with}, "
        f"installed {transformers.__version__}); see tests/planner/snapshot/README.md"
    )


def test_the_snapshot_covers_the_planner_paths():
    """The stored records hold what the module docstring promises, so a type that stopped covering a path is noticed."""
    rows = [json.loads(line) for path in sorted(EXPECTED.glob("*.jsonl")) for line in path.read_text().splitlines()]
    variants = {(row["model_type"], row["variant"]) for row in rows if "plan" in row}
    assert {("qwen3_moe", "ep"), ("qwen3_moe", "ep_axis"), ("llama", "sp"), ("gpt2", "tp4")} <= variants
    assert any('"RS(' in row.get("plan", "") for row in rows if row["variant"] == "tp4")
    assert any("multi-query" in note for row in rows if row["model_type"] == "gpt_bigcode" for note in row.get("notes", []))
    assert any(row.get("error", "").startswith("HpgenError") for row in rows)  # a refusal
    assert any("size" in row for row in rows) and any("messages" in row for row in rows)
