"""The rank side of the gathered-output loss matrix (``test_gathered_losses.py``).

Each case builds the unsharded transformers model and the generated one with the same
weights, parallelizes the generated one on its mesh, and computes the same losses in
both: the model's own (``labels=``), and three a user computes from the returned logits
(cross-entropy by hand, ``sum(logits * w)``, the KL divergence to a teacher's logits).
Every rank computes each loss alike from the gathered logits; the gradients must be the
unsharded model's (this rank's slice of them), not one count of them per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

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

LOSSES = ("labels", "cross-entropy by hand", "sum(logits * w)", "KL to a teacher")


@dataclass(frozen=True)
class LossCase:
    """One planner mode: a family's generated file, its plan and mesh."""

    name: str
    family: str
    generated: str
    plan: dict[str, Any]
    mesh: tuple[tuple[str, int], ...]
    shape: tuple[int, int] = (3, 9)  # (batch, tokens): uneven shards on every axis
    config: dict[str, Any] = field(default_factory=dict)  # overrides of the tiny config


@dataclass
class LossCell:
    """One loss in one mode on one rank: the largest gradient error, the tolerance, what went wrong."""

    loss_err: float
    grad_err: float  # max |gradient - unsharded slice| over every parameter
    grad_tol: float
    failures: list[str]


def _loss(kind: str, out: Any, ids: torch.Tensor, w: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    if kind == "labels":
        return out.loss
    logits = out.logits
    if kind == "cross-entropy by hand":
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    if kind == "sum(logits * w)":
        return (logits * w).sum()
    return F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")


def run_loss_cases(rank: int, world_size: int, cases: list[LossCase]) -> dict[str, dict[str, LossCell]]:
    """Every loss of :data:`LOSSES` in every case: case name -> loss -> :class:`LossCell`."""
    from hpgen.runtime import parallelize

    made: dict = {}
    results: dict[str, dict[str, LossCell]] = {}
    for case in cases:
        mesh = case_mesh(case.mesh, case.plan, world_size, made)
        config = make_config(case.family, **case.config)
        ref = reference_model(case.family, config, seed=3)
        model = generated_model(import_file(case.generated), case.family, config, ref)
        parallelize(model, case.plan, mesh)
        layouts = param_layouts(model, case.plan)
        axes = case.plan["mesh_dim_names"]
        ref.train()
        model.train()
        generator = torch.Generator().manual_seed(7)
        ids = torch.randint(0, config.vocab_size, case.shape, generator=generator)
        w = torch.randn(*case.shape, config.vocab_size, generator=generator)
        teacher = 3 * torch.randn(*case.shape, config.vocab_size, generator=generator)
        reference = dict(ref.named_parameters())
        cells = {}
        for kind in LOSSES:
            for m in (ref, model):
                m.zero_grad(set_to_none=True)
            labels = ids if kind == "labels" else None
            expected = _loss(kind, ref(input_ids=ids, labels=labels), ids, w, teacher)
            got = _loss(kind, model(input_ids=ids, labels=labels), ids, w, teacher)
            expected.backward()
            got.backward()
            cell = LossCell((expected - got).abs().item(), 0.0, 0.0, [])
            for name, param in model.named_parameters():
                full = reference[name].grad
                if param.grad is None:
                    cell.failures.append(f"{name}: no gradient")
                    continue
                want = expected_local(full, layouts.get(name, {}), axes, mesh)
                err, tol = (param.grad - want).abs().max().item(), tolerance(want)
                cell.grad_err, cell.grad_tol = max(cell.grad_err, err), max(cell.grad_tol, tol)
                if not err <= tol:
                    cell.failures.append(f"{name}: {err:.2e} > {tol:.2e}")
            if not cell.loss_err <= tolerance(expected):
                cell.failures.append(f"loss {cell.loss_err:.2e} > {tolerance(expected):.2e}")
            cells[kind] = cell
        cells["tuple and copy"] = _tuple_and_copy(model, ref, ids)
        results[case.name] = cells
    return results


def _tuple_and_copy(model: Any, ref: Any, ids: torch.Tensor) -> LossCell:
    """``model(ids, return_dict=False)[0]`` is the whole logits, and ``copy.deepcopy(model)`` (a
    reference or EMA model) runs alike and trains its own weights: its gradients of
    ``sum(logits * w)`` are the original's."""
    import copy

    failures = []
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids, return_dict=False)[0]
    if got.shape != want.shape:
        return LossCell(float("inf"), 0.0, 0.0, [f"return_dict=False: logits {tuple(got.shape)}, not {tuple(want.shape)}"])
    err = (got - want).abs().max().item()
    if not err <= tolerance(want):
        failures.append(f"return_dict=False: logits {err:.2e} off")
    twin = copy.deepcopy(model)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    for m in (model, twin):
        m.zero_grad(set_to_none=True)
        (m(ids).logits * w).sum().backward()
    grads = dict(twin.named_parameters())
    worst = max((p.grad - grads[n].grad).abs().max().item() for n, p in model.named_parameters())
    if any(p is grads[n] for n, p in model.named_parameters()):
        failures.append("deepcopy shares parameters with the original")
    if not worst <= 1e-6:
        failures.append(f"deepcopy: gradients {worst:.2e} from the original's")
    return LossCell(err, worst, 1e-6, failures)
