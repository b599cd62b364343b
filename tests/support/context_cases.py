"""The rank side of the context-parallel parity tests (``test_context_parallel.py``).

One rank function runs every case of a spawn: each case builds the unsharded transformers
model and the generated one with the same weights, parallelizes the generated one on its
mesh (``cp``, or ``cp x tp``), and runs the same inputs through both: training forwards
and backwards (logits, loss, every gradient), a left-padded batch, packed documents
(``position_ids`` restarting at 0), a user's 4-D mask, greedy generation after a cp
prefill, and training steps under activation checkpointing. The numbers come back to the
parent, which asserts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support.models import (
    expected_local,
    generated_model,
    import_file,
    make_config,
    param_layouts,
    parallelized_pair,
    reference_model,
    tolerance,
)


@dataclass(frozen=True)
class CpCase:
    """One model on one mesh, and the inputs it is checked on."""

    name: str
    family: str
    generated: str  # path of the file lowered under ``plan``
    plan: dict[str, Any]
    mesh: tuple[tuple[str, int], ...]  # (axis, size) in mesh order
    lengths: tuple[int, ...] = (16, 13)  # training batches of 2 sequences
    padded: bool = False  # a left-padded batch (attention_mask)
    packed: bool = False  # three documents in one row, by position_ids
    mask4d: bool = False  # a user's 4-D boolean mask
    generate: bool = False  # greedy tokens after a cp prefill
    compiled: bool = False  # loss and gradients through torch.compile(fullgraph=True, backend="aot_eager")
    sharded_logits: bool = False  # a training step with shard_logits: each rank's tokens' logits
    checkpointed: bool = False  # training steps under gradient_checkpointing_enable() (defaults, then reentrant)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class CpResult:
    checks: dict[str, tuple[float, float]]  # what -> (largest error, tolerance)
    grad_failures: list[str]
    grads_checked: int
    local_tokens: list[int]  # tokens of each decoder layer's output on this rank, first forward
    tokens: list[list[int]] = field(default_factory=list)
    reference_tokens: list[list[int]] = field(default_factory=list)


def _compare_step(
    case: CpCase,
    ref: Any,
    model: Any,
    layouts: dict,
    mesh: Any,
    label: str,
    result: CpResult,
    positions: torch.Tensor | None = None,
    **inputs: Any,
) -> None:
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
    expected = ref(**inputs)
    got = model(**inputs)
    if model.config._attn_implementation == "sdpa" and model.training and not _checkpointing(model):
        # the cp step's attention runs by blocks (no attention over padding), one call a layer
        blocks = _graph_nodes(got.loss, "BlockwiseAttentionBackward")
        result.checks[f"{label} attention by blocks"] = (float(blocks != model.config.num_hidden_layers), 0.0)
    expected.loss.backward()
    got.loss.backward()
    if positions is not None:  # sequence-sharded logits: this rank's tokens, in the order it holds them
        expected.logits = expected.logits.index_select(1, positions)
    valid = torch.isfinite(expected.logits)
    result.checks[f"{label} logits"] = (
        (expected.logits[valid] - got.logits[valid]).abs().max().item(),
        tolerance(expected.logits[valid]),
    )
    result.checks[f"{label} loss"] = ((expected.loss - got.loss).abs().item(), tolerance(expected.loss))
    reference = dict(ref.named_parameters())
    axes = [axis for axis, _ in case.mesh]
    for name, param in model.named_parameters():
        full = reference[name].grad
        if param.grad is None:
            result.grad_failures.append(f"{label} {name}: no gradient")
            continue
        want = expected_local(full, layouts.get(name, {}), axes, mesh)
        err, tol = (param.grad - want).abs().max().item(), tolerance(want)
        result.grads_checked += 1
        if not err <= tol:
            result.grad_failures.append(f"{label} {name}: {err:.2e} > {tol:.2e}")


def _checkpointing(model: Any) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _graph_nodes(output: torch.Tensor, name: str) -> int:
    """How many nodes of ``output``'s autograd graph are named ``name``."""
    seen, stack, count = set(), [output.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == name
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


def run_cp_refusals(case: CpCase, configs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``parallelize`` of ``case``'s plan on models whose config it must refuse: the message each
    raised, with ``" (model changed)"`` added where the refused model is no longer as built."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize
    from hpgen.runtime.defaults import IDENTITY_AXIS
    from hpgen.runtime.errors import ParallelizeError

    names = tuple(axis for axis, _ in case.mesh)
    mesh = init_device_mesh("cpu", tuple(size for _, size in case.mesh), mesh_dim_names=names)
    module = import_file(case.generated)
    messages = {}
    for label, overrides in configs.items():
        attention = overrides.pop("_attn_implementation", None)
        config = make_config(case.family, **overrides)
        if attention is not None:
            config._attn_implementation = attention
        ref = reference_model(case.family, config, seed=3)
        model = generated_model(module, case.family, config, ref)
        try:
            parallelize(model, case.plan, mesh)
        except ParallelizeError as error:
            changed = getattr(model, "_hp_parallelized", False) or model.model.rotary_emb._hp_cp is not IDENTITY_AXIS
            messages[label] = str(error) + (" (model changed)" if changed else "")
        else:
            messages[label] = "accepted"
    return messages


def run_cp_checkpoint(case: CpCase, folder: str) -> dict[str, Any]:
    """``dcp.save`` of a cp model's ``state_dict()``, loaded into transformers' unsharded model and into a
    fresh cp model: the parameters that differ from the saved ones (bit for bit), and the bytes stored."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize

    names = tuple(axis for axis, _ in case.mesh)
    mesh = init_device_mesh("cpu", tuple(size for _, size in case.mesh), mesh_dim_names=names)
    module = import_file(case.generated)
    config = make_config(case.family, **case.config)
    ref = reference_model(case.family, config, seed=5)
    model = generated_model(module, case.family, config, ref)
    parallelize(model, case.plan, mesh)
    dcp.save(model.state_dict(), checkpoint_id=folder)
    mismatches: dict[str, list[str]] = {}
    plain = reference_model(case.family, config, seed=6)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=folder)
    plain.load_state_dict(state)
    fresh = generated_model(module, case.family, config, reference_model(case.family, config, seed=7))
    parallelize(fresh, case.plan, mesh)
    fresh_state = fresh.state_dict()
    dcp.load(fresh_state, checkpoint_id=folder)
    fresh.load_state_dict(fresh_state)
    saved = dict(ref.named_parameters())
    for label, loaded in (("unsharded", plain), ("cp", fresh)):
        mismatches[label] = [n for n, p in loaded.named_parameters() if not torch.equal(p.detach(), saved[n].detach())]
    return {
        "mismatches": mismatches,
        "stored_bytes": sum(f.stat().st_size for f in Path(folder).iterdir() if f.suffix == ".distcp"),
        "param_bytes": sum(p.numel() * p.element_size() for p in ref.parameters()),
    }


def run_cp_spawn(
    rank: int,
    world_size: int,
    cases: list[CpCase],
    refusals: tuple[CpCase, dict[str, dict[str, Any]]] | None = None,
    checkpoint: tuple[CpCase, str] | None = None,
    training: list[Any] = (),
) -> dict[str, Any]:
    """Every case of ``cases`` (:func:`run_cp_cases`), then the refusals (key ``"refusals"``), a DCP round
    trip (``"checkpoint"``) and training steps composed with FSDP2 (:class:`tests.support.compose.TrainCase`,
    by name)."""
    from tests.support.compose import run_train_case
    from tests.support.models import case_mesh

    results: dict[str, Any] = run_cp_cases(rank, world_size, cases)
    if refusals is not None:
        results["refusals"] = run_cp_refusals(*refusals)
    if checkpoint is not None:
        results["checkpoint"] = run_cp_checkpoint(*checkpoint)
    made: dict = {}
    for case in training:
        results[case.name] = run_train_case(case, case_mesh(case.mesh, case.plan, world_size, made))
    return results


def run_cp_cases(rank: int, world_size: int, cases: list[CpCase]) -> dict[str, CpResult]:
    results = {}
    for case in cases:
        config = make_config(case.family, **case.config)
        mesh, ref, model = parallelized_pair(case.family, case.generated, case.plan, case.mesh, config)
        layouts = param_layouts(model, case.plan)
        result = CpResult({}, [], 0, [])
        seen: list[int] = []
        hooks = [layer.register_forward_hook(lambda m, a, out: seen.append(out.shape[1])) for layer in model.model.layers]
        ref.train()
        model.train()
        generator = torch.Generator().manual_seed(11)
        for n in case.lengths:
            ids = torch.randint(0, config.vocab_size, (2, n), generator=generator)
            _compare_step(case, ref, model, layouts, mesh, f"n={n}", result, input_ids=ids, labels=ids)
            if not result.local_tokens:
                result.local_tokens = list(seen)
        for hook in hooks:
            hook.remove()
        if case.padded:
            ids = torch.randint(0, config.vocab_size, (2, 11), generator=generator)
            mask = torch.ones(2, 11, dtype=torch.long)
            mask[0, :4] = 0
            labels = ids.masked_fill(mask == 0, -100)
            _compare_step(
                case, ref, model, layouts, mesh, "left-padded", result, input_ids=ids, attention_mask=mask, labels=labels
            )
        if case.packed:
            ids = torch.randint(0, config.vocab_size, (1, 15), generator=generator)
            positions = torch.tensor([[*range(6), *range(5), *range(4)]])
            _compare_step(case, ref, model, layouts, mesh, "packed", result, input_ids=ids, position_ids=positions, labels=ids)
        if case.mask4d:
            ids = torch.randint(0, config.vocab_size, (2, 10), generator=generator)
            mask = torch.ones(10, 10, dtype=torch.bool).tril()
            mask[6:, :3] = False  # the last queries do not see the first keys
            mask = mask[None, None].expand(2, 1, 10, 10)
            _compare_step(case, ref, model, layouts, mesh, "4-D mask", result, input_ids=ids, attention_mask=mask, labels=ids)
        if case.sharded_logits:
            from hpgen.runtime.context_logits import local_positions, shard_logits

            ids = torch.randint(0, config.vocab_size, (2, 13), generator=generator)
            shard_logits(model)
            positions = local_positions(model, 13)
            _compare_step(case, ref, model, layouts, mesh, "sharded logits", result, positions, input_ids=ids, labels=ids)
            shard_logits(model, False)
        if case.compiled:
            ids = torch.randint(0, config.vocab_size, (2, 13), generator=generator)

            def step(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                out = model(input_ids=ids, labels=ids)
                return out.loss, out.logits

            compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # a graph break would raise
            for m in (ref, model):
                m.zero_grad(set_to_none=True)
            expected = ref(input_ids=ids, labels=ids)
            expected.loss.backward()
            loss, logits = compiled(ids)
            loss.backward()
            torch._dynamo.reset()
            result.checks["compiled logits"] = ((expected.logits - logits).abs().max().item(), tolerance(expected.logits))
            reference = dict(ref.named_parameters())
            worst = max((p.grad - reference[n].grad).abs().max().item() for n, p in model.named_parameters())
            result.checks["compiled gradients"] = (worst, max(tolerance(p.grad) for p in reference.values()))
        if case.checkpointed:  # the layers rerun in backward, after the forward ended; the reference runs without
            for label, kwargs in (("checkpointed", None), ("checkpointed reentrant", {"use_reentrant": True})):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
                ids = torch.randint(0, config.vocab_size, (2, 13), generator=generator)
                _compare_step(case, ref, model, layouts, mesh, label, result, input_ids=ids, labels=ids)
                model.gradient_checkpointing_disable()
            attention = model.model.layers[0].self_attn  # called alone after those backwards: still refused
            cos = sin = torch.ones(2, 5, attention.head_dim)
            try:
                attention(torch.randn(2, 5, config.hidden_size), (cos, sin), None)
                refused = ""
            except RuntimeError as error:
                refused = str(error)
            missed = "no sequence was cut in this forward" not in refused
            result.checks["attention alone refused"] = (float(missed), 0.0)
        if case.generate:
            ref.eval()
            model.eval()
            prompt = torch.randint(0, config.vocab_size, (2, 9), generator=generator)
            kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                result.reference_tokens = ref.generate(prompt, **kwargs)[:, 9:].tolist()
                result.tokens = model.generate(prompt, **kwargs)[:, 9:].tolist()
        results[case.name] = result
    return results
