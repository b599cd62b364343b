"""Starcoder2 with sequence-parallel norms declared on ``nn.LayerNorm``, a class outside the file.

A norm on a sequence-sharded residual stream computes on each rank's tokens only, so its
parameters' gradients are partial: the plan declares the layout its input arrives in
(``S(1)`` in and in the body) and lists ``weight``/``bias`` in ``grad_reduce_params``
(``parity_table.starcoder2_norm_entries``). Such a contract moves nothing, so ``hpgen
lower`` leaves ``nn.LayerNorm`` alone and ``parallelize`` installs the gradient
reductions; the row ``starcoder2_sp_norms`` of the parity table checks the numbers.
"""

from __future__ import annotations

from tests.support.models import FAMILIES
from tests.support.parity_table import starcoder2_final_norm_gathered, starcoder2_norm_entries


def test_the_norm_class_is_left_alone_and_explained() -> None:
    from hpgen.generator.explain import explain
    from hpgen.generator.lower import analyze
    from hpgen.core.plan import plan_from_dict

    source = FAMILIES["starcoder2"].source()
    report = explain(analyze(source.read_text(), plan_from_dict(starcoder2_norm_entries()), source_name=source.name))
    norms = [record for record in report["wrapped"] if record["fqn"].endswith("layernorm")]
    assert [record["handled_by"] for record in norms] == ["identity", "identity"]
    for record in norms:
        assert "all-reduces the gradients of" in record["runs"] and "weight" in record["runs"]


def test_the_residual_stream_is_sequence_sharded(parity: list[dict]) -> None:
    assert [by_case["starcoder2_sp_norms"].residual_len for by_case in parity] == [4, 3]


def test_the_final_norm_is_wrapped_to_gather_its_output() -> None:
    # a contract that moves a value on a class outside the file: lowered (not refused), run by the generic wrapper
    from hpgen.generator.explain import explain
    from hpgen.generator.lower import analyze
    from hpgen.core.plan import plan_from_dict

    source = FAMILIES["starcoder2"].source()
    plan = plan_from_dict(starcoder2_final_norm_gathered())
    report = explain(analyze(source.read_text(), plan, source_name=source.name))
    (norm,) = [record for record in report["wrapped"] if record["fqn"] == "model.norm"]
    assert norm["handled_by"] == "runtime wrapper" and "generic wrapper" in norm["runs"]
    assert [(op["value"], op["op"]) for op in norm["ops"]] == [("output", "all_gather")]


def test_the_final_norm_sees_sharded_tokens_and_lm_head_all_of_them(parity: list[dict]) -> None:
    assert [by_case["starcoder2_sp_final_norm"].residual_len for by_case in parity] == [4, 3]
