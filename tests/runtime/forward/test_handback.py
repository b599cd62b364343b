"""hpgen.runtime.forward.handback on real gloo groups: a collective returns only once gloo's worker
thread has dropped its references to the tensors, so no Python object is ever freed from that
thread (which, at interpreter shutdown, aborts the process).

Without the wait, about a third of gloo collectives return while the worker still holds
their tensors (measured on torch 2.13, two ranks, a loaded machine), so the counts below
would be far from zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.runtime.forward.handback import all_gather_object, broadcast_object, call
from tests.support.dist import run_distributed

ROUNDS = 150


def _held_after_return(rank: int, world_size: int) -> dict[str, int]:
    """How often a tensor passed to or returned by a collective is still referenced from outside."""
    ax = AxisCollectives(dist.group.WORLD, "tp")
    held = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "all_to_all": 0, "with_grad": 0, "call": 0}
    for i in range(ROUNDS):
        x = torch.randn(4, 6)
        x_refs = x._use_count()
        outputs = {
            "all_reduce": ax.all_reduce(x),  # the no-grad hot path
            "all_gather": ax.all_gather(x, 0, total=4 * world_size),
            "reduce_scatter": ax.reduce_scatter(x, 1),
            "all_to_all": ax.all_to_all(x, 0, 1, total=4 * world_size),
        }
        for name, out in outputs.items():
            held[name] += out._use_count() > 1 or x._use_count() > x_refs
        leaf = torch.randn(4, 6, requires_grad=True)
        y = ax.all_gather(leaf * 2, 1, total=6 * world_size)  # the autograd node's forward
        held["with_grad"] += y._use_count() > 1
        y.sum().backward()  # (its backward reduce-scatters the gradient through the same ops)
        t = torch.full((3,), float(i))
        call(dist.all_reduce, t)
        held["call"] += t._use_count() > 1
    return held


def test_collectives_return_with_no_reference_left_in_the_backend():
    for held in run_distributed(_held_after_return, world_size=2, timeout=180):
        assert held == dict.fromkeys(held, 0), held


def _objects(rank: int, world_size: int) -> tuple[list, object, object]:
    mine = {"rank": rank, "text": "x" * (rank * 300 + 1)}  # payloads of different lengths
    return all_gather_object(mine), broadcast_object(mine if rank == 1 else None, src=1), broadcast_object(rank, src=0)


def test_object_collectives_give_every_rank_the_same_objects():
    results = run_distributed(_objects, world_size=3, timeout=120)
    every = [{"rank": r, "text": "x" * (r * 300 + 1)} for r in range(3)]
    assert results == [(every, every[1], 0)] * 3
