"""Where transformers picks a module's forward at run time, keep the generated one in charge.

transformers' ``@use_experts_implementation`` (every MoE experts class) replaces the
class's ``forward`` with a dispatcher that, unless ``config._experts_implementation`` is
``"eager"``, calls a kernel (``grouped_mm`` by default, ``batched_mm``, ...) *instead of*
``forward``. In a lowered file that ``forward`` is the generated one, so under the default
kernel its collectives never run: the partial sums of tensor-parallel experts are never
reduced (wrong logits, no error), and expert-parallel experts reach the kernel with global
expert ids (a crash inside ``_grouped_mm``).

:func:`route_dispatch` moves the dispatch one level down, onto ``_forward_impl``: the
class's ``forward`` is the generated one again, and its body dispatches to the configured
kernel, which then runs on this rank's shards between the collectives. It runs for the
classes ``parallelize`` binds; an unparallelized instance computes exactly as before
(the generated ``forward``'s default ops are identities around the same dispatch).

Other run-time replacements are per instance: the kernels hub's ``kernelize`` (and any
monkeypatch) sets ``module.forward``. :func:`instance_forward_problem` reports those, so
that ``parallelize`` refuses them rather than silently skipping the collectives.
Attention implementations (``sdpa``, ``flash_attention_2``, ...) are chosen inside the
attention body, on the local heads, and need nothing here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["instance_forward_problem", "route_dispatch"]


def _experts_dispatch(function: Any) -> tuple[Any, Callable[..., Any]] | None:
    """``(experts_interface, wrapped forward)`` when ``function`` is transformers' experts dispatcher."""
    if not inspect.isfunction(function):
        return None
    try:
        captured = inspect.getclosurevars(function).nonlocals
    except (TypeError, ValueError):
        return None
    interface, original = captured.get("experts_interface"), captured.get("original_forward")
    if original is None or not callable(getattr(interface, "get_interface", None)):
        return None
    return interface, original


def dispatches_experts(cls: type) -> bool:
    """True when ``cls`` or a base runs ``forward`` through transformers' experts dispatcher."""
    return any(_experts_dispatch(vars(klass).get("forward")) is not None for klass in cls.__mro__)


def route_dispatch(cls: type[nn.Module]) -> None:
    """Make the generated ``forward`` of ``cls`` (and its bases) run, with the kernel dispatch inside it.

    Idempotent; a class without transformers' experts dispatcher is left alone.
    """
    for klass in cls.__mro__:
        found = _experts_dispatch(vars(klass).get("forward"))
        if found is None or "_forward_impl" not in vars(klass):
            continue
        interface, generated_forward = found
        body = vars(klass)["_forward_impl"]

        @functools.wraps(body)
        def _forward_impl(self: nn.Module, *args: Any, _body: Any = body, _interface: Any = interface, **kwargs: Any):
            kernel = _interface.get_interface(self.config._experts_implementation, _body)
            return kernel(self, *args, **kwargs)

        klass.forward = generated_forward
        klass._forward_impl = _forward_impl
        if vars(klass).get("__hp_compute__") is body:  # a region's default compute is the body
            klass.__hp_compute__ = _forward_impl


def instance_forward_problem(module: nn.Module) -> str | None:
    """Why the generated ``forward`` of ``module`` would not run, or ``None``."""
    replaced = vars(module).get("forward")
    if replaced is None:
        return None
    owner = getattr(replaced, "__module__", None) or type(replaced).__name__
    return (
        f"its forward was replaced on the instance (by {owner}; the kernels hub's kernelize or a patch), so the "
        "generated forward and its collectives would not run. Build the model without hub kernels for the "
        "modules the plan names (use_kernels=False), or delete the instance attribute 'forward'"
    )
