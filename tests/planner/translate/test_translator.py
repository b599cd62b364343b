"""``hpgen plan``: frozen plans from transformers' own ``base_model_tp_plan`` / ``base_model_ep_plan``.

The plans are built on the meta device from the installed transformers' configs, so they
follow transformers as it is installed. What they must say is pinned by the hand-written
plans of ``tests/plans`` that the runtime tests run on two ranks: the generated llama plan
is ``llama_tp_vocab.json`` (and its attention and MLP contracts those of
``llama_tp.json``), the 2-layer sequence-parallel one ``llama_tp_sp.json``, the
Qwen3-MoE experts-parallel one ``qwen3_moe_tp_ep.json``. One test runs a generated plan on
two gloo ranks against the unsharded model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpgen.cli import cli
from hpgen.generator.lower import analyze, lower
from hpgen.core.plan import contract_signature, load_plan
from tests.conftest import PLANS, transformers_modeling_file

MODELS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


def run_plan(*args: str) -> tuple[int, str, str]:
    """``hpgen plan ARGS`` in-process: (exit code, stdout, stderr)."""
    result = CliRunner().invoke(cli, ["plan", *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``generated(MODEL, *FLAGS)``: the plan file ``hpgen plan MODEL FLAGS -o`` writes (made once)."""
    folder = tmp_path_factory.mktemp("plans")
    made: dict[tuple[str, ...], Path] = {}

    def make(model: str, *flags: str) -> Path:
        key = (model, *flags)
        if key not in made:
            path = folder / f"plan{len(made)}.json"
            code, _, err = run_plan(model, *flags, "-o", str(path))
            assert code == 0, err
            made[key] = path
        return made[key]

    return make


def tiny_llama_config(tmp_path: Path) -> Path:
    """config.json of the runtime tests' tiny llama (2 layers, 4 heads, 2 KV heads)."""
    from tests.support.models import make_config

    make_config("llama").save_pretrained(tmp_path)
    return tmp_path / "config.json"


def entries(path: Path) -> dict:
    """A plan file's validated entries by FQN pattern (lists sorted, so key order does not matter)."""
    return dict(load_plan(path).entries)


# --------------------------------------------------------------------------- plans that load and lower


@pytest.mark.parametrize("model", MODELS)
def test_plan_loads_and_lowers(generated: Callable[..., Path], model: str) -> None:
    path = generated(model, "--tp", "2")
    plan = load_plan(path)
    source = transformers_modeling_file(model)
    analysis = analyze(source.read_text(), plan, source_name=source.name)
    forms = {contract.form for lowering in analysis.classes.values() for contract in lowering.contracts}
    assert forms == {"tp_collective"}, forms  # every block lowers to bare collectives
    assert set(analysis.external) == {"model.embed_tokens", "lm_head"}  # wrapped by parallelize
    assert lower(source.read_text(), plan, source_name=source.name).count("self._hp_tp.all_reduce(") >= 2


def test_llama_is_the_hand_written_vocab_parallel_plan(generated: Callable[..., Path]) -> None:
    path = generated("llama", "--tp", "2")
    assert entries(path) == entries(PLANS / "llama_tp_vocab.json")
    plan, hand_written = load_plan(path), load_plan(PLANS / "llama_tp.json")
    for key in ("model.layers.*.self_attn", "model.layers.*.mlp"):
        assert contract_signature(plan, key) == contract_signature(hand_written, key)
    assert plan.model_class == "LlamaForCausalLM" and not plan.boundary_classes


def test_qwen_specifics(generated: Callable[..., Path]) -> None:
    qwen2 = entries(generated("qwen2", "--tp", "2"))["model.layers.*.self_attn"]
    assert {name: str(layout.on("tp")) for name, layout in qwen2.params.items() if name.endswith("bias")} == {
        "q_proj.bias": "S(0)",
        "k_proj.bias": "S(0)",
        "v_proj.bias": "S(0)",
    }
    qwen3 = entries(generated("qwen3", "--tp", "2"))["model.layers.*.self_attn"]
    assert qwen3.grad_reduce_params == ("k_norm.weight", "q_norm.weight")  # per-head norms see local heads


def test_an_embedding_subclass_of_the_modeling_file_is_wrapped_not_lowered(generated: Callable[..., Path]) -> None:
    # GemmaTextScaledWordEmbedding(nn.Embedding) scales the lookup: lowered as a class of the file,
    # it would all-reduce a lookup of ids outside its rows; parallelize's wrapper masks them first
    plan = load_plan(generated("gemma", "--tp", "2"))
    assert plan.boundary_classes == {"model.embed_tokens": "nn.Embedding"}
    source = transformers_modeling_file("gemma")
    assert set(analyze(source.read_text(), plan, source_name=source.name).external) == {"model.embed_tokens", "lm_head"}


def test_every_replicated_parameter_of_a_sharded_block_reduces_its_gradient(generated: Callable[..., Path]) -> None:
    # MiniCPM3's MLA attention: transformers' plan marks only kv_a_proj_with_mqa (mla_kv_a_proj); under
    # one boundary, each rank's backward reaches all four through its own heads only
    attention = entries(generated("minicpm3", "--tp", "2"))["model.layers.*.self_attn"]
    assert set(attention.grad_reduce_params) == {
        "q_a_proj.weight",
        "q_a_layernorm.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
    }
    assert {name for name, layout in attention.params.items() if str(layout.on("tp")) != "R"} == {
        "q_b_proj.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    }


def test_qwen3_moe_tensor_parallel_experts(generated: Callable[..., Path]) -> None:
    path = generated("qwen3_moe", "--tp", "2")
    document = json.loads(path.read_text())
    experts = entries(path)["model.layers.*.mlp.experts"]
    # packed_colwise on [E, 2I, H] is a strided shard of both halves; rowwise on [E, H, I] the last dim
    assert {name: str(layout.on("tp")) for name, layout in experts.params.items()} == {
        "gate_up_proj": "SS(1,2)",
        "down_proj": "S(2)",
    }
    assert experts.input_names == ("hidden_states", "top_k_weights")  # routing weights get a partial gradient
    # `model.layers.*.mlp` is a sparse block or a dense MLP depending on the layer: resolved from the model
    assert document["boundary_classes"] == {"model.layers.*.mlp.experts": "Qwen3MoeExperts"}
    assert "injections" not in document


def test_qwen3_moe_experts_parallel_is_the_hand_written_plan(generated: Callable[..., Path]) -> None:
    path = generated("qwen3_moe", "--tp", "2", "--ep", "2")
    mine, hand_written = json.loads(path.read_text()), json.loads((PLANS / "qwen3_moe_tp_ep.json").read_text())
    found = entries(path)
    for key, entry in entries(PLANS / "qwen3_moe_tp_ep.json").items():
        assert found[key] == entry
    for part in ("injections", "boundary_classes", "mesh_dim_names", "model_class"):
        assert mine[part] == hand_written[part]


def test_sequence_parallel_is_the_hand_written_plan(generated: Callable[..., Path], tmp_path: Path) -> None:
    config = tiny_llama_config(tmp_path)
    path = generated(str(config), "--tp", "2", "--sp")
    assert entries(path) == entries(PLANS / "llama_tp_sp.json")
    source = transformers_modeling_file("llama")
    text = lower(source.read_text(), load_plan(path), source_name=source.name)
    assert "self._hp_tp.reduce_scatter(" in text and "self._hp_tp.split(" in text


def test_sequence_parallel_gathers_at_the_last_layer_when_the_final_norm_is_torchs(
    generated: Callable[..., Path], tmp_path: Path
) -> None:
    from transformers import GPTNeoXConfig

    GPTNeoXConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=89, vocab_size=127
    ).save_pretrained(tmp_path)
    found = entries(generated(str(tmp_path / "config.json"), "--tp", "2", "--sp"))
    # final_layer_norm is an nn.LayerNorm, which hpgen cannot rewrite: the last layer gathers instead
    last = found["gpt_neox.layers.1"]
    assert [str(layout.on("tp")) for layout in (*last.out_src.values(), *last.out_dst.values())] == ["S(1)", "R"]
    assert "gpt_neox.final_layer_norm" not in found
    attention = found["gpt_neox.layers.*.attention"]
    # a parallel-residual layer: the block reduce-scatters the sum of both branches once (summed reduction), so
    # the attention's output stays partial and its bias, added into that sum on one rank, gets its whole gradient
    assert found["gpt_neox.layers.1"].summed_reduction is not None
    assert attention.deferred_bias_params == ("dense.bias",) and "dense.bias" not in attention.grad_reduce_params
    assert str(attention.out_dst["attn_output"].on("tp")) == "P(sum)"
    two = entries(generated(str(tmp_path / "config.json"), "--tp", "2", "--sp", "--no-summed-reduction"))
    attention = two["gpt_neox.layers.*.attention"]
    # reduced by the attention itself, the deferred row-parallel bias is added to a sequence shard: its gradient
    # is partial too
    assert attention.deferred_bias_params == ("dense.bias",) and "dense.bias" in attention.grad_reduce_params
    assert str(attention.out_dst["attn_output"].on("tp")) == "S(1)"


@pytest.mark.parametrize(
    ("flags", "mesh", "experts_params"),
    [
        (["--ep", "2"], ["ep"], {"gate_up_proj": {"ep": "S(0)"}, "down_proj": {"ep": "S(0)"}}),
        # an axis of their own beside tp: whole experts on ep, their intermediate dim on tp (the TP plan's rules)
        (
            ["--tp", "2", "--ep", "4", "--ep-axis", "ep"],
            ["ep", "tp"],
            {"gate_up_proj": {"ep": "S(0)", "tp": "SS(1,2)"}, "down_proj": {"ep": "S(0)", "tp": "S(2)"}},
        ),
        (
            ["--tp", "2", "--ep", "2", "--ep-axis", "ep"],
            ["ep", "tp"],
            {"gate_up_proj": {"ep": "S(0)", "tp": "SS(1,2)"}, "down_proj": {"ep": "S(0)", "tp": "S(2)"}},
        ),
    ],
)
def test_experts_parallel_on_an_axis_of_its_own(
    generated: Callable[..., Path], flags: list[str], mesh: list[str], experts_params: dict
) -> None:
    path = generated("qwen3_moe", *flags)
    document = json.loads(path.read_text())
    assert document["mesh_dim_names"] == mesh
    assert document["injections"][0]["local_compute_fn"]["axis"] == "ep"
    experts = document["param_plan"]["model.layers.*.mlp.experts"]
    assert experts["params"] == experts_params
    assert experts["out_src"]["output"] == {axis: "P(sum)" for axis in mesh}  # reduced on each axis's group
    assert ("model.layers.*.self_attn" in document["param_plan"]) == ("tp" in mesh)
    if "tp" in mesh:  # attention stays on tp alone
        attention = document["param_plan"]["model.layers.*.self_attn"]
        assert {axis for layout in attention["params"].values() for axis in layout} == {"tp"}
    source = transformers_modeling_file("qwen3_moe")
    lower(source.read_text(), load_plan(path), source_name=source.name)


def test_output_is_deterministic_json(generated: Callable[..., Path]) -> None:
    code, first, _ = run_plan("qwen3", "--tp", "2")
    assert code == 0
    assert generated("qwen3", "--tp", "2").read_text() == first  # stdout and -o: the same bytes, run after run
    document = json.loads(first)
    assert first == json.dumps(document, indent=2, sort_keys=True) + "\n"
    assert document["format"] == "hpgen.plan/1" and document["mesh_dim_names"] == ["tp"]


# --------------------------------------------------------------------------- bad input: exit 2, one line


def test_a_style_it_cannot_map_lists_the_supported_ones(tmp_path: Path) -> None:
    config = tiny_llama_config(tmp_path)
    document = json.loads(config.read_text())
    document["base_model_tp_plan"] = {"layers.*.self_attn.q_proj": "colwise", "norm": "sequence_parallel"}
    config.write_text(json.dumps(document))
    code, out, err = run_plan(str(config), "--tp", "2")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "'sequence_parallel'" in err and "supported styles: all_reduce, colwise," in err
    assert "rowwise_split_input" in err and "moe_tp_experts" in err


@pytest.mark.parametrize(
    ("overrides", "size", "expected"),
    [
        ({}, 3, "num_attention_heads=4 does not divide over --tp 3"),
        (
            {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2},
            3,
            "num_key_value_heads=2 does not divide over --tp 3 and --tp 3 is not a multiple of it",
        ),
    ],
)
def test_indivisible_heads_name_the_sizes(tmp_path: Path, overrides: dict, size: int, expected: str) -> None:
    from tests.support.models import make_config

    make_config("llama", **overrides).save_pretrained(tmp_path)
    code, out, err = run_plan(str(tmp_path / "config.json"), "--tp", str(size))
    assert code == 2 and out == ""
    assert expected in err and len(err.strip().splitlines()) == 1


def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path: Path) -> None:
    from tests.support.models import make_config

    make_config("qwen2").save_pretrained(tmp_path)  # 4 heads, 2 key/value heads, q/k/v biases
    code, out, err = run_plan(str(tmp_path / "config.json"), "--tp", "4")
    assert code == 0, err
    attention = json.loads(out)["param_plan"]["model.layers.*.self_attn"]
    placements = {name: layout["tp"] for name, layout in attention["params"].items()}
    # each key/value head on 2 consecutive ranks; its weight and bias alike; query heads still split
    assert {name for name, p in placements.items() if p == "RS(0,2)"} == {
        "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"
    }
    assert placements["q_proj.weight"] == placements["q_proj.bias"] == "S(0)"
    assert attention["divide_attrs"] == {"num_key_value_groups": 2}  # 1 query head per local kv head


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tp", "2", "--ep", "4"], "without --ep-axis the experts share the tp axis; give --ep-axis ep"),
        (["--tp", "2", "--ep-axis", "ep"], "--ep-axis names the experts' axis; give --ep too"),
        (["--tp", "2", "--ep", "2", "--ep-axis", "boundary"], "is not a usable axis name"),
    ],
)
def test_experts_axis_flags_are_checked(flags: list[str], expected: str) -> None:
    code, out, err = run_plan("qwen3_moe", *flags)
    assert code == 2 and out == "" and expected in err


def test_indivisible_experts_name_the_sizes() -> None:
    code, _, err = run_plan("qwen3_moe", "--ep", "3")
    assert code == 2 and "num_experts=128, which does not divide over --ep 3" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["no_such_model"], "is neither a config.json path nor a model type"),
        (["llama", "--ep", "2"], "has no base_model_ep_plan"),
        (["llama", "--sp", "--ep", "2"], "has no base_model_ep_plan"),
        (["missing/config.json"], "no such config file"),
    ],
)
def test_bad_targets_exit_2(args: list[str], expected: str) -> None:
    code, out, err = run_plan(*args)
    assert code == 2 and out == "" and expected in err


def test_generating_plans_keeps_torch_out_of_the_generator() -> None:
    probe = (
        "import sys, hpgen.planner.entry.make, hpgen.planner.translate.translator, hpgen.planner.derive.derivation, hpgen.planner.translate.derived_plan, "
        "hpgen.cli, hpgen.generator.lower; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


# --------------------------------------------------------------------------- two ranks


def test_generated_plans_match_the_unsharded_llama_on_two_ranks(tmp_path: Path) -> None:
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.translate.translator import translated_plan
    from tests.support.dist import run_distributed
    from tests.support.models import (
        Case,
        check_generation,
        check_gradients,
        check_logits,
        lower_family,
        make_config,
        run_cases,
    )

    cases = []
    for name, sp in (("tp", False), ("tp_sp", True)):
        plan = translated_plan(meta_model(make_config("llama")), tp=2, sp=sp)
        (tmp_path / name).mkdir()
        cases.append(Case(name, "llama", str(lower_family("llama", plan, tmp_path / name)), plan))
    results = run_distributed(run_cases, cases, timeout=300)
    for case in cases:
        check_logits(results, case.name)
        check_gradients(results, case.name)
        check_generation(results, case.name)
