"""docs/training.md's Trainer block, pasted as written, on 2 gloo ranks with ``TrainingArguments`` as it writes them.

The reader's files are made first: ``ckpt/`` (a tiny Llama, random weights), ``plan.json`` (what
``hpgen plan --tp 2`` writes for it) and ``modeling_llama_tp.py`` (``hpgen lower``'s output). The
block then runs unchanged as ``finetune.py`` under torchrun's environment, with no ``use_cpu``:
its step-20 checkpoint must hold the weights a stock Trainer reaches on the unsharded model in
one process (on main it trained nothing: the loss was scaled by ``1 // 2``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.support.dist import run_distributed
from tests.support import trainer_runs

REPO = Path(__file__).resolve().parents[3]


def _block(name: str) -> str:
    """The python block of docs/training.md whose first line is ``# NAME``."""
    text = (REPO / "docs" / "training.md").read_text()
    (block,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if block.startswith(f"# {name}")]
    return block


def _arguments(block: str) -> dict:
    """The block's ``TrainingArguments(...)`` keywords."""
    (call,) = re.findall(r"TrainingArguments\((.*?)\)\n", block)
    return eval(f"dict({call})")  # noqa: S307 - the project's own docs


def test_the_trainer_block_trains_as_one_process_does(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests.support.models import generated_plan, lower_family, reference_model

    config = trainer_runs.config()
    reference_model("llama", config, seed=0).save_pretrained(tmp_path / "ckpt")
    document = generated_plan("llama", tp=2)
    (tmp_path / "plan.json").write_text(json.dumps(document))
    shutil.copy(lower_family("llama", document, tmp_path), tmp_path / "modeling_llama_tp.py")
    block = _block("finetune.py")
    (tmp_path / "finetune.py").write_text(block)

    run_distributed(trainer_runs.docs_block, str(tmp_path), world_size=2, timeout=600)
    arguments = _arguments(block)
    expected = run_distributed(trainer_runs.docs_reference, str(tmp_path), arguments, world_size=1, timeout=600)[0]
    saved = load_file(str(tmp_path / arguments["output_dir"] / f"checkpoint-{arguments['max_steps']}" / "model.safetensors"))
    initial = reference_model("llama", config, seed=0).state_dict()
    apart = max((saved[name] - value).abs().max().item() for name, value in expected.items() if name in saved)
    moved = max((expected[name] - value).abs().max().item() for name, value in initial.items())
    print(f"\ndocs block, 2 ranks: weights moved {moved:.1e}, apart from the one-process run's {apart:.1e}")
    assert apart < moved / 20, (apart, moved)
