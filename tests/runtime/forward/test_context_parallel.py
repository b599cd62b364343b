"""Context parallelism (``hpgen plan --cp``) against the unsharded models, on real gloo ranks.

Plans from ``hpgen plan`` for the tiny Llama and Qwen3 configs, the installed modeling
files lowered under them. Two spawns: 2 ranks (``cp`` 2) and 4 ranks (``cp`` 4, ``cp`` 2 x
``tp`` 2 with and without ``--sp``, FSDP2 on ``dp`` 2 over ``cp`` 2). Every case compares
logits, loss and every gradient in train mode (13 tokens: uneven head-tail shards; the
2-rank cases also 16; under sdpa each step's attention runs by blocks), Llama under eager
attention at cp 2, and the 2-rank cases also a left-padded batch, packed documents by
``position_ids``, a user's 4-D mask, greedy generation after a cp prefill, a
``torch.compile(fullgraph=True)`` step and steps under ``gradient_checkpointing_enable()``
(Llama), a DCP round trip and the refusals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.compose import TrainCase
from tests.support.context_cases import CpCase, CpResult, run_cp_spawn
from tests.support.dist import run_distributed
from tests.support.models import lower_family, make_config

FAMILIES = ("llama", "qwen3")


def _plan(family: str, **flags: Any) -> dict[str, Any]:
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    return plan_model(meta_model(make_config(family)), name=family, **flags)


def _case(tmp: Path, name: str, family: str, mesh: tuple[tuple[str, int], ...], **flags: Any) -> dict[str, Any]:
    plan = _plan(family, **flags)
    (tmp / name).mkdir(parents=True, exist_ok=True)
    path = lower_family(family, plan, tmp / name)
    return dict(name=name, family=family, generated=str(path), plan=plan, mesh=mesh)


def _check(results: list[dict[str, CpResult]], name: str) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        for what, (err, tol) in result.checks.items():
            assert err <= tol, f"{name} rank {rank}: {what} {err:.2e} > {tol:.2e}"
        assert result.grads_checked > 0
        assert not result.grad_failures, f"{name} rank {rank}: " + "; ".join(result.grad_failures)
        assert result.tokens == result.reference_tokens, f"{name} rank {rank}: greedy tokens differ"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, CpResult]]:
    tmp = tmp_path_factory.mktemp("cp2")
    cases = []
    for family in FAMILIES:
        spec = _case(tmp, f"{family}_cp2", family, (("cp", 2),), cp=2)
        # Qwen3's small checkpoints tie lm_head to the embeddings: the head's share of the gradient is summed over cp
        tied = dict(tie_word_embeddings=True) if family == "qwen3" else {}
        cases.append(
            CpCase(
                **spec, padded=True, packed=True, mask4d=True, generate=True, compiled=family == "llama",
                sharded_logits=True, checkpointed=family == "llama", config=tied,
            )
        )
    # eager attention keeps its own path (the gathered keys and values, this rank's mask rows), layout included
    spec = _case(tmp, "llama_cp2_eager", "llama", (("cp", 2),), cp=2)
    cases.append(CpCase(**spec, lengths=(13,), padded=True, checkpointed=True, config=dict(attn_implementation="eager")))
    refused = {
        "sliding window": dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
        "attention dropout": dict(attention_dropout=0.1),
        "flex attention": dict(_attn_implementation="flex_attention"),
    }
    folder = tmp / "dcp"
    folder.mkdir()
    return run_distributed(run_cp_spawn, cases, (cases[1], refused), (cases[0], str(folder)), world_size=2, timeout=240)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, CpResult]]:
    tmp = tmp_path_factory.mktemp("cp4")
    cases = []
    for family in FAMILIES:
        for name, mesh, flags in (
            (f"{family}_cp4", (("cp", 4),), dict(cp=4)),
            (f"{family}_cp2_tp2", (("cp", 2), ("tp", 2)), dict(cp=2, tp=2)),
            (f"{family}_cp2_tp2_sp", (("cp", 2), ("tp", 2)), dict(cp=2, tp=2, sp=True)),
        ):
            cases.append(CpCase(**_case(tmp, name, family, mesh, **flags), lengths=(13,)))
    # FSDP2 on dp over cp: the cp 2 plan, fully_shard per decoder layer and root on dp, half the batch per dp rank
    spec = _case(tmp / "fsdp", "llama_cp2", "llama", (("dp", 2), ("cp", 2)), cp=2)
    training = [
        TrainCase("llama_dp2_cp2_fsdp2", "llama", spec["generated"], spec["plan"], spec["mesh"], "fsdp2", seq_len=13)
    ]
    return run_distributed(run_cp_spawn, cases, None, None, training, world_size=4, timeout=300)


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_matches_the_unsharded_model(two_ranks: list[dict[str, CpResult]], family: str) -> None:
    _check(two_ranks, f"{family}_cp2")
    result = two_ranks[0][f"{family}_cp2"]
    assert {"left-padded logits", "packed logits", "4-D mask logits", "sharded logits logits"} <= set(result.checks)
    assert family != "llama" or {"compiled logits", "compiled gradients"} <= set(result.checks)
    checkpointed = {"checkpointed loss", "checkpointed reentrant loss", "attention alone refused"}
    assert family != "llama" or checkpointed <= set(result.checks)
    assert len(result.tokens[0]) == 6


def test_cp2_eager_attention_matches_the_unsharded_model(two_ranks: list[dict[str, CpResult]]) -> None:
    _check(two_ranks, "llama_cp2_eager")
    result = two_ranks[0]["llama_cp2_eager"]
    assert {"left-padded logits", "checkpointed loss", "checkpointed reentrant loss"} <= set(result.checks)
    assert not any("by blocks" in what for what in result.checks)  # eager: no blocks


def test_cp2_cuts_the_sequence_head_tail(two_ranks: list[dict[str, CpResult]]) -> None:
    # 16 tokens in 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2, in every layer
    assert [by_case["llama_cp2"].local_tokens for by_case in two_ranks] == [[8, 8], [8, 8]]


def test_parallelize_refuses_on_every_rank_before_anything_changes(two_ranks: list[dict[str, Any]]) -> None:
    expected = {
        "sliding window": "does not cover sliding-window attention (config.sliding_window=4)",
        "attention dropout": "does not cover attention dropout (config.attention_dropout=0.1)",
        "flex attention": "runs sdpa or eager attention, not 'flex_attention'",
    }
    for rank, by_case in enumerate(two_ranks):
        for label, message in by_case["refusals"].items():
            assert expected[label] in message, (rank, label, message)
            assert "Qwen3ForCausalLM: context parallelism on 'cp'" in message and "model changed" not in message
            assert "\n" not in message
    assert two_ranks[0]["refusals"] == two_ranks[1]["refusals"]


def test_dcp_saves_one_copy_that_loads_unsharded_and_under_cp(two_ranks: list[dict[str, Any]]) -> None:
    for rank, by_case in enumerate(two_ranks):
        result = by_case["checkpoint"]
        assert result["mismatches"] == {"unsharded": [], "cp": []}, f"rank {rank}"
        # parameters are replicated on cp: the checkpoint holds one copy, not one per rank
        assert result["param_bytes"] <= result["stored_bytes"] < 1.2 * result["param_bytes"], result


def test_fsdp2_on_dp_over_cp_trains_like_one_process(four_ranks: list[dict[str, Any]]) -> None:
    for rank, by_case in enumerate(four_ranks):
        result = by_case["llama_dp2_cp2_fsdp2"]
        assert result.loss_err <= result.loss_tol, f"rank {rank}: loss {result.loss_err} > {result.loss_tol}"
        assert result.logits_err <= result.logits_tol, f"rank {rank}: logits {result.logits_err}"
        assert result.grads_checked > 0 and result.weights_checked == result.grads_checked
        assert not result.grad_failures, f"rank {rank}: " + "; ".join(result.grad_failures)
        assert not result.weight_failures, f"rank {rank}: after AdamW: " + "; ".join(result.weight_failures)
        assert result.local_bytes == result.expected_bytes == result.full_bytes  # replicated on cp


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mesh", ["cp4", "cp2_tp2", "cp2_tp2_sp"])
def test_four_ranks_match_the_unsharded_model(four_ranks: list[dict[str, CpResult]], family: str, mesh: str) -> None:
    _check(four_ranks, f"{family}_{mesh}")


def test_cp4_and_sp_cut_each_ranks_tokens(four_ranks: list[dict[str, CpResult]]) -> None:
    # cp 4: 13 tokens in 8 chunks (2, 2, 2, 2, 2, 1, 1, 1): rank r holds chunks r and 7 - r
    assert [by_case["llama_cp4"].local_tokens for by_case in four_ranks] == [[3, 3], [3, 3], [3, 3], [4, 4]]
    # cp 2 (chunks 4, 3, 3, 3: 7 and 6 tokens) x tp 2 (ranks 0, 1 are cp rank 0); --sp cuts each further on tp
    assert [by_case["llama_cp2_tp2"].local_tokens for by_case in four_ranks] == [[7, 7], [7, 7], [6, 6], [6, 6]]
    assert [by_case["llama_cp2_tp2_sp"].local_tokens for by_case in four_ranks] == [[4, 4], [3, 3], [3, 3], [3, 3]]


# ---- refusals: one line each, exit 2 and nothing written (the planner), on every rank (parallelize)

_REFUSED_CONFIGS = {
    "sliding-window attention (config.sliding_window=4)": dict(
        model_type="qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=0
    ),
    "ALiBi attention": dict(model_type="falcon", alibi=True, new_decoder_architecture=True),
    "recurrent or linear-attention layers (config.layer_types has linear_attention)": dict(model_type="qwen3_next"),
}


@pytest.mark.parametrize("why", sorted(_REFUSED_CONFIGS))
def test_hpgen_plan_cp_refuses_what_it_does_not_cover(tmp_path: Path, why: str) -> None:
    import json

    from click.testing import CliRunner

    from hpgen.cli import cli

    small = dict(hidden_size=64, intermediate_size=89, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**small, **_REFUSED_CONFIGS[why]}))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", str(config), "--cp", "2", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert f"--cp: context parallelism does not cover {why}" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not out.exists()


# the attention's function as the planner writes it, and by its module's own path (hpgen.core.plan_targets)
@pytest.mark.parametrize("module", ["hpgen.runtime.context_attention", "hpgen.runtime.context.attention"])
def test_hpgen_explain_shows_the_cp_collectives(tmp_path: Path, module: str) -> None:
    from click.testing import CliRunner

    from hpgen.cli import cli
    from tests.support.models import FAMILIES as MODELS

    plan = tmp_path / "plan.json"
    text = __import__("json").dumps(_plan("llama", cp=2))
    assert "hpgen.runtime.context_attention.gathered_kv_attention" in text
    plan.write_text(text.replace("hpgen.runtime.context_attention.", module + "."))
    result = CliRunner().invoke(cli, ["explain", str(MODELS["llama"].source()), str(plan)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = result.output
    assert "hidden_states: cp R -> S(1) ==> split(dim=1), backward all_gather" in text  # the cut, first layer
    assert "output: cp S(1) -> R ==> all_gather(dim=1), backward split" in text  # the final norm
    assert "key_states: cp S(2) -> R ==> all_gather(dim=2), backward reduce_scatter" in text
    assert "value_states: cp S(2) -> R ==> all_gather(dim=2), backward reduce_scatter" in text
    assert "rank r holds chunks r and 2*cp-1-r" in text
