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

The records are kept per transformers release (``snapshot/<major>.<minor>/``): the test
compares against the installed release's, so a new release that changes a plan fails here
until its records are stored (a decision, reviewed), and the previous release's keep
guarding the pin. After an intended change to what the planner writes, update the installed
release's records and review their diff like any other code change
(tests/planner/snapshot/README.md):

    HPGEN_UPDATE_PLANNER_SNAPSHOT=1 python -m pytest tests/planner/test_snapshot.py

run once with each venv whose release has records (the pinned one and the newest).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

SNAPSHOTS = Path(__file__).resolve().parent / "snapshot"
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
UPDATE = os.environ.get("HPGEN_UPDATE_PLANNER_SNAPSHOT") == "1"


def release(version: str) -> str:
    """``5.25.0`` -> ``5.25``: the records' key (a patch release is expected to plan the same)."""
    return ".".join(version.split(".")[:2])


def expected_dir() -> Path:
    """The installed transformers release's records (``snapshot/<major>.<minor>``)."""
    import transformers

    return SNAPSHOTS / release(transformers.__version__)


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
    directory = expected_dir()
    expected, version = directory / f"{model_type}.jsonl", directory / "transformers_version.txt"
    if UPDATE:
        directory.mkdir(exist_ok=True)
        expected.write_text(text)
        version.write_text(transformers.__version__ + "\n")
    stored = sorted(path.name for path in SNAPSHOTS.iterdir() if path.is_dir())
    assert expected.exists(), (
        f"no planner snapshot for transformers {transformers.__version__} ({directory.name}/{expected.name}; "
        f"stored: {', '.join(stored)}): a new release may plan differently. Review what it plans and store it with "
        f"HPGEN_UPDATE_PLANNER_SNAPSHOT=1 python -m pytest {__file__}"
    )
    made_with = version.read_text().strip()
    assert text == expected.read_text(), (
        f"{model_type}: the planner's output changed (snapshot made with transformers {made_with}, "
        f"installed {transformers.__version__}); see tests/planner/snapshot/README.md"
    )


def test_the_snapshot_covers_the_planner_paths():
    """The stored records hold what the module docstring promises, so a type that stopped covering a path is noticed."""
    assert expected_dir().is_dir(), f"no planner snapshot for the installed release ({expected_dir().name})"
    rows = [json.loads(line) for path in sorted(expected_dir().glob("*.jsonl")) for line in path.read_text().splitlines()]
    variants = {(row["model_type"], row["variant"]) for row in rows if "plan" in row}
    assert {("qwen3_moe", "ep"), ("qwen3_moe", "ep_axis"), ("llama", "sp"), ("gpt2", "tp4")} <= variants
    assert any('"RS(' in row.get("plan", "") for row in rows if row["variant"] == "tp4")
    assert any("multi-query" in note for row in rows if row["model_type"] == "gpt_bigcode" for note in row.get("notes", []))
    assert any(row.get("error", "").startswith("HpgenError") for row in rows)  # a refusal
    assert any("size" in row for row in rows) and any("messages" in row for row in rows)
