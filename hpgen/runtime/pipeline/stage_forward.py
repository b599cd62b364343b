"""One pipeline stage's forward: the embedding or the hidden states in, the hidden states or the logits out.

The first stage takes token ids, the others the previous stage's hidden states (as
``inputs_embeds``); stages before the last run the base model (``model.model``: its final
norm is ``nn.Identity`` there), so no head-side code (logit soft-capping, scaling) touches
the hidden states, and the last stage runs the causal LM's own ``forward`` for its logits.
Both the training schedule and the inference relay run stages through :func:`run_stage`;
the schedule enters it through the model's own call (:func:`call_stage`), so that the
hooks on the model run for each microbatch (FSDP2's on the root unit among them).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from hpgen.runtime.pipeline.attach import Staged

__all__ = ["HEAD_ONLY", "call_stage", "run_stage"]

# keywords of the causal LM's forward that its base model does not take
HEAD_ONLY = ("labels", "logits_to_keep", "num_items_in_batch")


def run_stage(model: nn.Module, staged: Staged, stage: int, value: Tensor, *, embedded: bool = False, **kwargs: Any) -> Any:
    """Stage ``stage`` of ``model`` on ``value`` (token ids on stage 0 unless ``embedded``, else hidden states).

    Returns the base model's output (``last_hidden_state``) before the last stage, the causal
    LM's output (``logits``, ``loss``) on it."""
    first, last = stage == 0, stage == staged.cut.num_stages - 1
    inputs = {"input_ids": value} if first and not embedded else {"inputs_embeds": value}
    with staged.cut.running(model, stage):
        if last:
            return staged.forward(**inputs, **kwargs)
        base = getattr(model, model.base_model_prefix)
        return base(**inputs, **{k: v for k, v in kwargs.items() if k not in HEAD_ONLY})


def call_stage(model: nn.Module, staged: Staged, stage: int, value: Tensor, **kwargs: Any) -> Any:
    """:func:`run_stage` through ``model(...)``: its forward hooks run, and the relay hands the call on."""
    inputs = {"input_ids": value} if stage == 0 else {"inputs_embeds": value}
    staged.running = stage
    try:
        return model(**inputs, **kwargs)
    finally:
        staged.running = None
