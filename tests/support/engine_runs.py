"""The rank side of ``tests/runtime/training/test_data_parallel.py``: training steps with the engine summing over cp.

Each case builds the unsharded transformers model and the generated one with the same weights,
parallelizes the generated one on its mesh (``cp``, ``dp x cp`` or ``cp x tp``), hands it to
:func:`hpgen.runtime.training.data_parallel` (DDP or FSDP2) or to nothing (hpgen's own hooks sum
over cp), and trains both for a few optimizer steps on the same token batches: gradient
accumulation over 4 micro-batches (DDP's ``no_sync`` / FSDP2's ``set_requires_gradient_sync`` on
all but the last), the loss divided by 4, ``clip_grad_norm_`` (hpgen's on the parallel model,
torch's on the reference) and AdamW. Each ``dp`` rank takes its rows of every micro-batch. What
comes back: the worst weight and norm errors against the reference, whether the cp ranks'
gradients were still this rank's share after a micro-batch inside ``no_sync`` (no sum made), the
gradient collectives each micro-batch's backward ran (torch.profiler's backend events), and the
optimizer's state bytes on this rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from tests.support.compose import _compare, _full
from tests.support.models import (
    case_mesh,
    generated_model,
    import_file,
    make_config,
    param_layouts,
    reference_model,
)


@dataclass(frozen=True)
class EngineCase:
    """Training steps of one model on one mesh under one engine (``none``, ``ddp`` or ``fsdp2``)."""

    name: str
    family: str
    generated: str
    plan: dict[str, Any]
    mesh: tuple[tuple[str, int], ...]
    engine: str = "none"
    steps: int = 2
    accumulation: int = 4
    batch: int = 2  # rows per micro-batch, all dp ranks together
    seq_len: int = 13  # uneven head-tail shards over cp 2
    max_norm: float = 0.5
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineResult:
    weight_failures: list[str]
    weights_checked: int
    weight_max_err: float
    norm_errs: list[float]  # |hpgen's clip norm - torch's on the reference|, per step
    norm_tols: list[float]
    clipped: bool  # the reference's norm exceeded max_norm on some step (the clip did something)
    shares_while_accumulating: bool | None  # gradients differed across cp after a no_sync micro-batch (DDP only)
    collectives: list[int]  # gradient collectives in each micro-batch's backward, first step (gradient_collectives)
    optimizer_bytes: int  # this rank's AdamW state (exp_avg, exp_avg_sq), local shards
    reference_optimizer_bytes: int


def gradient_collectives(events: list) -> tuple[int, int]:
    """(count, bytes) of the gradient collectives among torch.profiler ``events``: the backend's all-reduces
    and reduce-scatters whose input is 1-D or 2-D (a parameter's gradient, or an engine's flat bucket; the
    attention's key/value collectives are 4-D)."""
    count = nbytes = 0
    for event in events:
        backend, _, op = event.name.partition(":")
        if backend not in ("gloo", "nccl") or op == "barrier":
            continue
        shapes = [shape for shape in event.input_shapes if shape]
        if shapes and len(shapes[0]) in (1, 2) and op in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor"):
            count += 1
            numel = 1
            for size in shapes[0]:
                numel *= size
            nbytes += 4 * numel  # float32
    return count, nbytes


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """AdamW's ``exp_avg`` and ``exp_avg_sq`` bytes on this rank (their local shards under FSDP2)."""
    total = 0
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            local = value._local_tensor if hasattr(value, "_local_tensor") else value
            total += local.numel() * local.element_size()
    return total


def _cp_grads_differ(model: torch.nn.Module, mesh: Any) -> bool:
    """Whether this rank's (local) gradients differ from its cp neighbours' somewhere: shares, not sums."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = torch.cat([(g._local_tensor if hasattr(g, "_local_tensor") else g).flatten() for g in grads])
    gathered = [torch.empty_like(local) for _ in range(mesh["cp"].size())]
    dist.all_gather(gathered, local, group=mesh.get_group("cp"))
    differ = torch.tensor([float(any(not torch.equal(gathered[0], other) for other in gathered[1:]))])
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)  # one answer on every rank
    return bool(differ.item())


def run_engine_case(case: EngineCase, mesh: Any) -> EngineResult:
    from hpgen.runtime import clip_grad_norm_, parallelize
    from hpgen.runtime.training import data_parallel, no_sync

    config = make_config(case.family, **case.config)
    reference = reference_model(case.family, config, seed=3).train()
    model = generated_model(import_file(case.generated), case.family, config, reference).train()
    parallelize(model, case.plan, mesh)
    wrapped = model if case.engine == "none" else data_parallel(model, case.engine)

    names = tuple(mesh.mesh_dim_names)
    dp, dp_rank = (mesh.size(names.index("dp")), mesh.get_local_rank("dp")) if "dp" in names else (1, 0)
    rows = slice(dp_rank * case.batch // dp, (dp_rank + 1) * case.batch // dp)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    generator = torch.Generator().manual_seed(17)
    norm_errs, norm_tols, clipped, shares, collectives = [], [], False, None, []
    for _ in range(case.steps):
        for micro in range(case.accumulation):
            ids = torch.randint(0, config.vocab_size, (case.batch, case.seq_len), generator=generator)
            (reference(ids, labels=ids).loss / case.accumulation).backward()
            last = micro == case.accumulation - 1
            with contextlib.nullcontext() if last else no_sync(wrapped):
                loss = wrapped(ids[rows], labels=ids[rows]).loss / case.accumulation
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    loss.backward()
                if len(collectives) < case.accumulation:
                    collectives.append(gradient_collectives(prof.events())[0])
            if case.engine == "ddp" and micro == 0 and shares is None and "cp" in names:  # FSDP2 keeps its own
                shares = _cp_grads_differ(model, mesh)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), case.max_norm)
        got = clip_grad_norm_(model.parameters(), case.max_norm)
        clipped = clipped or bool(want > case.max_norm)
        norm_errs.append(abs(float(_full(got)) - float(want)))
        norm_tols.append(1e-4 * max(1.0, float(want)))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
    axes = case.plan["mesh_dim_names"]
    weights = {name: p.detach() for name, p in model.named_parameters()}
    ref_weights = {name: p.detach() for name, p in reference.named_parameters()}
    failures, checked, worst = _compare(weights, ref_weights, param_layouts(reference, case.plan), axes, mesh)
    return EngineResult(
        failures, checked, worst, norm_errs, norm_tols, clipped, shares, collectives, state_bytes(opt),
        state_bytes(ref_opt),
    )


def run_engine_cases(rank: int, world_size: int, cases: list[EngineCase], extra: Any = None) -> dict[str, Any]:
    """Rank body for ``run_distributed``: every case on its mesh, then ``extra(world_size)`` (its results by name)."""
    made: dict = {}
    results: dict[str, Any] = {case.name: run_engine_case(case, case_mesh(case.mesh, case.plan, world_size, made)) for case in cases}
    if extra is not None:
        results.update(extra(world_size, made))
    return results


def guard_checks(spec: dict[str, Any], axis: str = "cp") -> Any:
    """``extra`` for :func:`run_engine_cases`: the guard's answer to a DDP built by hand over ``axis`` of
    ``spec``'s mesh (None, or the error), under key ``"guard_<axis>"``."""
    return _GuardChecks(spec, axis)


class _GuardChecks:
    """On a cp world: a DDP over cp built by hand (not by data_parallel) is refused at its first forward.
    On a cp x tp world (``spec`` names it): a DDP over tp is refused with the shards unchanged, which
    shows that the ignore list found the DDP being built in its caller's frame, in this torch."""

    def __init__(self, spec: dict[str, Any], axis: str = "cp") -> None:
        self.spec = spec
        self.axis = axis

    def __call__(self, world_size: int, made: dict) -> dict[str, Any]:
        from torch.nn.parallel import DistributedDataParallel

        from hpgen.runtime import parallelize

        spec = self.spec
        mesh = case_mesh(spec["mesh"], spec["plan"], world_size, made)
        config = make_config(spec["family"], **spec["config"])
        reference = reference_model(spec["family"], config, seed=3)
        model = generated_model(import_file(spec["generated"]), spec["family"], config, reference)
        parallelize(model, spec["plan"], mesh)
        ddp = DistributedDataParallel(model, process_group=mesh.get_group(self.axis))
        ids = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
        try:
            ddp(ids, labels=ids)
            message = None
        except RuntimeError as error:
            message = str(error)
        return {f"guard_{self.axis}": message}
