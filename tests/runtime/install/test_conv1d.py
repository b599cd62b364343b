"""One test of transformers' ``Conv1D`` for the planner and the runtime (:mod:`hpgen.core.conv1d`)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import hpgen.planner.model.modules
import hpgen.runtime.install.params
from hpgen.core.conv1d import is_conv1d


def _other_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ self.weight


def test_a_conv1d_is_one_with_its_own_forward_and_its_weight_nx_by_nf() -> None:
    assert is_conv1d(Conv1D(nf=6, nx=4))
    assert not is_conv1d(nn.Linear(4, 6))

    replaced = type("Conv1D", (Conv1D,), {"forward": _other_forward})(nf=6, nx=4)
    assert not is_conv1d(replaced)  # a subclass that replaces forward may compute anything
    assert is_conv1d(type("Conv1D", (Conv1D,), {})(nf=6, nx=4))  # one that keeps it is still one

    transposed = Conv1D(nf=6, nx=4)
    transposed.weight = nn.Parameter(torch.zeros(6, 4))
    assert not is_conv1d(transposed)  # [nf, nx] is not the layout Conv1D computes with


def test_both_layers_ask_the_one_test() -> None:
    assert hpgen.planner.model.modules.is_conv1d is is_conv1d
    assert hpgen.runtime.install.params.is_conv1d is is_conv1d


def test_sharding_a_conv1d_keeps_nx_and_nf_truthful() -> None:
    """The runtime asks before each swap, while nx and nf still describe the weight, so either order works."""
    from hpgen.runtime.install.params import _update_sizes

    for order in (("weight", "bias"), ("bias", "weight")):
        module = Conv1D(nf=6, nx=4)
        local = {"weight": module.weight.detach()[:, :3].clone(), "bias": module.bias.detach()[:3].clone()}
        for attr in order:  # this rank's output columns and their biases, as shard_params swaps them
            conv1d = is_conv1d(module)
            setattr(module, attr, nn.Parameter(local[attr]))
            _update_sizes(module, conv1d)
        assert (module.nx, module.nf) == (4, 3) and is_conv1d(module), order
        assert module(torch.zeros(2, 4)).shape == (2, 3)
