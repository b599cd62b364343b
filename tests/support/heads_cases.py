"""Hand-written ``hpgen.plan/2`` plans that cut whole heads, and a rank body that checks one against the unsharded model.

Each plan is what docs/plan-format.md documents for its shape: query heads cut in whole
units (``S(0,head_dim)``), in groups beside their replicated key/value head
(``S(0,head_dim,g)`` with ``RS(0,r)``), and multi-query Falcon's fused ``query_key_value``
as blocks (``B(0, heads:S(0,head_dim), key:R, value:R)``) with one reduction a layer.
:func:`run_case` builds the transformers model (transformers' defaults: sdpa attention),
the generated one with the same perturbed weights, parallelizes it, and measures logits,
every gradient (this rank's slice of the reference's), greedy generation with the cache,
and the all-reduces of one forward and backward (counted as ``torch.distributed.all_reduce``
is called).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from tests.support.models import import_file, load_plan_dict, param_layouts, perturb_, tolerance

SEED = 0
BATCH, SEQ, NEW_TOKENS = 2, 7, 8


def llama_config(heads: int, kv_heads: int, family: str = "llama") -> Any:
    """A tiny Llama (or Qwen2, with its q/k/v biases) of ``heads`` query heads of 8, ``kv_heads`` key/value
    heads (transformers wants the hidden size a multiple of the heads: ``8 * heads``)."""
    from tests.support.models import make_config

    return make_config(family, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, hidden_size=8 * heads)


def falcon_config(heads: int) -> Any:
    """Multi-query Falcon as transformers' FalconConfig defaults it (Falcon-7B's architecture: one key/value
    head, parallel attention and MLP on one norm, rotary), tiny: ``heads`` heads of 8."""
    import transformers

    return transformers.FalconConfig(
        hidden_size=8 * heads, num_attention_heads=heads, num_hidden_layers=2, vocab_size=127, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip


def bigcode_config(heads: int) -> Any:
    """Multi-query GPTBigCode (StarCoder's architecture), tiny: ``heads`` heads of 8, biases everywhere."""
    import transformers

    return transformers.GPTBigCodeConfig(
        n_embd=8 * heads, n_head=heads, n_layer=2, vocab_size=127, n_positions=64, multi_query=True, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip


def bigcode_plan(config: Any) -> dict[str, Any]:
    """``hpgen.plan/2`` for multi-query GPTBigCode at tp 2: ``c_attn`` (weight and bias) as blocks of the query
    heads cut whole and the one key and value head replicated; the attention splits its output by
    ``embed_dim`` and ``kv_dim``, so ``embed_dim`` is this rank's query features (``local_attrs``)."""
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    plan = plan_model(meta_model(config), tp=2, name="gpt_bigcode")
    plan.pop("comments", None)
    plan["format"] = "hpgen.plan/2"
    head_dim = config.n_embd // config.n_head
    blocks = f"B(0, {config.n_embd}:S(0,{head_dim}), {head_dim}:R, {head_dim}:R)"
    query = {"of": "c_attn.weight", "dim": 0, "block": 0}
    plan["param_plan"]["transformer.h.*.attn"] = {
        "in_src": {"hidden_states": {"tp": "R"}},
        "in_dst": {"hidden_states": {"tp": "R"}},
        "out_names": ["attn_output", "attn_weights"],
        "out_src": {"attn_output": {"tp": "P(sum)"}},
        "out_dst": {"attn_output": {"tp": "R"}},
        "params": {
            "c_attn.weight": {"tp": blocks},
            "c_attn.bias": {"tp": blocks},
            "c_proj.weight": {"tp": f"S(1,{head_dim})"},
            "c_proj.bias": {"tp": "R"},
        },
        "deferred_bias_params": ["c_proj.bias"],
        "local_attrs": {
            "embed_dim": query,
            "num_heads": {**query, "unit": head_dim},
            "num_key_value_groups": {**query, "unit": head_dim},
        },
    }
    return plan


def attention_plan(config: Any, tp: int) -> dict[str, Any]:
    """``hpgen.plan/2`` for a Llama-shaped attention at ``tp``: whole heads, grouped beside replicated
    key/value heads where those are fewer than the ranks."""
    heads, kv, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    plan = load_plan_dict("llama_tp")
    plan["format"] = "hpgen.plan/2"
    plan["model_class"] = type(config).__name__.replace("Config", "ForCausalLM")
    attn = plan["param_plan"]["model.layers.*.self_attn"]
    if kv >= tp:
        query, key = f"S(0,{head_dim})", f"S(0,{head_dim})"
        out = f"S(1,{head_dim})"
    else:
        query, key, out = f"S(0,{head_dim},{kv})", f"RS(0,{tp // kv})", f"S(1,{head_dim},{kv})"
        attn["local_attrs"] = {
            "num_key_value_groups": {"of": "q_proj.weight", "dim": 0, "per": {"of": "k_proj.weight", "dim": 0}}
        }
    params = {"q_proj": query, "k_proj": key, "v_proj": key}
    attn["params"] = {f"{name}.weight": {"tp": p} for name, p in params.items()} | {"o_proj.weight": {"tp": out}}
    if getattr(config, "attention_bias", False) or type(config).__name__ == "Qwen2Config":
        attn["params"] |= {f"{name}.bias": {"tp": p} for name, p in params.items()}
    return plan


def falcon_plan(config: Any) -> dict[str, Any]:
    """``hpgen.plan/2`` for multi-query Falcon at tp 2: the query heads cut whole, the one key and value head
    replicated (blocks of ``query_key_value``), attention and MLP reduced once a layer."""
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    replicated = {"in_src": {"hidden_states": {"tp": "R"}}, "in_dst": {"hidden_states": {"tp": "R"}}}
    partial = {"out_src": {"attn_output": {"tp": "P(sum)"}}, "out_dst": {"attn_output": {"tp": "P(sum)"}}}
    return {
        "format": "hpgen.plan/2",
        "model_class": "FalconForCausalLM",
        "mesh_dim_names": ["tp"],
        "boundary_classes": {"transformer.h.*.self_attention": "FalconAttention"},
        "param_plan": {
            "transformer.word_embeddings": {
                "out_src": {"output": {"tp": "P(sum)"}},
                "out_dst": {"output": {"tp": "R"}},
                "params": {"weight": {"tp": "S(0)"}},
            },
            "lm_head": {
                "in_src": {"input": {"tp": "R"}},
                "in_dst": {"input": {"tp": "R"}},
                "out_src": {"output": {"tp": "S(-1)"}},
                "out_dst": {"output": {"tp": "R"}},
                "params": {"weight": {"tp": "S(0)"}},
            },
            "transformer.h.*": {
                "summed_reduction": {"branches": ["mlp", "self_attention"], "shared_input": "input_layernorm"}
            },
            "transformer.h.*.mlp": {
                "in_src": {"x": {"tp": "R"}},
                "in_dst": {"x": {"tp": "R"}},
                "in_grad_partial": ["x"],
                "out_src": {"output": {"tp": "P(sum)"}},
                "out_dst": {"output": {"tp": "P(sum)"}},
                "params": {"dense_h_to_4h.weight": {"tp": "S(0)"}, "dense_4h_to_h.weight": {"tp": "S(1)"}},
            },
            "transformer.h.*.self_attention": {
                **replicated,
                "in_grad_partial": ["hidden_states"],
                "out_names": ["attn_output", "output_1"],
                **partial,
                "params": {
                    "query_key_value.weight": {"tp": f"B(0, {heads * head_dim}:S(0,{head_dim}), {head_dim}:R, {head_dim}:R)"},
                    "dense.weight": {"tp": f"S(1,{head_dim})"},
                },
                "local_attrs": _falcon_query_counts(head_dim),
            },
        },
    }


def _falcon_query_counts(head_dim: int) -> dict[str, Any]:
    """The per-rank counts of multi-query Falcon's attention: its query heads, and (transformers 5.25's
    attention interface) ``num_key_value_groups``, the queries per key/value head, which with one key/value
    head equals the query heads a rank holds."""
    import inspect

    from transformers.models.falcon import modeling_falcon

    query = {"of": "query_key_value.weight", "dim": 0, "block": 0, "unit": head_dim}
    counts = {"num_heads": query}
    if "self.num_key_value_groups" in inspect.getsource(modeling_falcon.FalconAttention.__init__):
        counts["num_key_value_groups"] = query
    return counts


def lowered(config: Any, plan: dict[str, Any], path: str) -> str:
    """Lower the config's installed modeling file under ``plan`` into ``path``."""
    import inspect
    from pathlib import Path

    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import model_class_for

    source = Path(inspect.getsourcefile(model_class_for(config)) or "")
    text = lower(source.read_text(), plan_from_dict(copy.deepcopy(plan)), source_name=source.name, package=infer_package(source))
    Path(path).write_text(text)
    return path


# --------------------------------------------------------------------------- on ranks


class AllReduceCounter:
    """Counts ``torch.distributed.all_reduce`` calls by phase while installed."""

    def __init__(self) -> None:
        self.phase = "idle"
        self.calls: Counter = Counter()

    @contextlib.contextmanager
    def installed(self) -> Iterator[AllReduceCounter]:
        import torch.distributed as dist

        original = dist.all_reduce

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.phase != "idle":
                self.calls[self.phase] += 1
            return original(*args, **kwargs)

        dist.all_reduce = counted
        try:
            yield self
        finally:
            dist.all_reduce = original


def reference_of(config: Any) -> torch.nn.Module:
    """The unsharded transformers model of ``config``, its weights perturbed from :data:`SEED`, in eval mode."""
    from hpgen.planner.model.load import model_class_for

    torch.manual_seed(SEED)
    reference = model_class_for(config)(config)
    perturb_(reference, SEED)
    return reference.eval()


def reference_and_model(config: Any, generated: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The unsharded transformers model (perturbed weights, eval) and the generated model holding them."""
    reference = reference_of(config)
    model = getattr(import_file(generated), type(reference).__name__)(config)
    model.load_state_dict(reference.state_dict())
    return reference, model.eval()


def compare(model: torch.nn.Module, reference: torch.nn.Module, plan: dict[str, Any], mesh: Any, counter: AllReduceCounter) -> dict[str, Any]:
    """Logits, every gradient, greedy tokens and the all-reduces of one forward and backward, against ``reference``."""
    from tests.support.models import expected_local

    config = reference.config
    generator = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    ref_logits = reference(input_ids=ids).logits
    counter.calls.clear()
    counter.phase = "forward"
    logits = model(input_ids=ids).logits
    projection = torch.randn(ref_logits.shape, generator=generator)
    counter.phase = "backward"
    (logits * projection).sum().backward()
    counter.phase = "idle"
    (ref_logits * projection).sum().backward()

    layouts = param_layouts(reference, plan)
    failures, exact, total = [], 0, 0
    mine = dict(model.named_parameters())
    for name, ref_param in reference.named_parameters():
        if ref_param.grad is None:
            continue
        total += 1
        grad = mine[name].grad
        want = expected_local(ref_param.grad, layouts.get(name, {}), plan["mesh_dim_names"], mesh)
        if grad is None or grad.shape != want.shape:
            failures.append(f"{name}: gradient {None if grad is None else tuple(grad.shape)}, slice {tuple(want.shape)}")
            continue
        err, tol = (grad - want).abs().max().item(), tolerance(ref_param.grad)
        if err <= tol:
            exact += 1
        else:
            failures.append(f"{name}: {err:.3g} > {tol:.3g}")
    options = dict(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    with torch.no_grad():
        mine_out, ref_out = model.generate(ids[:1], **options), reference.generate(ids[:1], **options)
    ref_scores = torch.stack(ref_out.logits)
    return {
        "logits_err": (logits - ref_logits).abs().max().item(),
        "logits_tol": tolerance(ref_logits),
        "failures": failures,
        "grads_exact": exact,
        "grads_total": total,
        "tokens": mine_out.sequences[:, SEQ:].tolist(),
        "reference_tokens": ref_out.sequences[:, SEQ:].tolist(),
        "scores_err": (torch.stack(mine_out.logits) - ref_scores).abs().max().item(),
        "scores_tol": tolerance(ref_scores),
        "all_reduces": dict(counter.calls),
        "rank_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "shapes": {n: tuple(p.shape) for n, p in model.named_parameters() if ".0." in n},
        "full_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
    }


def run_cases(rank: int, world_size: int, cases: dict[str, tuple[Any, dict[str, Any], str]]) -> dict[str, dict[str, Any]]:
    """Rank body for ``run_distributed``: each case (config, plan, generated file) on a 1-D ``tp`` mesh of all ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    counter = AllReduceCounter()
    found = {}
    with counter.installed():
        for name, (config, plan, generated) in cases.items():
            reference, model = reference_and_model(config, generated)
            parallelize(model, plan, mesh)
            found[name] = compare(model, reference, plan, mesh, counter)
    return found


def check(results: list[dict[str, dict[str, Any]]], name: str) -> None:
    """Logits, every gradient and the greedy tokens of ``name`` match on every rank."""
    for rank, by_case in enumerate(results):
        got = by_case[name]
        assert got["logits_err"] <= got["logits_tol"], f"rank {rank}: logits {got['logits_err']} > {got['logits_tol']}"
        assert not got["failures"] and got["grads_exact"] == got["grads_total"] > 0, f"rank {rank}: {got['failures']}"
        assert got["tokens"] == got["reference_tokens"], f"rank {rank}"
        assert got["scores_err"] <= got["scores_tol"], f"rank {rank}: {got['scores_err']}"
        assert got["rank_bytes"] < got["full_bytes"]
