"""One rank's comparison of a parallelized model with the unsharded one holding the same weights.

:func:`run_cases` is the rank body :func:`hpgen.verify.spawn.run_distributed` runs: for each
prepared case it builds the reference (transformers' class, or the ``--source`` file's) and the
model of the generated file from one seed, perturbs the weights (transformers initialises
biases to zero and norms to one, which would hide a bias added twice or a norm gradient not
reduced), parallelizes, and compares logits, every parameter's gradient (this rank's shard of
the reference's) and greedy generation; then, where the model has dropout, train mode with the
ranks seeded apart must still agree across ranks (:func:`_train_mode`). Where they differ, :mod:`hpgen.verify.localize` finds
the first boundary that departs. A refusal by ``parallelize`` and an exception are outcomes
too, with the module that was running.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpgen.verify.hang import CollectiveWatch
from hpgen.verify.localize import Difference, Recorder, first_difference, returned_as_declared, tolerance
from hpgen.verify.prepare import Prepared

__all__ = ["Check", "Outcome", "Raised", "expected_shard", "run_cases"]

SEED = 0
BATCH, TOKENS, NEW_TOKENS = 2, 7, 8  # 7 tokens: uneven sequence shards on 2 ranks


@dataclass(frozen=True)
class Check:
    """One comparison: its name, the largest difference and the tolerance it was held to."""

    name: str
    err: float
    tol: float
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Raised:
    """An exception of the parallel model: where it ran and what it said."""

    stage: str  # "parallelize", "forward", "backward", "generate"
    fqn: str  # the innermost module running ("" when none)
    cls: str
    error: str  # the exception's last line
    refused: bool = False  # parallelize's own refusal (a ParallelizeError), not a crash


@dataclass
class Outcome:
    """What one rank found for one case (picklable)."""

    name: str
    checks: list[Check] = field(default_factory=list)
    raised: Raised | None = None
    forward: Difference | None = None
    backward: Difference | None = None
    params: list[Difference] = field(default_factory=list)  # differing parameter gradients, backward order
    reference_error: str = ""  # transformers' own model fails on the tiny config


def run_cases(rank: int, world_size: int, cases: list[Prepared], progress: bool = True) -> list[Outcome]:
    """Rank body: each case's outcome; a barrier between cases keeps the ranks in step."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    meshes: dict[tuple, Any] = {}
    outcomes = []
    for case in cases:
        if progress and rank == 0:
            print(f"hpgen verify: {case.name}: comparing on {_mesh_text(case.mesh)}", file=sys.stderr, flush=True)
        mesh = _mesh(case.mesh, meshes)
        outcome = Outcome(case.name)
        try:
            _run_case(case, mesh, outcome)
        except Exception:  # noqa: BLE001 - an hpgen bug or a model the checks cannot drive: said per case
            outcome.raised = Raised("verify", "", "", _last_line(traceback.format_exc()))
        outcomes.append(outcome)
        dist.barrier()
    return outcomes


def _mesh_text(mesh: tuple[tuple[str, int], ...]) -> str:
    return " x ".join(f"{axis} {size}" for axis, size in mesh) + " gloo ranks"


def _mesh(dims: tuple[tuple[str, int], ...], made: dict) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if dims not in made:
        made[dims] = init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(a for a, _ in dims))
    return made[dims]


def _run_case(case: Prepared, mesh: Any, outcome: Outcome) -> None:
    from hpgen.core.plan import plan_from_dict
    from hpgen.runtime import parallelize
    from hpgen.runtime.errors import ParallelizeError

    plan = plan_from_dict(case.plan, name=case.plan_name)
    config = case.config
    reference_class = _reference_class(case)
    torch.manual_seed(SEED)
    try:
        reference = reference_class(config)
    except Exception as error:  # noqa: BLE001 - the tiny config, not the plan
        outcome.reference_error = f"transformers' own model cannot be built from the tiny config: {_short(error)}"
        return
    perturb_(reference, SEED)
    reference.eval()
    generated = _import_file(case.generated)
    others = [_import_file(path) for path in case.others]
    torch.manual_seed(SEED)  # the same non-persistent buffers (some are drawn at random)
    model = getattr(generated, reference_class.__name__)(config)
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"the generated model's parameters differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.eval()

    generator = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, config.get_text_config().vocab_size, (BATCH, TOKENS), generator=generator)
    reference_recorder = Recorder(reference, plan)
    try:
        ref_logits = reference(input_ids=ids).logits
    except Exception as error:  # noqa: BLE001
        outcome.reference_error = f"transformers' own model fails on the tiny config: {_short(error)}"
        return
    projection = torch.randn(ref_logits.shape, generator=generator)
    (ref_logits.float() * projection).sum().backward()
    reference_recorder.remove()

    layouts = param_layouts(reference, plan)
    try:
        parallelize(
            model, plan, mesh, generated=others, trust_plan_code=case.trust_plan_code, trusted_modules=case.trusted_modules
        )
    except ParallelizeError as error:
        outcome.raised = Raised("parallelize", "", "", str(error).strip().splitlines()[0], refused=True)
        return
    except Exception as error:  # noqa: BLE001
        outcome.raised = Raised("parallelize", "", "", _short(error))
        return
    axes = {mesh.get_group(name): name for name in mesh.mesh_dim_names}
    if plan.pipeline is not None:  # pipeline stages: gradients through pipeline_step
        with CollectiveWatch(model, axes):
            _staged_checks(model, reference, plan, mesh, ids, layouts, outcome)
        return
    with CollectiveWatch(model, axes):  # a collective that never completes is named per rank
        _checks(model, reference, reference_recorder, plan, mesh, ids, ref_logits, projection, layouts, outcome)


def _checks(
    model: nn.Module,
    reference: nn.Module,
    reference_recorder: Recorder,
    plan: Any,
    mesh: Any,
    ids: torch.Tensor,
    ref_logits: torch.Tensor,
    projection: torch.Tensor,
    layouts: dict[str, dict[str, str]],
    outcome: Outcome,
) -> None:
    """The parallelized model against the unsharded one: logits, gradients, generation, train mode."""
    recorder = Recorder(model, plan, params=True)
    try:
        logits = model(input_ids=ids).logits
    except Exception as error:  # noqa: BLE001
        fqn = recorder.stack[-1] if recorder.stack else ""
        outcome.raised = Raised("forward", fqn, recorder.classes.get(fqn, ""), _short(error))
        recorder.remove()
        return
    tol = tolerance(ref_logits)
    if _on_any_rank(logits.shape != ref_logits.shape):
        outcome.checks.append(Check("logits", float("inf"), tol, False, f"shape {tuple(logits.shape)} on this rank, "
                                    f"{tuple(ref_logits.shape)} unsharded"))
        outcome.forward = first_difference(
            recorder.outputs, reference_recorder.outputs, "forward", recorder.classes, plan, mesh
        ) or returned_as_declared(recorder.outputs, logits, ref_logits, recorder.classes, plan)
        recorder.remove()
        return
    err = (logits.float() - ref_logits.float()).abs().max().item()
    outcome.checks.append(Check("logits", err, tol, err <= tol))
    try:
        (logits.float() * projection).sum().backward()
    except Exception as error:  # noqa: BLE001
        last = recorder.grads[-1].fqn if recorder.grads else ""
        outcome.raised = Raised("backward", last, recorder.classes.get(last, ""), _short(error))
        recorder.remove()
        return
    recorder.remove()
    worst: list[tuple[float, float]] = []
    outcome.params = gradient_differences(model, reference, layouts, plan, mesh, recorder.param_order, worst)
    err, tol = max(worst, key=lambda pair: pair[0] / max(pair[1], 1e-30), default=(0.0, 0.0))
    checked = sum(1 for p in reference.parameters() if p.grad is not None)
    outcome.checks.append(
        Check("gradients", err, tol, not outcome.params, f"{len(outcome.params)} of {checked} parameters differ")
    )
    if _on_any_rank(not all(check.ok for check in outcome.checks)):  # every rank localizes, or none
        outcome.forward = first_difference(
            recorder.outputs, reference_recorder.outputs, "forward", recorder.classes, plan, mesh
        )
        if outcome.forward is None and not outcome.checks[0].ok:
            outcome.forward = returned_as_declared(recorder.outputs, logits, ref_logits, recorder.classes, plan)
        outcome.backward = first_difference(
            recorder.grads, reference_recorder.grads, "backward", recorder.classes, plan, mesh
        )
    outcome.checks.append(_generation(model, reference, ids))
    # last: train mode (the code paths only training takes: a deferred bias added by one rank before the
    # reduction, the random streams); this sets the dropouts of the config both models share
    outcome.checks.append(_train_parity(model, reference, ids, projection, layouts, plan, mesh))
    if _with_dropout(model, TRAIN_DROPOUT):
        outcome.checks.append(_train_mode(model, ids, layouts, plan, mesh))


def _staged_checks(
    model: nn.Module, reference: nn.Module, plan: Any, mesh: Any, ids: torch.Tensor, layouts: dict[str, dict[str, str]],
    outcome: Any,
) -> None:
    """The checks of a model cut into pipeline stages: its ``model(input_ids)`` relays activations without
    gradients (docs/pipeline.md), so the gradients are checked through ``pipeline_step`` against the unsharded
    model's causal-LM loss on the same batch (labels: the ids), each rank's stage against the reference's
    gradients of it; the logits (the relay) and greedy generation as for any plan."""
    from hpgen.runtime.pipeline import pipeline_step
    from hpgen.runtime.pipeline.attach import staged

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


def _on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank: a decision every rank takes alike (the next steps run collectives)."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


TRAIN_DROPOUT = 0.1


def _with_dropout(model: nn.Module, p: float) -> bool:
    """Set every dropout of ``model`` to ``p`` (its config's ``*drop*`` probabilities, ``nn.Dropout``
    modules and the float ``*dropout*`` attributes attention modules copied at init); whether it has any."""
    from hpgen.verify.shrink import all_configs

    found = False
    for part in all_configs(model.config):  # what the modeling code (and the random streams) read at call time
        for name, value in vars(part).items():
            if "drop" in name.lower() and isinstance(value, float) and not name.startswith("_"):
                setattr(part, name, p)
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p, found = p, True
            continue
        for name, value in vars(module).items():
            if "dropout" in name.lower() and isinstance(value, float) and not name.startswith("_"):
                setattr(module, name, p)
                found = True
    return found


def _train_parity(
    model: nn.Module, reference: nn.Module, ids: torch.Tensor, projection: torch.Tensor,
    layouts: Mapping[str, Mapping[str, str]], plan: Any, mesh: Any,
) -> Check:
    """Train mode with every dropout at 0: the same logits and gradients as the unsharded model in train mode."""
    _with_dropout(reference, 0.0)
    _with_dropout(model, 0.0)
    for each in (reference, model):
        each.zero_grad(set_to_none=True)
        each.train()
    try:
        ref_logits = reference(input_ids=ids).logits.float()
        logits = model(input_ids=ids).logits.float()
        (ref_logits * projection).sum().backward()
        (logits * projection).sum().backward()
    finally:
        reference.eval()
        model.eval()
    err, tol = (logits - ref_logits).abs().max().item(), tolerance(ref_logits)
    differ = gradient_differences(model, reference, layouts, plan, mesh, [])
    detail = "dropout 0: logits and gradients as the unsharded model's in train mode"
    if differ:
        detail = f"dropout 0: {len(differ)} gradients differ: {', '.join(d.what for d in differ[:5])}"
    return Check("train mode, dropout 0", err, tol, err <= tol and not differ, detail)


def _train_mode(
    model: nn.Module, ids: torch.Tensor, layouts: Mapping[str, Mapping[str, str]], plan: Any, mesh: Any
) -> Check:
    """Train mode with dropout, each rank seeded apart (as data-loading code does): the ranks must
    still agree, on the logits and on every replicated parameter's gradient (hpgen's random streams
    draw one mask where a value is replicated or partial)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234 + dist.get_rank())
    logits = model(input_ids=ids).logits.float()
    logits.square().mean().backward()
    model.eval()
    values = [("logits", logits.detach())]
    values += [
        (name, param.grad)
        for name, param in model.named_parameters()
        if param.grad is not None and all(p == "R" for p in layouts.get(name, {}).values())
    ]
    worst, tol_of_worst, differ = 0.0, 0.0, []
    for name, value in values:
        pieces = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, value.contiguous())
        err = max((piece - pieces[0]).abs().max().item() for piece in pieces)
        tol = tolerance(pieces[0])
        if err / max(tol, 1e-30) >= worst / max(tol_of_worst, 1e-30):
            worst, tol_of_worst = err, tol
        if not err <= tol:
            differ.append(name)
    detail = f"dropout {TRAIN_DROPOUT}, ranks seeded apart: {len(values)} values agree across ranks"
    if differ:
        detail = f"dropout {TRAIN_DROPOUT}, ranks seeded apart: differ across ranks: {', '.join(differ[:5])}"
    return Check("train mode, dropout 0.1", worst, tol_of_worst, not differ, detail)


def _generation(model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> Check:
    """Greedy decoding with the cache: the same tokens, and each step's logits within tolerance."""
    options = dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        mine = model.generate(ids[:1], **options)
        ref = reference.generate(ids[:1], **options)
    steps = min(len(mine.logits), len(ref.logits))
    ref_scores = torch.stack(ref.logits[:steps]).float()
    err = (torch.stack(mine.logits[:steps]).float() - ref_scores).abs().max().item()
    tol = tolerance(ref_scores)
    same = mine.sequences.tolist() == ref.sequences.tolist()
    detail = "" if same else f"tokens {mine.sequences[0, TOKENS:].tolist()} != {ref.sequences[0, TOKENS:].tolist()}"
    return Check("greedy generation", err, tol, same and err <= tol, detail)


def gradient_differences(
    model: nn.Module, reference: nn.Module, layouts: Mapping[str, Mapping[str, str]], plan: Any, mesh: Any,
    order: list[str], worst: list[tuple[float, float]] | None = None,
) -> list[Difference]:
    """The parameters whose gradient differs from this rank's shard of the reference's, in backward order.

    A bias is held to its layer's gradient scale: some are zero but for rounding (a key
    projection's bias: the softmax ignores a shift shared by all keys).
    """
    refs = dict(reference.named_parameters())
    mine = dict(model.named_parameters())
    axes = [(axis, mesh.get_local_rank(axis), mesh.size(mesh.mesh_dim_names.index(axis))) for axis in plan.mesh_dim_names]
    rank_of = {name: index for index, name in enumerate(dict.fromkeys(order))}
    found = []
    for name, ref_param in refs.items():
        if ref_param.grad is None:
            continue  # unused in this forward
        param = mine.get(name)
        owner = name.rpartition(".")[0]
        cls = type(model.get_submodule(owner)).__name__ if owner else type(model).__name__
        if param is None or param.grad is None:
            found.append(Difference(owner, cls, "backward", f"{name} (no gradient)", float("inf"), 0.0))
            continue
        want = ref_param.grad
        for axis, coordinate, size in axes:  # each axis splits what the previous ones left, in mesh order
            want = expected_shard(want, layouts.get(name, {}).get(axis, "R"), coordinate, size)
        scale = ref_param.grad
        weight = refs.get(name[: -len("bias")] + "weight") if name.endswith(".bias") else None
        if weight is not None and weight.grad is not None and weight.grad.abs().max() > scale.abs().max():
            scale = weight.grad
        if param.grad.shape != want.shape:
            found.append(Difference(owner, cls, "backward", f"{name} (shape {tuple(param.grad.shape)}, "
                                    f"expected {tuple(want.shape)})", float("inf"), 0.0))
            continue
        err, tol = (param.grad.float() - want.float()).abs().max().item(), tolerance(scale)
        if worst is not None:
            worst.append((err, tol))
        if not err <= tol:
            found.append(Difference(owner, cls, "backward", name, err, tol))
    return sorted(found, key=lambda d: rank_of.get(d.what, len(rank_of)))


def param_layouts(model: nn.Module, plan: Any) -> dict[str, dict[str, str]]:
    """Parameter FQN -> {axis: placement text} for every parameter the plan names."""
    result: dict[str, dict[str, str]] = {}
    for fqn, _ in model.named_modules():
        entry = plan.entry_for(fqn) if fqn else None
        if entry is None:
            continue
        for name, layout in entry.params.items():
            result[f"{fqn}.{name}"] = {axis: str(placement) for axis, placement in layout.placements}
    return result


def expected_shard(full: torch.Tensor, placement: str, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s chunk of ``full`` for one placement, written apart from the runtime's sharding."""
    text = placement.replace(" ", "")
    if text == "R" or text.startswith("P("):
        return full
    if text.startswith("RS("):  # size / r chunks, chunk rank // r
        dim, replicas = (int(part) for part in text[3:-1].split(","))
        return full.tensor_split(size // replicas, dim)[rank // replicas]
    if text.startswith("SS("):
        dim, blocks = (int(part) for part in text[3:-1].split(","))
        return torch.cat([block.tensor_split(size, dim)[rank] for block in full.chunk(blocks, dim)], dim)
    if text.startswith("B("):  # blocks along dim, each with its own placement, the rank's pieces concatenated
        dim_text, _, rest = text[2:-1].partition(",")
        blocks, depth, start = [], 0, 0
        for index, char in enumerate(rest + ","):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if char == "," and depth == 0:
                blocks.append(rest[start:index].split(":", 1))
                start = index + 1
        dim = int(dim_text)
        parts = full.split([int(n) for n, _ in blocks], dim)
        return torch.cat([expected_shard(part, inner, rank, size) for part, (_, inner) in zip(parts, blocks)], dim)
    if text.startswith("S("):  # S(d), S(d,u): whole units of u, S(d,u,g): g groups, each on size / g ranks
        dim, unit, groups = ([int(part) for part in text[2:-1].split(",")] + [1, 1])[:3]
        per_set = size // groups
        group = full.chunk(groups, dim)[rank // per_set]
        units = group.split(unit, dim)
        counts = [len(units) // per_set + (i < len(units) % per_set) for i in range(per_set)]
        first = sum(counts[: rank % per_set])
        return torch.cat(units[first : first + counts[rank % per_set]], dim)
    raise ValueError(placement)


def perturb_(model: nn.Module, seed: int, scale: float = 0.2) -> None:
    """Add seeded N(0, scale²) noise to every parameter (tied ones once): no zero bias, no unit norm."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)


_IMPORTED = itertools.count()


def _import_file(path: str | Path, name: str | None = None) -> Any:
    """Import a file under a fresh module name (transformers reads the class's module source)."""
    name = name or f"_hpgen_verify_{Path(path).stem}_{next(_IMPORTED)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _reference_class(case: Prepared) -> type:
    """The unsharded class: from ``--source`` (imported in its package) or the installed transformers."""
    if case.reference_file is not None:
        stem = Path(case.reference_file).stem
        name = f"{case.reference_package}.{stem}" if case.reference_package else f"_hpgen_verify_reference_{stem}"
        module = sys.modules.get(name) or _import_file(case.reference_file, name)
    else:
        module = importlib.import_module(case.reference_module)
    return getattr(module, case.class_name)


def _short(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip() and not line.startswith((" ", "\t"))]
    return (lines[-1] if lines else "no output").strip()[:400]
