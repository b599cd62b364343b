"""What ``parallelize`` attaches to a model cut to its pipeline stages: the stage record, the tied groups, the relay.

``model._hp_stage`` is a :class:`Staged`: this rank's :class:`~hpgen.runtime.pipeline.stages.StageCut`,
the process group of the pipeline axis and the groups of the tied parameters; ``pipeline_step``
and ``clip_grad_norm_`` read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from hpgen.runtime.pipeline.stages import StageCut
from hpgen.runtime.pipeline.tied import TiedParam, tied_params

__all__ = ["Staged", "install_stage", "staged"]


@dataclass
class Staged:
    """A staged model's pipeline: its stages on this rank, the pipeline axis's group, the tied parameters."""

    cut: StageCut
    group: dist.ProcessGroup
    forward: Callable[..., Any]  # the causal LM's own forward (the relay wraps ``model.forward``)
    tied: list[TiedParam] = field(default_factory=list)

    @property
    def rank(self) -> int:
        """This rank's index on the pipeline axis."""
        return self.cut.mesh.get_local_rank(self.cut.axis)

    def global_rank(self, pp_rank: int) -> int:
        """The global rank of the pipeline-axis rank ``pp_rank`` in this rank's pipeline group."""
        return dist.get_global_rank(self.group, pp_rank)


def install_stage(model: nn.Module, cut: StageCut) -> None:
    """Record the stage on ``model`` and make the tied parameters' groups (then
    :func:`hpgen.runtime.pipeline.relay.install_relay` wraps ``forward``)."""
    group = cut.mesh.get_group(cut.axis)
    tied = tied_params(model, cut.mesh, cut.axis, cut.tied_holders, cut.tied) if cut.tied else []
    model._hp_stage = Staged(cut, group, model.forward, tied)


def staged(model: nn.Module) -> Staged | None:
    """The :class:`Staged` of a model ``parallelize`` cut into pipeline stages (through peft), or None."""
    seen = model
    for _ in range(4):
        found = seen.__dict__.get("_hp_stage")
        if isinstance(found, Staged):
            return found
        inner = getattr(seen, "module", None) or getattr(seen, "base_model", None)
        if not isinstance(inner, nn.Module) or inner is seen:
            return None
        seen = inner
    return None
