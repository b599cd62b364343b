"""The plan's ``pipeline`` key: stages read, ranges expanded, mistakes refused at their JSON path."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hpgen.core.errors import HpgenError
from hpgen.core.plan import plan_from_dict

PLANS = Path(__file__).resolve().parents[1] / "plans"


def load_plan_dict(name: str) -> dict:
    return json.loads((PLANS / f"{name}.json").read_text())  # no torch: core tests run without it


def _staged(stages, mesh=("pp", "tp")) -> dict:
    document = load_plan_dict("llama_tp")
    document["mesh_dim_names"] = list(mesh)
    document["pipeline"] = {"axis": "pp", "stages": stages}
    return document


def test_ranges_expand_and_write_back_compact():
    plan = plan_from_dict(_staged([["model.embed_tokens", "model.layers.0-2"], ["model.layers.3", "model.norm", "lm_head"]]))
    assert plan.pipeline.stages[0] == ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2")
    assert plan.pipeline.stage_of("model.layers.3.mlp.up_proj") == 1
    assert plan.pipeline.document()["stages"][0] == ["model.embed_tokens", "model.layers.0-2"]


def test_a_plan_without_stages_hashes_as_before():
    document = load_plan_dict("llama_tp")
    plan = plan_from_dict(document)
    assert plan.pipeline is None
    assert plan.digest() == plan_from_dict(copy.deepcopy(document)).digest()


@pytest.mark.parametrize(
    ("change", "where", "message"),
    [
        (lambda d: d["pipeline"].update(axis="dp"), "pipeline.axis", "unknown axis 'dp'"),
        (lambda d: d["pipeline"]["stages"][1].append("model.layers.1"), "pipeline.stages[1][2]", "already on a stage"),
        (lambda d: d["pipeline"]["stages"][1].append("model.layers"), "pipeline.stages[1][2]", "already on a stage"),
        (lambda d: d["pipeline"]["stages"][0].append("model.layers.5-3"), "pipeline.stages[0][2]", "not a module FQN or a range"),
        (lambda d: d["pipeline"]["stages"].append([]), "pipeline.stages[2]", "a stage with no module"),
        (lambda d: d["pipeline"].pop("stages"), "pipeline", "missing required key 'stages'"),
        (
            lambda d: d["param_plan"]["model.layers.*.mlp"]["params"]["up_proj.weight"].update(pp="S(0)"),
            'params["up_proj.weight"].pp',
            "only R (stages hold whole modules)",
        ),
    ],
)
def test_mistakes_are_refused_at_their_place(change, where, message):
    document = _staged([["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm"]])
    change(document)
    with pytest.raises(HpgenError) as error:
        plan_from_dict(document, name="p.json")
    assert where in str(error.value) and message in str(error.value)
