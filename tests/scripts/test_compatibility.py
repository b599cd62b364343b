"""benchmarks/compatibility.py: the release table from a suite log and coverage results."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.compatibility import BEGIN, END, main


def test_the_table_counts_what_the_results_hold_and_says_not_run_for_the_rest(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    rows = [
        {"model_type": "a", "parity": True, "grads_ok": True, "layers_sharded": True, "param_share": 0.5},
        {"model_type": "b", "parity": True, "grads_ok": True, "layers_sharded": True, "param_share": 0.9},
        {"model_type": "c", "parity": False, "grads_ok": False, "layers_sharded": True, "param_share": 0.5},
    ]
    (results / "hpgen-coverage-tp.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (results / "hpgen-coverage-sp.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    suite = tmp_path / "suite.log"
    suite.write_text("....\n========== 1 failed, 7 passed in 3.00s ==========\n")
    page = tmp_path / "page.md"
    page.write_text(f"# x\n{BEGIN}\nold\n{END}\nafter\n")
    assert main(["--release", "9.9.0", "--suite", str(suite), "--results", str(results), "--page", str(page)]) == 0
    text = page.read_text()
    # a: at parity and sharded at 0.5; b: at parity but 0.9 per rank (TP counts it not, SP does); no EP file
    assert "| 9.9.0 | 1 failed, 7 passed in 3.00s | 1 | 2 | not run |" in text
    assert "old" not in text and text.endswith(f"{END}\nafter\n")
