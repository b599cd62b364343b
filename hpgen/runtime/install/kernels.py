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
Where the local shards do not suit the configured kernel (``grouped_mm`` needs 16-byte
strides), :func:`fit_experts_kernel` switches that module to its eager body, and
``parallelize`` says so in one line.
With the ``kernels`` package (transformers 5.25 requires it), a layer class decorated with
``use_kernelized_func`` holds per-instance wrappers of the file's hub functions
(``causal_conv1d_forward``, ``mamba_scan_forward``) in ``_kernel_funcs``, made by the class
the instance was built as, and its ``forward`` routes the file's calls to them: after the
class swap they would call the *original* file's functions, or the hub kernel ``kernelize``
bound, on this rank's shards. :func:`fit_hub_functions` rebinds them to the generated
file's functions, dropping a bound kernel, and ``parallelize`` says so once.
Attention implementations (``sdpa``, ``flash_attention_2``, ...) are chosen inside the
attention body, on the local heads, and need nothing here.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["fit_experts_kernel", "fit_hub_functions", "instance_forward_problem", "route_dispatch"]


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
            # An instance may have been switched to the eager body (see ``fit_experts_kernel``).
            implementation = vars(self).get("_hp_experts_implementation") or self.config._experts_implementation
            kernel = _interface.get_interface(implementation, _body)
            return kernel(self, *args, **kwargs)

        klass.forward = generated_forward
        klass._forward_impl = _forward_impl
        klass._hp_experts_dispatch = True  # the dispatch now lives in _forward_impl
        if vars(klass).get("__hp_compute__") is body:  # a region's default compute is the body
            klass.__hp_compute__ = _forward_impl


# Kernels whose operands need every stride to be a multiple of 16 bytes (torch's grouped_mm).
_ALIGNED_KERNELS = ("grouped_mm",)


def fit_experts_kernel(module: nn.Module) -> str | None:
    """Switch ``module`` to its eager body when its local shards do not suit the configured kernel.

    ``grouped_mm`` needs 16-byte strides: a shard can break that where the whole weight
    did not (an intermediate dim of 24 floats over 4 ranks is 6 floats, 24 bytes), and the
    kernel would fail inside transformers. Returns what was switched and why, or ``None``.
    """
    if not getattr(type(module), "_hp_experts_dispatch", False):
        return None
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in _ALIGNED_KERNELS:
        return None
    for name, param in module.named_parameters(recurse=False):
        if param.dim() == 3 and any(stride * param.element_size() % 16 for stride in param.stride()[:-1]):
            module._hp_experts_implementation = "eager"
            return (
                f"{name} {tuple(param.shape)} {str(param.dtype).removeprefix('torch.')}: rows of "
                f"{param.stride()[-2] * param.element_size()} bytes, {implementation} needs multiples of 16"
            )
    return None


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


def fit_hub_functions(module: nn.Module) -> str | None:
    """Point ``module``'s hub-function wrappers (``_kernel_funcs``) at its own class's file; what was dropped.

    Returns the names of the hub kernels ``kernelize`` had bound (now replaced by the file's
    function, which the generated ``forward`` runs on the local shards), or ``None``.
    """
    wrappers = vars(module).get("_kernel_funcs")
    if not isinstance(wrappers, dict) or not wrappers:
        return None
    namespace = vars(sys.modules.get(type(module).__module__) or sys)
    layers = {
        getattr(type(value), "kernel_layer_name", None): value
        for value in namespace.values()
        if isinstance(value, nn.Module) and getattr(type(value), "kernel_layer_name", None)
    }
    dropped = []
    for name, wrapper in list(wrappers.items()):
        own = layers.get(getattr(type(wrapper), "kernel_layer_name", None))
        if own is None or (type(wrapper) is type(own) and "forward" not in vars(wrapper)):
            continue
        if "forward" in vars(wrapper):  # kernelize bound a hub kernel to this instance
            dropped.append(name)
        wrappers[name] = type(own)()
    return ", ".join(sorted(dropped)) or None
