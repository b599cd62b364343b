"""A cp model's logits and loss: the loss on each rank's own tokens, the logits gathered or left sharded.

Plans of ``hpgen plan --cp N`` gather the sequence at the final norm, so the language-model
head and the loss would see the whole sequence on every rank, and the loss would save the
whole ``[tokens, vocabulary]`` logits for backward on each of them: for long contexts the
largest tensor of the step. Instead, on a forward of the whole sequence (a training step,
or a forward without ``logits_to_keep``), :func:`install_logits` has the head run on this
rank's tokens (its weight's gradient summed over cp) (the head-tail shard of :mod:`hpgen.runtime.forward.context_axis`) and the
model's ``loss_function`` compute the loss of those tokens: their labels are the whole
sequence's, shifted before they are cut (a chunk's last token predicts the first token of
the next chunk, wherever that chunk lives), each rank's loss is its tokens' sum over the
whole batch's count of labels, and the ranks' losses are summed. The loss and its
gradients are the unsharded model's; what a rank saves is its share of the logits.

The logits the model returns are gathered along the sequence (the unsharded model's), or,
after :func:`shard_logits`, left as this rank's tokens in the order it holds them
(:func:`local_positions` gives their positions): the gather of ``[tokens, vocabulary]`` on
every rank is then skipped too.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor, nn

from hpgen.runtime.errors import ParallelizeError

__all__ = ["install_logits", "local_positions", "shard_logits"]


class _LogitsState:
    """What the hooks of one cp model share during a forward."""

    def __init__(self, axis: Any) -> None:
        self.axis = axis
        self.local = False  # this forward runs the head and the loss on this rank's tokens
        self.sharded = False  # the user asked for sequence-sharded logits (shard_logits)
        self.n = 0  # the whole sequence's length in this forward
        self.as_tuple = False  # the caller asked for a tuple (return_dict=False): made after the gather
        self.engine_scale = 0  # a data-parallel engine sums the head's gradient over cp: scale by this, no all-reduce


class _LocalLoss:
    """The model's ``loss_function``, on this rank's logits and its tokens' shifted labels, summed over cp."""

    def __init__(self, loss: Any, state: _LogitsState) -> None:
        self.loss = loss
        self.state = state

    def __call__(
        self,
        logits: Tensor,
        labels: Tensor | None,
        vocab_size: int,
        num_items_in_batch: Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        state = self.state
        if not state.local:
            return self.loss(
                logits, labels, vocab_size, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                shift_labels=shift_labels, **kwargs,
            )
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        if num_items_in_batch is None:  # the unsharded loss is the mean over every label of the batch
            num_items_in_batch = (shift_labels != ignore_index).sum()
        layout = state.axis.layout(state.n, shift_labels.device)
        mine = shift_labels.index_select(-1, layout.local).contiguous()
        loss = self.loss(
            logits, None, vocab_size, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
            shift_labels=mine, **kwargs,
        )
        return state.axis.all_reduce(loss, "sum", backward="identity")

    def __getattr__(self, name: str) -> Any:
        if "loss" not in self.__dict__:  # copy.deepcopy asks for __setstate__ before filling __dict__
            raise AttributeError(name)
        return getattr(self.__dict__["loss"], name)


def install_logits(model: nn.Module, axis: Any, planned: Collection[str]) -> None:
    """The head on this rank's tokens and the loss on them, for ``model`` on the ``cp`` ``axis``.

    Only a plain ``nn.Linear`` head the plan leaves alone takes this rank's tokens (its
    weight's gradient, from a share of the tokens, summed over cp in backward); a model
    whose head the plan shards (``cp x tp``), or without a ``loss_function``, keeps the
    gathered sequence for its head and loss. ``planned``: the FQNs of the modules the plan matches.

    The head's forward and the model's hooks are objects holding the head and the state
    (not closures), so ``copy.deepcopy(model)`` (a reference or EMA model) gets its own,
    running on the copy's head.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear or not hasattr(model, "loss_function"):
        return
    fqn = next(name for name, module in model.named_modules() if module is head)
    if fqn in planned:
        return
    state = _LogitsState(axis)
    model._hp_cp_logits = state
    model.loss_function = _LocalLoss(model.loss_function, state)
    head.forward = _LocalHead(head, state)
    model.register_forward_pre_hook(_Begin(state), with_kwargs=True)
    model.register_forward_hook(_End(state), with_kwargs=True, always_call=True)


class _LocalHead:
    """``lm_head.forward``: on a forward of the whole sequence, this rank's tokens only (the
    weight's gradient summed over cp in backward); otherwise the head as it is."""

    def __init__(self, head: nn.Linear, state: _LogitsState) -> None:
        self.head = head
        self.state = state

    def __call__(self, hidden: Tensor) -> Tensor:
        head, state = self.head, self.state
        if not state.local or hidden.size(1) != state.n:
            return nn.Linear.forward(head, hidden)
        axis = state.axis
        scale = state.engine_scale

        def share(x: Tensor) -> Tensor:
            if scale:  # each rank's share, times cp: the engine's average over cp is the sum
                return _ScaleGrad.apply(x, scale)
            return axis.copy(x)  # the sum over cp, in backward

        bias = None if head.bias is None else share(head.bias)
        return nn.functional.linear(axis.split(hidden, 1), share(head.weight), bias)


class _ScaleGrad(torch.autograd.Function):
    """The head's weight (or bias) as it is, its gradient times ``factor`` in backward.

    When a data-parallel engine makes the sum over cp (:func:`hpgen.runtime.training.data_parallel`)
    it AVERAGES over its ranks; this rank's share of the head's gradient (its own tokens'), times the
    cp size, averages to the sum of the shares, with no collective of hpgen's."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


class _Begin:
    """Forward pre-hook: whether this forward runs the head and the loss on this rank's tokens.

    A caller asking for a tuple (``return_dict=False``, or ``config.return_dict`` false)
    gets the model's output as a ``ModelOutput`` here, so :class:`_End` finds the logits to
    gather by name, and the tuple after that."""

    def __init__(self, state: _LogitsState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        state = self.state
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        keep = kwargs.get("logits_to_keep", 0)
        whole = isinstance(keep, int) and keep == 0 and isinstance(ids, Tensor) and ids.dim() >= 2
        state.local = bool(state.axis.active and whole and not torch.compiler.is_compiling())
        state.n = ids.size(1) if state.local else 0
        state.as_tuple = False
        if not state.local:
            return None
        asked = kwargs.get("return_dict")
        if asked is None:
            asked = getattr(getattr(module, "config", None), "return_dict", True)
        if asked:
            return None
        state.as_tuple = True
        return args, {**kwargs, "return_dict": True}


class _End:
    """Forward hook: the logits gathered along the sequence (unless sharded), the tuple if asked for.

    The gather's backward is a split (each rank keeps its tokens' rows of the gradient): a
    loss computed alike on every rank from the gathered logits hands every rank the same
    whole gradient, and summing those copies (a reduce-scatter) would count it cp times.
    """

    def __init__(self, state: _LogitsState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        state = self.state
        if not state.local:
            return output
        state.local = False
        as_tuple, state.as_tuple = state.as_tuple, False
        if output is None:  # the forward raised (an always_call hook)
            return output
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, tuple):
            raise RuntimeError(
                f"{type(module).__name__}: context parallelism: the forward returned a tuple, in which the logits "
                "to gather along the sequence cannot be found; call it with return_dict=True"
            )
        if logits is not None and not state.sharded:
            output.logits = state.axis.all_gather(logits, 1, total=state.n, backward="split")
        return output.to_tuple() if as_tuple else output


def _state(model: nn.Module) -> _LogitsState:
    base = getattr(model, "get_base_model", None)
    found = getattr(model, "_hp_cp_logits", None) or getattr(base() if callable(base) else None, "_hp_cp_logits", None)
    if found is None:
        raise ParallelizeError(
            f"{type(model).__name__}: no context-parallel logits to shard: parallelize it on a mesh with a 'cp' axis first"
        )
    return found


def shard_logits(model: nn.Module, sharded: bool = True) -> None:
    """Return logits sequence-sharded from ``model``'s forwards over the whole sequence
    (``sharded=False``: gathered again, the default): this rank's tokens, in the order of
    :func:`local_positions`. For long contexts the gathered ``[tokens, vocabulary]`` logits
    are the largest tensor of a step; the loss is the unsharded model's either way."""
    _state(model).sharded = sharded


def local_positions(model: nn.Module, n: int, device: torch.device | str = "cpu") -> Tensor:
    """The sequence positions of this rank's tokens, in the order its sharded logits hold them."""
    return _state(model).axis.layout(n, torch.device(device)).local
