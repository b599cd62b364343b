"""The summed reduction (a parallel-residual block's two branches reduced once): plan, planner, generated code.

The runtime side, parity on 2 gloo ranks and the collectives counted there, lives in
``tests/runtime/forward/test_parity_derived.py`` (one shared spawn with the other derived families).
"""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpgen.cli import cli
from hpgen.core.errors import HpgenError
from hpgen.generator.lower import lower
from hpgen.core.plan import load_plan, plan_from_dict

from tests.conftest import FIXTURES, transformers_modeling_file

SOURCE = FIXTURES / "modeling_tiny_parallel.py"
PLAN = FIXTURES / "plan_tp_summed.json"
# family -> (its modeling file, the block class, the branches in the order the sum adds them, the shared norm
# or, where each branch reads its own norm of the block input, (the norm run first, the other))
BLOCKS = {
    "gptj": ("gptj", "GPTJBlock", ("attn", "mlp"), "ln_1"),
    "phi": ("phi", "PhiDecoderLayer", ("self_attn", "mlp"), "input_layernorm"),
    "cohere": ("cohere", "CohereDecoderLayer", ("self_attn", "mlp"), "input_layernorm"),
    "stablelm": ("stablelm", "StableLmDecoderLayer", ("self_attn", "mlp"), "input_layernorm"),
    "gpt_neox": ("gpt_neox", "GPTNeoXLayer", ("mlp", "attention"), ("input_layernorm", "post_attention_layernorm")),
    # lowered here only (their default configs): parity runs on the others
    "cohere2": ("cohere2", "Cohere2DecoderLayer", ("self_attn", "mlp"), "input_layernorm"),
    "codegen": ("codegen", "CodeGenBlock", ("attn", "mlp"), "ln_1"),
}


def _plan_document() -> dict:
    return json.loads(PLAN.read_text())


def _planned(family: str, **options: object) -> dict:
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import load_config, meta_model
    from tests.support.derived_configs import CONFIGS, tiny

    config = tiny(family) if family in CONFIGS else load_config(family)
    return plan_model(meta_model(config), tp=2, name=family, **options)


def _function(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (function,) = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return function


def _terms(node: ast.expr) -> list[str]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _terms(node.left) + _terms(node.right)
    return [ast.dump(node)]


class _Unreduce(ast.NodeTransformer):
    """``self._hp_tp.all_reduce(x)`` (or ``reduce_scatter(x, dim=1)``) back to ``x``."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        node = self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute) and func.value.attr == "_hp_tp":
            return node.args[0]
        return node


def _statements(function: ast.FunctionDef) -> list[ast.stmt]:
    return [node for node in ast.walk(ast.Module(function.body, [])) if isinstance(node, ast.stmt)]


def _assert_only_the_sum_changed(original: ast.FunctionDef, generated: ast.FunctionDef) -> None:
    """Every statement of the body is the original's but one, whose sum has the same terms, two of them reduced."""
    before, after = _statements(original), _statements(generated)
    assert len(before) == len(after)
    # an ``if`` holding the edited statement differs only through it
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if ast.dump(a) != ast.dump(b) and not isinstance(b, ast.If)]
    assert len(changed) == 1, [ast.unparse(after[i]) for i in changed]
    old, new = before[changed[0]], after[changed[0]]
    assert type(old) is type(new) and ast.unparse(new).count("._hp_tp.") == 1
    restored = _Unreduce().visit(copy.deepcopy(new))
    assert ast.dump(restored) != ast.dump(old) or "+" in ast.unparse(old)
    assert sorted(_terms(old.value)) == sorted(_terms(restored.value))  # the same sum, reassociated at most


def test_the_fixture_body_changes_only_in_its_sum() -> None:
    generated = ast.parse(lower(SOURCE.read_text(), load_plan(PLAN), source_name=SOURCE.name))
    original = ast.parse(SOURCE.read_text())
    _assert_only_the_sum_changed(
        _function(original, "TinyParallelBlock", "forward"), _function(generated, "TinyParallelBlock", "_forward_impl")
    )


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_transformers_blocks_are_recognised_and_change_only_in_their_sum(family: str) -> None:
    model_dir, cls, branches, shared = BLOCKS[family]
    plan = _planned(family)
    (key,) = [k for k, entry in plan["param_plan"].items() if "summed_reduction" in entry]
    pair = {"shared_input": shared[0], "paired_input": shared[1]} if isinstance(shared, tuple) else {"shared_input": shared}
    expected = {"branches": list(branches), **(pair if shared else {})}
    assert plan["param_plan"][key]["summed_reduction"] == expected
    for branch in branches:
        entry = plan["param_plan"][f"{key}.{branch}"]
        assert all(layout["tp"] == "P(sum)" for layout in entry["out_dst"].values())
        assert ("in_grad_partial" in entry) == (shared is not None)
    path = transformers_modeling_file(model_dir)
    text = lower(path.read_text(), plan_from_dict(plan), source_name=path.name)
    assert text.count("# hpgen summed reduction:") == 1
    _assert_only_the_sum_changed(_function(ast.parse(path.read_text()), cls, "forward"), _function(ast.parse(text), cls, "_forward_impl"))


def test_sequence_parallel_blocks_reduce_scatter_once() -> None:
    plan = _planned("gptj", sp=True)
    path = transformers_modeling_file("gptj")
    text = lower(path.read_text(), plan_from_dict(plan), source_name=path.name)
    assert "return self._hp_tp.reduce_scatter(attn_output + feed_forward_hidden_states, dim=1) + residual" in text
    assert "ln_1 output: tp S(1) -> R ==> all_gather(dim=1) for both branches" in text


def test_a_sequential_residual_block_and_the_option_off_keep_two_reductions() -> None:
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model
    from tests.support.derived_configs import tiny

    config = tiny("stablelm")
    config.use_parallel_residual = False  # the other branch of its forward: x + attn, then + mlp
    for plan in (plan_model(meta_model(config), tp=2, name="stablelm"), _planned("gptj", summed=False)):
        assert not any("summed_reduction" in entry for entry in plan["param_plan"].values())
        assert all(
            layout.get("tp") != "P(sum)" for entry in plan["param_plan"].values() for layout in entry.get("out_dst", {}).values()
        )


def test_explain_shows_the_edit_and_the_shared_input() -> None:
    result = CliRunner().invoke(cli, ["explain", str(SOURCE), str(PLAN)], catch_exceptions=False)
    assert result.exit_code == 0
    assert "summed reduction of attn + mlp, once (the one edit in the body):" in result.output
    assert "return self._hp_tp.all_reduce(attn_output + feed_forward_hidden_states) + residual" in result.output
    assert "ln_1 output: tp R -> R ==> copy, backward all_reduce" in result.output


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p["transformer.h.*"]["summed_reduction"].update(branches=["attn"]), "needs exactly two branches"),
        (lambda p: p["transformer.h.*"]["summed_reduction"].update(branches=["attn", "ln_2"]), "no param_plan entry"),
        (lambda p: p["transformer.h.*.mlp"]["out_dst"]["output"].update(tp="R"), "must stay P\\(sum\\)"),
        (lambda p: p["transformer.h.*"]["summed_reduction"].update(shared_input="attn"), "is a branch"),
        (lambda p: p["transformer.h.*"]["summed_reduction"].update(extra=1), "unknown key 'extra'"),
        (lambda p: p["transformer.h.*.mlp"].update(in_grad_partial=["x"]), "'x' is not a declared input"),
    ],
)
def test_bad_summed_reductions_are_refused_with_their_place(change, message: str) -> None:
    document = _plan_document()
    change(document["param_plan"])
    with pytest.raises(HpgenError, match=message) as error:
        plan_from_dict(document, name="plan.json")
    assert "param_plan" in str(error.value)


def test_a_body_without_the_sum_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "modeling_tiny_parallel.py"
    source.write_text(SOURCE.read_text().replace("return attn_output + feed_forward_hidden_states + residual", "return attn_output + residual + feed_forward_hidden_states.mean()"))
    output = tmp_path / "out.py"
    result = CliRunner().invoke(cli, ["lower", str(source), str(PLAN), "-o", str(output)])
    assert result.exit_code == 2
    assert "modeling_tiny_parallel.py" in result.output and "no expression adds the outputs of self.attn and self.mlp" in result.output
    assert "Traceback" not in result.output and not output.exists()


def test_hpgen_plan_writes_it_unless_told_not_to(tmp_path: Path) -> None:
    from tests.support.derived_configs import tiny

    tiny("gptj").save_pretrained(tmp_path)
    config, runner = str(tmp_path / "config.json"), CliRunner()
    summed = runner.invoke(cli, ["plan", config, "--tp", "2", "--explain"], catch_exceptions=False)
    two = runner.invoke(cli, ["plan", config, "--tp", "2", "--no-summed-reduction"], catch_exceptions=False)
    assert summed.exit_code == two.exit_code == 0
    assert "reduced once: transformer.h.*: attn + mlp reduced once, summed" in summed.stderr
    assert '"summed_reduction"' in summed.stdout and '"summed_reduction"' not in two.stdout


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ((), (("attn", "mlp"), "ln_1")),
        # a non-linear module between a branch and the sum: not a summed block
        (("attn_output = self.resid_dropout(attn_output)", "attn_output = self.ln_1(attn_output)"), None),
        # the branch's output read again: not a summed block
        (("return attn_output + feed_forward_hidden_states + residual", "return attn_output + feed_forward_hidden_states + residual + attn_output.mean()"), None),
        # the norm's output read by something else too: summed, but each branch keeps its own copy
        (("return attn_output + feed_forward_hidden_states + residual", "return attn_output + feed_forward_hidden_states + residual + hidden_states"), (("attn", "mlp"), None)),
        # the norm also run for something else: a hook on it would copy that output too
        (("residual = hidden_states", "residual = hidden_states + 0 * self.ln_1(hidden_states)"), (("attn", "mlp"), None)),
    ],
)
def test_the_planner_reads_the_block_from_its_source(tmp_path: Path, change: tuple[str, ...], expected) -> None:
    import importlib.util
    import sys

    from hpgen.planner.passes.summed_reductions import find_summed_block

    text = SOURCE.read_text()
    if change:
        assert change[0] in text
        text = text.replace(change[0], change[1])
    path = tmp_path / f"modeling_variant_{abs(hash(change))}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    block = module.TinyParallelBlock(module.TinyParallelConfig())
    found = find_summed_block(block, ("attn", "mlp"), {"attn": "hidden_states", "mlp": "hidden_states"})
    assert (None if found is None else (found.branches, found.shared_input)) == expected


def test_a_sum_written_in_place_becomes_one_reduced_assignment() -> None:
    """Falcon's form, ``mlp_output += attention_output``: the augmented assignment is the site."""
    text = SOURCE.read_text().replace(
        "        return attn_output + feed_forward_hidden_states + residual\n",
        "        feed_forward_hidden_states += attn_output\n        return feed_forward_hidden_states + residual\n",
    )
    generated = lower(text, load_plan(PLAN), source_name=SOURCE.name)
    expected = "        feed_forward_hidden_states = self._hp_tp.all_reduce(feed_forward_hidden_states + attn_output)\n"
    assert expected in generated
    assert "        return feed_forward_hidden_states + residual\n" in generated


def test_a_test_on_a_branch_module_takes_the_path_the_instance_takes() -> None:
    """``if self.mlp is not None:`` around a branch's call, ``if self.attn is None:`` before the sum: the plan
    names both branches, so the block holds them and the lowering follows the path the planner read (it
    found no sum: after an ``if`` without ``else`` the call's value was unknown)."""
    text = SOURCE.read_text().replace(
        "        feed_forward_hidden_states = self.mlp(hidden_states)\n"
        "        return attn_output + feed_forward_hidden_states + residual\n",
        "        if self.mlp is not None:\n"
        "            feed_forward_hidden_states = self.mlp(hidden_states)\n"
        "        if self.attn is None:\n"
        "            return feed_forward_hidden_states + residual\n"
        "        else:\n"
        "            return attn_output + feed_forward_hidden_states + residual\n",
    )
    generated = lower(text, load_plan(PLAN), source_name=SOURCE.name)
    assert "            return feed_forward_hidden_states + residual\n" in generated
    assert "            return self._hp_tp.all_reduce(attn_output + feed_forward_hidden_states) + residual\n" in generated
    assert generated.count("# hpgen summed reduction:") == 1


def test_ernie_moe_shared_experts_guarded_by_their_none_test_are_summed_under_sp() -> None:
    """Ernie-4.5-MoE calls and adds its shared experts under ``if self.shared_experts is not None:``; with
    ``--sp`` the planner sums them with the routed experts, and the lowering places that one sum."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model, model_and_config
    from hpgen.verify.shrink import tiny_config

    _, config = model_and_config(tiny_config("ernie4_5_moe"))
    plan = plan_model(meta_model(config), tp=2, name="ernie4_5_moe", sp=True)
    (key,) = [k for k, entry in plan["param_plan"].items() if "summed_reduction" in entry]
    assert plan["param_plan"][key]["summed_reduction"] == {"branches": ["experts", "shared_experts"]}
    path = transformers_modeling_file("ernie4_5_moe")
    text = lower(path.read_text(), plan_from_dict(plan), source_name=path.name)
    assert "final_hidden_states = self._hp_tp.all_reduce(final_hidden_states + shared_output)" in text
    _assert_only_the_sum_changed(
        _function(ast.parse(path.read_text()), "Ernie4_5_MoeSparseMoeBlock", "forward"),
        _function(ast.parse(text), "Ernie4_5_MoeSparseMoeBlock", "_forward_impl"),
    )


@pytest.mark.parametrize("family", ["falcon_nda", "falcon_mha"])
def test_falcon_attention_is_sharded_by_heads_and_summed_with_the_mlp(family: str) -> None:
    """The rotary configs' dead ALiBi branch (the model passes ``alibi=None``) no longer blocks dividing the
    heads: the fused query_key_value is cut by whole heads / key-value groups and the block reduces once."""
    plan = _planned(family)["param_plan"]
    attention = plan["transformer.h.*.self_attention"]
    assert attention["params"] == {"query_key_value.weight": {"tp": "S(0)"}, "dense.weight": {"tp": "S(1)"}}
    # the head count the fused output's reshape reads is divided on every release: the grouped layout views it by
    # key/value groups, the per-head one by heads (transformers 5.24 divides both, 5.25's forward reads only that one)
    assert {"falcon_nda": "num_kv_heads", "falcon_mha": "num_heads"}[family] in attention["tp_divide_attrs"]
    assert plan["transformer.h.*"]["summed_reduction"]["branches"] == ["mlp", "self_attention"]


def test_falcon_keeps_its_attention_whole_where_alibi_reads_its_heads() -> None:
    """ALiBi (read by heads, not sharded) keeps the attention whole, and no summed reduction is written; multi-query
    Falcon (``[Q heads | K | V]``) is sharded and summed (tests/planner/derive/heads/test_uneven.py)."""
    from tests.support.derived_configs import tiny

    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    config = tiny("falcon_mha")
    config.alibi = True
    plan = plan_model(meta_model(config), tp=2, name="falcon_mha")["param_plan"]
    assert "transformer.h.*.self_attention" not in plan and "summed_reduction" not in plan.get("transformer.h.*", {})
    multi_query = plan_model(meta_model(tiny("falcon")), tp=2, name="falcon")["param_plan"]
    assert multi_query["transformer.h.*.self_attention"]["params"]["query_key_value.weight"] == {
        "tp": "B(0,64:S(0),16:R,16:R)"
    }
    assert multi_query["transformer.h.*"]["summed_reduction"]["branches"] == ["mlp", "self_attention"]


def _caller_calls(source: str) -> list[frozenset[str]]:
    """The None keywords of each call the caller's reading collects from ``source`` (``self.use_alibi`` False)."""
    import ast as _ast

    from hpgen.planner.flow.caller_nones import _Walk

    class Owner:
        use_alibi = False

    walk = _Walk(Owner(), {})
    walk.block(_ast.parse(source).body, in_loop=False)
    return walk.calls


def test_a_layer_argument_is_none_only_where_every_round_of_the_loop_passes_none() -> None:
    """The caller's reading folds ``if`` tests on the instance and forgets a name the loop rebinds."""
    calls = _caller_calls(
        "alibi = None\nmask = None\nif self.use_alibi:\n    alibi = build()\n"
        "for block in self.h:\n    out = block(x, alibi=alibi, mask=mask)\n    mask = out\n"
    )
    assert frozenset.intersection(*calls) == {"alibi"}


def test_a_call_in_a_branch_the_instance_rules_out_does_not_count() -> None:
    """Only the statements that run are read: a call in a folded-away ``if`` branch inside the loop adds nothing,
    and a statement nested in the loop is read once."""
    calls = _caller_calls(
        "alibi = None\nfor block in self.h:\n    if self.use_alibi:\n        out = block(x, alibi=build())\n"
        "    else:\n        out = block(x, alibi=alibi)\n    for sub in self.extra:\n        y = sub(y, alibi=None)\n"
    )
    assert calls == [frozenset({"alibi"}), frozenset({"alibi"})]


def test_summed_reductions_leave_the_draft_they_are_given_as_it_was() -> None:
    # the passes after the translator return new drafts: the translated draft (gptj's block
    # sums attn + mlp) is still the plan without the summed reduction after the pass
    from hpgen.planner.model.load import load_config, meta_model
    from hpgen.planner.passes.summed_reductions import add_summed_reductions
    from hpgen.planner.translate.translator import translated_draft

    model = meta_model(load_config("gptj"))
    draft = translated_draft(model, tp=2, name="gptj")
    before = draft.document()
    summed = add_summed_reductions(model, draft)
    assert draft.document() == before
    assert summed.document() != before
    (key,) = [key for key, entry in summed.entries.items() if entry.summed_reduction is not None]
    assert summed.entries[key].summed_reduction.branches == ("attn", "mlp")
    assert all(entry.summed_reduction is None for entry in draft.entries.values())
