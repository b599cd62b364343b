"""``hpgen verify``: wrong plans caught and located, the plans ``hpgen plan`` writes proven exact.

Every case of ``tests/support/verify_corpus.py`` is prepared as ``hpgen verify`` prepares it (planned,
shrunk, lowered) on two processes, a core each (:func:`tests.support.spread.spread`), then runs in ONE
spawn of 2 gloo ranks (:func:`hpgen.verify.run.verify_many`). One test drives the real command line in a
subprocess for the exit codes and ``--json``; the others invoke it in this process (click's runner).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.spread import spread
from tests.support.verify_corpus import (
    CORRECT,
    CORRECT_TINY,
    EAGER,
    EAGER_TINY,
    FALCON,
    WRONG,
    config_plan,
    falcon_config,
    in_this_release,
    tiny_written_plan,
    written_plan,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from hpgen.verify.report import finding, planner_plan
    from hpgen.verify.run import verify_many

    folder = str(tmp_path_factory.mktemp("verify"))
    specs = [("wrong", name, folder) for name in WRONG]
    specs += [("correct", name, folder) for name in CORRECT]
    specs += [("tiny", name, folder) for name in CORRECT_TINY]
    specs += [("eager", name, folder) for name in EAGER]
    specs += [("eager_tiny", name, folder) for name in EAGER_TINY]
    specs += [("falcon", name, folder) for name in FALCON]
    specs = [spec for spec in specs if in_this_release(_model_type(spec))]  # the others are skipped, with why
    cases = spread(_prepared_case, specs, key=_model_type)  # planned and lowered on both cores
    found = {}
    for verdict in verify_many(cases, progress=False):
        located = None if verdict.exact else finding(verdict, planner_plan(verdict))
        found[verdict.case.name] = (verdict, located)
    return found


def _model_type(spec: tuple[str, str, str]) -> str:
    """The model type a spec of ``verdicts`` plans (the specs of one type share its process and its plans)."""
    kind, name, _ = spec
    if kind == "wrong":
        return WRONG[name].model_type
    if kind in ("tiny", "eager_tiny"):
        return CORRECT_TINY[name][0]
    return "falcon" if kind == "falcon" else CORRECT[name][0]


def _prepared_case(spec: tuple[str, str, str]) -> Any:
    """One case of the corpus (kind, name, folder) as ``hpgen verify`` prepares it: the plan made (with its mistake),
    the config shrunk, the modeling file lowered (on a process of :func:`tests.support.spread.spread`)."""
    from hpgen.verify.prepare import prepare

    kind, name, folder = spec
    if kind == "wrong":
        wrong = WRONG[name]
        return prepare(wrong.plan(), Path(folder) / name, model=wrong.model_type, name=name)
    if kind == "tiny":
        model_type, flags = CORRECT_TINY[name]
        return prepare(tiny_written_plan(model_type, **dict(flags)), Path(folder) / name, model=model_type, name=name)
    if kind == "eager_tiny":
        model_type, flags = CORRECT_TINY[name]
        planned = tiny_written_plan(model_type, **dict(flags))
        case = prepare(planned, Path(folder) / f"{name}_eager", model=model_type, name=f"{name}_eager")
        case.config._attn_implementation = "eager"  # (the config object travels with the case)
        return case
    if kind == "falcon":
        arguments, attention = FALCON[name]
        config = falcon_config(arguments)
        config.save_pretrained(Path(folder) / name / "config")
        case = prepare(config_plan(config), Path(folder) / name, model=str(Path(folder) / name / "config"), name=name)
        case.config._attn_implementation = attention  # the shrunk config keeps transformers' default (sdpa)
        return case
    model_type, flags = CORRECT[name]
    if kind == "correct":
        return prepare(written_plan(model_type, **dict(flags)), Path(folder) / name, model=model_type, name=name)
    case = prepare(written_plan(model_type, **dict(flags)), Path(folder) / f"{name}_eager", model=model_type, name=f"{name}_eager")
    case.config._attn_implementation = "eager"  # (the config object travels with the case)
    return case


def _needs(model_type: str) -> None:
    """Skip where the installed transformers lacks ``model_type``: its cases run on the releases that have it."""
    if model_type and not in_this_release(model_type):
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")


@pytest.mark.parametrize(
    "name", sorted([*CORRECT, *CORRECT_TINY, *(f"{name}_eager" for name in (*EAGER, *EAGER_TINY)), *FALCON])
)
def test_written_plans_are_exact(verdicts: dict[str, Any], name: str) -> None:
    _needs(CORRECT_TINY.get(name.removesuffix("_eager"), ("",))[0])
    verdict, located = verdicts[name]
    assert verdict.exact, located["message"] if located else verdict
    assert {"logits", "gradients", "greedy generation"} <= {check.name for check in verdict.checks}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_plans_are_caught_and_located(verdicts: dict[str, Any], name: str) -> None:
    wrong = WRONG[name]
    verdict, located = verdicts[name]
    assert not verdict.exact  # proven wrong on 2 ranks: a difference, a crash or a refusal
    message = located["message"]
    if wrong.side == "parallelize":
        assert verdict.raised is not None and verdict.raised.refused, message
        assert wrong.fqn in message
        return
    if wrong.side == "raised":
        assert verdict.raised is not None and not verdict.raised.refused and verdict.raised.stage == "forward", message
    else:
        assert verdict.raised is None, message
        assert located["side"] == wrong.side, message
    assert located["fqn"].startswith(wrong.fqn), message
    assert located["fqn"] in message and located["cls"] in message
    if wrong.entry is not None:
        assert located["entry"] == wrong.entry, message
    if not wrong.planner:
        return
    # the planner reads the source otherwise, and says what it would declare
    assert located.get("planner"), message
    assert "hpgen plan would declare" in message, message


def test_the_inkling_case_verifies_its_shared_experts() -> None:
    # the plan the inkling_text cases verify (sdpa and eager) holds the shared experts column- then row-parallel,
    # their output reduced: read from the weights' shapes on 5.25, from transformers' plan on 5.24
    _needs("inkling_text")
    entry = tiny_written_plan("inkling_text")["param_plan"]["model.layers.*.mlp.shared_experts"]
    assert entry["params"] == {"gate_proj": {"tp": "S(1)"}, "up_proj": {"tp": "S(1)"}, "down_proj": {"tp": "S(2)"}}
    assert entry["out_src"] == {"output": {"tp": "P(sum)"}}


def test_the_report_names_the_partial_sum(verdicts: dict[str, Any]) -> None:
    _, located = verdicts["attention_out_R_for_P"]
    message = located["message"]
    assert message.startswith("model.layers.0.self_attn (LlamaAttention): forward: output attn_output differs")
    assert "out_src {attn_output tp R}" in message
    assert "did you mean out_src attn_output tp P(sum) (the body returns a partial sum: o_proj row-parallel)?" in message


def test_correct_gradients_only_differ_where_the_plan_is_wrong(verdicts: dict[str, Any]) -> None:
    # exact logits, 4 wrong gradients: the q/k norms of the two layers, nothing else
    verdict, _ = verdicts["qk_norm_missing_grad_reduce"]
    assert [check.ok for check in verdict.checks if check.name == "logits"] == [True]
    assert sorted(d.what.rsplit(".", 2)[-2] for d in verdict.params) == ["k_norm", "k_norm", "q_norm", "q_norm"]


def _hpgen(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpgen", *args], capture_output=True, text=True, cwd=cwd, timeout=240)


def test_the_command_line(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(WRONG["attention_out_R_for_P"].plan()))
    done = _hpgen("verify", str(plan), "llama", "--json", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["exact"] is False and report["mesh"] == {"tp": 2}
    assert report["finding"]["fqn"] == "model.layers.0.self_attn" and report["finding"]["side"] == "forward"
    stages = [line for line in done.stderr.splitlines() if line.startswith("hpgen verify:")]
    assert len(stages) >= 4, done.stderr  # a progress line per stage
    # bad input: exit 2, one line naming the file or the place, no traceback (in-process: nothing spawns)
    from click.testing import CliRunner

    from hpgen.cli import cli

    bad = tmp_path / "bad.json"
    bad.write_text('{"mesh_dim_names": ["tp"], "param_plan": {"x": {"out_src": {"output": {"tp": "S(x)"}}}}}')
    for args, where in (((str(bad), "llama"), "bad.json"), ((str(plan), "no_such_model_type"), "no_such_model_type"),
                        ((str(plan), "llama", "--ranks", "0"), "--ranks"),
                        ((str(plan), "llama", "--source", str(tmp_path / "missing.py")), "missing.py")):
        result = CliRunner().invoke(cli, ["verify", *args])
        assert result.exit_code == 2, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert "Traceback" not in result.output and where in result.output, result.output


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_command_line_runs_the_attention_implementation_asked_for(tmp_path: Path, attention: str) -> None:
    # the command in this process (click's runner): its ranks still spawn and verify, but this process's
    # torch, transformers and forkserver serve them (the subprocess's own start-up: test_the_command_line)
    from click.testing import CliRunner

    from hpgen.cli import cli

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(written_plan("llama")))
    done = CliRunner().invoke(cli, ["verify", str(plan), "llama", "--attn-implementation", attention, "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["exact"] is True and report["attn_implementation"] == attention
    text = CliRunner().invoke(cli, ["verify", str(plan), "llama", "--attn-implementation", "flash"])
    assert text.exit_code == 2 and (text.exception is None or isinstance(text.exception, SystemExit)), text.exception
    assert "Traceback" not in text.output and "--attn-implementation" in text.stderr, text.output


def test_prepare_sets_the_attention_on_the_tiny_config(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hpgen.core.errors import HpgenError
    from hpgen.verify.prepare import prepare

    for attention in ("eager", "sdpa"):
        case = prepare(written_plan("llama"), tmp_path / attention, model="llama", attn_implementation=attention)
        model = AutoModelForCausalLM.from_config(case.config)  # what each rank builds, unsharded and generated
        assert model.config._attn_implementation == attention
    with pytest.raises(HpgenError, match="choose one of eager, sdpa"):
        prepare(written_plan("llama"), tmp_path / "x", model="llama", attn_implementation="flash")


def test_the_tiny_copy_keeps_key_value_heads_under_another_name_valid(tmp_path: Path) -> None:
    # Falcon counts key/value heads in num_kv_heads: per head (as many as query heads) they shrink with the
    # query heads, grouped they become the tiny key/value count; transformers' own model runs either copy
    import torch
    from transformers import AutoModelForCausalLM

    from hpgen.verify.shrink import tiny_config

    for arguments, expected in (
        ({"hidden_size": 64, "num_attention_heads": 8, "multi_query": False}, (4, 4)),
        ({"hidden_size": 512, "num_attention_heads": 32, "new_decoder_architecture": True, "num_kv_heads": 8}, (4, 2)),
    ):
        config = tiny_config(falcon_config(arguments))
        assert (config.num_attention_heads, config.num_kv_heads) == expected, arguments
        model = AutoModelForCausalLM.from_config(config)
        assert model(torch.arange(7)[None]).logits.shape == (1, 7, 127)


def test_folded_layers_are_of_the_kind_they_stand_for(tmp_path: Path) -> None:
    # Inkling's plan names its 66 layers (sliding and hybrid ones differ): folded to 22 tiny layers, whose
    # layer_types must say what each stands for; left at the tiny count, transformers' model indexed past the end
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpgen.verify.prepare import prepare

    case = prepare(written_plan("inkling_text"), tmp_path, model="inkling_text")
    given = AutoConfig.for_model("inkling_text")
    firsts = [int(name.rpartition(".")[2].split("-")[0]) for name in case.layers]
    assert len(firsts) > 2 and case.config.num_hidden_layers == len(firsts)
    assert case.config.layer_types == [given.layer_types[index] for index in firsts]
    AutoModelForCausalLM.from_config(case.config)


def test_the_tiny_copy_keeps_the_users_options(tmp_path: Path) -> None:
    # a config.json (as in a checkpoint folder): its own options stay, its sizes shrink
    from transformers import LlamaConfig

    from hpgen.verify.prepare import prepare

    LlamaConfig(attention_bias=True, rms_norm_eps=1e-5, num_hidden_layers=40, hidden_size=8192).save_pretrained(tmp_path)
    plan = written_plan("llama")
    case = prepare(plan, tmp_path / "out", model=str(tmp_path))
    assert case.config.attention_bias is True and case.config.rms_norm_eps == 1e-5
    assert (case.config.hidden_size, case.config.num_hidden_layers, case.config.num_key_value_heads) == (64, 2, 2)
    assert case.mesh == (("tp", 2),) and case.reference_file is None
    # without MODEL: the plan's model_class, transformers' default config
    assert prepare(plan, tmp_path / "default").config.hidden_size == 64
    # --source: that file is lowered, and the unsharded class comes from it
    import transformers.models.llama.modeling_llama as source

    case = prepare(plan, tmp_path / "source", source=source.__file__)
    assert case.reference_file == str(Path(source.__file__).resolve())
    assert case.reference_package == "transformers.models.llama"
    assert "_forward_impl" in Path(case.generated).read_text()


def test_larger_axes_scale_the_heads(tmp_path: Path) -> None:
    # Mistral's 8 key/value heads on --tp 16 are replicated RS(0,2): the tiny copy runs on 2 x 2 ranks,
    # 8 query heads and 2 key/value heads; --ranks 8 doubles them
    from hpgen.planner.entry.make import make_plan
    from hpgen.verify.prepare import prepare

    plan = make_plan("mistral", tp=16)
    case = prepare(plan, tmp_path / "4", model="mistral")
    assert case.mesh == (("tp", 4),)
    assert (case.config.num_attention_heads, case.config.num_key_value_heads) == (8, 2)
    case = prepare(plan, tmp_path / "8", model="mistral", ranks=8)
    assert case.mesh == (("tp", 8),)
    assert (case.config.num_attention_heads, case.config.num_key_value_heads) == (16, 4)


def _six_head_plans() -> dict[str, dict[str, Any]]:
    """For a Llama of 6 query and 2 key/value heads of 128 at 4 ranks: the whole-head plan (hpgen.plan/2), and
    hpgen.plan/1's plain cut, which would split a head."""
    from tests.support.models import load_plan_dict

    whole = load_plan_dict("llama_tp")
    whole["format"] = "hpgen.plan/2"
    attention = whole["param_plan"]["model.layers.*.self_attn"]
    attention["params"] = {
        "q_proj.weight": {"tp": "S(0,128,2)"}, "k_proj.weight": {"tp": "RS(0,2)"}, "v_proj.weight": {"tp": "RS(0,2)"},
        "o_proj.weight": {"tp": "S(1,128,2)"},
    }  # fmt: skip
    attention["local_attrs"] = {
        "num_key_value_groups": {"of": "q_proj.weight", "dim": 0, "per": {"of": "k_proj.weight", "dim": 0}}
    }
    plain = load_plan_dict("llama_tp")
    plain["param_plan"]["model.layers.*.self_attn"]["params"]["k_proj.weight"] = {"tp": "RS(0,2)"}
    plain["param_plan"]["model.layers.*.self_attn"]["params"]["v_proj.weight"] = {"tp": "RS(0,2)"}
    return {"whole_heads": whole, "plain_cut": plain}


def test_the_tiny_copy_keeps_heads_that_do_not_divide(tmp_path: Path) -> None:
    """6 heads at --ranks 4 are proven on 6 heads (head_dim shrinks instead, the plan's units with it): the
    whole-head plan is exact, the plain cut is refused, where a 4-head copy would have called it exact."""
    from transformers import LlamaConfig

    from hpgen.verify.prepare import prepare
    from hpgen.verify.run import verify_many

    LlamaConfig(hidden_size=768, num_attention_heads=6, num_key_value_heads=2, head_dim=128).save_pretrained(tmp_path)
    cases = [
        prepare(plan, tmp_path / name, model=str(tmp_path), ranks=4, name=name) for name, plan in _six_head_plans().items()
    ]
    config = cases[0].config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size) == (6, 2, 16, 96)
    assert cases[0].mesh == (("tp", 4),)
    params = cases[0].plan["param_plan"]["model.layers.*.self_attn"]["params"]
    assert params["q_proj.weight"] == {"tp": "S(0,16,2)"} and params["o_proj.weight"] == {"tp": "S(1,16,2)"}
    whole, plain = verify_many(cases, progress=False)
    assert whole.exact, whole
    assert {"logits", "gradients", "greedy generation"} <= {check.name for check in whole.checks}
    assert not plain.exact and plain.raised is not None and plain.raised.refused
    assert "o_proj.weight S(1) on axis 'tp' of size 4: dim 1 holds 6 attention heads" in plain.raised.error
    assert "Plan it S(1,16): whole heads" in plain.raised.error, plain.raised.error


def test_a_removed_gather_of_a_vocabulary_that_does_not_divide_is_named(tmp_path: Path) -> None:
    # 127 rows over tp 2 (64 and 63): lm_head's output gather left out, the model returns each rank's rows
    from transformers import LlamaConfig

    from hpgen.planner.entry.make import make_plan
    from hpgen.verify.prepare import prepare
    from hpgen.verify.report import finding, planner_plan
    from hpgen.verify.run import verify_many

    config = tmp_path / "config.json"
    config.write_text(LlamaConfig(vocab_size=127, hidden_size=64, intermediate_size=89, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2).to_json_string())
    plan = make_plan(str(config), tp=2)
    plan["param_plan"]["lm_head"]["out_dst"] = {"output": {"tp": "S(-1)"}}
    (verdict,) = verify_many([prepare(plan, tmp_path / "case", model=str(config), name="vocab127")], progress=False)
    assert not verdict.exact
    located = finding(verdict, planner_plan(verdict))
    assert located["fqn"] == "lm_head" and located["entry"] == "lm_head", located["message"]
    assert "(2, 7, 64) on this rank, (2, 7, 127) unsharded" in located["message"]
