"""Lowering the installed transformers' modeling files, read from site-packages.

For each: the output compiles; every class the plan does not rewrite is byte-identical;
each ``_forward_impl`` body is the original ``forward`` body (same AST, same bytes);
decorators moved to the new ``forward``; lowering is deterministic whatever the plan's
key order; a generated file is refused as input.
"""

import ast
import json
import random

import libcst as cst
import pytest

from hpgen.core.errors import HpgenError
from hpgen.generator.lower import lower
from hpgen.core.plan import load_plan, plan_from_dict

from tests.conftest import PLANS, transformers_modeling_file

MODELS = {
    "llama": ("llama_tp.json", "transformers.models.llama", {"LlamaAttention", "LlamaMLP"}),
    "qwen2": ("qwen2_tp.json", "transformers.models.qwen2", {"Qwen2Attention", "Qwen2MLP"}),
    "mistral": ("mistral_tp.json", "transformers.models.mistral", {"MistralAttention", "MistralMLP"}),
    "qwen3_moe": ("qwen3_moe_tp_ep.json", "transformers.models.qwen3_moe", {"Qwen3MoeAttention", "Qwen3MoeExperts"}),
}


def top_level_classes(code: str) -> dict[str, cst.ClassDef]:
    module = cst.parse_module(code)
    return {node.name.value: (module, node) for node in module.body if isinstance(node, cst.ClassDef)}


def method(node: cst.ClassDef, name: str) -> cst.FunctionDef:
    (found,) = [s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name]
    return found


@pytest.fixture(scope="module", params=sorted(MODELS))
def lowered(request):
    model = request.param
    plan_name, package, rewritten = MODELS[model]
    path = transformers_modeling_file(model)
    source = path.read_text()
    output = lower(source, load_plan(PLANS / plan_name), source_name=str(path), package=package)
    return model, source, output, rewritten, package


def test_output_compiles_and_imports_are_absolute(lowered):
    model, source, output, _, package = lowered
    compile(output, f"generated_{model}.py", "exec")
    tree = ast.parse(output)
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert f"from {package}.configuration_{model} import" in output


def test_classes_outside_the_plan_are_byte_identical(lowered):
    _, source, output, rewritten, _ = lowered
    before, after = top_level_classes(source), top_level_classes(output)
    assert set(before) <= set(after)
    for name, (module, node) in before.items():
        if name not in rewritten:
            out_module, out_node = after[name]
            assert out_module.code_for_node(out_node) == module.code_for_node(node), name


def test_forward_impl_is_the_original_forward(lowered):
    _, source, output, rewritten, _ = lowered
    before, after = top_level_classes(source), top_level_classes(output)
    for name in rewritten:
        module, original = before[name][0], method(before[name][1], "forward")
        out_module, impl = after[name][0], method(after[name][1], "_forward_impl")
        original_ast = ast.dump(ast.parse(_as_function(module, original)))
        assert ast.dump(ast.parse(_as_function(out_module, impl, rename="forward"))) == original_ast
        assert out_module.code_for_node(impl.body) == module.code_for_node(original.body)
        assert not impl.decorators
        new_forward = method(after[name][1], "forward")
        assert [out_module.code_for_node(d) for d in new_forward.decorators] == [
            module.code_for_node(d) for d in original.decorators
        ]
        assert out_module.code_for_node(new_forward.params) == module.code_for_node(original.params)


def _as_function(module: cst.Module, node: cst.FunctionDef, rename: str | None = None) -> str:
    """The function's source without decorators, dedented to the module level."""
    bare = node.with_changes(decorators=(), leading_lines=(), lines_after_decorators=())
    if rename:
        bare = bare.with_changes(name=cst.Name(rename))
    return cst.Module(body=[bare], default_indent=module.default_indent).code


def test_lowering_is_deterministic_for_any_key_order(lowered):
    model, source, output, _, package = lowered
    document = json.loads((PLANS / MODELS[model][0]).read_text())
    rng = random.Random(0)

    def shuffled(value):
        if isinstance(value, dict):
            items = list(value.items())
            rng.shuffle(items)
            return {key: shuffled(item) for key, item in items}
        return value

    path = str(transformers_modeling_file(model))
    twice = lower(source, load_plan(PLANS / MODELS[model][0]), source_name=path, package=package)
    assert twice == output
    again = lower(source, plan_from_dict(shuffled(document), name=MODELS[model][0], sha256=load_plan(PLANS / MODELS[model][0]).sha256), source_name=path, package=package)
    assert again == output


def test_a_generated_file_is_refused(lowered):
    model, _, output, _, package = lowered
    with pytest.raises(HpgenError, match="this file was generated by hpgen; lower the original modeling file instead"):
        lower(output, load_plan(PLANS / MODELS[model][0]), package=package)
