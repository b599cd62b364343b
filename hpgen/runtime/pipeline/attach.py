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
    running: int | None = None  # the stage a ``model(...)`` call runs for ``pipeline_step`` (None: the relay)

    @property
    def rank(self) -> int:
        """This rank's index on the pipeline axis."""
        return self.cut.mesh.get_local_rank(self.cut.axis)

    def norm_weights(self, model: nn.Module) -> dict[int, float]:
        """id of each parameter -> the share of the whole model's norm its pipeline ranks add up to.

        The gradient-norm sum runs over every rank of the mesh, but a parameter lives on the
        ranks of one stage (of two, for a tied table): its weight is multiplied by the pipeline
        ranks over those holding it, so that every stage counts once."""
        weights = {id(param): float(self.cut.size) for param in model.parameters()}
        for item in self.tied:
            if item.name is not None:
                weights[id(model.get_parameter(item.name))] = self.cut.size / item.holders
        return weights

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
    """The :class:`Staged` of a model ``parallelize`` cut into pipeline stages (or of a peft model's base), or None."""
    if hasattr(model, "get_base_model"):  # peft's PeftModel: the stages are its base model's
        model = model.get_base_model()
    found = model.__dict__.get("_hp_stage")
    return found if isinstance(found, Staged) else None
