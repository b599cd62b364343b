"""``hpgen verify``'s checks of a model cut into pipeline stages (a plan with a ``pipeline`` key).

A staged model's ``model(input_ids)`` relays activations between the stages without gradients
(docs/pipeline.md): the gradients are checked through ``pipeline_step`` instead, against the
unsharded model's causal-LM loss on the same batch (labels: the ids), each rank's stage's
parameters against the reference's gradients of them. The logits (the relay) and greedy
generation are checked as for any plan.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["staged_checks"]


def staged_checks(
    model: nn.Module, reference: nn.Module, plan: Any, mesh: Any, ids: torch.Tensor, layouts: dict[str, dict[str, str]],
    outcome: Any,
) -> None:
    """Append the logits, loss-and-gradients and greedy-generation checks of a staged ``model`` to ``outcome``."""
    from hpgen.runtime.pipeline import pipeline_step
    from hpgen.runtime.pipeline.attach import staged
    from hpgen.verify.compare import Check, _generation, gradient_differences
    from hpgen.verify.localize import tolerance

    with torch.no_grad():
        logits = model(input_ids=ids).logits
        ref_logits = reference(input_ids=ids).logits
    tol = tolerance(ref_logits)
    err = (logits.float() - ref_logits.float()).abs().max().item() if logits.shape == ref_logits.shape else float("inf")
    outcome.checks.append(Check("logits", err, tol, err <= tol))
    reference.zero_grad(set_to_none=True)
    labels = ids.clone()
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    mine = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, param in reference.named_parameters():
        if name not in mine:  # another stage's: checked on its own ranks
            param.grad = None
    model.zero_grad(set_to_none=True)
    several = len(staged(model).cut.stages) > 1
    loss = pipeline_step(
        model, input_ids=ids, labels=labels, microbatches=int(ids.shape[0]), schedule="Interleaved1F1B" if several else "1F1B"
    )
    loss_err, loss_tol = abs(float(loss) - float(ref_loss)), tolerance(ref_loss.detach())
    outcome.checks.append(Check("pipeline loss", loss_err, loss_tol, loss_err <= loss_tol))
    worst: list[tuple[float, float]] = []
    outcome.params = gradient_differences(model, reference, layouts, plan, mesh, [], worst)
    err, tol = max(worst, key=lambda pair: pair[0] / max(pair[1], 1e-30), default=(0.0, 0.0))
    outcome.checks.append(
        Check("gradients", err, tol, not outcome.params, f"pipeline_step: {len(outcome.params)} of {len(worst)} parameters differ")
    )
    outcome.checks.append(_generation(model, reference, ids))
