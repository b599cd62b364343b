"""Runs of a model cut into pipeline stages on gloo ranks, next to the unsharded model's numbers.

Each rank builds the unsharded reference (seeded, so every rank has the same), computes
its loss, gradients, logits and greedy tokens, then builds the generated (or plain) model
from the same weights, parallelizes it with a ``--pp`` plan and runs ``pipeline_step``
and inference; the test compares the two on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.support.models import (
    expected_local,
    generated_model,
    import_file,
    make_config,
    param_layouts,
    reference_model,
    tolerance,
)


@dataclass
class StageRun:
    """What one rank saw: the pipeline's loss and gradients and the unsharded model's."""

    loss: float
    reference_loss: float
    grad_errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (max error, tolerance)
    param_names: list[str] = field(default_factory=list)  # this rank's parameters, full names
    param_bytes: int = 0
    norm: float = 0.0  # hpgen.runtime.clip_grad_norm_ of the stage's gradients (a large max_norm: no clipping)
    reference_norm: float = 0.0
    logits: torch.Tensor | None = None
    reference_logits: torch.Tensor | None = None
    tokens: list[int] | None = None
    reference_tokens: list[int] | None = None
    sampled: list[int] | None = None  # do_sample tokens, each rank seeded differently


def batch(vocab: int, *, size: int = 4, length: int = 9, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels with -100 spread unequally: the first row all ignored, the others ignored in part."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (size, length), generator=generator)
    labels = ids.clone()
    labels[0, :] = -100
    labels[1, : length - 2] = -100
    if size > 2:
        labels[2, 3:5] = -100
    return ids, labels


def run_stages(
    rank: int,
    world: int,
    family: str,
    config: dict[str, Any],
    plan: dict[str, Any],
    dims: tuple[tuple[str, int], ...],
    generated: str | None,
    microbatches: int,
    schedule: str,
    infer: bool = False,
    padded: bool = False,
) -> StageRun:
    """One rank of a pipeline run (see the module docstring); ``generated``: the lowered file, None for transformers' class."""
    import transformers

    from hpgen.runtime import clip_grad_norm_, parallelize
    from hpgen.runtime.pipeline import pipeline_step

    torch.manual_seed(0)
    cfg = make_config(family, **config)
    reference = reference_model(family, cfg, seed=11)
    ids, labels = batch(cfg.vocab_size)
    mask = None
    if padded:  # left padding on the last row: masked out, no loss there
        mask = torch.ones_like(ids)
        mask[-1, :3] = 0
        labels[-1, :3] = -100
    out = reference(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
    if generated is not None:
        model = generated_model(import_file(generated), family, cfg, reference)
    else:
        model = getattr(transformers, type(reference).__name__)(cfg)
        model.load_state_dict(reference.state_dict())
        model.eval()
    mesh = init_device_mesh("cpu", tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims))
    parallelize(model, plan, mesh)
    loss = pipeline_step(model, input_ids=ids, labels=labels, attention_mask=mask, microbatches=microbatches, schedule=schedule)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    layouts = param_layouts(model, plan)
    errors = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        want = expected_local(ref_grads[name], layouts.get(name, {}), plan["mesh_dim_names"], mesh)
        got = param.grad if param.grad is not None else torch.full_like(param, float("nan"))
        errors[name] = ((got - want).abs().max().item(), tolerance(ref_grads[name]))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    norm = clip_grad_norm_(model.parameters(), 1e9)
    reference_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
    run = StageRun(float(loss), float(out.loss.detach()), errors, names, size, float(norm), float(reference_norm))
    if infer:
        with torch.no_grad():
            run.logits = model(ids[1:2]).logits
            run.reference_logits = reference(ids[1:2]).logits
            prompt = ids[1:2, :4]
            run.tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)[0].tolist()
            run.reference_tokens = reference.generate(prompt, max_new_tokens=6, do_sample=False)[0].tolist()
            torch.manual_seed(100 + rank)  # ranks seeded apart: sampling must still agree across the stages
            run.sampled = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0)[0].tolist()
    return run


def lowered(family: str, plan: dict[str, Any], directory: Path) -> str:
    from tests.support.models import lower_family

    return str(lower_family(family, plan, directory))


def checkpoint_round_trip(rank: int, world: int, family: str, config: dict[str, Any], plan: dict[str, Any], folder: str) -> dict[str, Any]:
    """from_pretrained onto stages, save_pretrained and DCP back out, read unsharded: what each step gave."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers

    from hpgen.runtime import from_pretrained

    root = Path(folder)
    cfg = make_config(family, **config)
    reference = reference_model(family, cfg, seed=5)
    if rank == 0:
        reference.save_pretrained(root / "ref")
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    cls = getattr(transformers, type(reference).__name__)
    model = from_pretrained(cls, root / "ref", plan, mesh)
    ids, _ = batch(cfg.vocab_size)
    with torch.no_grad():
        logits_error = (model(ids).logits - reference(ids).logits).abs().max().item()
    names = sorted(model.state_dict())
    model.save_pretrained(root / "saved")
    dcp.save(model.state_dict(), checkpoint_id=str(root / "dcp"))
    dist.barrier()
    result: dict[str, Any] = {"names": names, "logits_error": logits_error}
    if rank == 0:
        want = reference.state_dict()
        saved = cls.from_pretrained(root / "saved").state_dict()
        result["saved_error"] = max((saved[k] - want[k]).abs().max().item() for k in want)
        result["saved_keys_match"] = set(saved) == set(want)
        fresh = cls(cfg)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=str(root / "dcp"), no_dist=True)
        result["dcp_error"] = max((state[k] - want[k]).abs().max().item() for k in want)
    return result


def refusals(rank: int, world: int, plan: dict[str, Any], cases: dict[str, Any]) -> dict[str, str]:
    """The message each refusal gives on this rank (or ``no error``): bad plans, bad calls of ``pipeline_step``."""
    import copy

    import transformers

    from hpgen.runtime import parallelize
    from hpgen.runtime.pipeline import pipeline_step

    cfg = make_config("llama", num_hidden_layers=4)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    ids, labels = batch(cfg.vocab_size)

    def message(action: Any) -> str:
        try:
            action()
        except Exception as error:  # noqa: BLE001 - the message is what is compared
            return f"{type(error).__name__}: {error}"
        return "no error"

    found = {}
    for name, change in cases.items():
        changed = copy.deepcopy(plan)
        change(changed)
        found[name] = message(lambda: parallelize(transformers.LlamaForCausalLM(cfg), changed, mesh))
    model = parallelize(transformers.LlamaForCausalLM(cfg), plan, mesh)
    found["uneven microbatches"] = message(lambda: pipeline_step(model, input_ids=ids, labels=labels, microbatches=3))
    found["unknown schedule"] = message(
        lambda: pipeline_step(model, input_ids=ids, labels=labels, microbatches=2, schedule="Zigzag")
    )
    found["interleaved on one stage a rank"] = message(
        lambda: pipeline_step(model, input_ids=ids, labels=labels, microbatches=2, schedule="Interleaved1F1B")
    )
    found["not staged"] = message(
        lambda: pipeline_step(transformers.LlamaForCausalLM(cfg), input_ids=ids, labels=labels, microbatches=2)
    )
    return found


def resume_across_sizes(rank: int, world: int, plan_2x2: dict[str, Any], generated: str, plan_4: dict[str, Any], folder: str) -> float:
    """A DCP checkpoint saved at pp 2 x tp 2 loaded at pp 4: the largest logit error against the unsharded model."""
    import torch.distributed.checkpoint as dcp
    import transformers

    from hpgen.runtime import parallelize

    cfg = make_config("llama", num_hidden_layers=4)
    reference = reference_model("llama", cfg, seed=7)
    saved = generated_model(import_file(generated), "llama", cfg, reference)
    parallelize(saved, plan_2x2, init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")))
    dcp.save(saved.state_dict(), checkpoint_id=folder)
    torch.manual_seed(1)
    loaded = transformers.LlamaForCausalLM(cfg)  # other weights: the checkpoint must replace every one
    parallelize(loaded, plan_4, init_device_mesh("cpu", (4,), mesh_dim_names=("pp",)))
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=folder)
    loaded.load_state_dict(state)
    ids, _ = batch(cfg.vocab_size)
    with torch.no_grad():
        return (loaded(ids).logits - reference(ids).logits).abs().max().item()


def fsdp_stages(rank: int, world: int, plan: dict[str, Any], microbatches: int) -> dict[str, Any]:
    """FSDP2 on the dp dim of a (dp 2, pp 2) mesh: each dp rank trains on its half of the batch through its pipeline."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    from hpgen.runtime import parallelize
    from hpgen.runtime.pipeline import pipeline_step

    cfg = make_config("llama", num_hidden_layers=4)
    reference = reference_model("llama", cfg, seed=13)
    ids, labels = batch(cfg.vocab_size)
    out = reference(ids, labels=labels)
    out.loss.backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict(reference.state_dict())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    parallelize(model, plan, mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    share = mesh.get_local_rank("dp")
    rows = slice(2 * share, 2 * share + 2)  # the batch's rows ignore unequal numbers of labels
    loss = pipeline_step(model, input_ids=ids[rows], labels=labels[rows], microbatches=microbatches)
    errors = {}
    for name, param in model.named_parameters():
        got = param.grad.full_tensor()
        errors[name] = ((got - want[name]).abs().max().item(), tolerance(want[name]))
    return {"loss": float(loss), "reference_loss": float(out.loss.detach()), "grad_errors": errors}
