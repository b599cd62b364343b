"""Where a per-head tensor made outside an attention carries its heads (BLOOM's ``alibi``, MPT's ``position_bias``).

Such a tensor is a ``forward`` argument of the attention, built once by the model for all
heads. Its head dimension is found by running the model on the meta device (shapes only,
nothing allocated) with a batch ``B`` and a sequence ``L`` chosen to differ from the head
count ``H``, and reading the argument's shape as the attention receives it:

- a dim of size ``H`` (MPT's ``[H, 1, L]``): the block's input goes ``R -> S(d)``, each rank
  keeping its heads' slice, no communication;
- a dim of size ``B * H`` (BLOOM's batch-major ``[B * H, 1, L]``): not one placement (the
  rank's rows are a chunk of every batch's heads), so the block becomes a region whose
  local compute (:func:`hpgen.runtime.forward.local_heads.batch_major_heads`) views it as
  ``[B, H, ...]`` and keeps this rank's heads;
- no such dim (ProphetNet's relative position buckets, ``[B, L, L]`` integers): not per head,
  it stays ``R``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["HeadLayout", "TracedCall", "head_layouts", "meta_forward", "probe_sizes", "recorded_arguments"]


@dataclass(frozen=True)
class HeadLayout:
    """How one argument of one module carries the heads: ``kind`` is ``dim``, ``batch_major`` or ``none``."""

    kind: str
    dim: int = 0
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class TracedCall:
    """One split, join or ``repeat_interleave`` a module's ``forward`` made in a meta-device run
    (:func:`hpgen.planner.derive.heads.parts.traced_calls`)."""

    module: str  # FQN of the module whose forward made the call (the nearest frame with a module ``self``)
    line: int
    op: str
    shapes: tuple[tuple[int, ...], ...]  # the tensor operands' shapes
    dim: int | None  # normalised (non-negative), None when not known
    parts: int | None  # equal parts a split makes; None for unequal parts or a join


def probe_sizes(heads: int) -> tuple[int, int]:
    """A batch and a sequence length that no head count, or product, is mistaken for."""
    batch, length = 3, 7
    while batch in (heads, 1) or heads % batch == 0:
        batch += 2
    while length in (heads, batch, batch * heads) or heads % length == 0:
        length += 2
    return batch, length


def head_layouts(
    model: Any, wanted: dict[str, tuple[str, ...]], heads: int, *, recorded: dict[Any, Any] | None = None
) -> dict[tuple[str, str], HeadLayout]:
    """``(module FQN, argument) -> HeadLayout`` for the ``wanted`` arguments, from one meta-device forward.

    ``recorded``, kept by the caller for one model (a derivation asks once per decoder layer),
    holds what each forward saw: the model runs once per probe size and class of the wanted
    modules, every module of those classes recorded, instead of once per layer. Raises
    ``RuntimeError`` (with the cause) when the model cannot run on the meta device or a wanted
    module is not called.
    """
    batch, length = probe_sizes(heads)
    classes = frozenset(type(model.get_submodule(fqn)) for fqn in wanted)
    key = (batch, length, classes)
    recorded = {} if recorded is None else recorded
    if key not in recorded:
        recorded[key] = recorded_arguments(model, classes, batch, length)
    arguments = recorded[key]
    if isinstance(arguments, str):  # the forward failed: the same error for every layer
        raise RuntimeError(arguments)
    found: dict[tuple[str, str], HeadLayout] = {}
    for fqn, names in wanted.items():
        for name in names:
            if fqn not in arguments:
                raise RuntimeError(f"{fqn} was not called with {name} in a forward on the meta device")
            given, extra = arguments[fqn]
            shape = given.get(name, extra.get(name))
            if shape is None:
                found[(fqn, name)] = HeadLayout("none")
            elif heads in shape and shape.count(heads) == 1:
                found[(fqn, name)] = HeadLayout("dim", shape.index(heads), shape)
            elif batch * heads in shape and shape.count(batch * heads) == 1:
                found[(fqn, name)] = HeadLayout("batch_major", shape.index(batch * heads), shape)
            elif heads in shape or batch * heads in shape:
                raise RuntimeError(f"{name} of {fqn} has shape {shape}: its head dim is ambiguous")
            else:
                found[(fqn, name)] = HeadLayout("none", shape=shape)
    return found


def recorded_arguments(model: Any, classes: frozenset[type], batch: int, length: int) -> dict[str, Any] | str:
    """Module FQN -> (its arguments' shapes, its ``**kwargs``' shapes; ``None`` where not a tensor) at its
    first call in one meta forward, for every module of ``classes``; the error text where the model cannot run."""
    import torch

    def shape(value: Any) -> tuple[int, ...] | None:
        return tuple(value.shape) if isinstance(value, torch.Tensor) else None

    seen: dict[str, Any] = {}
    handles = []
    for fqn, module in model.named_modules(remove_duplicate=False):  # a shared module: each of its names
        if type(module) not in classes:
            continue
        signature = inspect.signature(type(module).forward)

        def hook(module: Any, args: tuple, kwargs: dict, fqn: str = fqn, sig: Any = signature) -> None:
            if fqn in seen:
                return
            try:
                bound = sig.bind(module, *args, **kwargs).arguments
            except TypeError:
                return
            extra = bound.get("kwargs") if isinstance(bound.get("kwargs"), dict) else {}
            seen[fqn] = ({n: shape(v) for n, v in bound.items()}, {n: shape(v) for n, v in extra.items()})

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        meta_forward(model, batch, length)
    except RuntimeError as error:
        return str(error)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def meta_forward(model: Any, batch: int, length: int) -> None:
    """One forward of ``model`` on meta tensors; ``RuntimeError`` with the cause where it cannot run.

    With a mask of ones transformers does not look for packed sequences in the positions (a
    data-dependent test the meta device cannot answer), and a ready 4-D causal mask, which it
    passes on as it is, needs no data at all; a model that refuses a mask runs without one.
    Experts run as transformers' ``batched_mm`` for the forward: the default loop asks which
    experts got tokens (``.item()``, data the meta device does not have) and ``grouped_mm``
    wants bfloat16 there; the shapes every expert path gives are the same.
    """
    import torch

    ids = torch.zeros(batch, length, dtype=torch.long, device="meta")
    mask = torch.ones(batch, length, dtype=torch.long, device="meta")
    causal = torch.ones(batch, 1, length, length, dtype=torch.bool, device="meta")
    error: Exception | None = None
    with _batched_experts(model):
        for extra in ({"attention_mask": mask}, {"attention_mask": causal}, {}):
            try:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False, **extra)
                return
            except Exception as failure:
                error = error or failure
    raise RuntimeError(f"the model does not run on the meta device ({type(error).__name__}: {error})") from None


@contextmanager
def _batched_experts(model: Any) -> Iterator[None]:
    """Every config among the model's modules that chooses an experts implementation set to ``batched_mm``, and
    set back afterwards (the model is the planner's, read again later)."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    chosen = {key: c for key, c in configs.items() if hasattr(c, "_experts_implementation")}
    before = {key: c._experts_implementation for key, c in chosen.items()}
    try:
        for c in chosen.values():
            c._experts_implementation = "batched_mm"
        yield
    finally:
        for key, c in chosen.items():
            c._experts_implementation = before[key]
