"""Training loops with gradient clipping, parallelized and unsharded: the rank bodies of tests/runtime/training/test_clipping.py.

A case trains the same tiny model a few AdamW steps, clipping every step with ``max_norm``
below the gradient norm (so clipping scales every step): once unsharded in one process with
``torch.nn.utils.clip_grad_norm_``, once parallelized with ``hpgen.runtime.clip_grad_norm_``,
each ``dp`` rank on its share of the batch. It reports each step's norm on both sides, the
losses, the final weights' largest difference (the parallelized model's state dict gathered
whole: ``full_tensor()`` of its DTensors) and the norm ``torch.nn.utils.clip_grad_norm_``
would have reported on this rank's local shards at the first step (what clipping got wrong).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tests.support.models import generated_model, import_file, make_config, reference_model

STEPS = 3
MAX_NORM = 0.05  # below every step's gradient norm of these tiny models: the test checks that it clips
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ClipCase:
    """One clipped loop: a family's generated file and plan, the mesh, what wraps the model on ``dp``."""

    name: str
    family: str
    generated: str
    plan: Mapping[str, Any]
    mesh: tuple[tuple[str, int], ...]  # the whole mesh, (axis, size) in mesh order
    axis: str | None = None  # parallelize on this 1-D submesh (several independent copies of the model)
    engine: str = "none"  # "fsdp2" (each decoder layer, then the root) or "ddp", on the mesh's "dp" axis
    config: Mapping[str, Any] = field(default_factory=dict)
    norm_type: float = 2.0
    lora: bool = False  # peft's LoRA put on before parallelize; only the adapters train
    given: str = "parameters"  # what clip_grad_norm_ is given: "parameters" (a list) or "model"
    nonfinite: bool = False  # a non-finite gradient instead of a loop (see nonfinite_case)
    export: str | None = None  # a folder: after the loop, full_state_dict, save_pretrained (loaded back by
    # transformers) and optimizer_state_dict are compared with the unsharded run (see export_checks)
    boost: str | None = None  # this parameter's gradient x 100 on both sides: the largest element is on one rank


@dataclass
class ClipResult:
    norms: list[float]
    reference_norms: list[float]
    losses: list[float]
    reference_losses: list[float]
    weight_err: float  # max |gathered weight - reference weight| after the steps
    weights_checked: int
    local_norm: float  # torch's own clip_grad_norm_ on this rank's local tensors, first step
    extra: dict[str, Any] = field(default_factory=dict)


def _models(case: ClipCase, mesh: Any) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(unsharded reference, the parallelized model as the loop calls it, the parallelized model itself)."""
    from hpgen.runtime import parallelize

    config = make_config(case.family, **case.config)
    reference = reference_model(case.family, config, seed=0).train()
    model = generated_model(import_file(case.generated), case.family, config, reference).train()
    if case.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
        reference = get_peft_model(reference, lora)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():  # peft starts lora_B at zero, which would hide a wrong lora_A gradient
            for name, param in reference.named_parameters():
                if "lora_" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.1)
        model = get_peft_model(model, lora)
        model.load_state_dict(reference.state_dict())
    parallelize(model, case.plan, mesh[case.axis] if case.axis else mesh)
    wrapped = model
    if case.engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        base = model.get_base_model() if case.lora else model
        for layer in base.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif case.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
    return reference, wrapped, model


def _batches(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (4, 7), generator=generator) for _ in range(STEPS)]


def _rows(case: ClipCase, mesh: Any) -> slice:
    names = tuple(mesh.mesh_dim_names)
    if case.engine == "none" or "dp" not in names:
        return slice(None)
    dp, rank = mesh.size(names.index("dp")), mesh.get_local_rank("dp")
    return slice(rank * 4 // dp, (rank + 1) * 4 // dp)


def _whole(value: Any) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _local_norm(params: list[torch.Tensor], norm_type: float) -> float:
    """What torch's clip_grad_norm_ computes on this rank: the norm of its local tensors."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, norm_type).item()


def clip_case(case: ClipCase, mesh: Any) -> ClipResult:
    """Both loops, compared (see the module docstring)."""
    import torch.distributed as dist

    from hpgen.runtime import clip_grad_norm_

    if case.nonfinite:
        return nonfinite_case(case, mesh)
    reference, wrapped, model = _models(case, mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, eps=1e-4)
    ref_optimizer = torch.optim.AdamW(ref_params, lr=1e-2, eps=1e-4)
    rows = _rows(case, mesh)
    dp_group = mesh.get_group("dp") if rows != slice(None) else None
    result = ClipResult([], [], [], [], math.inf, 0, math.nan)
    for step, ids in enumerate(_batches(reference.config.vocab_size)):
        loss = wrapped(ids[rows], labels=ids[rows]).loss
        loss.backward()
        if case.boost:
            model.get_parameter(case.boost).grad.mul_(100.0)
        if step == 0:
            result.local_norm = _local_norm(params, case.norm_type)
        given = model if case.given == "model" else params
        norm = clip_grad_norm_(given, MAX_NORM, norm_type=case.norm_type)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref_loss = reference(ids, labels=ids).loss
        ref_loss.backward()
        if case.boost:
            reference.get_parameter(case.boost).grad.mul_(100.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM, norm_type=case.norm_type)
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if dp_group is not None:
            dist.all_reduce(mean, group=dp_group)
            mean /= dist.get_world_size(dp_group)
        result.losses.append(mean.item())
        result.reference_losses.append(ref_loss.item())
        result.norms.append(norm.item())
        result.reference_norms.append(ref_norm.item())
    mine = model.state_dict()
    want = reference.state_dict()
    errors = [(_whole(mine[key]).detach() - want[key]).abs().max().item() for key in want]
    result.weight_err, result.weights_checked = max(errors), len(errors)
    if case.export:
        result.extra = export_checks(case, model, optimizer, reference, ref_optimizer)
    return result


def export_checks(
    case: ClipCase, model: nn.Module, optimizer: Any, reference: nn.Module, ref_optimizer: Any
) -> dict[str, Any]:
    """The trained model exported three ways, each against the unsharded run: ``full_state_dict`` (every tensor,
    on rank 0), ``save_pretrained`` loaded into the plain transformers class (its logits, every rank loads), and
    ``optimizer_state_dict`` (AdamW's moments gathered whole)."""
    import torch.distributed as dist
    import transformers

    from hpgen.runtime import full_state_dict, optimizer_state_dict
    from tests.support.models import FAMILIES

    want = reference.state_dict()
    full = full_state_dict(model)
    checks: dict[str, Any] = {}
    if dist.get_rank() == 0:
        checks["full_keys"] = sorted(full) == sorted(want)
        checks["full_err"] = max((full[key] - want[key]).abs().max().item() for key in want if key in full)
    model.save_pretrained(case.export)
    loaded = getattr(transformers, FAMILIES[case.family].model).from_pretrained(case.export).eval()
    ids = _batches(reference.config.vocab_size)[0]
    with torch.no_grad():
        checks["logits_err"] = (loaded(ids).logits - reference.eval()(ids).logits).abs().max().item()
    state = optimizer_state_dict(model, optimizer)["state"]
    names = {id(p): name for name, p in reference.named_parameters()}
    moments = 0
    worst = 0.0
    for param, per_param in ref_optimizer.state.items():
        name = names[id(param)]
        for moment in ("exp_avg", "exp_avg_sq"):
            worst = max(worst, (_whole(state[name][moment]) - per_param[moment]).abs().max().item())
            moments += 1
    checks["moments"], checks["moments_err"] = moments, worst
    return checks


def nonfinite_case(case: ClipCase, mesh: Any) -> ClipResult:
    """A ``nan`` and then an ``inf`` put into one element of a sharded gradient (on the rank holding it) and
    of the reference's: the norms, the error ``error_if_nonfinite`` raises on each rank, and the gradients after
    clipping by an infinite norm (``nan`` where the ``inf`` was, zero elsewhere: torch's arithmetic)."""
    from hpgen.runtime import clip_grad_norm_
    from hpgen.runtime.checkpoint.state_dict import sharded_params

    reference, _, model = _models(case, mesh)
    name = "model.layers.0.mlp.gate_proj.weight"
    record = sharded_params(model)[name]
    row = record.global_shape[0] - 1  # the last output row: on the axis's last rank
    (start, stop), = [record.shard_layout.range(0)]
    ids = _batches(reference.config.vocab_size)[0]
    extra: dict[str, Any] = {}
    for bad in ("nan", "inf"):
        for net in (model, reference):
            net.zero_grad(set_to_none=True)
            net(ids, labels=ids).loss.backward()
        ref_grad = reference.get_parameter(name).grad
        ref_grad[row, 0] = float(bad)
        if start <= row < stop:
            model.get_parameter(name).grad[row - start, 0] = float(bad)
        messages = []
        for clip, net in ((clip_grad_norm_, model), (torch.nn.utils.clip_grad_norm_, reference)):
            try:
                clip(list(net.parameters()), MAX_NORM, error_if_nonfinite=True)
                messages.append("no error")
            except RuntimeError as error:
                messages.append(str(error))
        norm = clip_grad_norm_(list(model.parameters()), MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), MAX_NORM)
        grads = [p.grad for p in model.parameters()]
        extra[bad] = dict(
            norm=norm.item(),
            reference_norm=ref_norm.item(),
            message=messages[0],
            reference_message=messages[1],
            nans=sum(int(g.isnan().sum()) for g in grads),
            largest=max(float(g.nan_to_num(0.0).abs().max()) for g in grads),
            reference_nans=sum(int(p.grad.isnan().sum()) for p in reference.parameters()),
            reference_largest=max(float(p.grad.nan_to_num(0.0).abs().max()) for p in reference.parameters()),
            holds=start <= row < stop,
        )
    return ClipResult([], [], [], [], 0.0, 0, math.nan, extra=extra)


def run_clip_cases(rank: int, world_size: int, cases: list[ClipCase]) -> dict[str, ClipResult]:
    """Rank body for ``run_distributed``: every case on its mesh (made once per shape)."""
    from torch.distributed.device_mesh import init_device_mesh

    made: dict = {}
    results = {}
    for case in cases:
        if case.mesh not in made:
            made[case.mesh] = init_device_mesh(
                "cpu", tuple(size for _, size in case.mesh), mesh_dim_names=tuple(axis for axis, _ in case.mesh)
            )
        torch.manual_seed(0)
        results[case.name] = clip_case(case, made[case.mesh])
    return results
