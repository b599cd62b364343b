"""The two parameter fixes a sharded body needs: deferred biases and gradient reductions.

``deferred_bias_params``: a row-parallel projection (``o_proj``, ``down_proj``) makes a
partial sum; its bias must be added once, after the reduction, not on every rank. The
inner ``nn.Linear`` becomes a :class:`~hpgen.runtime.wrappers.DeferredBiasLinear` (no
bias in its matmul; the Parameter stays registered where it was, so ``state_dict`` is
unchanged) and a forward hook on the boundary adds the bias to the reduced output.

``grad_reduce_params``: a replicated parameter used on a shard of the activations (a
per-head ``q_norm``, a norm on a sequence-sharded residual stream) gets only this rank's
part of its gradient. A tensor hook all-reduces that gradient over the axes on which
the boundary's body is sharded, before it is accumulated into ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpgen.runtime.ops import address_of, get_output, replace_output

__all__ = ["BiasAdder", "GradAllReduce"]


class BiasAdder:
    """Forward hook: add ``owner.bias`` to output ``name`` of the boundary's (reduced) return."""

    def __init__(self, owner: nn.Module, output_names: Sequence[str], name: str) -> None:
        self.owner = owner
        self.output_names = tuple(output_names)
        self.name = name

    def __call__(self, module: nn.Module, args: Any, outputs: Any) -> Any:
        address = address_of(outputs, self.output_names, self.name)
        value = get_output(outputs, address)
        return replace_output(outputs, address, value + self.owner.bias)


class GradAllReduce:
    """Tensor hook: the sum over ``groups`` of a gradient each rank holds only a part of."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], where: str) -> None:
        self.groups = tuple(groups)
        self.where = where  # the parameter's FQN, for debugging

    def __call__(self, grad: Tensor) -> Tensor:
        total = grad.clone(memory_format=torch.contiguous_format)
        for group in self.groups:
            dist.all_reduce(total, group=group)
        return total

    def __repr__(self) -> str:
        return f"GradAllReduce({self.where}, groups={len(self.groups)})"
