"""docs/coverage.md's rendering (``benchmarks/coverage.py --render``): the sections other runs wrote stay.

The page holds the TP/SP/EP tables, the train-mode section (``--train``, run less often) and the
heads section (``benchmarks/coverage_heads.py``). Re-rendering after a TP run whose results folder
has no train-mode results must keep the page's train-mode and heads sections as they were, and
the page says how long the runs that wrote its rows took.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest


def test_render_keeps_the_train_and_heads_sections_and_gives_the_wall_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # by its package path, sys.path untouched: a top-level ``coverage`` would shadow coverage.py (pytest-cov)
    from benchmarks import coverage

    rows = [
        coverage.Row("llama", "LlamaForCausalLM", True, True, True, 1e-6, 1e-4, True, 0.51, True, wall=90.0),
        coverage.Row("gpt2", "GPT2LMHeadModel", True, True, True, 1e-6, 1e-4, True, 0.5, True, wall=30.0),
    ]
    results = tmp_path / "results"
    results.mkdir()
    coverage.results_path(results, "tp").write_text(
        "".join(json.dumps(dataclasses.asdict(row)) + "\n" for row in rows)
    )
    train = f"{coverage.TRAIN_BEGIN}\n## Train mode\n\nan earlier --train run\n{coverage.TRAIN_END}\n"
    heads = f"{coverage.HEADS_BEGIN}\n## Heads\n\nan earlier coverage_heads.py run\n{coverage.HEADS_END}\n"
    table = tmp_path / "coverage.md"
    table.write_text(f"# old table\n\n{train}\n{heads}")
    monkeypatch.setattr(sys, "argv", ["coverage.py", "--render", "--results", str(results), "--table", str(table)])

    coverage.main()

    page = table.read_text()
    assert "# old table" not in page
    assert "(wall time: TP 2 min)" in page  # 90 + 30 s
    assert "| llama | LlamaForCausalLM |" in page
    assert page.count(coverage.TRAIN_BEGIN) == 1 and train in page
    assert page.count(coverage.HEADS_BEGIN) == 1 and heads in page
    assert page.index(train) < page.index(heads)


def test_a_run_over_a_partial_results_folder_leaves_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--only llama` with a fresh results folder used to rewrite the page from that one row
    from benchmarks import coverage

    def one_row(wanted, variant, path, rows, chunk, timeout) -> None:  # what run() records, without the ranks
        for name in wanted:
            rows[name] = coverage.Row(name, "LlamaForCausalLM", True, True, True, 1e-6, 1e-4, True, 0.5, True)

    monkeypatch.setattr(coverage, "run", one_row)
    table = tmp_path / "coverage.md"
    table.write_text("# the page of the full run\n")
    results = tmp_path / "fresh"
    monkeypatch.setattr(
        sys, "argv", ["coverage.py", "--only", "llama", "--results", str(results), "--table", str(table)]
    )

    coverage.main()

    assert table.read_text() == "# the page of the full run\n"
    assert f"{table} left as it is" in capsys.readouterr().err
