"""A 2-rank ``save_pretrained`` killed at every step of its write: the folder is always the old or the new checkpoint.

Both ranks gather the old and the new unsharded state dicts (real gathers of a model
parallelized on 2 gloo ranks); the writer's half of the save
(:func:`hpgen.runtime.checkpoint.saving.write_checkpoint`, what rank 0 runs after the gather) is
then run in forked children of rank 0 killed with SIGKILL at each of its file-system steps
(:mod:`tests.support.faults`): before, inside and after every safetensors file, at every
fsync, rename, link and delete. After each kill transformers' own ``from_pretrained``
loads the folder and its logits must be exactly the old checkpoint's or exactly the new
one's; then a save that is not killed must leave nothing of the killed one behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CASES = [  # label, save_pretrained keywords, whether the system may exchange two folders
    ("one file", {}, True),
    ("sharded", {"max_shard_size": "100KB"}, True),
    ("sharded, two renames", {"max_shard_size": "100KB"}, False),
]


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def kill_saves(model: torch.nn.Module, cls: type, root: str, rank: int, ids: torch.Tensor) -> dict[str, Any]:
    """Every rank calls it; rank 0 returns {case: {"steps", "kills", "outcomes", "leftovers", "kept"}}."""
    import torch.distributed as dist

    from hpgen.runtime.checkpoint.folder_swap import leftovers, recover
    from hpgen.runtime.checkpoint.saving import full_state_dict, write_checkpoint
    from tests.support.faults import kill_trials

    old = full_state_dict(model)
    saved = [param.detach().clone() for param in model.parameters()]
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.25)
    new = full_state_dict(model)
    with torch.no_grad():
        for param, value in zip(model.parameters(), saved):
            param.copy_(value)
    dist.barrier()
    if rank != 0:
        return {}
    found: dict[str, Any] = {}
    for label, kwargs, exchange in CASES:
        folder = Path(root) / f"killed_{label.replace(' ', '_').replace(',', '')}"
        write_checkpoint(model, new, folder, **kwargs)
        new_logits = _logits(cls.from_pretrained(folder), ids)
        write_checkpoint(model, old, folder, **kwargs)
        (folder / "tokenizer.json").write_text("{}")  # not the save's: must survive every save
        old_logits = _logits(cls.from_pretrained(folder), ids)
        assert not torch.equal(old_logits, new_logits)
        outcomes: list[str] = []
        left: list[str] = []
        kept: list[bool] = []

        def check(step: int) -> None:
            if not exchange:
                recover(folder)  # the rule for the window between two renames
            try:
                logits = _logits(cls.from_pretrained(folder), ids)
                outcome = "old" if torch.equal(logits, old_logits) else "new" if torch.equal(logits, new_logits) else "mixed"
            except Exception as error:  # noqa: BLE001 - a lost checkpoint is what this counts
                outcome = f"lost: {type(error).__name__}: {str(error)[:200]}"
            outcomes.append(outcome)
            kept.append((folder / "tokenizer.json").is_file())
            write_checkpoint(model, old, folder, **kwargs)  # the next save, not killed
            left.extend(str(p) for p in leftovers(folder))
            left.extend(str(p) for p in folder.iterdir() if "hpgen" in p.name or p.name.startswith(".tmp"))

        steps, kills = kill_trials(lambda: write_checkpoint(model, new, folder, **kwargs), check, exchange=exchange)
        found[label] = {"steps": steps, "kills": kills, "outcomes": outcomes, "leftovers": left, "kept": kept}
    return found
