"""Collectives carry their sizes: a scatter returns what each rank gave the gather before it.

One spawn of 2 gloo ranks runs every case, inside a model forward's scope
(:class:`ShardScope`), eagerly and in the form the ops take under ``torch.compile``:
a gather of a different token count on each rank (12 and 6, a rank with none, none at
all), the sum over ranks scattered back (the experts of a data-parallel attention),
after a batch split of the same dim as a generated model entry writes it (its sizes
found once and handed to each split, leaving no record that the tokens' gather could
take for its own); values and gradients checked exactly; and tuples (the rotary
``(cos, sin)``) moved like tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hpgen.runtime.forward import collectives
from hpgen.runtime.forward.collectives import AxisCollectives, ShardScope
from tests.support.dist import run_distributed

HIDDEN = 3


def _round_trip(ax: AxisCollectives, counts: list[int], *, batch_split: bool) -> list[str]:
    """Gather ``counts[rank]`` tokens, weigh them per rank (a partial sum), scatter back.

    Returns what failed (empty when the values and gradients are exact).
    """
    failures = []
    gen = torch.Generator().manual_seed(sum(counts) + 7 * len(counts))
    pieces = [torch.randn(n, HIDDEN, generator=gen, dtype=torch.float64) for n in counts]
    grads = [torch.randn(n, HIDDEN, generator=gen, dtype=torch.float64) for n in counts]
    weights = [float(r + 2) for r in range(ax.size)]
    scope = ShardScope([ax])
    scope.enter(None, ())
    try:
        if batch_split:  # a batch split at the model's entry, as generated: sizes found once, handed on
            batch = (torch.zeros(3, HIDDEN, dtype=torch.long), torch.zeros(3, 4, HIDDEN))
            sizes = ax.split_sizes(*batch, dim=0)
            rows = (2, 1)[ax.rank]
            shapes = [tuple(ax.split(t, 0, sizes=sizes).shape) for t in batch]
            if sizes != (2, 1) or shapes != [(rows, HIDDEN), (rows, 4, HIDDEN)]:
                failures.append(f"{counts}: batch split {sizes}")
        x = pieces[ax.rank].clone().requires_grad_()
        whole = ax.all_gather(x, 0)
        if not torch.equal(whole.detach(), torch.cat(pieces)):
            failures.append(f"{counts}: gathered values")
        out = ax.reduce_scatter(whole * weights[ax.rank], 0)
        if not torch.allclose(out.detach(), pieces[ax.rank] * sum(weights)):
            failures.append(f"{counts}: scattered {tuple(out.shape)} for {tuple(x.shape)}")
        else:
            (out * grads[ax.rank]).sum().backward()
            if not torch.allclose(x.grad, grads[ax.rank] * sum(weights)):
                failures.append(f"{counts}: gradient")
        again = ax.split(torch.cat(pieces), 0)  # R -> S of the same dim: what each rank gave, too
        if not torch.equal(again, pieces[ax.rank]):
            failures.append(f"{counts}: split {tuple(again.shape)}")
    finally:
        scope.exit(None, (), None)
    return failures


def _sequences(ax: AxisCollectives) -> list[str]:
    """A tuple (the rotary ``(cos, sin)``) and a nested list split and gathered like tensors."""
    cos, sin = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    scope = ShardScope([ax])
    scope.enter(None, ())
    try:
        pieces = ax.split((cos, sin), 0)
        nested = ax.split([cos, (sin, None)], 0)
        back = ax.all_gather(pieces, 0)
    finally:
        scope.exit(None, (), None)
    failures = []
    if type(pieces) is not tuple or not all(torch.equal(p, t.tensor_split(2)[ax.rank]) for p, t in zip(pieces, (cos, sin))):
        failures.append("tuple split")
    if type(nested) is not list or type(nested[1]) is not tuple or nested[1][1] is not None:
        failures.append("nested split keeps its types")
    elif not torch.equal(nested[1][0], sin.tensor_split(2)[ax.rank]):
        failures.append("nested split")
    if not (type(back) is tuple and torch.equal(back[0], cos) and torch.equal(back[1], sin)):
        failures.append("tuple gather")
    return failures


def _records(rank: int, world_size: int) -> list[str]:
    ax = AxisCollectives(dist.group.WORLD, "ep")
    failures = _sequences(ax)
    for traced in (False, True):
        collectives._tracing = (lambda: True) if traced else (lambda: False)  # this spawned process only
        for counts in ([12, 6], [6, 12], [0, 5], [5, 0], [0, 0], [4, 4]):
            for batch_split in (False, True):
                failures += [f"traced={traced} {f}" for f in _round_trip(ax, counts, batch_split=batch_split)]
    return failures


@pytest.fixture(scope="module")
def records() -> list[list[str]]:
    return run_distributed(_records, world_size=2, timeout=240)


def test_scatter_returns_what_each_rank_gave_the_gather(records):
    assert records == [[], []]


def test_given_sizes_are_refused_where_they_cannot_apply() -> None:
    from torch import nn

    from hpgen.runtime import give_shard_sizes

    model = nn.Linear(2, 2)
    model._hp_ep = AxisCollectives(None, "ep")  # an axis of one rank: nothing is ever gathered
    with pytest.raises(ValueError, match="no axis 'ep' of more than one rank"):
        give_shard_sizes(model, "ep", [3, 4])
    with pytest.raises(ValueError, match="dim must be"):
        give_shard_sizes(model, "ep", [3, 4], dim=-1)
