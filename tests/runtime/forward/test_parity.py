"""Every row of ``parity_table.PARITY`` against the unsharded transformers model, on 2 gloo ranks.

Each test checks one property of one row on both ranks: logits, every parameter's
gradient (the local slice of the reference gradient), 12 greedily generated tokens with
the KV cache, that ``parallelize`` kept the state-dict keys, and that each rank holds its
share of the parameters by the plan, less than the whole model. Models run with
transformers' defaults (sdpa attention, the grouped_mm experts kernel).
"""

from __future__ import annotations

import pytest

from tests.support.models import (
    check_generation,
    check_gradients,
    check_logits,
    check_share,
    check_state_dict_keys,
)
from tests.support.parity_table import PARITY


@pytest.mark.parametrize("name", PARITY)
def test_logits(parity: list[dict], name: str) -> None:
    check_logits(parity, name)


@pytest.mark.parametrize("name", PARITY)
def test_state_dict_keys_unchanged(parity: list[dict], name: str) -> None:
    check_state_dict_keys(parity, name)


@pytest.mark.parametrize("name", PARITY)
def test_gradients(parity: list[dict], name: str) -> None:
    check_gradients(parity, name)


@pytest.mark.parametrize("name", PARITY)
def test_each_rank_holds_its_share(parity: list[dict], name: str) -> None:
    check_share(parity, name)


@pytest.mark.parametrize("name", PARITY)
def test_greedy_generation(parity: list[dict], name: str) -> None:
    check_generation(parity, name)


@pytest.mark.parametrize("name", ["inkling_completed", "inkling2_completed"])
def test_the_completed_inkling_plans_hold_at_most_two_thirds_per_rank(parity: list[dict], name: str) -> None:
    """transformers' plans shard only Inkling's and Inkling2's experts; with the attention completed from the
    source (convolutions, per-head scales and the relative-position matrix included) no rank holds more than
    0.65 of the parameters."""
    shares = [by_case[name].local_bytes / by_case[name].full_bytes for by_case in parity]
    assert max(shares) <= 0.65, shares
