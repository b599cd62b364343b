"""Boundaries in several modeling files, each class named by file (:mod:`hpgen.planner.passes.modeling_files`)."""

from __future__ import annotations

from pathlib import Path

from tests.planner.plan_helpers import translated


def test_a_language_model_from_another_file_names_each_class_by_file() -> None:
    # GOT-OCR2 builds Qwen2's decoder layers through AutoModel: the plan names the two files and
    # every boundary's class by qualified name, so that each file's lowering takes its own keys
    from hpgen.generator.lower import analyze
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import source_file as _source_file

    model, plan = translated("got_ocr2")
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
    model, plan = translated("qwen2")
    assert "modeling_files" not in plan.get("comments", {})
    assert all("." not in name or name.startswith("nn.") for name in plan.get("boundary_classes", {}).values())
