"""``parallelize`` refuses what cannot work, names the problem, and changes nothing.

Every scenario runs on 2 real gloo ranks (one spawn for all): build a model from a
generated file, try to install a plan that does not fit it, and report the error and
whether the model is exactly as before (same Parameter objects, values and shapes, same
classes, no bound attributes, no hooks).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.models import (
    generated_model,
    import_file,
    load_plan_dict,
    lower_family,
    make_config,
    reference_model,
)
from tests.support.untouched import snapshot, untouched


def _with(plan: dict[str, Any], key: str, **changes: Any) -> dict[str, Any]:
    plan = copy.deepcopy(plan)
    plan["param_plan"].setdefault(key, {}).update(changes)
    return plan


def _kv(attention: dict[str, Any], placement: str) -> dict[str, Any]:
    return {name: {"tp": placement} for name in attention["params"] if name[0] in "kv"}


def _scenarios() -> dict[str, tuple[str, str, dict[str, Any], dict[str, Any], list[str]]]:
    """name -> (family, generated-file plan, plan given to parallelize, config, expected message parts)."""
    tp = load_plan_dict("llama_tp")
    attn = tp["param_plan"]["model.layers.*.self_attn"]
    vocab = load_plan_dict("llama_tp_vocab")
    bias = load_plan_dict("llama_bias")
    for entry in bias["param_plan"].values():
        del entry["deferred_bias_params"]
    renamed = load_plan_dict("llama_tp")
    renamed["mesh_dim_names"] = ["ep"]
    for entry in renamed["param_plan"].values():
        for part in ("in_src", "in_dst", "out_src", "out_dst", "params"):
            entry[part] = {name: {"ep": layout["tp"]} for name, layout in entry[part].items()}
    return {
        "kv_heads": (
            "llama",
            "llama_tp",
            tp,
            {"num_key_value_heads": 1},
            [
                "model.layers.0.self_attn",
                "k_proj.weight",
                "1 key/value heads",
                "head_dim 16",
                "axis 'tp' of size 2",
                "a rank would hold part of a head. Plan it RS(0,2): each head whole on 2 ranks",
            ],
        ),
        "kv_heads_replicated_too_few": (
            "llama",
            "llama_tp",
            _with(tp, "model.layers.*.self_attn", params={**attn["params"], **_kv(attn, "RS(0,1)")}),
            {"num_key_value_heads": 1},
            ["k_proj.weight", "RS(0,1) on axis 'tp' of size 2: dim 0 holds 1 key/value heads", "which its 2 chunks do not divide"],
        ),
        "kv_replicas_not_dividing": (
            "llama",
            "llama_tp",
            _with(tp, "model.layers.*.self_attn", params={**attn["params"], **_kv(attn, "RS(0,3)")}),
            {},
            ["k_proj.weight", "RS(0,3) on axis 'tp'", "3 ranks, which does not divide the axis size 2"],
        ),
        "experts": (
            "qwen3_moe",
            "qwen3_moe_tp_ep",
            load_plan_dict("qwen3_moe_tp_ep"),
            {"num_experts": 3},
            ["model.layers.0.mlp.experts", "down_proj", "3 experts", "axis 'tp' of size 2"],
        ),
        "stale_contract": (
            "llama",
            "llama_tp",
            load_plan_dict("llama_generic"),
            {},
            ["model.layers.0.self_attn", "position_ids", "stale", "hpgen lower"],
        ),
        "not_lowered": (
            "llama",
            "llama_tp",
            load_plan_dict("llama_tp_sp"),
            {},
            ["model.layers.0 (LlamaDecoderLayer", "no generated forward", "hpgen lower"],
        ),
        "missing_param": (
            "llama",
            "llama_tp",
            _with(tp, "model.layers.*.self_attn", params={**attn["params"], "q_proj.bias": {"tp": "S(0)"}}),
            {},
            ["model.layers.0.self_attn", "'q_proj.bias'", "not a parameter"],
        ),
        "tied_mismatch": (
            "llama",
            "llama_tp",
            _with(tp, "model.embed_tokens", **vocab["param_plan"]["model.embed_tokens"]),
            {"tie_word_embeddings": True},
            ["model.embed_tokens.weight", "lm_head.weight", "tied", "tp S(0)", "unplanned (R)"],
        ),
        "replicated_input_block": (
            "llama",
            "llama_tp",
            {
                **_with(tp, "model.layers.*.self_attn", params={**attn["params"], "o_proj.weight": {"tp": "B(1, 48:S(1,16), 16:R)"}}),
                "format": "hpgen.plan/2",
            },
            {},
            ["model.layers.0.self_attn", "o_proj.weight B(1,48:S(1,16),16:R)", "added to the partial sum once per rank"],
        ),
        "row_bias_not_deferred": (
            "llama",
            "llama_tp",
            bias,
            {"attention_bias": True, "mlp_bias": True},
            ["model.layers.0.self_attn", "o_proj.bias", "deferred_bias_params"],
        ),
        "mesh_axis": ("llama", "llama_tp", renamed, {}, ["ep", "not dims of the mesh", "tp"]),
        "unmatched_key": (
            "llama",
            "llama_tp",
            _with(tp, "model.decoder.*.mlp", **tp["param_plan"]["model.layers.*.mlp"]),
            {},
            ["'model.decoder.*.mlp'", "match no module"],
        ),
        "misspelt_key": (
            "llama",
            "llama_tp",
            {**tp, "param_plan": {**{k: v for k, v in tp["param_plan"].items() if k != "model.layers.*.self_attn"},
                                  "model.layers.*.self_atn": attn}},
            {},
            ["'model.layers.*.self_atn' (did you mean 'model.layers.*.self_attn'?)", "match no module"],
        ),
        "misspelt_param": (
            "llama",
            "llama_tp",
            _with(tp, "model.layers.*.self_attn", params={**attn["params"], "q_prj.weight": {"tp": "S(0)"}}),
            {},
            ["'q_prj.weight'", "not a parameter of this module (did you mean 'q_proj.weight'?)"],
        ),
        "grad_reduce_without_layout": (
            "llama",
            "llama_tp",
            _with(tp, "model.layers.*.input_layernorm", params={"weight": {"tp": "R"}}, grad_reduce_params=["weight"]),
            {},
            ["model.layers.0.input_layernorm", "shards its body on no axis", "Declare the layout", '"in_dst"'],
        ),
        "grad_reduce_over_a_shard": (
            "llama",
            "llama_tp",
            _with(tp, "model.layers.*.self_attn", grad_reduce_params=["q_proj.weight"]),
            {},
            [
                "model.layers.0.self_attn.q_proj.weight: grad_reduce_params sums its gradient over 'tp' "
                "(its body is sharded on)",
                "param_plan['model.layers.*.self_attn'].params['q_proj.weight'] shards it there (S(0))",
                "leave it out of grad_reduce_params",
            ],
        ),
        "grad_reduce_named_axis_over_a_shard": (
            "llama",
            "llama_tp",
            _with(tp, "model.layers.*.self_attn", grad_reduce_params={"o_proj.weight": ["tp"]}),
            {},
            ["self_attn.o_proj.weight: grad_reduce_params sums its gradient over 'tp' (it names)", "(S(1))"],
        ),
        "divide_attr": (
            "llama",
            "llama_tp",
            _with(tp, "model.layers.*.self_attn", tp_divide_attrs=["layer_idx"]),
            {},
            ["model.layers.1.self_attn", "layer_idx=1", "axis 'tp' of size 2"],
        ),
    }


def _try_all(rank: int, world_size: int, scenarios: dict[str, tuple]) -> dict[str, tuple[str, str, list[str]]]:
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize
    from hpgen.runtime.errors import ParallelizeError

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    outcome = {}
    for name, (family, generated, plan, overrides) in scenarios.items():
        config = make_config(family, **overrides)
        model = generated_model(import_file(generated), family, config, reference_model(family, config, seed=0))
        before = snapshot(model)
        try:
            parallelize(model, plan, mesh)
        except ParallelizeError as error:
            outcome[name] = ("ParallelizeError", str(error), untouched(model, before))
        else:
            outcome[name] = ("no error", "", untouched(model, before))
    return outcome


SCENARIOS = _scenarios()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = tmp_path_factory.mktemp("errors")
    files = {}
    runs = {}
    for name, (family, lowered, plan, config, _) in SCENARIOS.items():
        if (family, lowered) not in files:
            files[family, lowered] = str(lower_family(family, lowered, directory))
        runs[name] = (family, files[family, lowered], plan, config)
    return run_distributed(_try_all, runs, timeout=300)


@pytest.mark.parametrize("name", SCENARIOS)
def test_refused_before_anything_changed(outcomes: list[dict], name: str) -> None:
    expected = SCENARIOS[name][-1]
    for rank, by_name in enumerate(outcomes):
        kind, message, changes = by_name[name]
        assert kind == "ParallelizeError", f"rank {rank}: {kind}"
        for part in expected:
            assert part in message, f"rank {rank}: {part!r} not in:\n{message}"
        assert changes == [], f"rank {rank}: {changes}"
