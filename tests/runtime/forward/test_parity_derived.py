"""Plans derived from the modeling source, on 2 gloo ranks against the unsharded transformers model.

Ten layouts the derivation must get right: GPT-2 (``Conv1D`` weights transposed, the
fused ``c_attn`` as three packed blocks, ``split_size`` divided), GPT-NeoX from its source
(``--from-source``: the per-head interleaved ``query_key_value`` as a plain shard), OPT
(attention as one block, ``fc1``/``fc2`` in the decoder layer as two wrapped linears), and
GPTBigCode with multi-query attention (the attention stays replicated, the MLP shards), and
two ALiBi models whose per-head bias is made outside the attention: MPT's ``[heads, 1, L]``
enters the attention block ``R -> S(0)``, BLOOM's batch-major ``[batch * heads, 1, L]`` is cut
by the region's local compute (:mod:`hpgen.runtime.forward.local_heads`), on a batch of 2; and xLSTM,
whose layers are classes under a module-level ``if``, and Fuyu, whose language model comes from
another modeling file (both read by the derivation, not rewritten: their feed-forwards shard as
wrapped leaves); DeepSeek-V3's multi-head latent attention (the low-rank down-projections
replicated in the block, the head-sized up-projections column-parallel) and Kimi Linear's KDA
mixer (its depthwise convolution over the concatenated q/k/v as packed blocks, per-head ``A_log``),
DiffLlama's differential attention, whose heads work in pairs across the two halves (a strided cut
of both halves; its two key/value heads replicated, or, with four, cut the same way), and
RecurrentGemma, whose recurrent block holds its per-channel state in a recurrence of the file
(the RG-LRU, per-head gates) and calls its depthwise ``nn.Conv1d`` as a module: besides the logits
and gradients, greedy generation with the cache (prefill, then decode steps that read the
convolution's weight directly and the channel states allocated at ``lru_width``) gives the
reference's tokens, from a 1-token and from a 5-token prompt; and Doge's dynamic-mask attention,
whose ``dt_proj`` reads every value head and writes one mask value per key/value head:
column-parallel over those outputs, its input gathered on entry (:mod:`hpgen.planner.derive.gathered`),
with a keep window shorter than the sequence so that the top-k over the keys runs on each rank's
heads (also with ``--sp``, and generated greedily through the cache, whose keys outgrow the window).
Each compares the logits and every parameter's gradient (this rank's slice) and checks the
sizing report of :mod:`hpgen.planner.entry.sizing_report` against the run: each rank's parameter bytes
counted from its real parameters, and the collectives counted as they are called (each
call of ``torch.distributed.all_reduce`` and of the single-tensor all-gather /
reduce-scatter the runtime uses) over a forward and a backward of one sequence.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.derived_configs import tiny
from tests.support.dist import run_distributed
from tests.support.spread import spread

FAMILIES = (
    "gpt2", "gpt_neox", "opt", "gpt_bigcode", "bloom", "mpt", "xlstm", "fuyu", "mamba", "zamba", "mamba2",
    "deepseek_v3", "kimi_linear", "diffllama", "diffllama_grouped", "recurrent_gemma", "doge",
    "gptj", "phi", "cohere", "stablelm", "falcon_nda", "falcon_mha", "codegen", "cohere2",
)  # fmt: skip
# families planned as `hpgen plan` does by default: transformers' plan, its blocks cross-checked against the
# source (Doge's attention replaced by the derived one, whose dt_proj gathers the values on entry)
TRANSFORMERS_PLAN = ("doge", "gptj", "phi", "cohere", "cohere2")
# families also planned with --sp (the sequence-sharded stream around the same blocks), as case "<family>_sp"
SP = ("doge", "gptj", "cohere", "gpt_neox", "falcon_mha", "codegen", "cohere2")  # the summed blocks: one norm for both branches (sums a + m + x, x + a + m), two norms
# parallel-residual blocks, planned with the summed reduction (one all-reduce a layer: the embedding's, then one
# per layer forward and one per layer backward: one norm for both branches, or two norms moved as a pair)
SUMMED = {
    "gptj": 1, "phi": 1, "cohere": 1, "stablelm": 1, "gpt_neox": 1, "falcon_nda": 1, "falcon_mha": 1, "codegen": 1,
    "cohere2": 1,
}  # fmt: skip
# in bfloat16, with and without the summed reduction ("<family>_two_bf16": two reductions a layer)
BF16 = ("gptj", "gpt_neox")
VARIANTS = {
    **{f"{family}_sp": (family, {"sp": True}) for family in SP},
    # CodeGen planned from transformers' plan too (the default of `hpgen plan`): mp_num and embed_dim left whole
    "codegen_tp_plan": ("codegen", {"from_source": False}),
    **{f"{family}_bf16": (family, {"dtype": "bfloat16"}) for family in BF16},
    **{f"{family}_two_bf16": (family, {"dtype": "bfloat16", "summed": False}) for family in BF16},
}
CASES = FAMILIES + tuple(VARIANTS)
# families also compared on greedy generation with the cache, by prompt length. RecurrentGemma keeps its states
# on the modules and allocates them afresh when the batch size changes: the 1-token prompt, right after the
# batch-of-2 forward, decodes from the zero states it allocates (the convolution's at ``self.hidden_size``)
# Doge's 5-token prompt already holds more keys than its keep window of 4
GENERATES = {"recurrent_gemma": (1, 5), "doge": (5,), **{family: (5,) for family in SUMMED}}
NEW_TOKENS = 4
SEED = 0
SHARE_LIMIT: dict[str, float] = {}  # every family here shards to at most 0.65 of the parameters per rank
BATCH, SEQ = 2, 7


def _family(case: str) -> str:
    return VARIANTS[case][0] if case in VARIANTS else case


def _options(case: str) -> dict[str, Any]:
    return VARIANTS[case][1] if case in VARIANTS else {}


def _plan_and_generated(case: str, directory: Path) -> tuple[dict, str]:
    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import meta_model, model_class_for
    from hpgen.planner.entry.make import plan_model

    family = _family(case)
    options = _options(case)
    from_source = options.get("from_source", family not in TRANSFORMERS_PLAN)
    plan = plan_model(
        meta_model(tiny(family)),
        tp=2,
        sp=options.get("sp", False),
        from_source=from_source,
        name=family,
        summed=options.get("summed", True),
    )
    source = Path(inspect.getsourcefile(model_class_for(tiny(family))) or "")
    text = lower(source.read_text(), plan_from_dict(plan), source_name=source.name, package=infer_package(source))
    path = directory / f"{case}_derived.py"
    path.write_text(text)
    return plan, str(path)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    directory = tmp_path_factory.mktemp("derived")
    prepared = spread(_prepared, [(case, str(directory)) for case in CASES], key=lambda item: _family(item[0]))
    cases = dict(zip(CASES, prepared, strict=True))
    return cases, run_distributed(_rank, cases, timeout=420)


def _prepared(item: tuple[str, str]) -> tuple[dict, str]:
    """:func:`_plan_and_generated` of (case, folder), on a process of :func:`tests.support.spread.spread`."""
    case, directory = item
    return _plan_and_generated(case, Path(directory))


def _rank(rank: int, world_size: int, cases: dict[str, tuple[dict, str]]) -> dict[str, dict]:
    """Every family on this rank: errors, gradient failures, real parameter bytes, counted collectives."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    counter = _CollectiveCounter()
    with counter.installed():
        return {case: _run(case, plan, generated, mesh, counter) for case, (plan, generated) in cases.items()}


class _CollectiveCounter:
    """Counts the process-group collectives as they are called, by phase: (calls, bytes of the tensor)."""

    def __init__(self) -> None:
        self.phase = "idle"
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def installed(self) -> Any:
        import torch.distributed as dist

        import hpgen.runtime.forward.collectives as collectives

        @contextlib.contextmanager
        def patch() -> Any:
            saved = (dist.all_reduce, collectives._all_gather_single, collectives._reduce_scatter_single)
            dist.all_reduce = self._wrap(dist.all_reduce, "all_reduce")
            collectives._all_gather_single = self._wrap(collectives._all_gather_single, "all_gather")
            collectives._reduce_scatter_single = self._wrap(collectives._reduce_scatter_single, "reduce_scatter")
            try:
                yield
            finally:
                dist.all_reduce, collectives._all_gather_single, collectives._reduce_scatter_single = saved

        return patch()

    def _wrap(self, function: Any, kind: str) -> Any:
        @functools.wraps(function)
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if self.phase != "idle":
                sizes = "size exchange" if str(tensor.dtype) == "torch.int64" else "data"
                self.calls[(self.phase, kind, sizes)] += 1
                self.bytes[(self.phase, kind, sizes)] += tensor.numel() * tensor.element_size()
            return function(tensor, *args, **kwargs)

        return counted


def _run(case: str, plan: dict, generated: str, mesh: Any, counter: _CollectiveCounter) -> dict:
    import torch

    from hpgen.planner.model.load import model_class_for
    from hpgen.runtime import parallelize
    from tests.support.models import expected_shard, import_file, param_layouts, perturb_, tolerance

    config = tiny(_family(case))
    cls = model_class_for(config)
    torch.manual_seed(SEED)
    reference = cls(config)
    perturb_(reference, SEED)
    reference.eval()
    model = getattr(import_file(generated), cls.__name__)(config)
    model.load_state_dict(reference.state_dict())
    model.eval()
    parallelize(model, plan, mesh)
    if _options(case).get("dtype") == "bfloat16":
        return _bf16_error(model, reference, config)
    rank_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    generator = torch.Generator().manual_seed(SEED + 1)
    # the collectives of one sequence (a learned-position table moves once per position, so with
    # one sequence per token), forward and backward; its gradients are then cleared
    ids = torch.randint(0, config.get_text_config().vocab_size, (1, SEQ), generator=generator)
    counter.calls.clear()
    counter.bytes.clear()
    counter.phase = "forward"
    with _layer_norms() as norms:
        logits = model(input_ids=ids).logits
    counter.phase = "backward"
    logits.sum().backward()
    counter.phase = "idle"
    counted = {"calls": dict(counter.calls), "bytes": dict(counter.bytes)}
    model.zero_grad(set_to_none=True)
    with torch.no_grad(), _layer_norms() as no_grad_norms:
        model(input_ids=ids)
    with torch.no_grad(), _layer_norms() as reference_norms:
        reference(input_ids=ids)
    counted["layer_norms"] = {"forward": norms[0], "no_grad": no_grad_norms[0], "reference": reference_norms[0]}

    ids = torch.randint(0, config.get_text_config().vocab_size, (BATCH, SEQ), generator=generator)
    ref_logits = reference(input_ids=ids).logits
    logits = model(input_ids=ids).logits
    projection = torch.randn(ref_logits.shape, generator=generator)
    (ref_logits * projection).sum().backward()
    (logits * projection).sum().backward()

    rank, size = mesh.get_local_rank(), mesh.size()
    layouts = param_layouts(reference, plan)
    failures = []
    mine = dict(model.named_parameters())
    for name, ref_param in reference.named_parameters():
        if ref_param.grad is None:
            continue
        param = mine[name]
        if param.grad is None:
            failures.append(f"{name}: no gradient")
            continue
        want = expected_shard(ref_param.grad, layouts.get(name, {}).get("tp", "R"), rank, size)
        err, tol = (param.grad - want).abs().max().item(), tolerance(ref_param.grad)
        if name.endswith(".bias") and f"{name[:-4]}weight" in mine:  # a key bias: zero but for rounding
            tol = max(tol, tolerance(dict(reference.named_parameters())[f"{name[:-4]}weight"].grad))
        if not err <= tol:
            failures.append(f"{name}: {err:.3g} > {tol:.3g}")
    generated = {
        length: _greedy(model, reference, ids[:1, :length]) for length in GENERATES.get(case, ())
    }
    return {
        "generated": generated,
        "logits_err": (logits - ref_logits).abs().max().item(),
        "logits_tol": tolerance(ref_logits),
        "failures": failures,
        "rank_bytes": rank_bytes,
        "full_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
        **counted,
    }


@contextlib.contextmanager
def _layer_norms() -> Iterator[list[int]]:
    """Counts the calls of ``F.layer_norm`` (every ``nn.LayerNorm`` forward) inside the block."""
    import torch.nn.functional as F

    count, original = [0], F.layer_norm

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    F.layer_norm = counted
    try:
        yield count
    finally:
        F.layer_norm = original


def _bf16_error(model: Any, reference: Any, config: Any) -> dict:
    """How far the parallel model's bfloat16 logits are from the float32 unsharded model's."""
    import torch

    generator = torch.Generator().manual_seed(SEED + 2)
    ids = torch.randint(0, config.get_text_config().vocab_size, (BATCH, SEQ), generator=generator)
    with torch.no_grad():
        exact = reference(input_ids=ids).logits
        logits = model.to(torch.bfloat16)(input_ids=ids).logits.float()
    return {"bf16_err": (logits - exact).abs().max().item()}


def _greedy(model: Any, reference: Any, prompt: Any) -> dict:
    """Greedy tokens and per-step logits of both models with the cache (``use_cache=True``)."""
    import torch

    options = dict(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    with torch.no_grad():
        mine, ref = model.generate(prompt, **options), reference.generate(prompt, **options)
    from tests.support.models import tolerance

    ref_scores = torch.stack(ref.logits)
    return {
        "tokens": mine.sequences.tolist(),
        "reference_tokens": ref.sequences.tolist(),
        "scores_err": (torch.stack(mine.logits) - ref_scores).abs().max().item(),
        "scores_tol": tolerance(ref_scores),
    }


@pytest.mark.parametrize("family", sorted(GENERATES))
def test_greedy_generation_with_the_cache_matches(results: tuple[dict, list[dict]], family: str) -> None:
    _, ranks = results
    for rank, by_family in enumerate(ranks):
        for length, got in by_family[family]["generated"].items():
            assert got["tokens"] == got["reference_tokens"], (rank, length)
            assert len(got["tokens"][0]) == length + NEW_TOKENS, (rank, length)
            assert got["scores_err"] <= got["scores_tol"], (rank, length, got["scores_err"])


@pytest.mark.parametrize("family", [case for case in CASES if "dtype" not in _options(case)])
def test_logits_and_every_gradient_match(results: tuple[dict, list[dict]], family: str) -> None:
    _, ranks = results
    for rank, by_family in enumerate(ranks):
        result = by_family[family]
        assert result["logits_err"] <= result["logits_tol"], f"rank {rank}: {result['logits_err']}"
        assert not result["failures"], f"rank {rank}: " + "; ".join(result["failures"][:5])


# Fuyu's parameters are mostly its vision patch projection (replicated, never run by the text-only
# causal LM): its language model's MLP shards, but no rank gets under 0.65 of the whole model.
@pytest.mark.parametrize("family", [f for f in CASES if f != "fuyu" and "dtype" not in _options(f)])
def test_each_rank_holds_at_most_two_thirds_of_the_parameters(results: tuple[dict, list[dict]], family: str) -> None:
    _, ranks = results
    share = max(by_family[family]["rank_bytes"] for by_family in ranks) / ranks[0][family]["full_bytes"]
    assert share <= SHARE_LIMIT.get(family, 0.65), share


# MPT's position_bias is split R -> S(0) into the attention; the report counts that split's backward
# all-gather, which never runs (the bias has no gradient), so its counts are one gather high there.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "mpt"])
def test_the_sizing_report_matches_the_run(results: tuple[dict, list[dict]], family: str) -> None:
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.sizing_report import size_report

    cases, ranks = results
    report = size_report(meta_model(tiny(family)), cases[family][0], tp=2, dtype="float32")
    tokens = SEQ  # the counted run is one sequence
    for rank, by_family in enumerate(ranks):
        result = by_family[family]
        assert result["rank_bytes"] == report.rank_bytes[rank]  # memory: the real parameters
        calls, sizes = result["calls"], result["bytes"]
        for phase in ("forward", "backward"):
            expected = report.totals(phase)
            extra = report.grad_reduce_count if phase == "backward" else 0
            reduce_calls, reduce_bytes, _ = expected.get("all_reduce", (0, 0, 0.0))
            assert calls.get((phase, "all_reduce", "data"), 0) == reduce_calls + extra, (phase, calls)
            assert sizes.get((phase, "all_reduce", "data"), 0) == reduce_bytes * tokens + (
                report.grad_reduce_bytes if phase == "backward" else 0
            )
            gather_calls, gather_bytes, _ = expected.get("all_gather", (0, 0, 0.0))
            assert calls.get((phase, "all_gather", "data"), 0) == gather_calls, (phase, calls)
            assert (phase, "all_gather", "size exchange") not in calls  # the wrapped lm_head knows its sizes
            # an uneven shard is padded to the largest: at most one element per rank and token more
            moved = sizes.get((phase, "all_gather", "data"), 0)
            assert gather_bytes * tokens <= moved <= gather_bytes * tokens + 2 * tokens * report.element_size


LAYERS = 2  # every tiny config's


@pytest.mark.parametrize("family", sorted(SUMMED))
def test_a_parallel_residual_block_reduces_once_a_layer(results: tuple[dict, list[dict]], family: str) -> None:
    """Counted on the run: the embedding's all-reduce, then one per layer; backward the lm_head input's, then one
    per layer (both branches' shared norm) or two (GPT-NeoX: one per norm). With --sp one reduce-scatter a layer."""
    _, ranks = results
    for by_family in ranks:
        calls = by_family[family]["calls"]
        assert calls[("forward", "all_reduce", "data")] == 1 + LAYERS, calls
        assert calls[("backward", "all_reduce", "data")] == 1 + SUMMED[family] * LAYERS, calls
        if f"{family}_sp" in by_family:
            sp = by_family[f"{family}_sp"]["calls"]
            assert sp[("forward", "reduce_scatter", "data")] == LAYERS, sp
            assert sp[("backward", "reduce_scatter", "data")] == SUMMED[family] * LAYERS, sp


# Cohere's norms are their own classes (CohereLayerNorm, Cohere2LayerNorm), not F.layer_norm: nothing to count
@pytest.mark.parametrize("family", sorted(set(SUMMED) - {"cohere", "cohere2"}))
def test_a_summed_block_runs_each_norm_once(results: tuple[dict, list[dict]], family: str) -> None:
    """As many norm forwards as the unsharded model: two norms moved as a pair compute the second one once (with a
    gradient), and without a gradient nothing is paired."""
    _, ranks = results
    for by_family in ranks:
        norms = by_family[family]["layer_norms"]
        assert norms["reference"] > 0
        assert norms["forward"] == norms["no_grad"] == norms["reference"], norms


@pytest.mark.parametrize("family", BF16)
def test_one_reduction_is_no_further_from_the_float32_model_in_bfloat16(results: tuple[dict, list[dict]], family: str) -> None:
    _, ranks = results
    for by_family in ranks:
        summed, two = by_family[f"{family}_bf16"]["bf16_err"], by_family[f"{family}_two_bf16"]["bf16_err"]
        assert summed <= two, (summed, two)
