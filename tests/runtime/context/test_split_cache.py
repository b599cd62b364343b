"""Decoding over the key/value cache split across ``cp``, against the unsharded models, on real gloo ranks.

Llama and Qwen3 (tiny configs, plans from ``hpgen plan``) at cp 2 (2 ranks), and cp 4 and
cp 2 x tp 2 (one 4-rank spawn): a left-padded 64-token batch's cached forward and its
continuation, greedy tokens after 16 new ones, ``return_dict_in_generate``, a decode loop
of one's own, sampling under one seed, and which positions each rank's cache holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpgen.runtime.forward.context_axis import HeadTail
from tests.support.dist import run_distributed
from tests.support.models import lower_family, make_config
from tests.support.split_cache_cases import NEW, PROMPT, DecodeCase, DecodeResult, run_decode_cases

FAMILIES = ("llama", "qwen3")


def _case(tmp: Path, name: str, family: str, mesh: tuple[tuple[str, int], ...], **flags: Any) -> DecodeCase:
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    plan = plan_model(meta_model(make_config(family)), name=family, **flags)
    (tmp / name).mkdir(parents=True, exist_ok=True)
    return DecodeCase(name, family, str(lower_family(family, plan, tmp / name)), plan, mesh)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, DecodeResult]]:
    tmp = tmp_path_factory.mktemp("decode2")
    cases = [_case(tmp, f"{family}_cp2", family, (("cp", 2),), cp=2) for family in FAMILIES]
    return run_distributed(run_decode_cases, cases, world_size=2, timeout=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, DecodeResult]]:
    tmp = tmp_path_factory.mktemp("decode4")
    cases = []
    for family in FAMILIES:
        cases.append(_case(tmp, f"{family}_cp4", family, (("cp", 4),), cp=4))
        cases.append(_case(tmp, f"{family}_cp2_tp2", family, (("cp", 2), ("tp", 2)), cp=2, tp=2))
    return run_distributed(run_decode_cases, cases, world_size=4, timeout=300)


def _check(results: list[dict[str, DecodeResult]], name: str, cp: int) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        for what, (err, tol) in result.checks.items():
            assert err <= tol, f"{name} rank {rank}: {what} {err:.2e} > {tol:.2e}"
        for what, want in result.reference.items():
            assert result.tokens[what] == want, f"{name} rank {rank}: {what} tokens differ from the unsharded model's"
        assert result.tokens["return_dict_in_generate"] == result.reference["greedy"]
        assert set(result.layer_types) == {"SplitLayer"}, result.layer_types
        assert set(result.whole_cache_lengths) == {PROMPT + NEW - 1}, result.whole_cache_lengths
        assert set(result.eager_cache_lengths) == {PROMPT + NEW - 1}, result.eager_cache_lengths
        assert result.tokens == results[0][name].tokens, f"{name}: rank {rank}'s tokens differ from rank 0's"
    _check_positions(results, name, cp)


def _check_positions(results: list[dict[str, DecodeResult]], name: str, cp: int) -> None:
    """Each cp rank holds its own positions, every position is held once, and the ranks stay balanced."""
    by_cp = {r[name].cp_rank: r[name] for r in results}  # tp ranks of one cp rank hold the same positions
    assert sorted(by_cp) == list(range(cp))
    for rank, result in by_cp.items():
        prefill = HeadTail(PROMPT, cp, rank, "cpu").local.tolist()
        assert all(layer == prefill for layer in result.positions["prefill"]), f"{name} cp rank {rank}: prefill positions"
    for when, total in (("prefill", PROMPT), ("continued", PROMPT + 3), ("generated", PROMPT + NEW - 1)):
        for layer in range(len(by_cp[0].positions[when])):
            held = [by_cp[rank].positions[when][layer] for rank in range(cp)]
            assert sorted(p for h in held for p in h) == list(range(total)), f"{name} {when} layer {layer}: {held}"
            sizes = [len(h) for h in held]
            assert max(sizes) - min(sizes) <= 1 and max(sizes) <= -(-total // cp), f"{name} {when}: sizes {sizes}"
            assert all(r.lengths[when][layer] == total for r in by_cp.values()), f"{name} {when}: reported length"


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_decodes_over_a_split_cache_like_one_process(two_ranks: list[dict[str, DecodeResult]], family: str) -> None:
    _check(two_ranks, f"{family}_cp2", 2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mesh,cp", [("cp4", 4), ("cp2_tp2", 2)])
def test_four_ranks_decode_over_a_split_cache_like_one_process(
    four_ranks: list[dict[str, DecodeResult]], family: str, mesh: str, cp: int
) -> None:
    _check(four_ranks, f"{family}_{mesh}", cp)
