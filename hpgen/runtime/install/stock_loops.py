"""Refusing a stock ``transformers.Trainer`` or ``Accelerator().prepare`` at the first thing each reads of the model.

Neither knows a model is parallelized: whatever their configuration (DDP or none, accelerate's
``ParallelismConfig``, FSDP or FSDP2, resuming a checkpoint) they clip by each rank's own norm,
scale the loss by their own process count, shard the data over ranks that must see the same
batch, or wrap and shard the model over them. Each is stopped, on every rank alike (the same
attribute read, no collective), before it changes anything:

- transformers' ``Trainer.__init__`` reads ``model.tp_size`` before it builds its accelerator
  (``_build_accelerator_args``), which is before accelerate's own checks of a
  ``ParallelismConfig``, before the FSDP checks and before ``train(resume_from_checkpoint=...)``
  can load a weight;
- accelerate's ``Accelerator.prepare`` reads ``hf_device_map`` of every module
  (``verify_device_map``) before any distributed preparation (DDP, tensor parallel, FSDP, FSDP2,
  DeepSpeed); a process that is not distributed goes straight to ``prepare_model``, which the
  model's ``_is_accelerate_prepared`` (``wrapped.AccelerateCheck``) refuses.

Both attributes become :class:`StockLoopCheck` data descriptors on the parallelized model's class
(an instance attribute cannot stand in front of ``tp_size``, a property of transformers'
``PreTrainedModel``, nor is it kept when the user assigns one). A descriptor refuses only a
parallelized instance read from inside a stock Trainer's or accelerator's own method (found in
the calling frames, as ``KeptFromDDP`` finds its DDP); every other read, and every instance that
is not parallelized, sees exactly what the class gave before.

The calling frames are read because neither library documents a place reached earlier (looked
for in transformers 5.24/5.25 and accelerate, as installed): ``TrainerCallback``'s first event,
``on_init_end``, comes at the end of ``Trainer.__init__``, after the accelerator is built and
the model moved, and only for callbacks the user passed (``DEFAULT_CALLBACKS`` is a module
list, not an API); accelerate's ``register_*_pre_hook`` are per accelerator and about saving
and loading state; neither offers entry points for plugins, nor a hook ahead of ``prepare``.
What a stock loop reads first is the one thing hpgen's model is asked before anything happens,
and only the frames say who asks. ``tests/runtime/training/test_stock_loops.py`` runs every
configuration of both against the installed transformers and accelerate, so a release that
reads something else first fails there.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["StockLoopCheck", "install_stock_loop_checks", "prepared_by_hpgen_trainer", "preparing", "stock_loop_message"]

# frames searched above a read for the stock loop's method (peft's wrappers forward the read through a few)
_FRAMES = 16

_PREPARING: contextvars.ContextVar[Any] = contextvars.ContextVar("hpgen_trainer_preparing", default=None)


@contextlib.contextmanager
def prepared_by_hpgen_trainer(accelerator: Any) -> Iterator[None]:
    """While ``hpgen.runtime.trainer.Trainer``'s own accelerator prepares a model, the checks let it."""
    token = _PREPARING.set(accelerator)
    try:
        yield
    finally:
        _PREPARING.reset(token)


def preparing() -> Any:
    """The hpgen Trainer's accelerator now preparing a model, or None."""
    return _PREPARING.get()


def stock_loop_message(model_name: str, what: str) -> str:
    """The refusal of a stock loop, ``what`` saying which one and where it was stopped."""
    return (
        f"hpgen: {model_name} was handed to {what}. Neither a stock transformers.Trainer nor accelerate's "
        "Accelerator.prepare knows the model is parallelized: they clip by each rank's own gradient norm (the "
        "replicated weights move apart), scale the loss by their own process count, and shard the data over ranks that "
        "must see the same batch, or wrap and shard the model over them (DDP, FSDP, their own tensor parallelism). "
        "Nothing was loaded or moved and no optimizer step was taken.\nTrain it with hpgen.runtime.trainer.Trainer "
        "(transformers' Trainer, same constructor: DDP or FSDP2 on the data-parallel mesh axis only, data sharded over "
        "those ranks, clipping by the whole model's norm), or in your own loop leave the model out of "
        "accelerator.prepare and use hpgen.runtime.clip_grad_norm_ instead of torch.nn.utils.clip_grad_norm_."
    )


def _stock_trainer(obj: Any) -> bool | None:
    """Whether ``obj``, if a ``transformers.Trainer``, is a stock one (hpgen's marks its class ``_hpgen_trainer``);
    None for anything else."""
    trainer = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer is None or not isinstance(obj, trainer):
        return None
    return not getattr(type(obj), "_hpgen_trainer", False)


def _stock_accelerator(obj: Any) -> bool | None:
    """Whether ``obj``, if an accelerate ``Accelerator``, prepares outside hpgen's Trainer; None for anything else."""
    accelerator = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
    if accelerator is None or not isinstance(obj, accelerator):
        return None
    return _PREPARING.get() is None


_READERS = {
    "tp_size": (_stock_trainer, "a stock transformers.Trainer (stopped in its constructor)"),
    "hf_device_map": (_stock_accelerator, "accelerate's Accelerator.prepare (stopped before it prepares anything)"),
}


def _read_by_stock_loop(name: str) -> bool:
    """Whether the nearest calling frame (above the descriptor's) that is a method of the loop reading ``name`` is a
    stock one's (the frames: see the module docstring for why nothing documented answers who reads)."""
    stock, _ = _READERS[name]
    frame = sys._getframe(2)
    for _ in range(_FRAMES):
        if frame is None:
            return False
        found = stock(frame.f_locals.get("self"))
        if found is not None:
            return found
        frame = frame.f_back
    return False


class StockLoopCheck:
    """A data descriptor on a parallelized model's class for ``tp_size`` or ``hf_device_map``.

    Read from a parallelized instance by a stock Trainer's or accelerator's method, it raises; any
    other read or write does what the class did before: the property or class value it replaced,
    else the instance's own value (``nn.Module``'s lookup, then ``AttributeError``).
    """

    def __init__(self, name: str, original: Any) -> None:
        self.name = name
        self.original = original  # what the class's MRO gave for the name, or None

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self if self.original is None else self.original
        if _parallelized(obj) and _read_by_stock_loop(self.name):
            raise RuntimeError(stock_loop_message(type(obj).__name__, _READERS[self.name][1]))
        if hasattr(self.original, "__get__"):
            return self.original.__get__(obj, owner)
        if self.name in obj.__dict__:
            return obj.__dict__[self.name]
        if self.original is not None:
            return self.original
        return nn.Module.__getattr__(obj, self.name)  # AttributeError, as before

    def __set__(self, obj: Any, value: Any) -> None:
        if hasattr(self.original, "__set__"):
            self.original.__set__(obj, value)
        else:
            obj.__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        if hasattr(self.original, "__delete__"):
            self.original.__delete__(obj)
        elif self.name in obj.__dict__:
            del obj.__dict__[self.name]
        else:
            raise AttributeError(self.name)


def _parallelized(obj: Any) -> bool:
    return "_hp_accelerate_check" in getattr(obj, "__dict__", {})


def install_stock_loop_checks(cls: type) -> None:
    """Put a :class:`StockLoopCheck` for each attribute a stock loop reads first on ``cls`` (once)."""
    for name in _READERS:
        original = next((klass.__dict__[name] for klass in cls.__mro__ if name in klass.__dict__), None)
        if isinstance(original, StockLoopCheck):  # on this class already, or inherited
            continue
        setattr(cls, name, StockLoopCheck(name, original))
