"""The examples in ``examples/`` run as the README says, under torchrun, and still agree with
the unsharded model (an example that rots is worse than none)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]


def _torchrun(script: str, ranks: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(REPO / "examples" / script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_tp_llama_matches_the_unsharded_model() -> None:
    out = _torchrun("tp_llama.py", 2)
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all("greedy tokens match" in line and "(50.0%)" in line for line in lines), out


def test_2d_training_tracks_the_unsharded_model() -> None:
    out = _torchrun("train_2d.py", 4)
    steps = re.findall(r"step \d+: loss ([\d.]+)  \(unsharded model on the whole batch: ([\d.]+)\)", out)
    assert len(steps) >= 3, out
    for mine, reference in steps:
        assert abs(float(mine) - float(reference)) <= 1e-4 * max(1.0, abs(float(reference))), out
    assert float(steps[-1][0]) < float(steps[0][0])  # it trains


def test_lora_finetuning_tracks_peft_on_one_process() -> None:
    out = _torchrun("lora_finetune.py", 2)
    steps = re.findall(r"step \d+: loss ([\d.]+)  \(unsharded peft model: ([\d.]+)\)", out)
    assert len(steps) == 5, out
    for mine, reference in steps:
        assert abs(float(mine) - float(reference)) <= 1e-4 * max(1.0, abs(float(reference))), out
    assert float(steps[-1][0]) < float(steps[0][0])  # it trains
    (err,) = re.findall(r"saved adapter on one process: logits max \|diff\| (\S+)", out)
    assert float(err) < 1e-4, out
