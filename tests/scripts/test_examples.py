"""The examples in ``examples/`` and README's walk-through run and still agree with the unsharded
model (an example that rots is worse than none).

README's walk-through (its files and commands, verbatim) and ``examples/tp_llama.py`` run as
the README says, under ``torchrun``. The training examples run their script unchanged, as
``__main__``, on the ranks of :func:`tests.support.dist.run_distributed` with the variables torchrun
sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``...): the
script makes its own process group from them as under torchrun, and the ranks come from the
test session's preloaded forkserver instead of fresh interpreters that import torch and
transformers again (about 5 CPU seconds a process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.dist import run_distributed
from tests.support.walk_through import WalkThrough
from tests.support.torchrun import as_under_torchrun

REPO = Path(__file__).resolve().parents[2]


def _as_under_torchrun(rank: int, world_size: int, script: str) -> str:
    """Rank body: run ``script`` as ``__main__`` in torchrun's environment; return what it printed."""
    import contextlib
    import io
    import runpy

    as_under_torchrun(rank, world_size)
    sys.argv = [script]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(script, run_name="__main__")
    return printed.getvalue()


def _ranks_run(script: str, ranks: int) -> str:
    """What ``torchrun --nproc-per-node RANKS examples/SCRIPT`` prints, rank by rank (see the module docstring)."""
    return "".join(run_distributed(_as_under_torchrun, str(REPO / "examples" / script), world_size=ranks, timeout=600))


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
    out = _ranks_run("train_2d.py", 4)
    steps = re.findall(r"step \d+: loss ([\d.]+)  \(unsharded model on the whole batch: ([\d.]+)\)", out)
    assert len(steps) >= 3, out
    for mine, reference in steps:
        assert abs(float(mine) - float(reference)) <= 1e-4 * max(1.0, abs(float(reference))), out
    assert float(steps[-1][0]) < float(steps[0][0])  # it trains


def test_lora_finetuning_tracks_peft_on_one_process() -> None:
    out = _ranks_run("lora_finetune.py", 2)
    steps = re.findall(r"step \d+: loss ([\d.]+)  \(unsharded peft model: ([\d.]+)\)", out)
    assert len(steps) == 5, out
    for mine, reference in steps:
        assert abs(float(mine) - float(reference)) <= 1e-4 * max(1.0, abs(float(reference))), out
    assert float(steps[-1][0]) < float(steps[0][0])  # it trains
    (err,) = re.findall(r"saved adapter on one process: logits max \|diff\| (\S+)", out)
    assert float(err) < 1e-4, out


def test_trainer_finetuning_tracks_the_unsharded_model() -> None:
    # dp 2 x tp 2, the README's command; at tp 2 alone (2 ranks) the script runs the same lines without DDP on
    # dp, which tests/runtime/training/test_trainer.py's "tp 2" cases prove against the one-process Trainer
    out = _ranks_run("trainer_finetune.py", 4)
    number = r"(\d+\.\d+)"
    steps = re.findall(rf"step \d+: loss {number} grad_norm {number}  \(unsharded model, one process: {number} {number}\)", out)
    assert len(steps) == 5, out
    for loss, norm, reference_loss, reference_norm in steps:
        assert abs(float(loss) - float(reference_loss)) <= 1e-4 and abs(float(norm) - float(reference_norm)) <= 1e-4, out
        assert float(reference_norm) > 0.5  # clipping (max_grad_norm 0.5) was active
    ((logits, weights),) = re.findall(r"logits max \|diff\| (\S+); its weights vs the unsharded model's after the same steps: (\S+)", out)
    assert float(logits) < 1e-4 and float(weights) < 1e-3, out


def test_the_readme_walk_through_runs_as_written(readme_walk_through: WalkThrough) -> None:
    """README's example: its files (the blocks headed ``# NAME.py``) and its commands, verbatim (run once a
    session by the ``readme_walk_through`` fixture, whose folder the docs' pages start from)."""
    done, commands = readme_walk_through.done, readme_walk_through.commands
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hpgen plan ckpt/ --tp 2" in commands and "wrote plan.json" in done.stderr
    found = re.findall(r"rank (\d): largest difference to the unsharded logits ([\d.e+-]+), ([\d.e+-]+)", done.stdout)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], done.stdout[-2000:]
    assert all(float(a) < 1e-4 and float(b) < 1e-4 for _, a, b in found), found


def test_long_context_trains_like_one_process_under_cp() -> None:
    out = _ranks_run("long_context.py", 2)
    steps = re.findall(r"step \d+: loss ([\d.]+)  \(unsharded model on one process: ([\d.]+)\)", out)
    assert len(steps) == 3, out
    for mine, reference in steps:
        assert abs(float(mine) - float(reference)) <= 1e-4 * max(1.0, abs(float(reference))), out
    assert float(steps[-1][0]) < float(steps[0][0])  # it trains
    assert "greedy tokens after a cp prefill match" in out, out
