"""Where a per-head tensor made outside an attention carries its heads (BLOOM's ``alibi``, MPT's ``position_bias``).

Such a tensor is a ``forward`` argument of the attention, built once by the model for all
heads. Its head dimension is found by running the model on the meta device (shapes only,
nothing allocated) with a batch ``B`` and a sequence ``L`` chosen to differ from the head
count ``H``, and reading the argument's shape as the attention receives it:

- a dim of size ``H`` (MPT's ``[H, 1, L]``): the block's input goes ``R -> S(d)``, each rank
  keeping its heads' slice, no communication;
- a dim of size ``B * H`` (BLOOM's batch-major ``[B * H, 1, L]``): not one placement (the
  rank's rows are a chunk of every batch's heads), so the block becomes a region whose
  local compute (:func:`hpgen.runtime.local_heads.batch_major_heads`) views it as
  ``[B, H, ...]`` and keeps this rank's heads;
- no such dim (ProphetNet's relative position buckets, ``[B, L, L]`` integers): not per head,
  it stays ``R``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

__all__ = ["HeadLayout", "TracedCall", "head_layouts", "meta_forward", "probe_sizes"]


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


def head_layouts(model: Any, wanted: dict[str, tuple[str, ...]], heads: int) -> dict[tuple[str, str], HeadLayout]:
    """``(module FQN, argument) -> HeadLayout`` for the ``wanted`` arguments, from one meta-device forward.

    Raises ``RuntimeError`` (with the cause) when the model cannot run on the meta device or
    a wanted module is not called.
    """
    import torch

    batch, length = probe_sizes(heads)
    seen: dict[tuple[str, str], Any] = {}
    handles = []
    for fqn, names in wanted.items():
        module = model.get_submodule(fqn)
        signature = inspect.signature(type(module).forward)

        def hook(module: Any, args: tuple, kwargs: dict, fqn: str = fqn, names: tuple = names, sig: Any = signature) -> None:
            try:
                bound = sig.bind(module, *args, **kwargs).arguments
            except TypeError:
                return
            for name in names:
                value = bound.get(name, bound.get("kwargs", {}).get(name) if isinstance(bound.get("kwargs"), dict) else None)
                seen.setdefault((fqn, name), tuple(value.shape) if isinstance(value, torch.Tensor) else None)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        meta_forward(model, batch, length)
    finally:
        for handle in handles:
            handle.remove()
    found: dict[tuple[str, str], HeadLayout] = {}
    for fqn, names in wanted.items():
        for name in names:
            if (fqn, name) not in seen:
                raise RuntimeError(f"{fqn} was not called with {name} in a forward on the meta device")
            shape = seen[(fqn, name)]
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


def meta_forward(model: Any, batch: int, length: int) -> None:
    """One forward of ``model`` on meta tensors; ``RuntimeError`` with the cause where it cannot run.

    With a mask of ones transformers does not look for packed sequences in the positions (a
    data-dependent test the meta device cannot answer), and a ready 4-D causal mask, which it
    passes on as it is, needs no data at all; a model that refuses a mask runs without one.
    """
    import torch

    ids = torch.zeros(batch, length, dtype=torch.long, device="meta")
    mask = torch.ones(batch, length, dtype=torch.long, device="meta")
    causal = torch.ones(batch, 1, length, length, dtype=torch.bool, device="meta")
    error: Exception | None = None
    for extra in ({"attention_mask": mask}, {"attention_mask": causal}, {}):
        try:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False, **extra)
            return
        except Exception as failure:
            error = error or failure
    raise RuntimeError(f"the model does not run on the meta device ({type(error).__name__}: {error})") from None
