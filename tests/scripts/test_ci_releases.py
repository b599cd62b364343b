""".ci/releases.sh: which transformers releases CI's second stage runs the ``releases`` subset on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bash(script: str) -> list[str]:
    """The lines ``script`` prints with .ci/releases.sh sourced, run from the repository root."""
    command = ["bash", "-c", f". .ci/releases.sh\n{script}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.split()


@pytest.mark.parametrize(
    ("previous", "newest", "expected"),
    [
        ("5.24.0", "5.25.0", ["5.24.0"]),  # the newest is the pin: its whole suite ran already
        ("5.24.0", "5.26.0", ["5.24.0", "5.26.0"]),
        ("5.24.0", "5.24.0", ["5.24.0"]),  # the index offers nothing newer than the previous pin: once
        ("5.25.0", "5.25.0", []),
    ],
)
def test_the_second_stage_runs_each_release_once_and_never_the_pin(previous, newest, expected):
    assert _bash(f"releases_to_check 5.25.0 {previous} {newest}") == expected


def test_both_pins_name_a_release_with_planner_snapshot_records():
    """Each pinned release has its records (tests/planner/test_snapshot.py fails without them on that release)."""
    pin, previous = _bash("pinned_release constraints/ci.txt; pinned_release constraints/previous.txt")
    assert pin != previous
    for release in (pin, previous):
        folder = ROOT / "tests" / "planner" / "snapshot" / ".".join(release.split(".")[:2])
        assert (folder / "transformers_version.txt").read_text().strip() == release
