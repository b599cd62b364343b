"""``hpgen plan`` where transformers has no plan: the layout derived from the modeling source.

Each test builds a tiny model of one family on the meta device and checks the structure
of what :mod:`hpgen.planner` derives from its modeling file: which modules become
boundaries of which kind, the placements (GPT-2's ``Conv1D`` flips the sharded dim, its
fused ``c_attn`` is three packed blocks, GPT-NeoX's per-head interleaved
``query_key_value`` keeps whole heads with a plain shard), the attributes divided, and the
notes for what stays replicated and why (multi-query key/value packed with the queries), and
the per-head ALiBi inputs made outside the attention (MPT's cut ``R -> S(0)``, BLOOM's
batch-major one by a region's local compute). The 2-rank parity of derived plans is in
``tests/runtime/test_parity_derived.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpgen.cli import cli
from tests.derived_configs import tiny


def placements(placed) -> dict[str, str]:
    """A derived entry's parameter placements, as the plan writes them."""
    return {name: str(placement) for name, placement in placed.params.items()}


def derived(family: str, tp: int = 2) -> dict[str, Any]:
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    return plan_model(meta_model(tiny(family)), tp=tp, from_source=True, name=family)


def entry(plan: dict[str, Any], key: str) -> dict[str, Any]:
    assert key in plan["param_plan"], sorted(plan["param_plan"])
    return plan["param_plan"][key]


def test_gpt2_conv1d_and_the_fused_qkv() -> None:
    plan = derived("gpt2")
    attn = entry(plan, "transformer.h.*.attn")
    # Conv1D weights are [in, out]: the column-parallel c_attn shards dim 1, in three packed Q|K|V blocks
    assert attn["params"]["c_attn.weight"] == {"tp": "SS(1,3)"}
    assert attn["params"]["c_attn.bias"] == {"tp": "SS(0,3)"}
    assert attn["params"]["c_proj.weight"] == {"tp": "S(0)"}  # row-parallel: the input dim, dim 0
    assert attn["deferred_bias_params"] == ["c_proj.bias"]
    assert attn["tp_divide_attrs"] == ["split_size"]  # split(self.split_size) cuts the local Q|K|V
    assert attn["out_src"] == {"attn_output": {"tp": "P(sum)"}} and attn["out_dst"] == {"attn_output": {"tp": "R"}}
    mlp = entry(plan, "transformer.h.*.mlp")
    assert mlp["params"]["c_fc.weight"] == {"tp": "S(1)"} and mlp["params"]["c_proj.weight"] == {"tp": "S(0)"}
    assert entry(plan, "transformer.wte")["params"] == {"weight": {"tp": "S(0)"}}
    assert plan["comments"]["plan_source"] == "derived from the source"


def test_gpt_neox_interleaved_qkv_keeps_whole_heads() -> None:
    plan = derived("gpt_neox")
    attention = entry(plan, "gpt_neox.layers.*.attention")
    # view(..., heads, 3 * head_dim): [h, 3, d] per head, so a plain row shard holds whole heads
    assert attention["params"]["query_key_value.weight"] == {"tp": "S(0)"}
    assert attention["params"]["dense.weight"] == {"tp": "S(1)"}
    assert entry(plan, "gpt_neox.layers.*.mlp")["params"]["dense_h_to_4h.weight"] == {"tp": "S(0)"}


def test_opt_mlp_in_the_decoder_layer_becomes_two_wrapped_linears() -> None:
    plan = derived("opt")
    # the attention returns out_proj's output alone: one block
    attention = entry(plan, "model.decoder.layers.*.self_attn")
    assert attention["in_src"] == {"hidden_states": {"tp": "R"}}
    assert attention["tp_divide_attrs"] == ["num_heads"]
    # fc1/fc2 sit in the decoder layer itself, between residual adds: each its own boundary
    fc1, fc2 = entry(plan, "model.decoder.layers.*.fc1"), entry(plan, "model.decoder.layers.*.fc2")
    assert fc1["out_src"] == fc1["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert fc2["in_src"] == fc2["in_dst"] == {"input": {"tp": "S(-1)"}}
    assert fc2["out_src"] == {"output": {"tp": "P(sum)"}} and fc2["deferred_bias_params"] == ["bias"]


def test_bert_self_attention_keeps_its_output_sharded_for_the_dense_after_it() -> None:
    plan = derived("bert")
    self_attention = entry(plan, "bert.encoder.layer.*.attention.self")
    assert self_attention["out_src"] == self_attention["out_dst"] == {"output_0": {"tp": "S(-1)"}} or all(
        value == {"tp": "S(-1)"} for value in self_attention["out_dst"].values()
    )
    assert entry(plan, "bert.encoder.layer.*.attention.output.dense")["in_dst"] == {"input": {"tp": "S(-1)"}}
    # the output projection's bias is also registered as cls.predictions.bias: both shard alike
    assert entry(plan, "cls.predictions")["params"] == {"bias": {"tp": "S(0)"}}
    assert entry(plan, "cls.predictions.decoder")["params"]["bias"] == {"tp": "S(0)"}


@pytest.mark.parametrize(
    ("family", "module", "reason"),
    [
        ("gpt_bigcode", "transformer.h.*.attn.c_attn", "unequal sizes [64, 16, 16]"),
    ],
)
def test_what_cannot_shard_stays_replicated_and_says_why(family: str, module: str, reason: str) -> None:
    plan = derived(family)
    assert reason in plan["comments"]["replicated"][module]
    assert not any(key.endswith(("self_attention", ".attn")) for key in plan["param_plan"])
    assert any(".mlp" in key for key in plan["param_plan"])  # the MLP still shards


def test_a_per_head_input_with_its_own_head_dim_is_cut_on_entry() -> None:
    plan = derived("mpt")  # position_bias is [heads, 1, max_seq_len], made once by MptModel
    attn = entry(plan, "transformer.blocks.*.attn")
    assert attn["in_src"]["position_bias"] == {"tp": "R"} and attn["in_dst"]["position_bias"] == {"tp": "S(0)"}
    assert attn["params"]["Wqkv.weight"] == {"tp": "SS(0,3)"} and attn["params"]["out_proj.weight"] == {"tp": "S(1)"}
    assert attn["tp_divide_attrs"] == ["n_heads"]
    assert "position_bias" in plan["comments"]["sharded"]["transformer.blocks.*.attn"]
    assert "injections" not in plan


def test_a_batch_major_per_head_input_is_cut_by_a_region() -> None:
    plan = derived("bloom")  # alibi is [batch * heads, 1, L]: no S placement holds a rank's heads of every batch
    attention = entry(plan, "transformer.h.*.self_attention")
    assert attention["in_src"] == {"alibi": {"tp": "R"}} and attention["in_dst"] == {"alibi": {"tp": "R"}}
    assert attention["tp_divide_attrs"] == ["num_heads"]
    assert plan["injections"] == [
        {
            "match": "transformer.h.*.self_attention",
            "local_compute_fn": {
                "_target_": "hpgen.runtime.local_heads.batch_major_heads",
                "head_inputs": ["alibi"],
                "global_heads": 4,
                "axis": "tp",
            },
        }
    ]
    # the attention adds the residual inside: its projections are the wrapped leaves
    assert entry(plan, "transformer.h.*.self_attention.query_key_value")["params"]["weight"] == {"tp": "S(0)"}
    assert entry(plan, "transformer.h.*.self_attention.dense")["params"]["weight"] == {"tp": "S(1)"}


def test_batch_major_heads_keeps_this_ranks_heads_of_every_batch() -> None:
    import types

    import torch

    from hpgen.runtime.local_heads import batch_major_heads

    class Body(torch.nn.Module):
        def _forward_impl(self, hidden_states: torch.Tensor, alibi: torch.Tensor, mask: Any = None) -> torch.Tensor:
            return alibi

    body = Body()
    alibi = torch.arange(2 * 4 * 3.0).reshape(2 * 4, 1, 3)  # batch 2, heads 4, row b * 4 + h
    for rank in (0, 1):
        body._hp_tp = types.SimpleNamespace(size=2, rank=rank)
        got = batch_major_heads(body, None, alibi, head_inputs=["alibi"], global_heads=4)
        want = alibi.view(2, 4, 1, 3)[:, 2 * rank : 2 * rank + 2].reshape(4, 1, 3)
        assert torch.equal(got, want)
    body._hp_tp = types.SimpleNamespace(size=1, rank=0)  # unparallelized: the body as it is
    assert batch_major_heads(body, None, alibi, head_inputs=["alibi"], global_heads=4) is alibi


def test_a_chunked_feed_forward_returns_only_its_result() -> None:
    plan = derived("xmod")  # apply_chunking_to_forward(self.feed_forward_chunk, ..., attention_output)
    assert entry(plan, "roberta.encoder.layer.*.intermediate.dense")["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert entry(plan, "roberta.encoder.layer.*.output.dense")["params"]["weight"] == {"tp": "S(1)"}


def test_classes_under_a_module_level_if_are_read_and_left_to_wrapped_leaves() -> None:
    plan = derived("xlstm")  # hpgen lower rewrites top-level classes only: no block on xLSTMFeedForward
    assert "backbone.blocks.*.ffn" not in plan["param_plan"]
    for name in ("proj_up", "proj_up_gate"):
        assert entry(plan, f"backbone.blocks.*.ffn.{name}")["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert entry(plan, "backbone.blocks.*.ffn.proj_down")["params"]["weight"] == {"tp": "S(1)"}


def test_layers_from_another_modeling_file_shard_as_wrapped_leaves() -> None:
    plan = derived("fuyu")  # FuyuForCausalLM's file has no layers: Persimmon's file is read, not rewritten
    mlp = "model.language_model.layers.*.mlp"
    assert mlp not in plan["param_plan"]
    assert entry(plan, f"{mlp}.dense_h_to_4h")["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert entry(plan, f"{mlp}.dense_4h_to_h")["params"]["weight"] == {"tp": "S(1)"}
    # the attention's per-head q/k layernorms need a block to reduce their gradients in: not in this file
    assert "needs a block" in plan["comments"]["replicated"]["model.language_model.layers.*.self_attn.dense"]


def test_a_norm_across_the_sharded_features_leaves_the_pair_replicated() -> None:
    plan = derived("bitnet")  # BitNet normalises the attention output (attn_sub_norm) before o_proj
    assert "model.layers.*.self_attn.o_proj" in plan["comments"]["replicated"]
    # only the MLP's down_proj (89 -> 64, wider in than out) is sharded: a row on its split replicated input
    assert set(plan["param_plan"]) == {"model.embed_tokens", "lm_head", "model.layers.*.mlp.down_proj"}
    assert plan["param_plan"]["model.layers.*.mlp.down_proj"]["in_dst"] == {"input": {"tp": "S(-1)"}}


def test_heads_that_do_not_divide_are_cut_whole_by_the_derivation() -> None:
    plan = derived("opt", tp=3)  # 4 heads of 16 on 3 ranks: 2, 1, 1
    attention = entry(plan, "model.decoder.layers.*.self_attn")
    assert attention["params"]["q_proj.weight"] == attention["params"]["v_proj.bias"] == {"tp": "S(0,16)"}
    assert attention["params"]["out_proj.weight"] == {"tp": "S(1,16)"}
    # each rank's num_heads, counted from its shard of out_proj's input in heads of 16
    assert attention["local_attrs"] == {"num_heads": {"of": "out_proj.weight", "dim": 1, "unit": 16}}
    assert "tp_divide_attrs" not in attention and plan["format"] == "hpgen.plan/2"


def test_mamba_mixer_shards_its_channels_and_reduces_x_proj() -> None:
    plan = derived("mamba")
    mixer = entry(plan, "backbone.layers.*.mixer")
    assert mixer["params"] == {
        "in_proj.weight": {"tp": "SS(0,2)"},  # chunk(2): the [x | z] blocks, each rank its chunk of both
        "conv1d.weight": {"tp": "S(0)"},  # depthwise: one filter per channel
        "conv1d.bias": {"tp": "S(0)"},
        "A_log": {"tp": "S(0)"},
        "D": {"tp": "S(0)"},
        "dt_proj.weight": {"tp": "S(0)"},
        "dt_proj.bias": {"tp": "S(0)"},
        "out_proj.weight": {"tp": "S(1)"},
    }
    assert mixer["in_dst"] == {"hidden_states": {"tp": "R"}} and mixer["out_src"] == {"output": {"tp": "P(sum)"}}
    x_proj = entry(plan, "backbone.layers.*.mixer.x_proj")
    assert x_proj["params"] == {"weight": {"tp": "S(1)"}}
    assert x_proj["in_src"] == {"input": {"tp": "S(-1)"}} and x_proj["out_dst"] == {"output": {"tp": "R"}}
    assert x_proj["out_grad_partial"] == ["output"]  # dt, B, C feed the sharded scan: reduced in backward too
    assert plan["comments"]["replicated"] == {}


def test_zamba_mixer_shards_whole_mamba_heads() -> None:
    plan = derived("zamba")
    mixer = entry(plan, "model.layers.*.mamba_decoder.mamba")
    # view(batch, -1, 2, seq): each channel's x and gate side by side, so a plain shard keeps the pairs
    assert mixer["params"]["in_proj.weight"] == {"tp": "S(0)"}
    for name in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D"):  # [heads, ...]
        assert mixer["params"][name] == {"tp": "S(0)"}
    assert mixer["tp_divide_attrs"] == ["n_mamba_heads"]
    assert not any(key.endswith("x_proj") for key in plan["param_plan"])  # per head: nothing to reduce


def test_mixers_the_placements_cannot_cut_gather_around_a_replicated_scan() -> None:
    plan = derived("mamba2")  # in_proj packs z|x|B|C|dt, blocks of unequal sizes
    in_proj = entry(plan, "backbone.layers.*.mixer.in_proj")
    assert in_proj["params"] == {"weight": {"tp": "S(0)"}}
    assert in_proj["out_src"] == {"output": {"tp": "S(-1)"}} and in_proj["out_dst"] == {"output": {"tp": "R"}}
    out_proj = entry(plan, "backbone.layers.*.mixer.out_proj")
    assert out_proj["in_src"] == {"input": {"tp": "R"}} and out_proj["in_dst"] == {"input": {"tp": "S(-1)"}}
    assert out_proj["params"] == {"weight": {"tp": "S(1)"}}
    assert "backbone.layers.*.mixer" not in plan["param_plan"]  # the scan runs replicated, unchanged
    assert "unequal sizes" in plan["comments"]["sharded"]["backbone.layers.*.mixer.in_proj"]
    # Zamba's two Mamba heads over 4 ranks: the same honest gather, and the note says why
    four = derived("zamba", tp=4)
    note = four["comments"]["sharded"]["model.layers.*.mamba_decoder.mamba.in_proj"]
    assert "holds 2 heads" in note and "--tp 4" in note
    assert "model.layers.*.mamba_decoder.mamba" not in four["param_plan"]


def test_transformers_plan_is_kept_where_it_shards_the_layers() -> None:
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_source

    neox = meta_model(tiny("gpt_neox"))
    assert plan_source(neox) == "transformers' plan"
    assert plan_source(neox, from_source=True) == "derived from the source"
    assert plan_source(meta_model(tiny("gpt2"))) == "derived from the source"


def test_transformers_plan_is_completed_where_it_leaves_the_attention_replicated() -> None:
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.translate.translator import translated_plan

    model = meta_model(tiny("flint"))
    plan = plan_model(model, tp=2, name="flint")
    translated = translated_plan(model, tp=2, name="flint")
    assert "model.layers.*.self_attn" not in translated["param_plan"]  # transformers shards the MLP only
    for key, entry in translated["param_plan"].items():
        assert plan["param_plan"][key] == entry  # kept as transformers wrote it
    attention = plan["param_plan"]["model.layers.*.self_attn"]
    assert attention["params"]["q_proj.weight"] == {"tp": "S(0)"} and attention["params"]["o_proj.weight"] == {
        "tp": "S(1)"
    }
    assert plan["comments"]["plan_source"] == "transformers' plan"
    assert list(plan["comments"]["completed_from_source"]) == ["model.layers.*.self_attn"]
    # --sp keeps transformers' plan alone: the attention only gathers and splits the sequence
    with_sp = plan_model(model, tp=2, sp=True, name="flint")
    assert "completed_from_source" not in with_sp["comments"]
    assert "params" not in with_sp["param_plan"]["model.layers.*.self_attn"]


def test_derived_plans_load_and_lower() -> None:
    import inspect

    from hpgen.generate import infer_package
    from hpgen.lower import lower
    from hpgen.plan import plan_from_dict
    from hpgen.planner.model.load import model_class_for

    for family in ("gpt2", "opt", "bert"):
        source = Path(inspect.getsourcefile(model_class_for(tiny(family))) or "")
        text = lower(
            source.read_text(), plan_from_dict(derived(family)), source_name=source.name, package=infer_package(source)
        )
        assert "_hp_tp" in text


def test_sizing_report_counts_bytes_and_collectives() -> None:
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.sizing_report import size_report

    model = meta_model(tiny("gpt2"))
    report = size_report(model, derived("gpt2"), tp=2, dtype="bfloat16")
    total = sum(p.numel() for p in model.parameters()) * 2
    assert report.total_bytes == total and report.sharded_bytes + report.replicated_bytes == total
    assert report.rank_bytes[0] + report.rank_bytes[1] == report.sharded_bytes + 2 * report.replicated_bytes
    assert report.layers == {"transformer.h.*": 2}
    forward = [c for c in report.per_layer["transformer.h.*"] if c.phase == "forward"]
    assert [(c.module, c.kind, c.tensor_bytes) for c in forward] == [
        ("transformer.h.*.attn", "all_reduce", 128),  # 64 features at 2 bytes, per token
        ("transformer.h.*.mlp", "all_reduce", 128),
    ]
    totals = report.totals("forward")
    # two per layer, the token embedding's and the learned positions' (64 rows: as big as half the vocabulary)
    assert totals["all_reduce"][0] == 2 * 2 + 2
    assert totals["all_gather"][0] == 1  # the logits: lm_head knows its out_features, no size exchange
    assert "encoder_hidden_states" in report.optional


def test_hpgen_plan_prints_the_notes_and_the_sizing_report(tmp_path: Path) -> None:
    config = tmp_path / "gpt2"
    tiny("gpt2").save_pretrained(config)
    result = CliRunner().invoke(
        cli, ["plan", str(config / "config.json"), "--tp", "2", "--explain"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["comments"]["plan_source"] == "derived from the source"
    assert "sharded: transformer.h.*.attn: attention: column- and row-parallel projections" in result.stderr
    assert "parameters at bfloat16" in result.stderr and "total per forward" in result.stderr


def test_the_sizing_report_is_at_the_checkpoints_dtype_unless_told(tmp_path: Path) -> None:
    """A float32 checkpoint is sized at float32 (its config's dtype), --dtype overrides it; the report says which."""
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.sizing_report import format_bytes, size_report

    config = tiny("gpt2")
    config.dtype = "float32"
    config.save_pretrained(tmp_path)
    path = str(tmp_path / "config.json")
    own = CliRunner().invoke(cli, ["plan", path, "--tp", "2"], catch_exceptions=False)
    told = CliRunner().invoke(cli, ["plan", path, "--tp", "2", "--dtype", "bfloat16"], catch_exceptions=False)
    assert own.exit_code == told.exit_code == 0, own.stderr + told.stderr
    assert "parameters at float32 (the config's dtype; --dtype to change): " in own.stderr
    assert "parameters at bfloat16 (--dtype): " in told.stderr
    sized = size_report(meta_model(config), json.loads(own.stdout), tp=2, dtype="float32")
    assert f"{format_bytes(sized.total_bytes)} unsharded" in own.stderr
    assert f"{format_bytes(sized.total_bytes // 2)} unsharded" in told.stderr


def test_hpgen_explain_adds_the_sizing_report_with_config(tmp_path: Path) -> None:
    import inspect

    from hpgen.planner.model.load import model_class_for

    config = tmp_path / "opt"
    tiny("opt").save_pretrained(config)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(derived("opt")))
    source = inspect.getsourcefile(model_class_for(tiny("opt")))
    result = CliRunner().invoke(
        cli, ["explain", str(source), str(plan), "--config", str(config / "config.json"), "--tp", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    sizing = json.loads(result.stdout)["sizing"]
    assert sizing["per_layer"]["model.decoder.layers.*"]["layers"] == 2
    assert sizing["parameters"]["rank_bytes"][0] < sizing["parameters"]["total_bytes"] * 0.65


def _translated(model_type: str) -> tuple[Any, dict[str, Any]]:
    """transformers' plan of ``model_type``'s tiny config (the coverage table's), on the meta device."""
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model
    from hpgen.verify.shrink import tiny_config

    model = meta_model(tiny_config(model_type))
    return model, plan_model(model, tp=2, name=model_type)


def test_a_language_model_from_another_file_names_each_class_by_file() -> None:
    # GOT-OCR2 builds Qwen2's decoder layers through AutoModel: the plan names the two files and
    # every boundary's class by qualified name, so that each file's lowering takes its own keys
    from hpgen.lower import analyze
    from hpgen.plan import plan_from_dict
    from hpgen.planner.model.load import source_file as _source_file

    model, plan = _translated("got_ocr2")
    files = plan["comments"]["modeling_files"]
    assert files == ["transformers.models.got_ocr2.modeling_got_ocr2", "transformers.models.qwen2.modeling_qwen2"]
    classes = plan["boundary_classes"]
    assert classes["model.language_model.layers.*.self_attn"] == "transformers.models.qwen2.modeling_qwen2.Qwen2Attention"
    assert classes["lm_head"] == "nn.Linear"
    loaded = plan_from_dict(plan)
    qwen2 = Path(_source_file(type(model.model.language_model.layers[0].self_attn)))
    own = analyze(qwen2.read_text(encoding="utf-8"), loaded, source_name=qwen2.name)
    assert sorted(own.classes) == ["Qwen2Attention", "Qwen2MLP"] and not own.elsewhere.keys() & {
        "model.language_model.layers.*.mlp"
    }
    root = Path(_source_file(type(model)))
    theirs = analyze(root.read_text(encoding="utf-8"), loaded, source_name=root.name)
    assert "model.language_model.layers.*.self_attn" in theirs.elsewhere
    assert "Qwen2Attention" not in theirs.classes


def test_one_file_plans_keep_their_boundary_classes() -> None:
    model, plan = _translated("qwen2")
    assert "modeling_files" not in plan.get("comments", {})
    assert all("." not in name or name.startswith("nn.") for name in plan.get("boundary_classes", {}).values())


def test_a_packed_gate_up_split_by_chunk_is_corrected_to_packed_colwise() -> None:
    # transformers' inkling plan says colwise for experts.gate_up_proj, which forward splits with
    # chunk(2) (inkling2 through self._apply_gate): each rank needs its chunk of both blocks
    for model_type in ("inkling_text", "inkling2_text"):
        _, plan = _translated(model_type)
        experts = entry(plan, "model.layers.*.mlp.experts")
        assert experts["params"]["gate_up_proj"] == {"tp": "SS(1,2)"}, model_type
        assert "chunk(2)" in plan["comments"]["corrected"]["model.layers.*.mlp.experts.gate_up_proj"]
    # the shared experts' gating weights, a second input of a sharded MLP-like block, get R -> R too
    _, inkling = _translated("inkling_text")
    assert entry(inkling, "model.layers.*.mlp.shared_experts")["in_src"] == {
        "hidden_states": {"tp": "R"},
        "gammas": {"tp": "R"},
    }
    _, qwen3_moe = _translated("qwen3_moe")  # packed_colwise already: nothing to correct
    assert "corrected" not in qwen3_moe["comments"]


def test_chunked_attributes_reads_forward_and_the_methods_it_calls() -> None:
    import ast
    import textwrap

    from hpgen.planner.translate.corrections import chunked_attributes

    source = textwrap.dedent(
        """
        class E:
            def forward(self, x):
                a, b = linear(x, self.w[0]).chunk(2, dim=-1)
                y = self._gate(linear(x, self.v))
                z = self.u(x).chunk(3, dim=-1)
                return self.d(a * b + y)
            def _gate(self, h):
                g, u = h.chunk(2, dim=-1)
                return g * u
        """
    )
    assert chunked_attributes(ast.parse(source), "E") == {"w", "v"}


def test_a_block_the_source_contradicts_falls_back_to_replicated() -> None:
    # a block of transformers' plan that shards the module needing a sharded value whole is dropped,
    # the group staying replicated as the derivation leaves it; MLA plans (deepseek_v2) keep their
    # attention: what needs a value whole there is kv_a_layernorm, which transformers leaves replicated too
    from hpgen.planner.passes.crosscheck import drop_contradicted
    from hpgen.planner.derive.placed import Derivation

    from hpgen.placement import Placement
    from hpgen.plan_entries import Layout
    from hpgen.planner.translate.draft import DraftEntry, DraftPlan

    def layout(text: str) -> Layout:
        return Layout.same(("tp",), Placement.parse(text))

    plan = DraftPlan(
        "M",
        ("tp",),
        {
            "layers.*.attn": DraftEntry(params={"q.weight": layout("S(0)"), "mix.weight": layout("S(1)")}),
            "layers.*.mlp": DraftEntry(params={"up.weight": layout("S(0)")}),
        },
    )
    derivation = Derivation()
    derivation.note("layers.0.attn.q", False, "the output of q also reaches mix", needs_whole="layers.0.attn.mix")
    kept = drop_contradicted(plan, derivation)
    assert list(kept.entries) == ["layers.*.mlp"]
    assert "kept replicated" in kept.comments["replaced"]["layers.*.attn"]
    _, deepseek = _translated("deepseek_v2")
    assert "model.layers.*.self_attn" in deepseek["param_plan"]
    assert "replaced" not in deepseek["comments"]


def test_a_projection_reading_the_values_whole_is_gathered_on_entry() -> None:
    # Doge's dt_proj reads every value head (kv_heads * head_dim -> kv_heads) to build one mask row per
    # key/value head: column-parallel over its outputs, its input gathered (S(-1) -> R), its output
    # sharded with the heads; A (one per key/value head) follows. transformers' rowwise dt_proj is
    # replaced by the derived attention; the MLP stays as transformers' plan has it.
    from hpgen.planner.derive.derivation import derive
    from hpgen.planner.model.load import meta_model

    derivation = derive(meta_model(tiny("doge")), tp=2)
    assert derivation.placed["model.layers.0.self_attn"].kind == "block"
    leaf = derivation.placed["model.layers.0.self_attn.dt_proj"]
    assert leaf.kind == "gather_leaf" and placements(leaf) == {"weight": "S(0)", "bias": "S(0)"}
    attn = placements(derivation.placed["model.layers.0.self_attn"])
    assert attn["A"] == "S(0)" and not any(name.startswith("dt_proj.") for name in attn)
    plan = plan_model_of("doge")
    assert plan["comments"]["plan_source"] == "transformers' plan"
    dt_proj = entry(plan, "model.layers.*.self_attn.dt_proj")
    assert dt_proj["in_src"] == {"input": {"tp": "S(-1)"}} and dt_proj["in_dst"] == {"input": {"tp": "R"}}
    assert dt_proj["out_src"] == dt_proj["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert entry(plan, "model.layers.*.self_attn")["params"]["o_proj.weight"] == {"tp": "S(1)"}
    assert "gathers its input" in plan["comments"]["replaced"]["model.layers.*.self_attn"]
    assert "model.layers.*.mlp" in plan["param_plan"]
    # --sp: the derived attention is entered from the sequence-sharded stream like transformers' MLP
    from hpgen.planner.entry.make import plan_model

    sp = plan_model(meta_model(tiny("doge")), tp=2, sp=True, name="doge")
    assert entry(sp, "model.layers.*.self_attn")["in_src"] == {"hidden_states": {"tp": "S(1)"}}
    assert entry(sp, "model.layers.*.self_attn.dt_proj")["in_src"] == {"input": {"tp": "S(-1)"}}
    assert entry(sp, "model.layers.*.mlp")["in_src"] == {"x": {"tp": "S(1)"}}


def test_a_gathered_column_must_write_one_value_per_head_of_a_plain_layout() -> None:
    import torch.nn as nn

    from hpgen.planner.derive.placed import Contradicted
    from hpgen.planner.derive.gathered import check_gathered
    from hpgen.planner.derive.column_layouts import PLAIN, grouped, packed
    from hpgen.planner.derive.heads.counts import Heads

    modules = {"a.v": nn.Linear(64, 32), "a.dt": nn.Linear(32, 2), "a.mix": nn.Linear(32, 3)}
    heads = Heads(query=4, kv=2, head_dim=16)
    check_gathered({"a.dt": {"a.v"}}, modules, {"a.v": PLAIN}, heads, 2, "a")  # one per key/value head
    with pytest.raises(Contradicted, match="not one per head"):
        check_gathered({"a.mix": {"a.v"}}, modules, {"a.v": PLAIN}, heads, 2, "a")
    for layout in (packed(2), grouped(2)):  # blocks, or heads interleaved with their values: out of order gathered
        with pytest.raises(Contradicted, match="packed layout"):
            check_gathered({"a.dt": {"a.v"}}, modules, {"a.v": layout}, heads, 2, "a")
    with pytest.raises(Contradicted, match="do not divide"):
        check_gathered({"a.dt": {"a.v"}}, modules, {"a.v": PLAIN}, heads, 4, "a")


def plan_model_of(family: str) -> dict[str, Any]:
    """``hpgen plan --tp 2`` of ``family``'s tiny config (transformers' plan where it has one)."""
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    return plan_model(meta_model(tiny(family)), tp=2, name=family)


def test_identity_experts_become_partial_inside_the_experts_sum() -> None:
    # transformers' moe_identity_expert: LongCat-Flash's zero-compute experts (nn.Identity) return the same
    # value on every rank, inside an experts module whose output is all-reduced: R -> P(sum)
    _, plan = _translated("longcat_flash")
    identity = entry(plan, "model.layers.*.mlp.experts.identity_expert")
    assert identity["out_src"] == {"output": {"tp": "R"}} and identity["out_dst"] == {"output": {"tp": "P(sum)"}}
    assert entry(plan, "model.layers.*.mlp.experts")["out_src"] == {"output": {"tp": "P(sum)"}}


def test_statistics_over_sharded_features_keep_those_layers_replicated() -> None:
    # Gemma3n's MLP thresholds gate_proj's output by its features' mean and std where activation_sparsity
    # > 0 (the first two of the tiny config's four layers): those MLPs stay replicated, the others shard
    _, plan = _translated("gemma3n_text")
    assert "model.layers.*.mlp" not in plan["param_plan"]
    assert {"model.layers.2.mlp", "model.layers.3.mlp"} <= set(plan["param_plan"])
    assert {"model.layers.0.mlp", "model.layers.1.mlp"} <= set(plan["comments"]["replaced"])
    assert "_gaussian_topk" in plan["comments"]["replaced"]["model.layers.0.mlp"]


def test_feature_statistics_follow_the_column_output_into_methods() -> None:
    import ast
    import textwrap
    from types import SimpleNamespace

    from hpgen.planner.translate.corrections import feature_statistics

    source = textwrap.dedent(
        """
        class M:
            def forward(self, x):
                g = self.gate(x)
                if self.sparse > 0.0:
                    g = self._top(g)
                u = self.up(x).mean(dim=0)
                return self.down(g * u)
            def _top(self, h):
                return h - torch.std(h, dim=-1, keepdim=True)
        """
    )
    tree = ast.parse(source)
    assert "M._top reduces the features of gate" in feature_statistics(tree, "M", {"gate", "up"}, SimpleNamespace(sparse=0.5))
    assert feature_statistics(tree, "M", {"gate", "up"}, SimpleNamespace(sparse=0.0)) is None  # branch not taken
    assert feature_statistics(tree, "M", {"up"}, SimpleNamespace(sparse=0.5)) is None  # a mean over dim 0 only


def test_latent_attention_keeps_its_down_projections_replicated_in_the_block() -> None:
    """MLA: ``q_b_proj``/``kv_b_proj`` are the columns; ``kv_a_proj_with_mqa`` (whose rotary key every
    head shares) and ``q_a_proj`` run whole on each rank, their gradients reduced."""
    plan = derived("deepseek_v3")
    attention = entry(plan, "model.layers.*.self_attn")
    assert attention["params"] == {
        "q_b_proj.weight": {"tp": "S(0)"},
        "kv_b_proj.weight": {"tp": "S(0)"},
        "o_proj.weight": {"tp": "S(1)"},
    }
    assert set(attention["grad_reduce_params"]) == {
        "q_a_proj.weight",
        "q_a_layernorm.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
    }
    assert list(attention["in_src"]) == ["hidden_states"]  # not the cache or **kwargs mixed into the latent
    assert "kv_a_proj_with_mqa" in plan["comments"]["sharded"]["model.layers.*.self_attn"]


def test_transformers_mla_plan_is_completed_with_the_attention() -> None:
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    plan = plan_model(meta_model(tiny("deepseek_v3")), tp=2, name="deepseek_v3")
    assert plan["comments"]["plan_source"] == "transformers' plan"
    assert entry(plan, "model.layers.*.self_attn")["params"]["kv_b_proj.weight"] == {"tp": "S(0)"}


LATENT_SOURCE = '''
from torch import nn


class LatentAttention(nn.Module):
    def __init__(self, cut):
        super().__init__()
        self.cut = cut
        self.num_heads = 4
        self.head_dim = 16
        self.q_proj = nn.Linear(64, 64, bias=False)
        self.kv_a = nn.Linear(64, 48, bias=False)
        self.kv_norm = nn.LayerNorm(32)
        self.kv_b = nn.Linear(32, 4 * 32, bias=False)
        self.o_proj = nn.Linear(64, 64, bias=False)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, 16).transpose(1, 2)
        latent, rot = self.kv_a(hidden_states).split([32, 16], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, s, -1, 32).transpose(1, 2)
        k, v = kv.split([16, 16], dim=-1)
        if self.cut:
            rot = rot.view(b, s, -1, 4).transpose(1, 2)  # the shared value cut into four "heads"
        else:
            rot = rot.view(b, 1, s, 16).expand(-1, k.shape[1], -1, -1)  # one head, shared
        k = k + rot
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self, cut):
        super().__init__()
        self.attn = LatentAttention(cut)

    def forward(self, hidden_states):
        return hidden_states + self.attn(hidden_states)


class Model(nn.Module):
    def __init__(self, cut):
        super().__init__()
        self.layers = nn.ModuleList([Layer(cut) for _ in range(2)])

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states
'''


@pytest.mark.parametrize("cut", [False, True])
def test_a_replicated_latent_is_shared_by_the_heads_or_the_group_stays_replicated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: bool
) -> None:
    """The latent ``kv_a`` stays replicated next to sharded heads only while it enters them as one head
    expanded to all; cut into heads itself, it would need a per-head slice, so the group is refused."""
    import importlib.util

    from hpgen.planner.derive.derivation import derive

    path = tmp_path / "latent_model.py"
    path.write_text(LATENT_SOURCE)
    spec = importlib.util.spec_from_file_location("latent_model", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(__import__("sys").modules, "latent_model", module)  # inspect finds the classes' file
    spec.loader.exec_module(module)
    derivation = derive(module.Model(cut), tp=2, source=path)
    notes = {note.target: note.text for note in derivation.notes if not note.sharded}
    if cut:
        assert "layers.0.attn" not in derivation.placed
        assert "cuts the replicated output of attn.kv_a into heads" in notes["layers.*.attn.o_proj"]
    else:
        block = derivation.placed["layers.0.attn"]
        assert placements(block) == {"q_proj.weight": "S(0)", "kv_b.weight": "S(0)", "o_proj.weight": "S(1)"}
        assert block.grad_reduce == {"kv_a.weight", "kv_norm.weight", "kv_norm.bias"}


def test_a_linear_attention_mixer_shards_its_conv_and_per_head_tensors_with_the_heads() -> None:
    """Kimi Linear's KDA: q/k/v, the gates' up-projections and b_proj are columns; the depthwise conv over
    ``cat([q, k, v])`` is three packed blocks; ``A_log`` ``[1, 1, heads, 1]`` is cut on its head dim; the
    gates' down-projections stay replicated; ``qkv_dim`` (the split sizes) is divided."""
    plan = derived("kimi_linear")
    mixer = entry(plan, "model.layers.0.self_attn")
    params = {name: layout["tp"] for name, layout in mixer["params"].items()}
    assert params["conv1d.weight"] == "SS(0,3)"
    assert params["forget_gate.A_log"] == "S(2)" and params["forget_gate.dt_bias"] == "S(0)"
    assert params["forget_gate.f_b_proj.weight"] == params["b_proj.weight"] == "S(0)"
    assert params["o_proj.weight"] == "S(1)"
    assert {"forget_gate.f_a_proj.weight", "g_a_proj.weight", "o_norm.weight"} <= set(mixer["grad_reduce_params"])
    assert mixer["tp_divide_attrs"] == ["qkv_dim"]


def test_a_conv_over_blocks_of_unequal_sizes_has_no_packed_placement() -> None:
    from types import SimpleNamespace

    import torch
    from torch import nn

    from hpgen.planner.flow import Val
    from hpgen.planner.derive.linear_mixers import conv_placement

    model = nn.Module()
    model.conv = nn.Conv1d(256, 256, 4, groups=256, device="meta")
    name = "conv.weight"

    def split(sizes: list[int]) -> SimpleNamespace:
        value = Val(items=tuple(Val(const=size) for size in sizes))
        return SimpleNamespace(method="split", receiver=frozenset({f"param:{name}"}), arg_vals=(value,))

    weight = model.conv.weight
    assert conv_placement(model, name, weight, [64, 64, 128], [split([64, 64, 128])]) is None
    assert str(conv_placement(model, name, weight, [128, 128], [split([128, 128])])) == "SS(0,2)"
    assert conv_placement(model, name, weight, [128, 128], []) is None  # blocks unknown
    model.conv = nn.Conv1d(256, 256, 4, device="meta")  # mixes channels
    assert conv_placement(model, name, model.conv.weight, [128, 128], [split([128, 128])]) is None
    assert torch.Size([256, 1, 4]) == weight.shape


def test_a_row_whose_columns_cannot_shard_splits_its_replicated_input() -> None:
    """BitNet's MLP pair stays replicated (ffn_sub_norm across the sharded width), so down_proj, wider in
    than out, is a row on its split input: R -> S(-1), weight S(1), P(sum) -> R; --sp leaves it replicated."""
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    plan = derived("bitnet")
    down = entry(plan, "model.layers.*.mlp.down_proj")
    assert down["in_src"] == {"input": {"tp": "R"}} and down["in_dst"] == {"input": {"tp": "S(-1)"}}
    assert down["params"] == {"weight": {"tp": "S(1)"}}
    assert down["out_src"] == {"output": {"tp": "P(sum)"}} and down["out_dst"] == {"output": {"tp": "R"}}
    assert "split on entry" in plan["comments"]["sharded"]["model.layers.*.mlp.down_proj"]
    with pytest.raises(Exception, match="no decoder layer holds a sharded block"):
        plan_model(meta_model(tiny("bitnet")), tp=2, sp=True, from_source=True, name="bitnet")


def test_a_grouped_linear_is_not_sharded_as_a_linear() -> None:
    """A ``nn.Linear`` subclass whose forward reshapes its weight (DeepSeek-V4's block-diagonal o_a_proj)."""
    import torch
    from torch import nn

    from hpgen.planner.derive.split_rows import reshapes_weight

    class Grouped(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.weight.view(2, -1, x.shape[-1]).transpose(1, 2)
            return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    assert reshapes_weight(Grouped(4, 4, device="meta"))
    assert not reshapes_weight(Scaled(4, 4, device="meta")) and not reshapes_weight(nn.Linear(4, 4, device="meta"))


def test_differential_attention_keeps_each_pair_of_heads_on_one_rank() -> None:
    # DiffLlama works head i with head i + H/2 (chunk(2) over the heads) and the value heads in halves:
    # each rank takes its chunk of both halves, SS(0,2); the halves combine element by element, so the
    # row projection's input holds a rank's pairs contiguously, S(1)
    plan = derived("diffllama")
    attention = entry(plan, "model.layers.*.self_attn")
    assert attention["params"] == {
        "q_proj.weight": {"tp": "SS(0,2)"},
        "k_proj.weight": {"tp": "RS(0,2)"},  # one key/value head per half: every rank needs both
        "v_proj.weight": {"tp": "RS(0,2)"},
        "o_proj.weight": {"tp": "S(1)"},
    }
    assert attention["tp_divide_attrs"] == ["num_key_value_groups"]  # 2 query heads per key/value head -> 1
    assert attention["grad_reduce_params"] == ["lambda_k1", "lambda_k2", "lambda_q1", "lambda_q2"]
    assert "split into 2 parts" in plan["comments"]["sharded"]["model.layers.*.self_attn"]
    # four key/value heads, two per half: a strided cut of them too, and the groups stay as they are
    grouped = entry(derived("diffllama_grouped"), "model.layers.*.self_attn")
    assert {name: p["tp"] for name, p in grouped["params"].items()} == {
        "q_proj.weight": "SS(0,2)", "k_proj.weight": "SS(0,2)", "v_proj.weight": "SS(0,2)", "o_proj.weight": "S(1)"
    }
    assert "tp_divide_attrs" not in grouped


def test_differential_attention_whose_halves_do_not_divide_stays_replicated() -> None:
    # on 4 ranks the 2 key/value heads of each half neither divide nor are one per half
    plan = derived("diffllama_grouped", tp=4)
    assert "model.layers.*.self_attn" not in plan["param_plan"]
    reason = plan["comments"]["replicated"]["model.layers.*.self_attn.k_proj"]
    assert "2 per part neither divide over --tp 4" in reason, reason
    assert entry(plan, "model.layers.*.mlp")["params"]["down_proj.weight"] == {"tp": "S(1)"}


def test_a_weightless_torch_norm_over_whole_heads_works_per_head() -> None:
    import torch.nn as nn

    from hpgen.planner.derive.heads.rules import normalized_heads

    assert normalized_heads(nn.RMSNorm(32, elementwise_affine=False), {16}) == 32  # a pair of heads
    assert normalized_heads(nn.LayerNorm(16, elementwise_affine=False, bias=False), {16}) == 16
    assert normalized_heads(nn.RMSNorm(24, elementwise_affine=False), {16}) is None  # not whole heads
    assert normalized_heads(nn.RMSNorm(32), {16}) is None  # a weight: the per-head rule of q_norm decides

    class OwnNorm(nn.Module):  # its forward might reduce over anything: not taken on trust
        normalized_shape = (32,)

    assert normalized_heads(OwnNorm(), {16}) is None


def test_a_recurrent_block_shards_its_channels_through_the_recurrence_it_holds() -> None:
    """RecurrentGemma: the RG-LRU holds the per-channel state (a leaf of the file, opened and read), so
    linear_x/linear_y are columns, linear_out the row, the depthwise conv (called as a module: its groups
    divided) and the RG-LRU's per-head gates follow the channels; the sliding attention still shards."""
    plan = derived("recurrent_gemma")
    for layer in (0, 1):
        block = entry(plan, f"model.layers.{layer}.temporal_block")
        params = {name: layout["tp"] for name, layout in block["params"].items()}
        assert params == {
            "linear_x.weight": "S(0)", "linear_x.bias": "S(0)", "linear_y.weight": "S(0)", "linear_y.bias": "S(0)",
            "linear_out.weight": "S(1)", "linear_out.bias": "R",
            "conv_1d.weight": "S(0)", "conv_1d.bias": "S(0)", "rg_lru.recurrent_param": "S(0)",
            "rg_lru.input_gate_weight": "S(0)", "rg_lru.input_gate_bias": "S(0)",
            "rg_lru.recurrent_gate_weight": "S(0)", "rg_lru.recurrent_gate_bias": "S(0)",
        }  # fmt: skip
        assert block["deferred_bias_params"] == ["linear_out.bias"]
        # the states it allocates for the cache: torch.zeros((batch, self.lru_width)), (batch, self.hidden_size, ..)
        assert block["tp_divide_attrs"] == ["hidden_size", "lru_width"]
    assert entry(plan, "model.layers.*.temporal_block.rg_lru")["tp_divide_attrs"] == ["num_attention_heads"]
    conv = entry(plan, "model.layers.*.temporal_block.conv_1d")
    assert conv["tp_divide_attrs"] == ["groups", "in_channels", "out_channels"]
    attention = entry(plan, "model.layers.2.temporal_block")
    assert attention["params"]["q_proj.weight"] == {"tp": "S(0)"} and attention["params"]["o_proj.weight"] == {
        "tp": "S(1)"
    }
    assert plan["comments"]["replicated"] == {}


RECURRENT_SOURCE = '''
import types

import torch
from torch import nn


class Recurrence(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = 4
        self.width = 16
        self.gate = nn.Parameter(torch.zeros(4, 16, 16))
        self.decay = nn.Parameter(torch.zeros(64))

    def forward(self, x):
        b, s, c = x.shape
        h = self._heads(x, b * s)
        g = torch.sigmoid(torch.bmm(h, self.gate).transpose(0, 1).reshape(b, s, c))
        return self._scan(x * self._mixed(g), torch.exp(self.decay))

    def _heads(self, x, n):
        return x.reshape(n, self.heads, self.width).permute(1, 0, 2)

    def _mixed(self, g):
        return g

    def _scan(self, x, a):
        state = torch.zeros(x[:, 0].shape)
        out = torch.zeros_like(x)
        for t in range(x.shape[1]):
            state = a * state + x[:, t]
            out[:, t] = state
        return out


class MinorRecurrence(Recurrence):
    def _heads(self, x, n):  # heads interleaved: channel i belongs to head i % heads
        return x.reshape(n, self.width, self.heads).transpose(1, 2).permute(1, 0, 2)


class MeanRecurrence(Recurrence):
    def _mixed(self, g):
        return g - g.mean(-1, keepdim=True)


class DenseRecurrence(Recurrence):
    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.zeros(64, 64))

    def _mixed(self, g):
        return g @ self.mix


RECURRENCES = {"plain": Recurrence, "minor": MinorRecurrence, "mean": MeanRecurrence, "dense": DenseRecurrence}


class Block(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.channels = 64
        self.linear_x = nn.Linear(64, 64)
        self.linear_y = nn.Linear(64, 64)
        self.linear_out = nn.Linear(64, 64)
        self.conv = nn.Conv1d(64, 64, 4, groups=64, padding=3)
        self.rec = RECURRENCES[variant]()

    def forward(self, hidden_states):
        y = nn.functional.gelu(self.linear_y(hidden_states))
        x = self.linear_x(hidden_states).transpose(1, 2)
        x = self.conv(x)[..., : hidden_states.shape[1]].transpose(1, 2)
        start = torch.zeros((hidden_states.shape[0], 1, self.channels))
        return self.linear_out((self.rec(x) + start) * y)


class Layer(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.mixer = Block(variant)

    def forward(self, hidden_states):
        return hidden_states + self.mixer(self.norm(hidden_states))


class Model(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=64)
        self.layers = nn.ModuleList([Layer(variant) for _ in range(2)])

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states
'''


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("plain", None),
        ("minor", "does not reshape its 64 channels head-major into (4, 16)"),
        ("mean", "calls mean at line"),
        ("dense", "not a state-space mixer"),
    ],
)
def test_a_recurrence_is_opened_and_shards_only_where_its_code_works_per_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str, reason: str | None
) -> None:
    """A leaf of the file holding per-head gates and per-channel decays: sharded with the channels when it cuts
    the heads head-major and combines nothing across channels; heads cut channel-minor or a mean over the
    channels make the honest gather around a replicated body; a ``[C, C]`` matrix is no per-channel state."""
    import importlib.util

    from hpgen.planner.derive.derivation import derive

    path = tmp_path / "recurrent_model.py"
    path.write_text(RECURRENT_SOURCE)
    spec = importlib.util.spec_from_file_location("recurrent_model", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(__import__("sys").modules, "recurrent_model", module)  # inspect finds the classes' file
    spec.loader.exec_module(module)
    derivation = derive(module.Model(variant), tp=2, source=path)
    placed = derivation.placed
    notes = {note.target: note.text for note in derivation.notes}
    if reason is None:
        block = placed["layers.0.mixer"]
        assert block.kind == "block" and placements(block)["linear_out.weight"] == "S(1)"
        assert {placements(block)[n] for n in ("rec.gate", "rec.decay", "conv.weight", "linear_x.weight")} == {"S(0)"}
        assert block.divide == {"channels"}  # the state it allocates
        assert placed["layers.0.mixer.rec"].divide == {"heads"}  # the reshape into heads; `width` stays
        assert placed["layers.0.mixer.conv"].divide == {"groups", "in_channels", "out_channels"}
    elif variant == "dense":
        assert "layers.0.mixer" not in placed and "layers.0.mixer.linear_x" not in placed
        assert "not part of a column -> row pair" in notes["layers.*.mixer.linear_out"]
    else:
        assert "layers.0.mixer" not in placed  # the body runs replicated between gathered and split projections
        assert placed["layers.0.mixer.linear_x"].kind == "col_gather"
        assert placed["layers.0.mixer.linear_out"].kind == "split_row"
        assert reason in notes["layers.*.mixer.linear_x"]


HEAD_MAP_SOURCE = '''
import torch
from torch import nn
import torch.nn.functional as F


class RelativeLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(8, 12))

    def forward(self, states, positions):
        logits = (states @ self.proj).transpose(1, 2)
        index = positions.clamp(0, 11).expand(*logits.shape[:2], -1, -1)
        return logits.gather(-1, index)


class SummedLogits(RelativeLogits):
    def forward(self, states, positions):
        logits = (states @ self.proj).sum(2, keepdim=True).transpose(1, 2)
        return logits.gather(-1, positions.clamp(0, 11).expand(*logits.shape[:2], -1, -1))


class ShortConv(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1d = nn.Conv1d(channels, channels, 3, groups=channels, bias=False)

    def forward(self, x):
        out = F.conv1d(x.transpose(1, 2), self.conv1d.weight, padding=2, groups=x.shape[-1])
        return x + out[..., : x.shape[1]].transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.num_heads = 4
        self.head_dim = 16
        self.q_proj = nn.Linear(64, 64, bias=False)
        self.k_proj = nn.Linear(64, 64, bias=False)
        self.v_proj = nn.Linear(64, 64, bias=False)
        self.r_proj = nn.Linear(64, 4 * 8, bias=False)
        self.k_conv = ShortConv(128 if variant == "conv_over_k_and_v" else 64)
        self.rel = SummedLogits() if variant == "sums_heads" else RelativeLogits()
        self.o_proj = nn.Linear(64, 64, bias=False)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, 16).transpose(1, 2)
        if self.variant == "conv_over_k_and_v":
            k, v = self.k_conv(torch.cat([self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)).chunk(2, -1)
        else:
            k, v = self.k_conv(self.k_proj(hidden_states)), self.v_proj(hidden_states)
        k = k.view(b, s, -1, 16).transpose(1, 2)
        v = v.view(b, s, -1, 16).transpose(1, 2)
        r = self.r_proj(hidden_states).view(b, s, self.num_heads, -1)
        positions = torch.arange(s)[:, None] - torch.arange(s)[None, :]
        bias = self.rel(r, positions[None, None])
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.attn = Attention(variant)

    def forward(self, hidden_states):
        return hidden_states + self.attn(hidden_states)


class Model(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.layers = nn.ModuleList([Layer(variant) for _ in range(2)])

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states
'''


@pytest.mark.parametrize("variant", ["per_head", "sums_heads", "conv_over_k_and_v"])
def test_a_per_head_matrix_and_a_short_conv_on_one_column_follow_the_heads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    """A leaf applying one ``[d_rel, e]`` matrix to each head's features (``r.view(..., heads, -1) @ proj``,
    d_rel 8, not the head size) runs on this rank's heads with the whole matrix, its gradient reduced; a
    depthwise conv over one column's output alone is ``S(0)``. A leaf that sums over the heads, or a conv
    over ``cat([k, v])`` (no split says its blocks), leaves the attention replicated."""
    import importlib.util

    from hpgen.planner.derive.derivation import derive

    path = tmp_path / "head_map_model.py"
    path.write_text(HEAD_MAP_SOURCE)
    spec = importlib.util.spec_from_file_location("head_map_model", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(__import__("sys").modules, "head_map_model", module)  # inspect finds the classes' file
    spec.loader.exec_module(module)
    derivation = derive(module.Model(variant), tp=2, source=path)
    notes = {note.target: note.text for note in derivation.notes if not note.sharded}
    if variant == "per_head":
        block = derivation.placed["layers.0.attn"]
        assert placements(block) == {
            "q_proj.weight": "S(0)", "k_proj.weight": "S(0)", "v_proj.weight": "S(0)", "r_proj.weight": "S(0)",
            "o_proj.weight": "S(1)", "k_conv.conv1d.weight": "S(0)",
        }
        assert block.grad_reduce == {"rel.proj"}
        assert block.divide == {"num_heads"}
    elif variant == "sums_heads":
        assert "layers.0.attn" not in derivation.placed
        assert notes["layers.*.attn.o_proj"] == "not part of a column -> row pair: kept replicated"
    else:
        assert "layers.0.attn" not in derivation.placed
        assert "k_conv.conv1d.weight (128, 1, 3) directly, which does not follow the shards" in notes[
            "layers.*.attn.o_proj"
        ]


def test_inkling2_attention_is_completed_with_its_per_head_scales_taps_and_shared_map() -> None:
    """transformers' plan shards Inkling2's experts only; the derivation adds the attention. The sliding
    layer's L2-clip scales ``[heads, d]`` (leaves over per-head views) and the full layer's (read directly)
    shard by head; the relative-position matrix ``[d_rel, extent]`` (``x @ proj``, one map for every head)
    stays whole with its gradient reduced; the dynamic convolutions' static taps ``[kernel, channels]`` shard
    their channels and ``weight_proj`` (``view(b, s, heads, 1, kernel)``) its heads; ``num_heads`` is divided,
    ``conv_kernel_size`` (4, as many as the heads, but sized within a head) is not. The relative-position
    projection's 16 rows are its module's 4 heads of ``d_rel`` 4, which divide over 2 ranks (not one head of
    the attention's head_dim 16)."""
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    plan = plan_model(meta_model(tiny("inkling2")), tp=2, name="inkling2")
    assert plan["comments"]["plan_source"] == "transformers' plan"
    sliding, full = (entry(plan, f"model.layers.{i}.self_attn") for i in (0, 1))
    for block in (sliding, full):
        params = {name: layout["tp"] for name, layout in block["params"].items()}
        assert params["q_proj.norm.scale"] == params["relative_position_bias.norm.scale"] == "S(0)"
        assert params["sink_proj.weight"] == params["o_proj.gate_proj.weight"] == "S(0)"
        assert params["o_proj.linear.weight"] == "S(1)"
        assert block["grad_reduce_params"] == ["relative_position_bias.proj"]
    assert {n: sliding["params"][n]["tp"] for n in ("k_proj.sconv.conv1d.weight", "v_proj.sconv.conv1d.weight")} == {
        "k_proj.sconv.conv1d.weight": "S(0)", "v_proj.sconv.conv1d.weight": "S(0)",
    }
    for side in ("k", "v"):
        assert full["params"][f"{side}_proj.sconv.static_weight"] == {"tp": "S(1)"}
        assert full["params"][f"{side}_proj.sconv.weight_proj.weight"] == {"tp": "S(0)"}
        assert entry(plan, f"model.layers.1.self_attn.{side}_proj.sconv")["tp_divide_attrs"] == ["num_heads"]
    assert entry(plan, "model.layers.*.self_attn.relative_position_bias")["tp_divide_attrs"] == ["num_heads"]


def test_output_names_come_from_records_not_from_a_tensor_method_with_keywords() -> None:
    # Inkling2's short convolution ends ``return hidden_states.to(dtype=input_dtype)``: one tensor, named
    # ``output``; a ``dtype`` output would make the generated forward assign ``outputs.dtype``
    from hpgen.index import parse_source
    from hpgen.planner.translate.forwards import return_names

    source = (
        "class Conv:\n    def forward(self, x):\n        return x.to(dtype=x.dtype)\n\n"
        "class Model:\n    def forward(self, x):\n        return BaseModelOutput(last_hidden_state=x)\n"
    )
    parsed = parse_source(source)
    assert return_names(parsed, "Conv") == ("output",)
    assert return_names(parsed, "Model") == ("last_hidden_state",)
