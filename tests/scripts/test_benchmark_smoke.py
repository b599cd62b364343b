"""The benchmarks' smoke modes run end to end, so the scripts cannot rot on machines without a GPU.

``benchmarks/gpu_decode.py --cpu-smoke``: 2 gloo ranks, a tiny float32 Llama, Dynamo's
``eager`` backend, a few decode steps; every variant must run, eagerly and compiled, and
decode the unsharded model's greedy tokens. ``benchmarks/clip.py --smoke``: 2 gloo ranks, 2 rounds;
hpgen's clip must return the unsharded model's norm with one all-reduce. Their timings mean
nothing and are not checked.

Each script's ``main()`` runs in this process with its command line, as ``python
benchmarks/SCRIPT --smoke`` would (parsing, spawning the ranks, the table printed, the JSON
written): its ranks come from the test session's preloaded forkserver rather than from a new
interpreter that imports torch and starts a forkserver of its own.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest


def _main(script: str, *args: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``python benchmarks/SCRIPT.py ARGS`` prints, its ``main()`` run here."""
    import torch._dynamo
    import transformers

    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{script}.py", *args])
    limit = torch._dynamo.config.recompile_limit  # gpu_decode.py raises it for its process
    try:
        module.main()
    finally:
        torch._dynamo.config.recompile_limit = limit
        transformers.utils.logging.enable_progress_bar()  # and turns the progress bars off
    return capsys.readouterr().out


def test_gpu_decode_cpu_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "smoke.json"
    printed = _main("gpu_decode", "--cpu-smoke", "--json", str(out), monkeypatch=monkeypatch, capsys=capsys)
    assert "| hpgen compiled / hand-written compiled |" in printed
    results = json.loads(out.read_text())
    frameworks = ("hand-written", "hpgen", "transformers")
    names = {f"{framework} {mode}" for framework in frameworks for mode in ("eager", "compiled")}
    assert set(results["tokens_per_s"]) == names
    steps = results["setup"]["steps"]
    assert results["greedy_tokens_agreeing"] == {name: steps for name in names}
    for kinds in results["tokens_per_s"].values():
        assert all(value > 0 for values in kinds.values() for value in values)


def test_clip_smoke(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/clip.py --smoke``: 2 gloo ranks, 2 rounds; hpgen's norm is the unsharded model's, in one all-reduce."""
    printed = _main("clip", "--smoke", monkeypatch=monkeypatch, capsys=capsys)
    rows = {line.split("|")[1].strip(): line for line in printed.splitlines() if line.startswith("| ")}
    assert {"torch local", "hpgen", "hpgen (model)", "torch unsharded"} <= set(rows)
    assert "| 1 all_reduce |" in rows["hpgen"] and "| none |" in rows["torch local"]
    difference = float(printed.split("hpgen's norm - the unsharded model's: ")[1].split(";")[0])
    assert difference < 1e-4
