"""Context parallelism at install: what a ``cp`` axis refuses, and the decode steps it replicates.

The ``cp`` axis (:mod:`hpgen.runtime.forward.context_axis`) cuts the sequence and gathers keys
and values in attention (:mod:`hpgen.runtime.context.attention`). That is exact for softmax
attention over a mask transformers builds for the whole sequence; :func:`survey_context`
refuses, before anything changes, the models where it would not be: attention
implementations other than sdpa and eager (flash and flex build their masks or
causality from lengths), sliding windows, ALiBi, recurrent and linear-attention layers,
and attention dropout (the unsharded model's dropout mask cannot be drawn in pieces).

:class:`DecodeReplicates`, a forward pre-hook of the model, runs a forward that continues
a filled key/value cache replicated over ``cp`` (a decode step after a cp prefill): each
rank computes the new tokens whole, and attention over a cache split across the ranks
merges their partial results (:mod:`hpgen.runtime.context.decode`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from hpgen.core.context_coverage import CONTEXT_AXIS, context_refusal
from hpgen.runtime.context.sequence import install_sequence_keyword
from hpgen.runtime.context_logits import install_logits
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.context_axis import ContextAxis

__all__ = ["DecodeReplicates", "install_context", "survey_context"]

_ATTENTION = ("sdpa", "eager")


def _configs(model: nn.Module) -> list[Any]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    found = [config]
    for name in ("text_config", "language_config"):
        sub = getattr(config, name, None)
        if sub is not None:
            found.append(sub)
    return found


def survey_context(model: nn.Module, axes: dict[str, Any]) -> None:
    """Refuse (``ParallelizeError``) a model whose attention the cp axis would not compute exactly."""
    ax = axes.get(CONTEXT_AXIS)
    if not isinstance(ax, ContextAxis) or ax.size == 1:
        return
    name = type(model).__name__
    for config in _configs(model):
        implementation = getattr(config, "_attn_implementation", None) or "eager"
        if implementation not in _ATTENTION:
            raise ParallelizeError(
                f"{name}: context parallelism on {CONTEXT_AXIS!r} runs sdpa or eager attention, not "
                f"{implementation!r}; load the model with attn_implementation='sdpa'"
            )
        why = context_refusal(config)
        if why is not None:
            raise ParallelizeError(f"{name}: context parallelism on {CONTEXT_AXIS!r} does not cover {why}")
        dropout = getattr(config, "attention_dropout", 0.0) or 0.0
        if dropout:
            raise ParallelizeError(
                f"{name}: context parallelism on {CONTEXT_AXIS!r} does not cover attention dropout "
                f"(config.attention_dropout={dropout}): the unsharded model's dropout mask cannot be drawn in pieces"
            )


class DecodeReplicates:
    """Forward pre-hook of the model (with kwargs): a forward continuing a filled cache runs replicated on ``cp``."""

    def __init__(self, axis: ContextAxis) -> None:
        self.axis = axis
        self.entered = False

    def before(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        cache = next((kwargs[k] for k in ("cache", "past_key_values") if kwargs.get(k) is not None), None)
        if cache is None or not _filled(cache):
            return
        if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
            raise RuntimeError(
                f"{type(module).__name__}: a forward that continues a filled cache runs replicated over the "
                f"{self.axis.name!r} axis, where gradients would be counted once per rank; run it under torch.no_grad()"
            )
        self.axis._replicated = True
        self.entered = True

    def after(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if self.entered:
            self.axis._replicated = False
            self.entered = False

    def __deepcopy__(self, memo: dict) -> DecodeReplicates:
        return self


def _filled(cache: Any) -> bool:
    length = getattr(cache, "get_seq_length", None)
    if length is None:
        return False
    seen = length()
    return bool(seen.item() if isinstance(seen, torch.Tensor) else seen)


def install_context(model: nn.Module, axes: dict[str, Any], planned: Collection[str]) -> None:
    """The decode-step hook, the layout handed to attention (:mod:`hpgen.runtime.context.sequence`)
    and the head and loss on each rank's tokens (:mod:`hpgen.runtime.context_logits`), on a model
    with a ``cp`` axis of more than one rank. ``planned``: the FQNs of the modules the plan matches."""
    ax = axes.get(CONTEXT_AXIS)
    if not isinstance(ax, ContextAxis) or ax.size == 1:
        return
    hook = DecodeReplicates(ax)
    model.register_forward_pre_hook(hook.before, with_kwargs=True)
    model.register_forward_hook(hook.after, with_kwargs=True, always_call=True)
    attention = [name for name, module in model.named_modules() if hasattr(module, "_hp_cp_signature")]
    if attention:  # after the decode hook, so that a replicated forward passes no layout
        install_sequence_keyword(model, ax, attention)
    install_logits(model, ax, planned)
