"""A row-parallel projection on its split replicated input (:mod:`hpgen.planner.derive.split_rows`)."""

from __future__ import annotations

import pytest

from tests.support.derived_configs import tiny
from tests.planner.plan_helpers import derived, entry


def test_a_row_whose_columns_cannot_shard_splits_its_replicated_input() -> None:
    """BitNet's MLP pair stays replicated (ffn_sub_norm across the sharded width), so down_proj, wider in
    than out, is a row on its split input: R -> S(-1), weight S(1), P(sum) -> R; --sp leaves it replicated."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    plan = derived("bitnet")
    down = entry(plan, "model.layers.*.mlp.down_proj")
    assert down["in_src"] == {"input": {"tp": "R"}} and down["in_dst"] == {"input": {"tp": "S(-1)"}}
    assert down["params"] == {"weight": {"tp": "S(1)"}}
    assert down["out_src"] == {"output": {"tp": "P(sum)"}} and down["out_dst"] == {"output": {"tp": "R"}}
    assert "split on entry" in plan["comments"]["sharded"]["model.layers.*.mlp.down_proj"]
    with pytest.raises(Exception, match="no decoder layer holds a sharded block"):
        plan_model(meta_model(tiny("bitnet")), tp=2, sp=True, from_source=True, name="bitnet")
