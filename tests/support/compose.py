"""Training parity of hpgen composed with torch's engines on other mesh axes.

One training step on a 2-D mesh: the model is parallelized on its plan's axes (``tp``,
``ep``), then wrapped by FSDP2 (``fully_shard`` on each decoder layer and the root, on
``dp``, as torchtitan does) or DDP (on ``dp``), or by nothing. Each ``dp`` rank takes its
share of the batch and the causal-LM loss (a mean over its tokens: FSDP2 and DDP average
the gradients over ``dp``, so the mean over equal shares is the mean over the batch).

The target is the unsharded transformers model on the whole batch: its loss, its
gradients (each rank's, DTensor or not, compared with the rank's slice of the
reference's), and its weights after one AdamW step (the same slices).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tests.support.models import (
    case_mesh,
    expected_local,
    generated_model,
    import_file,
    make_config,
    param_layouts,
    reference_model,
    tolerance,
)

ENGINES = ("none", "fsdp2", "fsdp2_root", "ddp")


@dataclass(frozen=True)
class TrainCase:
    """One training-step comparison on a mesh of ``mesh`` ((axis, size) in mesh order)."""

    name: str
    family: str
    generated: str
    plan: Mapping[str, Any]
    mesh: tuple[tuple[str, int], ...]
    engine: str = "none"  # one of ENGINES, on the mesh's "dp" axis (fsdp2_root: fully_shard on the root only)
    config: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    batch: int = 4
    seq_len: int = 7
    lr: float = 1e-2
    eps: float = 1e-4  # keeps Adam's first step smooth in the gradient (no sign(g) for tiny g)


@dataclass
class TrainResult:
    """What one rank measured (picklable)."""

    loss_err: float
    loss_tol: float
    logits_err: float
    logits_tol: float
    grad_failures: list[str]
    grads_checked: int
    grad_max_err: float
    weight_failures: list[str]
    weights_checked: int
    weight_max_err: float
    local_bytes: int  # this rank's plan-axis shards (FSDP2's dp pieces gathered)
    expected_bytes: int  # its share by the plan
    full_bytes: int


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's ``dp`` shards) gathered to this rank's plain tensor; others as they are."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _wrap(model: nn.Module, engine: str, mesh: Any) -> nn.Module:
    if engine in ("fsdp2", "fsdp2_root"):
        from torch.distributed.fsdp import fully_shard

        dp = mesh["dp"]
        if engine == "fsdp2":
            for layer in model.model.layers:
                fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
        return model
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=mesh.get_group("dp"))
    return model


def _compare(
    mine: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    layouts: Mapping[str, Mapping[str, str]],
    axes: Any,
    mesh: Any,
) -> tuple[list[str], int, float]:
    failures, checked, worst = [], 0, 0.0
    for name, full in reference.items():
        value = mine.get(name)
        if value is None:
            failures.append(f"{name}: missing")
            continue
        want, value = expected_local(full, layouts.get(name, {}), axes, mesh), _full(value)
        if value.shape != want.shape:  # a subtraction would broadcast
            failures.append(f"{name}: shape {tuple(value.shape)}, this rank's slice is {tuple(want.shape)}")
            continue
        err, tol = (value - want).abs().max().item(), tolerance(full)
        checked += 1
        worst = max(worst, err)
        if not err <= tol:
            failures.append(f"{name}: {err:.3g} > {tol:.3g}")
    return failures, checked, worst


def run_train_case(case: TrainCase, mesh: Any) -> TrainResult:
    """Parallelize, wrap, one forward/backward/AdamW step on both models; compare."""
    from hpgen.runtime import parallelize

    config = make_config(case.family, **case.config)
    reference = reference_model(case.family, config, case.seed).train()
    model = generated_model(import_file(case.generated), case.family, config, reference).train()
    parallelize(model, case.plan, mesh)
    wrapped = _wrap(model, case.engine, mesh)

    generator = torch.Generator().manual_seed(case.seed + 1)
    ids = torch.randint(0, config.vocab_size, (case.batch, case.seq_len), generator=generator)
    names = tuple(mesh.mesh_dim_names)
    dp, dp_rank = (mesh.size(names.index("dp")), mesh.get_local_rank("dp")) if "dp" in names else (1, 0)
    assert case.batch % dp == 0
    rows = slice(dp_rank * case.batch // dp, (dp_rank + 1) * case.batch // dp)

    ref_out = reference(ids, labels=ids)
    ref_out.loss.backward()
    with torch.no_grad():
        ref_share = reference(ids[rows], labels=ids[rows]).loss
    out = wrapped(ids[rows], labels=ids[rows])
    out.loss.backward()

    axes = case.plan["mesh_dim_names"]
    layouts = param_layouts(reference, case.plan)
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    grad_failures, grads_checked, grad_err = _compare(grads, ref_grads, layouts, axes, mesh)

    torch.optim.AdamW(reference.parameters(), lr=case.lr, eps=case.eps).step()
    torch.optim.AdamW(model.parameters(), lr=case.lr, eps=case.eps).step()
    weights = {name: p.detach() for name, p in model.named_parameters()}
    ref_weights = {name: p.detach() for name, p in reference.named_parameters()}
    weight_failures, weights_checked, weight_err = _compare(weights, ref_weights, layouts, axes, mesh)
    held = [_full(p) for p in weights.values()]  # in one order on every rank: full_tensor is collective
    return TrainResult(
        loss_err=abs(out.loss.item() - ref_share.item()),
        loss_tol=tolerance(ref_share),
        logits_err=(out.logits.detach() - ref_out.logits[rows].detach()).abs().max().item(),
        logits_tol=tolerance(ref_out.logits),
        grad_failures=grad_failures,
        grads_checked=grads_checked,
        grad_max_err=grad_err,
        weight_failures=weight_failures,
        weights_checked=weights_checked,
        weight_max_err=weight_err,
        local_bytes=sum(p.numel() * p.element_size() for p in held),
        expected_bytes=sum(
            expected_local(p, layouts.get(name, {}), axes, mesh).numel() * p.element_size()
            for name, p in ref_weights.items()
        ),
        full_bytes=sum(p.numel() * p.element_size() for p in ref_weights.values()),
    )


def run_train_cases(rank: int, world_size: int, cases: list[TrainCase]) -> dict[str, TrainResult]:
    """Rank body for ``run_distributed``: every case on its mesh."""
    made: dict = {}
    return {case.name: run_train_case(case, case_mesh(case.mesh, case.plan, world_size, made)) for case in cases}


def check_training(results: list[dict[str, TrainResult]], name: str) -> None:
    """Loss, logits, every gradient and every weight after the step within tolerance, on every rank."""
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert result.loss_err <= result.loss_tol, f"rank {rank}: loss {result.loss_err} > {result.loss_tol}"
        assert result.logits_err <= result.logits_tol, f"rank {rank}: logits {result.logits_err}"
        assert result.grads_checked > 0 and result.weights_checked == result.grads_checked
        assert not result.grad_failures, f"rank {rank}: " + "; ".join(result.grad_failures)
        assert not result.weight_failures, f"rank {rank}: after AdamW: " + "; ".join(result.weight_failures)
        held, planned, full = result.local_bytes, result.expected_bytes, result.full_bytes
        assert held == planned < full, f"rank {rank}: holds {held} bytes of parameters, its share {planned} of {full}"
