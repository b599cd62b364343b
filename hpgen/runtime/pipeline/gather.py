"""The whole model's state dict from its pipeline stages, for ``save_pretrained`` and ``full_state_dict``.

Each rank holds its stages' tensors only (made whole on the other axes first). The ranks
of each pipeline group exchange them; a rank that keeps the result (rank 0 for
``save_pretrained``) gets every stage's, under the unsharded model's names. Groups in
which no rank keeps anything exchange nothing.
"""

from __future__ import annotations

import torch

from hpgen.runtime.forward.handback import all_gather_object
from hpgen.runtime.pipeline.attach import Staged

__all__ = ["gather_stages"]


def gather_stages(pipeline: Staged, local: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """Every stage's ``local`` state dict, merged, where ``keep``; an empty dict elsewhere."""
    if not any(all_gather_object(keep, pipeline.group)):
        return {}
    parts = all_gather_object({key: value.detach().cpu() for key, value in local.items()}, pipeline.group)
    size = len(parts)
    if not keep:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for stage in range(pipeline.cut.num_stages):  # the unsharded model's order: stage by stage
        for key, value in (parts[stage % size] or {}).items():
            merged.setdefault(key, value)
    return merged
