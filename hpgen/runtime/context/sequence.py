"""The sequence a cp forward cuts, handed to attention as a keyword argument of the decoder layers.

A model forward on a ``cp`` axis cuts its ``n`` tokens in the head-tail layout
(:class:`~hpgen.runtime.forward.context_axis.HeadTail`). Attention needs that layout (where each
of the rank's chunks starts, how long the sequence is); :class:`PassesSequence`, a forward
pre-hook of the module that runs the decoder layers, puts it into that module's keyword arguments,
which transformers' models pass on to every decoder layer, its attention module and the attention
function (``**kwargs``). So it is an argument of each call: activation checkpointing saves it with
the layer's inputs and a layer recomputed in backward gets the same layout, with no state on any
module and nothing exchanged between the ranks to find it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

__all__ = ["KEYWORD", "CutSequence", "PassesSequence", "install_sequence_keyword"]

KEYWORD = "hpgen_cp_sequence"  # the keyword argument's name, unlikely to meet a model's own


@dataclass(frozen=True)
class CutSequence:
    """The ``cp`` axis (a :class:`~hpgen.runtime.forward.context_axis.ContextAxis`) and the head-tail
    layout of the sequence this forward cut on it."""

    axis: Any
    layout: Any

    def __deepcopy__(self, memo: dict) -> CutSequence:
        return self  # holds process-group handles


class PassesSequence:
    """Forward pre-hook (with kwargs) of the module that runs the decoder layers: adds ``KEYWORD``.

    The length comes from the forward's ``input_ids`` or ``inputs_embeds`` (dim 1, the dim the
    first decoder layer's input is cut on). A forward that runs replicated (a decode step) or a
    one-rank axis gets nothing added.
    """

    def __init__(self, axis: Any) -> None:
        self.axis = axis

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if not self.axis.active:
            return None
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None and args and isinstance(args[0], Tensor):
            tokens = args[0]
        if not isinstance(tokens, Tensor) or tokens.dim() < 2:
            return None
        layout = self.axis.layout(tokens.size(1), tokens.device)
        return args, {**kwargs, KEYWORD: CutSequence(self.axis, layout)}

    def __deepcopy__(self, memo: dict) -> PassesSequence:
        return self


def install_sequence_keyword(model: nn.Module, axis: Any, attention: list[str]) -> None:
    """Register :class:`PassesSequence` on the module of ``model`` whose layer list holds the
    attention modules named ``attention`` (qualified names), e.g. ``model`` for ``model.layers.0.self_attn``."""
    lists = [name for name, module in model.named_modules() if isinstance(module, nn.ModuleList)]
    for name in lists:
        if any(found.startswith(f"{name}.") for found in attention):
            owner = name.rpartition(".")[0]
            model.get_submodule(owner).register_forward_pre_hook(PassesSequence(axis), with_kwargs=True)
            return
    raise ValueError(
        f"{type(model).__name__}: context parallelism found no list of decoder layers holding its attention modules"
    )
