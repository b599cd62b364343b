"""peft's tuner layers as a plan sees them: found, read through ``base_layer``, and the methods refused.

A plan is written for the base model (``q_proj.weight``). peft puts a tuner layer in the
linear's place and moves the linear to ``q_proj.base_layer``; :func:`resolve_tuner_names`
reads each plan entry through that indirection, so one plan serves the base model and
every peft model made from it. :func:`method_problem` says why an adapter cannot be
sharded like its base layer (:mod:`hpgen.runtime.install.adapters`): DoRA and peft's other LoRA
variants, ``lora_bias`` on a row-parallel base, LoRA on anything but a linear, other tuners.

Nothing here imports peft: a model without it has no tuner layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from torch import nn

from hpgen.core.plan import LocalCount
from hpgen.runtime.forward.wrappers import MIXINS
from hpgen.runtime.install.params import Matched

__all__ = ["is_tuner_layer", "method_problem", "peft_base_model", "resolve_tuner_names"]

WRAPPER_MIXINS = set(MIXINS.values())


def is_tuner_layer(module: nn.Module) -> bool:
    """A peft tuner layer (``lora.Linear``, ``IA3Layer``...): it holds the original module as ``base_layer``."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(type(module), "adapter_layer_names")


def peft_base_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside a ``PeftModel``, or None for any other model."""
    has_base = hasattr(type(model), "get_base_model") and isinstance(getattr(model, "base_model", None), nn.Module)
    if not has_base or not hasattr(model, "peft_config"):
        return None
    return model.get_base_model()


def _base_path(module: nn.Module, path: str) -> str:
    """``path`` (a submodule of ``module``, '' for itself) through every tuner layer's ``base_layer``."""
    current = module.get_submodule(path) if path else module
    while is_tuner_layer(current):
        current = current.base_layer
        path = f"{path}.base_layer" if path else "base_layer"
    return path


def _renamed(module: nn.Module, name: str) -> str:
    owner, _, leaf = name.rpartition(".")
    try:
        base = _base_path(module, owner)
    except AttributeError:
        return name  # not a submodule: check_param_names reports it
    return f"{base}.{leaf}" if base else leaf


def resolve_tuner_names(matched: Iterable[Matched]) -> list[Matched]:
    """Each entry's parameter names read through peft's ``base_layer`` where a tuner layer holds them."""
    resolved = []
    for item in matched:
        entry = item.entry
        counted = [name for _, count in entry.local_attrs for name in count.params()]
        names = [*entry.params, *entry.deferred_bias_params, *entry.grad_reduce_params, *counted]
        rename = {name: _renamed(item.module, name) for name in names}
        if all(old == new for old, new in rename.items()):
            resolved.append(item)
            continue
        entry = dataclasses.replace(
            entry,
            params={rename[name]: layout for name, layout in entry.params.items()},
            deferred_bias_params=tuple(rename[name] for name in entry.deferred_bias_params),
            grad_reduce_params=tuple(rename[name] for name in entry.grad_reduce_params),
            local_attrs=tuple((attr, _renamed_count(count, rename)) for attr, count in entry.local_attrs),
            grad_reduce_axes=tuple((rename[name], axes) for name, axes in entry.grad_reduce_axes),
        )
        resolved.append(dataclasses.replace(item, entry=entry))
    return resolved


def _renamed_count(count: LocalCount, rename: dict[str, str]) -> LocalCount:
    per = _renamed_count(count.per, rename) if count.per is not None else None
    return dataclasses.replace(count, of=rename[count.of], per=per)


def method_problem(layer: nn.Module, name: str, sharded_inputs: Sequence[str]) -> str | None:
    """Why the adapter ``name`` of the tuner ``layer`` cannot be sharded like its base, or None."""
    # the class peft made (parallelize may have swapped in its wrapper subclass)
    cls = next(
        (c for c in type(layer).__mro__ if c.__module__.startswith("peft.") and not set(c.__bases__) & WRAPPER_MIXINS),
        type(layer),
    )
    if not (cls.__module__.startswith("peft.tuners.lora") and hasattr(layer, "lora_A") and hasattr(layer, "lora_B")):
        tuner = cls.__module__.split(".")[2].upper() if cls.__module__.startswith("peft.tuners.") else cls.__module__
        return (
            f"the peft method {tuner} ({cls.__module__}.{cls.__qualname__}) is not supported on a parallelized "
            "model: only LoRA (lora.Linear)"
        )
    if cls.__name__ != "Linear":
        return f"LoRA's {cls.__qualname__} layer is not supported on a parallelized model: only lora.Linear"
    variant = getattr(layer, "lora_variant", {}).get(name)
    if variant is not None:
        method = "DoRA (use_dora=True)" if getattr(layer, "use_dora", {}).get(name) else type(variant).__name__
        return f"adapter {name!r} uses {method}, which is not supported on a parallelized model: use plain LoRA"
    if getattr(layer, "lora_bias", {}).get(name) and sharded_inputs:
        return (
            f"adapter {name!r} has lora_bias=True on a row-parallel base layer (inputs sharded on "
            f"{', '.join(sharded_inputs)}): its bias would be added once per rank; use lora_bias=False"
        )
    return None
