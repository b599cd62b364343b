"""DCP checkpoints of FSDP2 x hpgen models (``dp x tp``), on the ranks of the 2-D spawn.

Per case: the model parallelized on ``tp`` and ``fully_shard``-ed per decoder layer and
root on ``dp``; ``model.state_dict()`` must give every parameter a DTensor of the global
shape whose ``full_tensor()`` is the unsharded weight (DTensor's reading of the composed
placements, checked on real ranks); ``dcp.save`` of it is then loaded into a fresh
FSDP2 x hpgen model (weights and logits bit-exact), into transformers' unsharded model
(weights bit-exact, logits within tolerance) and into an hpgen model on ``tp`` alone
(each rank's chunk bit-exact); and ``load_state_dict`` of the full unsharded state dict
into a fresh FSDP2 x hpgen model gives the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support.models import (
    FAMILIES,
    expected_local,
    generated_model,
    import_file,
    make_config,
    param_layouts,
    reference_model,
    tolerance,
)


@dataclass(frozen=True)
class CheckpointCase:
    name: str
    family: str
    generated: str
    plan: dict
    folder: str  # the DCP checkpoint folder (shared by the ranks)
    seed: int = 0


@dataclass
class CheckpointResult:
    """What one rank measured (picklable)."""

    not_global: list[str] = field(default_factory=list)  # entries not DTensors of the global shape
    full_tensor: list[str] = field(default_factory=list)  # full_tensor() != the unsharded weight
    placements: dict[str, str] = field(default_factory=dict)  # layer-0 / embedding placements
    checked: int = 0
    mismatches: dict[str, list[str]] = field(default_factory=dict)  # load target -> params not bit-equal
    logits: dict[str, tuple[float, float]] = field(default_factory=dict)  # load target -> (err, tol)
    error: str = ""


def _fsdp(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def run_checkpoint_case(case: CheckpointCase, mesh: Any) -> CheckpointResult:
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.tensor import DTensor

    from hpgen.runtime import parallelize

    out = CheckpointResult()
    config = make_config(case.family)
    reference = reference_model(case.family, config, case.seed).eval()
    cls = getattr(import_file(case.generated), FAMILIES[case.family].model)
    model = generated_model(import_file(case.generated), case.family, config, reference)
    parallelize(model, case.plan, mesh)
    _fsdp(model, mesh)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
        ref_logits = reference(ids).logits

    expected = reference.state_dict()
    state = model.state_dict()
    for key, value in state.items():
        if not isinstance(value, DTensor) or tuple(value.shape) != tuple(expected[key].shape):
            out.not_global.append(key)
            continue
        out.checked += 1
        if not torch.equal(value.full_tensor(), expected[key]):
            out.full_tensor.append(key)
        if ".layers.0." in key or "embed" in key or "lm_head" in key:
            out.placements[key] = str(tuple(value.placements))
    dcp.save(state, checkpoint_id=case.folder)

    def fsdp_model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)  # weights that differ from the saved ones (and per rank)
        fresh = cls(config).eval()
        parallelize(fresh, case.plan, mesh)
        return _fsdp(fresh, mesh)

    def same_locals(candidate: torch.nn.Module) -> list[str]:
        ours = dict(model.named_parameters())
        return [n for n, p in candidate.named_parameters() if not torch.equal(_local(p), _local(ours[n]))]

    rank = mesh.get_rank()
    fresh = fsdp_model(100 + rank)
    fresh_state = fresh.state_dict()
    dcp.load(fresh_state, checkpoint_id=case.folder)
    fresh.load_state_dict(fresh_state)
    out.mismatches["fsdp2 x tp"] = same_locals(fresh)
    with torch.no_grad():
        out.logits["fsdp2 x tp"] = ((fresh(ids).logits - logits).abs().max().item(), 0.0)

    torch.manual_seed(200 + rank)
    plain = getattr(transformers, FAMILIES[case.family].model)(config).eval()
    plain_state = plain.state_dict()
    dcp.load(plain_state, checkpoint_id=case.folder)
    plain.load_state_dict(plain_state)
    out.mismatches["unsharded"] = [n for n, t in plain.state_dict().items() if not torch.equal(t, expected[n])]
    with torch.no_grad():
        plain_logits = plain(ids).logits
    out.logits["unsharded"] = ((plain_logits - logits).abs().max().item(), tolerance(ref_logits))
    out.logits["reference"] = ((logits - ref_logits).abs().max().item(), tolerance(ref_logits))

    torch.manual_seed(300 + rank)
    tp_only = cls(config).eval()
    parallelize(tp_only, case.plan, mesh)
    tp_state = tp_only.state_dict()
    dcp.load(tp_state, checkpoint_id=case.folder)
    tp_only.load_state_dict(tp_state)
    layouts = param_layouts(reference, case.plan)
    axes = case.plan["mesh_dim_names"]
    out.mismatches["tp only"] = [
        n
        for n, p in tp_only.named_parameters()
        if not torch.equal(p.detach(), expected_local(expected[n], layouts.get(n, {}), axes, mesh))
    ]
    with torch.no_grad():
        out.logits["tp only"] = ((tp_only(ids).logits - logits).abs().max().item(), tolerance(ref_logits))

    full = fsdp_model(400 + rank)
    full.load_state_dict(reference.state_dict())  # full unsharded tensors into FSDP2's pieces
    out.mismatches["full state dict"] = same_locals(full)

    _optimizer_resume(out, case, model, reference, fsdp_model, ids, mesh)
    return out


def _adam_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _optimizer_resume(
    out: CheckpointResult, case: CheckpointCase, model: Any, reference: Any, fsdp_model: Any, ids: Any, mesh: Any
) -> None:
    """One AdamW step on the FSDP2 x tp model; model and optimizer saved with DCP, resumed at dp x tp = 2 x 2
    (fresh FSDP2 x hpgen), at tp 2 alone (hpgen), unsharded and at dp x tp = 4 x 1 (transformers' model, alone
    and under FSDP2, with torch's calls)."""
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from hpgen.runtime import load_optimizer_state_dict, optimizer_state_dict, parallelize

    folder = case.folder + "_optimizer"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _adam_step(model, optimizer, ids)
    dcp.save({"model": model.state_dict(), "optim": optimizer_state_dict(model, optimizer)}, checkpoint_id=folder)
    plain_reference = getattr(transformers, FAMILIES[case.family].model)(reference.config)
    plain_reference.load_state_dict(reference.state_dict())
    reference_optimizer = torch.optim.AdamW(plain_reference.parameters(), lr=1e-2)
    _adam_step(plain_reference, reference_optimizer, ids)  # the same step, unsharded, on the same batch
    ours = {name: optimizer.state[param] for name, param in model.named_parameters()}

    def resume(candidate: torch.nn.Module, hpgen: bool) -> torch.optim.Optimizer:
        candidate_optimizer = torch.optim.AdamW(candidate.parameters(), lr=1e-2)
        get = optimizer_state_dict if hpgen else get_optimizer_state_dict
        state = {"model": candidate.state_dict(), "optim": get(candidate, candidate_optimizer)}
        dcp.load(state, checkpoint_id=folder)
        candidate.load_state_dict(state["model"])
        (load_optimizer_state_dict if hpgen else set_optimizer_state_dict)(candidate, candidate_optimizer, state["optim"])
        return candidate_optimizer

    fresh = fsdp_model(500 + mesh.get_rank())
    fresh_optimizer = resume(fresh, True)
    out.mismatches["optimizer: fsdp2 x tp"] = [
        f"{name} {key}"
        for name, param in fresh.named_parameters()
        for key in ("exp_avg", "exp_avg_sq")
        if not torch.equal(_local(fresh_optimizer.state[param][key]), _local(ours[name][key]))
    ]

    tp_only = getattr(import_file(case.generated), FAMILIES[case.family].model)(reference.config)
    parallelize(tp_only, case.plan, mesh)
    tp_optimizer = resume(tp_only, True)
    plain = getattr(transformers, FAMILIES[case.family].model)(reference.config)
    plain_optimizer = resume(plain, False)
    layouts = param_layouts(reference, case.plan)
    axes = case.plan["mesh_dim_names"]
    tp_params = dict(tp_only.named_parameters())
    reference_params = dict(plain_reference.named_parameters())
    worst = 0.0
    out.mismatches["optimizer: tp only"], out.mismatches["optimizer: unsharded"] = [], []
    for name, param in plain.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            full = plain_optimizer.state[param][key]
            local = expected_local(full, layouts.get(name, {}), axes, mesh)
            if not torch.equal(tp_optimizer.state[tp_params[name]][key], local):
                out.mismatches["optimizer: tp only"].append(f"{name} {key}")
            want = reference_optimizer.state[reference_params[name]][key]
            if full.shape != want.shape:
                out.mismatches["optimizer: unsharded"].append(f"{name} {key}: shape {tuple(full.shape)}")
            else:
                worst = max(worst, ((full - want).abs().max() / (want.abs().max() + 1e-12)).item())
    out.logits["optimizer: unsharded vs the unsharded step"] = (worst, 1e-3)

    # dp x tp = 4 x 1: transformers' model under FSDP2 alone on all 4 ranks, torch's own calls
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dp4 = init_device_mesh("cpu", (mesh.size(),), mesh_dim_names=("dp",))
    fsdp_plain = getattr(transformers, FAMILIES[case.family].model)(reference.config)
    for layer in fsdp_plain.model.layers:
        fully_shard(layer, mesh=dp4)
    fully_shard(fsdp_plain, mesh=dp4)
    fsdp_plain_optimizer = resume(fsdp_plain, False)
    plain_params = dict(plain.named_parameters())
    out.mismatches["optimizer: fsdp2 4 x 1"] = [
        f"{name} {key}"
        for name, param in fsdp_plain.named_parameters()
        for key in ("exp_avg", "exp_avg_sq")
        if not torch.equal(
            fsdp_plain_optimizer.state[param][key].full_tensor(), plain_optimizer.state[plain_params[name]][key]
        )
    ]


def run_checkpoint_cases(rank: int, world_size: int, cases: list[CheckpointCase]) -> dict[str, CheckpointResult]:
    """Rank body: every case on a ``dp x tp`` = 2 x 2 mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {case.name: run_checkpoint_case(case, mesh) for case in cases}
