"""Data-parallel attention with expert-parallel experts (Qwen3-MoE), against the unsharded model.

The decoder stack runs on each rank's sequences; the experts, sharded over the same axis,
gather every rank's tokens (the router's flattened ``[tokens, hidden]``), and the scatter
after them returns each rank its own. Two ways to feed it, each checked on 2 and 4 gloo
ranks in one spawn per world size:

- *global*: one batch on every rank (training, offline inference), split at the model's
  entry (3 -> 2/1, 6 -> 2/2/1/1, 3 -> 1/1/1/0 on 4 ranks: a rank with no sequence runs a
  placeholder); logits, every gradient, greedy generation with one and two prompts;
- *serving*: each rank its own requests, of its own batch and length; each rank's logits
  and greedy tokens equal the unsharded model's on its own requests, and a step where one
  rank has none; and a step whose token counts the serving code gives
  (``give_shard_sizes``), which exchanges nothing;
- on 4 ranks also a 2 x 2 mesh: attention tensor-parallel over ``tp`` inside each
  data-parallel group of ``ep`` (gradient sums named per axis), global batch.

In every way, each model forward exchanges shard sizes (one all-gather of an int64 per
rank, a host synchronisation on GPUs) at most once: the experts' routing ids and weights
take the sizes their tokens' gather found, and each later layer's tokens take those the
layer before scattered back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import (
    expected_local,
    generated_model,
    import_file,
    lower_family,
    make_config,
    param_layouts,
    reference_model,
    tolerance,
)

FAMILY = "qwen3_moe"


def dp_attention_plan(mode: str) -> dict[str, Any]:
    """What ``hpgen plan --ep 2 --attn-dp`` writes for the tiny config (``mode`` ``global``), or that
    plan made to serve (``serving``): each rank's own batch is its shard, given back as it is."""
    from hpgen.planner.passes.data_parallel_attention import data_parallel_attention
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    model = meta_model(make_config(FAMILY))
    plan = data_parallel_attention(model, plan_model(model, ep=2), FAMILY)
    if mode == "serving":
        entry = plan["param_plan"]["model"]
        entry["in_src"] = dict(entry["in_dst"])
        entry["out_dst"] = dict(entry["out_src"])
    return plan


def attention_tp_plan() -> dict[str, Any]:
    """What ``hpgen plan --ep 2 --tp 2 --attn-dp`` writes, on a 2 x 2 mesh: the ``--attn-dp`` plan over
    ``ep``, with ``hpgen plan --tp 2``'s attention entry on ``tp`` (heads split inside each data-parallel
    group). The layers' gradient sums name ``ep`` alone, so ``q_proj`` (rows sharded on ``tp``) is summed
    over ``ep`` only, and ``q_norm`` over both."""
    from hpgen.planner.passes.data_parallel_attention import data_parallel_attention
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    model = meta_model(make_config(FAMILY))
    plan = data_parallel_attention(model, plan_model(model, ep=2), FAMILY, plan_model(model, tp=2))
    assert plan["mesh_dim_names"] == ["ep", "tp"] and "model.layers.*.self_attn" in plan["param_plan"]
    return plan


def _build(path: str, plan: dict, world_size: int, check_inputs: Any) -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize

    config = make_config(FAMILY)
    reference = reference_model(FAMILY, config, 0)
    model = generated_model(import_file(path), FAMILY, config, reference)
    if plan["mesh_dim_names"] == ["ep", "tp"]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    parallelize(model, plan, mesh, check_inputs=check_inputs)
    return model, reference, mesh


GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


@contextlib.contextmanager
def counted_exchanges(model: Any) -> Iterator[list[int]]:
    """Inside: the size exchanges each forward of ``model`` makes, one count a forward, counted on
    the axes' own exchange (every gather that finds no sizes makes one there)."""
    from hpgen.runtime.forward.collectives import AxisCollectives

    counts: list[int] = []
    exchange = AxisCollectives._exchange_sizes

    def counting(self: AxisCollectives, n: Any, device: Any) -> Any:
        counts[-1] += 1
        return exchange(self, n, device)

    hook = model.register_forward_pre_hook(lambda module, args: counts.append(0))
    AxisCollectives._exchange_sizes = counting  # this spawned process only
    try:
        yield counts
    finally:
        AxisCollectives._exchange_sizes = exchange
        hook.remove()


def _global(rank: int, world_size: int, path: str, plan: dict) -> dict[str, Any]:
    """Logits and every gradient for each batch size; greedy tokens for one and two prompts."""
    model, reference, mesh = _build(path, plan, world_size, True)
    layouts = param_layouts(reference, plan)
    found: dict[str, Any] = {}
    for batch in (3, 6) if world_size == 4 else (3,):
        generator = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, 127, (batch, 5), generator=generator)
        model.zero_grad()
        reference.zero_grad()
        with counted_exchanges(model) as exchanges:
            ref_logits, logits = reference(ids).logits, model(ids).logits
            projection = torch.randn(ref_logits.shape, generator=generator)
            (ref_logits * projection).sum().backward()
            (logits * projection).sum().backward()
        found[f"exchanges, batch {batch}"] = exchanges
        mine = dict(model.named_parameters())
        bad, checked = [], 0
        for name, ref_param in reference.named_parameters():
            want = expected_local(ref_param.grad, layouts.get(name, {}), plan["mesh_dim_names"], mesh)
            grad = mine[name].grad
            checked += 1
            if grad is None or grad.shape != want.shape or not (grad - want).abs().max() <= tolerance(ref_param.grad):
                bad.append(name)
        found[f"batch {batch}"] = (
            (logits - ref_logits).abs().max().item() <= tolerance(ref_logits),
            checked,
            bad,
        )
    with torch.no_grad():
        for prompts in (1, 2):
            ids = torch.randint(0, 127, (prompts, 4), generator=torch.Generator().manual_seed(prompts))
            with counted_exchanges(model) as exchanges:
                tokens = model.generate(ids, **GREEDY)
            found[f"generate {prompts}"] = torch.equal(tokens, reference.generate(ids, **GREEDY))
            found[f"exchanges, generate {prompts}"] = exchanges
    return found


# each rank's own requests: (batch, length) by rank; rank 1 has one request of 3 tokens
SERVING = [(2, 6), (1, 3), (1, 5), (3, 2)]


def _serving(rank: int, world_size: int, path: str, plan: dict) -> dict[str, Any]:
    model, reference, _ = _build(path, plan, world_size, False)
    ids = torch.randint(0, 127, SERVING[rank], generator=torch.Generator().manual_seed(rank))
    found: dict[str, Any] = {}
    with torch.no_grad(), counted_exchanges(model) as exchanges:
        ref_logits = reference(ids).logits
        found["logits"] = (model(ids).logits - ref_logits).abs().max().item() <= tolerance(ref_logits)
        found["generate"] = torch.equal(model.generate(ids, **GREEDY), reference.generate(ids, **GREEDY))
        # a step in which rank 1 has no request: it still joins every layer's expert collectives
        step = ids[:0] if rank == 1 else ids
        logits = model(step).logits
        if rank == 1:
            found["empty step"] = tuple(logits.shape) == (0, ids.shape[1], 127)
        else:
            found["empty step"] = (logits - ref_logits).abs().max().item() <= tolerance(ref_logits)
    found["exchanges"] = exchanges
    # serving code that knows every rank's token count gives it: that forward exchanges nothing
    from hpgen.runtime import give_shard_sizes

    give_shard_sizes(model, "ep", [batch * length for batch, length in SERVING[:world_size]])
    with torch.no_grad(), counted_exchanges(model) as given:
        logits = model(ids).logits
    found["given counts"] = ((logits - ref_logits).abs().max().item() <= tolerance(ref_logits), given)
    return found


def _ranks(rank: int, world_size: int, paths: dict[str, str], plans: dict[str, dict]) -> dict[str, Any]:
    found = {
        "global": _global(rank, world_size, paths["global"], plans["global"]),
        "serving": _serving(rank, world_size, paths["serving"], plans["serving"]),
    }
    if world_size == 4:
        found["attention tp"] = _global(rank, world_size, paths["attention tp"], plans["attention tp"])
    return found


@pytest.fixture(scope="module")
def lowered(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, dict]]:
    directory = tmp_path_factory.mktemp("dp_attention")
    plans = {mode: dp_attention_plan(mode) for mode in ("global", "serving")}
    plans["attention tp"] = attention_tp_plan()
    paths = {}
    for mode, plan in plans.items():
        (directory / mode).mkdir()  # a directory each: the files are named by family and plan kind
        paths[mode] = str(lower_family(FAMILY, plan, Path(directory / mode)))
    return paths, plans


@pytest.fixture(scope="module")
def runs(lowered) -> dict[int, list[dict[str, Any]]]:
    """World size -> each rank's findings (one spawn per world size)."""
    paths, plans = lowered
    return {n: run_distributed(_ranks, paths, plans, world_size=n, timeout=300) for n in (2, 4)}


def _check_global(found: dict[str, Any], where: str) -> None:
    for case, value in found.items():
        if case.startswith("exchanges"):
            _check_exchanges(value, f"{where} {case}")
        elif case.startswith("batch"):
            exact, checked, bad = value
            assert exact and checked == 25 and not bad, f"{where} {case}: logits exact {exact}, wrong {bad}"
        else:
            assert value, f"{where}: {case} tokens differ"


def _check_exchanges(per_forward: list[int], where: str) -> None:
    """No forward exchanged its shard sizes more than once (the first layer's tokens; the tiny
    model has two MoE layers, whose three gathers each exchanged before the sizes were shared)."""
    assert per_forward and max(per_forward) <= 1, f"{where}: size exchanges per forward {per_forward}"


def test_global_batch_logits_gradients_and_generation(runs):
    for world_size, results in runs.items():
        for rank, found in enumerate(results):
            _check_global(found["global"], f"{world_size} ranks, rank {rank}")


def test_attention_tensor_parallel_inside_each_data_parallel_group(runs):
    for rank, found in enumerate(runs[4]):
        _check_global(found["attention tp"], f"2 x 2 mesh, rank {rank}")


def test_serving_each_rank_its_own_requests(runs):
    for world_size, results in runs.items():
        for rank, found in enumerate(results):
            serving = dict(found["serving"])
            _check_exchanges(serving.pop("exchanges"), f"{world_size} ranks, rank {rank}, serving")
            assert serving.pop("given counts") == (True, [0]), f"{world_size} ranks, rank {rank}: counts given"
            assert serving == {"logits": True, "generate": True, "empty step": True}, f"{world_size} ranks, rank {rank}"
