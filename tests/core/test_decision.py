"""One decision per plan entry: the same answers as the raw plan, made once and kept with the plan."""

import dataclasses
from pathlib import Path

from hpgen.core.decision import entry_decision
from hpgen.core.plan import contract_signature, load_plan, plan_from_dict
from hpgen.core.transitions import summed_ops, value_ops

PLANS = Path(__file__).resolve().parents[1] / "plans"


def plan_of(name: str):
    return load_plan(PLANS / f"{name}.json")  # no torch: core tests run without it


def test_a_decision_answers_what_the_plan_answers_for_every_entry():
    for name in ("llama_tp_vocab", "llama_tp_sp", "qwen3_moe_tp_ep", "tiny_region", "tiny_generic"):
        plan = plan_of(name)
        for key, entry in plan.entries.items():
            for known in ((), ("input",)):
                decision = entry_decision(plan, key, known_inputs=known)
                assert (decision.inputs, decision.outputs) == value_ops(plan, key, known_inputs=known), (name, key)
                assert decision.signature == contract_signature(plan, key)
                assert decision.injection == plan.injection_for(key)
                assert decision.summed == summed_ops(plan, key)
                assert decision.mesh == plan.mesh_dim_names and decision.entry is entry
                moves = any(not op.is_identity for value in (*decision.inputs, *decision.outputs) for op in value.ops)
                rewritten = decision.injection is not None or entry.region_dispatch or entry.summed_reduction is not None
                assert decision.is_identity == (not moves and not rewritten), (name, key, known)


def test_a_copy_into_a_sharded_body_is_not_identity():
    """A replicated input known to the module (``input`` of an nn.Linear) gets a copy into a sharded body."""
    sharded = {"tp": "S(-1)"}
    entry = {"params": {"weight": {"tp": "S(0)"}}, "out_src": {"output": sharded}, "out_dst": {"output": sharded}}
    plan = plan_from_dict({"mesh_dim_names": ["tp"], "param_plan": {"lin": entry}})
    assert entry_decision(plan, "lin").is_identity
    known = entry_decision(plan, "lin", known_inputs=("input",))
    assert not known.is_identity and [op.kind for op in known.inputs[0].ops] == ["copy"]
    assert known.sharded_axes == ("tp",)


def test_the_second_question_is_a_lookup_kept_with_that_plan_only():
    plan = plan_of("llama_tp_vocab")
    key = next(iter(plan.entries))
    first = entry_decision(plan, key, known_inputs=("input",))
    assert entry_decision(plan, key, known_inputs=("input", "input")) is first  # known inputs as a set
    assert entry_decision(plan, key) is not first
    digest = plan.digest()
    fresh = plan_of("llama_tp_vocab")
    assert plan == fresh and digest == fresh.digest()  # the table is no field: equality and digest ignore it
    renamed = dataclasses.replace(plan, name="other")
    assert entry_decision(renamed, key, known_inputs=("input",)) is not first  # a new plan, a table of its own
