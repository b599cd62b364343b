"""Whole heads on any tp size (``hpgen.plan/2``): hand-written plans on gloo ranks against the unsharded model.

Three spawns, each packing its cases (:mod:`tests.support.heads_cases`):

- 4 ranks: Llama-shaped 6 query / 2 key/value heads and Qwen2-shaped 14 / 2 (q/k/v biases)
  at tp 4, each group's query heads cut whole beside its replicated key/value head
  (``S(0,8,2)`` with ``RS(0,2)``, ``num_key_value_groups`` per rank); and the refusals:
  a plain ``S(0)`` that cuts heads says what the plan must say instead, a cut that leaves a
  rank with no head is refused in one line, the same on every rank;
- 3 ranks: 7 heads at tp 3 (3, 2, 2), and its checkpoints: ``from_pretrained`` reading each
  rank's boxes, the state dict (the uneven whole-head shards have no exact DTensor form:
  copies laid out DTensor's way), DCP saved at tp 3 and loaded into the unsharded model,
  ``save_pretrained``;
- 2 ranks: 7 heads at tp 2, multi-query Falcon (transformers' default architecture) with 8
  and 7 heads (``B(0, heads:S(0,8), 8:R, 8:R)``: one all-reduce a layer forward, the key and
  value rows' gradient summed in one more backward), multi-query GPTBigCode with 7 heads (its
  ``c_attn`` weight and bias as blocks, ``embed_dim`` per rank), the tp-3 DCP checkpoint loaded at tp 2,
  Falcon's blocks through ``from_pretrained``, DCP (loaded unsharded) and ``save_pretrained``,
  and LoRA on whole-head projections (Llama's ``S(0,8)``/``S(1,8)``, Falcon's blocks).

Each parity case compares the logits, every parameter's gradient (this rank's slice of the
reference's) and greedy generation with the cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.heads_cases import (
    attention_plan,
    bigcode_config,
    bigcode_plan,
    check,
    falcon_config,
    falcon_plan,
    llama_config,
    lowered,
    reference_of,
    run_cases,
)

LAYERS = 2


def _unsharded_round_trips(model, state, cls, config, expected, dcp_dir, saved_dir):
    """The names that differ from ``expected`` after a DCP save of ``state`` (into ``dcp_dir``) loaded into
    the unsharded ``cls``, and after ``save_pretrained`` (into ``saved_dir``) read back by ``cls.from_pretrained``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=dcp_dir)
    plain = cls(config)
    plain_state = plain.state_dict()
    dcp.load(plain_state, checkpoint_id=dcp_dir)
    plain.load_state_dict(plain_state)
    model.save_pretrained(saved_dir)
    saved = cls.from_pretrained(saved_dir)
    return tuple(
        [n for n, t in loaded.state_dict().items() if not torch.equal(t, expected[n])] for loaded in (plain, saved)
    )


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("heads")


# --------------------------------------------------------------------------- 4 ranks: grouped heads, refusals


def _cases4(directory: Path) -> dict[str, tuple[Any, dict[str, Any], str]]:
    cases = {}
    for name, config in (("llama_6_2_tp4", llama_config(6, 2)), ("qwen2_14_2_tp4", llama_config(14, 2, "qwen2"))):
        plan = attention_plan(config, 4)
        cases[name] = (config, plan, lowered(config, plan, str(directory / f"{name}.py")))
    return cases


def _run4(rank: int, world_size: int, cases: dict[str, tuple[Any, dict[str, Any], str]]) -> dict[str, Any]:
    """The parity cases, then the refusals (each a fresh model)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize
    from hpgen.runtime.errors import ParallelizeError
    from tests.support.heads_cases import reference_and_model
    from tests.support.models import load_plan_dict

    found = run_cases(rank, world_size, cases)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    config, _, generated = cases["llama_6_2_tp4"]  # a lowered Llama file: any Llama config builds from it
    plans = {"plain S(0)": (config, load_plan_dict("llama_tp"))}  # the query and key/value projections S(0)
    plain_kv = attention_plan(config, 4)
    for name in ("k_proj", "v_proj"):
        plain_kv["param_plan"]["model.layers.*.self_attn"]["params"][f"{name}.weight"] = {"tp": "S(0)"}
    plans["query heads S(0,8,2), key/value S(0)"] = (config, plain_kv)
    three_groups = attention_plan(config, 4)
    three_groups["param_plan"]["model.layers.*.self_attn"]["params"]["q_proj.weight"] = {"tp": "S(0,8,3)"}
    plans["3 groups on 4 ranks"] = (config, three_groups)
    three = llama_config(3, 3)
    whole = attention_plan(three, 4)  # 3 heads, each cut whole: S(0,8) on 4 ranks leaves one none
    whole["param_plan"]["model.layers.*.self_attn"]["params"] = {
        "q_proj.weight": {"tp": "S(0,8)"}, "k_proj.weight": {"tp": "S(0,8)"}, "v_proj.weight": {"tp": "S(0,8)"},
        "o_proj.weight": {"tp": "S(1,8)"},
    }  # fmt: skip
    whole["param_plan"]["model.layers.*.self_attn"].pop("local_attrs", None)
    plans["3 heads on 4 ranks"] = (three, whole)
    refusals = {}
    for label, (model_config, plan) in plans.items():
        _, model = reference_and_model(model_config, generated)
        try:
            parallelize(model, plan, mesh)
            refusals[label] = None
        except ParallelizeError as error:
            refusals[label] = str(error)
    found["refusals"] = refusals
    return found


@pytest.fixture(scope="module")
def results4(directory: Path) -> list[dict[str, Any]]:
    return run_distributed(_run4, _cases4(directory), world_size=4, timeout=400)


@pytest.mark.parametrize("name", ["llama_6_2_tp4", "qwen2_14_2_tp4"])
def test_grouped_heads_at_tp4(results4: list[dict[str, Any]], name: str) -> None:
    check(results4, name)
    # 6 query heads in 2 groups of 3, cut 2/1 beside their key/value head; 14 in groups of 7, cut 4/3
    rows = [by_case[name]["shapes"]["model.layers.0.self_attn.q_proj.weight"][0] // 8 for by_case in results4]
    assert rows == ([2, 1, 2, 1] if name.startswith("llama") else [4, 3, 4, 3]), rows
    kv = [by_case[name]["shapes"]["model.layers.0.self_attn.k_proj.weight"][0] // 8 for by_case in results4]
    assert kv == [1, 1, 1, 1], kv


def test_head_refusals_say_what_the_plan_must_say(results4: list[dict[str, Any]]) -> None:
    for by_case in results4:
        refusals = by_case["refusals"]
        assert all(message is not None and "\n" not in message for message in refusals.values()), refusals
        assert refusals == results4[0]["refusals"]  # the same on every rank
    refusals = results4[0]["refusals"]
    # llama_tp's S(0): the 2 key/value heads cannot cover 4 ranks; replicate them
    assert "k_proj.weight S(0) on axis 'tp' of size 4: dim 0 holds 2 key/value heads" in refusals["plain S(0)"]
    assert "Plan it RS(0,2): each head whole on 2 ranks" in refusals["plain S(0)"]
    assert "Plan it RS(0,2)" in refusals["query heads S(0,8,2), key/value S(0)"]
    assert refusals["3 groups on 4 ranks"].endswith(
        "q_proj.weight S(0,8,3) on axis 'tp': S(0,8,3) cuts the axis of size 4 into 3 sets of ranks, which does not divide"
    ), refusals["3 groups on 4 ranks"]
    assert refusals["3 heads on 4 ranks"].endswith(
        "k_proj.weight S(0,8) on axis 'tp': S(0,8): dim 0 holds 3 units of 8, fewer than the 4 ranks, so a rank would "
        "hold none (no head): at most 3 ranks"
    ), refusals["3 heads on 4 ranks"]


# --------------------------------------------------------------------------- 3 ranks: 7 heads, checkpoints


def _run3(rank: int, world_size: int, cases: dict[str, Any], root: str) -> dict[str, Any]:
    """7 heads at tp 3, then its checkpoints: from_pretrained, state dict, DCP, save_pretrained."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hpgen.runtime import from_pretrained
    from tests.support.models import expected_local, import_file, param_layouts, tolerance

    transformers.utils.logging.disable_progress_bar()
    found: dict[str, Any] = run_cases(rank, world_size, cases)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    config, plan, generated = cases["llama_7_tp3"]
    folder = f"{root}/llama_7"
    reference = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    expected = reference.state_dict()
    layouts = param_layouts(reference, plan)
    model = from_pretrained(import_file(generated).LlamaForCausalLM, folder, plan, mesh)

    def mismatches(candidate: torch.nn.Module) -> list[str]:
        ours = dict(candidate.named_parameters())
        return [
            n
            for n, full in expected.items()
            if not torch.equal(ours[n].detach(), expected_local(full, layouts.get(n, {}), ("tp",), mesh))
        ]

    ids = torch.arange(14).reshape(2, 7) % config.vocab_size
    with torch.no_grad():
        want = reference(ids).logits
        found["from_pretrained"] = mismatches(model)
        found["from_pretrained logits"] = ((model(ids).logits - want).abs().max().item(), tolerance(want))
    found["q_proj rows"] = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    state = model.state_dict()
    q = state["model.layers.0.self_attn.q_proj.weight"]
    found["q_proj state"] = (type(q).__name__, str(tuple(q.placements)), tuple(q.shape))
    found["dcp tp3 to unsharded"], found["save_pretrained"] = _unsharded_round_trips(
        model, state, transformers.LlamaForCausalLM, reference.config, expected, f"{root}/dcp3", f"{root}/saved3"
    )
    found["dtensor keys"] = sum(isinstance(v, DTensor) for v in state.values())
    return found


@pytest.fixture(scope="module")
def results3(directory: Path) -> list[dict[str, Any]]:
    config = llama_config(7, 7)
    plan = attention_plan(config, 3)
    reference_of(config).save_pretrained(directory / "llama_7")
    cases = {"llama_7_tp3": (config, plan, lowered(config, plan, str(directory / "llama_7_tp3.py")))}
    return run_distributed(_run3, cases, str(directory), world_size=3, timeout=400)


def test_seven_heads_at_tp3(results3: list[dict[str, Any]]) -> None:
    check(results3, "llama_7_tp3")
    assert [by_case["q_proj rows"] for by_case in results3] == [3 * 8, 2 * 8, 2 * 8]


def test_checkpoints_at_tp3(results3: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results3):
        for key in ("from_pretrained", "dcp tp3 to unsharded", "save_pretrained"):
            assert result[key] == [], f"rank {rank}: {key}: {result[key]}"
        err, tol = result["from_pretrained logits"]
        assert err <= tol, f"rank {rank}: {err} > {tol}"
        # 3, 2, 2 heads against DTensor's chunks of 24, 24, 8 rows: a copy laid out DTensor's way, full shape
        assert result["q_proj state"] == ("DTensor", "(Shard(dim=0),)", (56, 56))
        assert result["dtensor keys"] > 0


# --------------------------------------------------------------------------- 2 ranks: Falcon, DCP at tp 2, LoRA


def _run2(rank: int, world_size: int, cases: dict[str, Any], lora: list[Any], root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize
    from tests.support.heads_cases import reference_and_model
    from tests.support.lora import run_lora_case
    from tests.support.models import expected_local, param_layouts

    found: dict[str, Any] = run_cases(rank, world_size, cases)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    config, plan, generated = cases["llama_7_tp2"]
    reference, model = reference_and_model(config, generated)
    torch.manual_seed(100 + rank)  # weights that differ from the checkpoint's on every rank
    for param in model.parameters():
        param.data.normal_()
    parallelize(model, plan, mesh)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=f"{root}/dcp3")
    model.load_state_dict(state)
    layouts = param_layouts(reference, plan)
    ours = dict(model.named_parameters())
    found["dcp tp3 to tp2"] = [
        n
        for n, full in reference.state_dict().items()
        if not torch.equal(ours[n].detach(), expected_local(full, layouts.get(n, {}), ("tp",), mesh))
    ]
    found["lora"] = {case.name: run_lora_case(case, mesh, root) for case in lora}
    found["falcon checkpoints"] = _falcon_checkpoints(cases["falcon_7"], mesh, root)
    return found


def _falcon_checkpoints(case: tuple[Any, dict[str, Any], str], mesh: Any, root: str) -> dict[str, list[str]]:
    """Falcon's blocks through the checkpoints: from_pretrained (each rank's two boxes of query_key_value),
    DCP saved at tp 2 and loaded unsharded, save_pretrained."""
    import transformers

    from hpgen.runtime import from_pretrained
    from tests.support.models import expected_local, import_file, param_layouts

    transformers.utils.logging.disable_progress_bar()
    _, plan, generated = case
    folder = f"{root}/falcon_7"
    reference = transformers.FalconForCausalLM.from_pretrained(folder).eval()
    expected = reference.state_dict()
    layouts = param_layouts(reference, plan)
    model = from_pretrained(import_file(generated).FalconForCausalLM, folder, plan, mesh)
    ours = dict(model.named_parameters(remove_duplicate=False))
    found = {
        "from_pretrained": [
            n
            for n, full in expected.items()
            if n in ours and not torch.equal(ours[n].detach(), expected_local(full, layouts.get(n, {}), ("tp",), mesh))
        ]
    }
    found["dcp to unsharded"], found["save_pretrained"] = _unsharded_round_trips(
        model, model.state_dict(), transformers.FalconForCausalLM, reference.config, expected, f"{root}/dcp_falcon", f"{root}/falcon_saved"
    )
    return found


@pytest.fixture(scope="module")
def results2(directory: Path, results3: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from tests.support.derived_configs import tiny
    from tests.support.lora import LoraCase

    cases = {}
    for name, config, plan_of in (
        ("llama_7_tp2", llama_config(7, 7), lambda c: attention_plan(c, 2)),
        ("falcon_8", falcon_config(8), falcon_plan),
        ("falcon_7", falcon_config(7), falcon_plan),
        ("bigcode_7", bigcode_config(7), bigcode_plan),
    ):
        plan = plan_of(config)
        cases[name] = (config, plan, lowered(config, plan, str(directory / f"{name}.py")))
    reference_of(cases["falcon_7"][0]).save_pretrained(directory / "falcon_7")
    falcon = tiny("falcon")  # 4 heads of 16, multi-query
    falcon_lora_plan = falcon_plan(falcon)
    lora = [
        LoraCase(
            "lora_llama_7",
            "llama",
            cases["llama_7_tp2"][2],
            cases["llama_7_tp2"][1],
            ("q_proj", "v_proj", "o_proj"),
            config=dict(num_attention_heads=7, num_key_value_heads=7, head_dim=8, hidden_size=56),
        ),
        LoraCase(
            "lora_falcon",
            "falcon",
            lowered(falcon, falcon_lora_plan, str(directory / "falcon_lora.py")),
            falcon_lora_plan,
            ("query_key_value", "dense"),
        ),
    ]
    (directory / "plans.json").write_text(json.dumps({name: plan for name, (_, plan, _) in cases.items()}))
    return run_distributed(_run2, cases, lora, str(directory), world_size=2, timeout=400)


@pytest.mark.parametrize("name", ["llama_7_tp2", "falcon_8", "falcon_7", "bigcode_7"])
def test_whole_heads_at_tp2(results2: list[dict[str, Any]], name: str) -> None:
    check(results2, name)


@pytest.mark.parametrize("name", ["falcon_8", "falcon_7"])
def test_multi_query_falcon_reduces_once_a_layer(results2: list[dict[str, Any]], name: str) -> None:
    """Forward: the embedding's all-reduce, then one a layer (attention and MLP summed). Backward: the lm_head
    input's, one a layer for the shared norm's input, and one a layer summing the key and value rows'
    gradient (the replicated blocks of query_key_value, adjacent: one collective)."""
    for by_case in results2:
        assert by_case[name]["all_reduces"] == {"forward": 1 + LAYERS, "backward": 1 + 2 * LAYERS}
    shares = [by_case[name]["rank_bytes"] / by_case[name]["full_bytes"] for by_case in results2]
    assert max(shares) < 0.53, shares


def test_dcp_saved_at_tp3_loads_at_tp2(results2: list[dict[str, Any]]) -> None:
    for rank, by_case in enumerate(results2):
        assert by_case["dcp tp3 to tp2"] == [], f"rank {rank}"


def test_falcon_blocks_through_checkpoints(results2: list[dict[str, Any]]) -> None:
    for rank, by_case in enumerate(results2):
        for check, mismatches in by_case["falcon checkpoints"].items():
            assert mismatches == [], f"rank {rank}: {check}: {mismatches}"


@pytest.mark.parametrize("name", ["lora_llama_7", "lora_falcon"])
def test_lora_on_whole_head_projections(results2: list[dict[str, Any]], name: str) -> None:
    for rank, by_case in enumerate(results2):
        result = by_case["lora"][name]
        assert result.error is None, result.error
        assert result.grads_checked > 0 and not result.grad_failures, f"rank {rank}: {result.grad_failures}"
        assert not result.param_failures, f"rank {rank}: {result.param_failures}"
        assert len(result.losses) >= 3
        for loss, want in zip(result.losses, result.reference_losses):
            assert abs(loss - want) <= 1e-5 + 1e-5 * abs(want), f"rank {rank}: {result.losses}"
    assert results2[0]["lora"][name].replicated == results2[1]["lora"][name].replicated
