"""The benchmarks' smoke modes run end to end, so the scripts cannot rot on machines without a GPU.

``benchmarks/gpu_decode.py --cpu-smoke``: 2 gloo ranks, a tiny float32 Llama, Dynamo's
``eager`` backend, a few decode steps; every variant must run, eagerly and compiled, and
decode the unsharded model's greedy tokens. ``benchmarks/clip.py --smoke``: 2 gloo ranks, 2 rounds;
hpgen's clip must return the unsharded model's norm with one all-reduce. Their timings mean
nothing and are not checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_decode_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_decode.py"), "--cpu-smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| hpgen compiled / hand-written compiled |" in done.stdout
    results = json.loads(out.read_text())
    frameworks = ("hand-written", "hpgen", "transformers")
    names = {f"{framework} {mode}" for framework in frameworks for mode in ("eager", "compiled")}
    assert set(results["tokens_per_s"]) == names
    steps = results["setup"]["steps"]
    assert results["greedy_tokens_agreeing"] == {name: steps for name in names}
    for kinds in results["tokens_per_s"].values():
        assert all(value > 0 for values in kinds.values() for value in values)


def test_clip_smoke() -> None:
    """``benchmarks/clip.py --smoke``: 2 gloo ranks, 2 rounds; hpgen's norm is the unsharded model's, in one all-reduce."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "clip.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert {"torch local", "hpgen", "hpgen (model)", "torch unsharded"} <= set(rows)
    assert "| 1 all_reduce |" in rows["hpgen"] and "| none |" in rows["torch local"]
    difference = float(done.stdout.split("hpgen's norm - the unsharded model's: ")[1].split(";")[0])
    assert difference < 1e-4
