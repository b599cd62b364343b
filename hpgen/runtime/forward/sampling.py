"""``generate`` on a parallelized model: the same tokens on every rank.

Sampling (``do_sample``, ``top_k``, ``top_p``, ``temperature``, beam sampling) draws from
the default generators of the process. Ranks seeded differently would draw different
tokens, and once their sequences end at different steps they wait in collectives their
peers never join. So ``parallelize`` binds :func:`generate` as the model's ``generate``:
it runs transformers' ``generate`` with every rank's default generators (the CPU one and
the model's CUDA one) set to those of the first rank of the plan's axes (one broadcast of
each state per axis), and puts each rank's own states back afterwards, so that per-rank
data pipelines and anything else the user seeded per rank go on as if nothing was drawn.

With one seed everywhere the first rank's state is every rank's own: the tokens are those
the unsharded model samples from the same seed. Greedy search and beam search draw
nothing; the logits they read are the same on every rank (gathered or all-reduced).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpgen.runtime.forward.handback import call
from hpgen.runtime.forward.streams import default_generators

__all__ = ["bind_generate", "first_rank_random_state"]


@contextlib.contextmanager
def first_rank_random_state(
    model: nn.Module, groups: Sequence[dist.ProcessGroup], device: torch.device
) -> Iterator[None]:
    """Within the block, the default generators hold the first rank's states; afterwards this rank's own."""
    generators = default_generators(model)
    own = [generator.get_state() for generator in generators]
    try:
        for generator, state in zip(generators, own):
            shared = state.to(device, copy=True)  # (to() of a CPU tensor to the CPU is the tensor itself)
            for group in groups:
                call(dist.broadcast, shared, src=dist.get_global_rank(group, 0), group=group)
            generator.set_state(shared.cpu())
        yield
    finally:
        for generator, state in zip(generators, own):
            generator.set_state(state)


class _Groups:
    """The process groups (and their device) generate agrees over; shared by copies of a model."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], device: torch.device) -> None:
        self.groups = tuple(groups)
        self.device = device

    def __deepcopy__(self, memo: dict) -> _Groups:
        return self


def generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """transformers' ``generate``, drawing every rank's random numbers from the first rank's states."""
    where = self._hp_generate_groups
    with first_rank_random_state(self, where.groups, where.device):
        return type(self).generate(self, *args, **kwargs)


def bind_generate(model: nn.Module, groups: Sequence[dist.ProcessGroup], device: torch.device) -> None:
    """Make ``model.generate`` agree across the ranks of ``groups`` (see the module docstring)."""
    if not groups or not callable(getattr(type(model), "generate", None)):
        return
    model._hp_generate_groups = _Groups(groups, device)
    model.generate = types.MethodType(generate, model)
