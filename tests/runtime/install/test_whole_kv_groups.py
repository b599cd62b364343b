"""``parallelize`` checks ``num_key_value_groups`` where key/value heads stay whole on every rank (``B`` layouts).

Multi-query Falcon's fused ``[queries | key | value]`` is cut ``B(0,q:S(0),d:R,d:R)``: each rank holds some query
heads and the one key/value head. transformers 5.25's Falcon repeats that head ``num_key_value_groups`` times
(eager attention's ``repeat_kv``), so the count must follow ``num_heads``; a plan that divides ``num_heads`` alone
attended with the wrong number of key/value heads at run time. Here it is refused at ``parallelize``, naming the
module, on 2 real gloo ranks, and the plan ``hpgen plan`` writes installs. On 5.24, whose Falcon has no
``num_key_value_groups``, only the written plan runs.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.models import import_file

CONFIG = {"num_hidden_layers": 2, "vocab_size": 127, "hidden_size": 64, "num_attention_heads": 4}
ATTENTION = "transformer.h.*.self_attention"


def _written_plan() -> dict[str, Any]:
    from transformers import FalconConfig

    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    return plan_model(meta_model(FalconConfig(**CONFIG)), tp=2, name="falcon")


def _groups_left_global(plan: dict[str, Any]) -> dict[str, Any]:
    plan = copy.deepcopy(plan)
    entry = plan["param_plan"][ATTENTION]
    entry["tp_divide_attrs"] = [a for a in entry["tp_divide_attrs"] if a != "num_key_value_groups"]
    return plan


def _install(rank: int, world_size: int, generated: str, plans: dict[str, dict[str, Any]]) -> dict[str, str]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import FalconConfig

    from hpgen.runtime import parallelize
    from hpgen.runtime.errors import ParallelizeError

    module = import_file(generated)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    found = {}
    for name, plan in plans.items():
        torch.manual_seed(0)
        model = module.FalconForCausalLM(FalconConfig(**CONFIG)).eval()
        try:
            parallelize(model, plan, mesh)
        except ParallelizeError as error:
            found[name] = str(error)
        else:
            found[name] = "installed"
    return found


def test_key_value_groups_follow_the_query_heads(tmp_path: Path) -> None:
    import transformers.models.falcon.modeling_falcon as falcon

    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict

    written = _written_plan()
    repeats = "num_key_value_groups" in inspect.getsource(falcon.FalconAttention.__init__)
    plans = {"written": written}
    if repeats:  # transformers 5.25 and later
        assert "num_key_value_groups" in written["param_plan"][ATTENTION]["tp_divide_attrs"]
        plans["groups_left_global"] = _groups_left_global(written)
    source = Path(falcon.__file__)
    generated = tmp_path / "modeling_falcon.py"
    generated.write_text(
        lower(source.read_text(), plan_from_dict(written, name="falcon.json"), source_name=source.name,
              package="transformers.models.falcon")  # fmt: skip
    )
    results = run_distributed(_install, str(generated), plans, timeout=240)
    for found in results:
        assert found["written"] == "installed", found["written"]
        if repeats:
            message = found["groups_left_global"]
            assert message.startswith("transformer.h.0.self_attention (FalconAttention): at tp=0"), message
            assert "num_key_value_groups would be 4" in message and "1 key/value head(s)" in message, message
