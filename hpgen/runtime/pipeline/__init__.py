"""Pipeline stages: a model cut into stages over a ``pp`` mesh axis, trained and run across them.

- ``hpgen.runtime.pipeline.stages``: which modules this rank's stages keep, checked, and the model trimmed to them;
- ``hpgen.runtime.pipeline.tied``: a parameter two stages hold (a tied embedding): its gradient summed between them;
- ``hpgen.runtime.pipeline.attach``: what ``parallelize`` attaches to a staged model (``model._hp_stage``);
- ``hpgen.runtime.pipeline.stage_forward``: one stage's forward, for the schedule and the relay alike;
- ``hpgen.runtime.pipeline.schedule``: ``pipeline_step``, forward and backward over microbatches with torch's schedules;
- ``hpgen.runtime.pipeline.relay``: ``model(input_ids)`` and ``generate`` across the stages, logits on every rank;
- ``hpgen.runtime.pipeline.gather``: the whole model's state dict from the stages (``save_pretrained``).

docs/pipeline.md says how to use them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pipeline_step"]


def __getattr__(name: str) -> Any:
    if name == "pipeline_step":
        from hpgen.runtime.pipeline.schedule import pipeline_step

        return pipeline_step
    raise AttributeError(name)
