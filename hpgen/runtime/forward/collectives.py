"""Autograd-aware collectives of one mesh axis, as generated ``forward``s call them.

A generated forward writes each placement transition of one mesh axis as one call on
that axis's object, ``self._hp_<axis>``::

    hidden_states = self._hp_sp.all_gather(hidden_states, dim=1)     # S(1) -> R
    outputs = (self._hp_tp.all_reduce(outputs[0]), *outputs[1:])     # P(sum) -> R

Every collective changes only how a tensor is laid out over the axis, never its logical
value, so its gradient is the same transition run backwards: the gradient of the output
arrives in the output's placement and leaves in the input's. Which collective does that
depends on the gradient's placement, so each method takes ``backward=``, the op applied
to the gradient (Megatron's conjugate pairs are the defaults):

==========================  ==================  ================  ======================
method                      forward             default backward  other valid backward
==========================  ==================  ================  ======================
``all_reduce(x, op)``       P(op) -> R          identity          all_reduce
``all_gather(x, dim)``      S(dim) -> R         reduce_scatter    split
``reduce_scatter(x, dim)``  P(sum) -> S(dim)    all_gather        --
``split(x, dim)``           R -> S(dim)         all_gather        --
``all_to_all(x, i, j)``     S(i) -> S(j)        all_to_all        --
``copy(x)``                 R -> R (no-op)      all_reduce        identity
==========================  ==================  ================  ======================

A backward op fits when it is the forward's transition reversed: ``all_gather`` makes a
sharded tensor whole, so its gradient must go from whole to sharded (``reduce_scatter``
when each rank holds a partial gradient, ``split`` when each holds the full one). The
backward op works on the forward's own dim and per-rank sizes, so uneven shards round-trip
exactly. Reductions also apply their own derivative after the backward collective:
``avg`` scales the gradient by ``1/size``; ``max``/``min`` pass it only where this rank's
value is the result (on a tie every tied rank gets the full gradient).

Shards follow ``torch.tensor_split``: of ``n`` elements over ``k`` ranks, the first
``n % k`` ranks hold one more, and a rank may hold none. ``reduce_scatter``, ``split`` and
``all_to_all`` split a dim whose full size every rank knows. ``all_gather`` and
``all_to_all`` receive shards whose sizes, in general, only their senders know; they take
them from the first of these that applies, the same on every rank (a rank that used a
shortcut its peers did not would wait in a collective they never run):

1. ``total=``: the caller knows the gathered dim's full size (a column-parallel
   ``lm_head`` knows its ``out_features``); or ``sizes=``: the generated ``forward``
   found them once for several values cut alike (:meth:`AxisCollectives.shard_sizes`,
   :meth:`AxisCollectives.split_sizes`: the experts' tokens, routing ids and weights; a
   batch split at a model's entry and gathered at its exit);
2. inside a forward of a parallelized model (:func:`scope_shard_sizes`), the op of this
   axis that last made a shard of the same dim in that forward (the ``split`` of the
   sequence at the first decoder layer, the ``reduce_scatter`` of the layer before) left
   its sizes behind, and the gathers after it use them. Every rank runs the same ops in
   the same order, so every rank finds the same record; a shard whose size is not the
   recorded one is an error, never a silent misread;
3. otherwise one small all-gather exchanges the sizes (a host synchronisation on CUDA;
   under ``torch.compile`` it needs ``torch._dynamo.config.capture_scalar_outputs``).

A scatter (``reduce_scatter``, ``split``, an ``all_to_all``'s new shard) of a dim that a
gather of the same forward made whole returns what each rank gave that gather (12 and 6
tokens gathered into the experts come back 12 and 6, not 9 and 9); otherwise it cuts like
``torch.tensor_split``. The records are kept per dim, and look at nothing else of a
tensor's shape (:mod:`~hpgen.runtime.forward.shard_records`); a rank may hold nothing
(zero tokens) and still joins every collective. The backward reuses the forward's sizes
and exchanges nothing.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) every op is written with
torch's functional collectives (``torch.ops._c10d_functional``), which Dynamo traces and
Inductor schedules, and the autograd node (one ``torch.autograd.Function``) is traced
too, so a parallelized model compiles whole with ``fullgraph=True``, forward and
backward. Eager calls keep the in-place ``torch.distributed`` collectives.

Every op also takes a tuple or list of tensors (nested or not, the rotary ``(cos, sin)``):
each element moves as a tensor would, and the result has the input's type.

Results are fresh contiguous tensors; inputs are never modified. An axis of size one (or
with no process group) returns its input itself from every op, with no autograd node, and
every op returns ``None`` for ``None`` (optional inputs such as attention masks). Tensors
may live on any device the group's backend accepts (CPU with gloo, CUDA with NCCL).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from hpgen.core.shards import split_sizes

from .eager_collectives import OPS as _OPS
from .handback import call
from .moves import Move as _Move
from .moves import Sharded as _Shard
from .moves import Size
from .native_ops import NativeOps
from .shard_records import ShardRecords
from .traced_collectives import TRACED as _TRACED
from .traced_collectives import fc_all_gather as _fc_all_gather

__all__ = ["IDENTITY_AXIS", "REDUCE_OPS", "AxisCollectives", "ShardScope", "give_shard_sizes", "scope_shard_sizes"]

REDUCE_OPS = ("sum", "avg", "max", "min")

# Looked up softly: generated files import this module on builds without torch.distributed
# too, and torch 2.13 renamed the single-tensor collectives that older releases also have.
_all_gather_single = getattr(dist, "all_gather_single", getattr(dist, "all_gather_into_tensor", None))
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", getattr(dist, "reduce_scatter_tensor", None))

# Whether each op's input and output are sharded. A backward op is valid for a forward op
# when its kind is the forward's reversed, so this table states every conjugate pair.
_KIND: dict[str, tuple[bool, bool]] = {
    "identity": (False, False),
    "all_reduce": (False, False),
    "all_gather": (True, False),
    "reduce_scatter": (False, True),
    "split": (False, True),
    "all_to_all": (True, True),
}
_VALID_BACKWARD: dict[str, tuple[str, ...]] = {
    op: tuple(b for b, kind in _KIND.items() if kind == (dst, src)) for op, (src, dst) in _KIND.items()
}


def _tracing() -> bool:
    """Whether Dynamo is tracing: the ops then take their functional-collective form.

    (A function of its own so that the tests can run that form eagerly too.)
    """
    return torch.compiler.is_compiling()


def _check(op: str, backward: str, reduce: str = "sum") -> None:
    """Reject a reduction or backward op that ``op`` cannot run, naming the valid ones."""
    if reduce not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {reduce!r} for all_reduce; valid: {', '.join(REDUCE_OPS)}")
    if backward not in _VALID_BACKWARD[op]:
        public = "copy" if op == "identity" else op
        raise ValueError(
            f"backward={backward!r} is not a conjugate of {public}; valid: {', '.join(_VALID_BACKWARD[op])}"
        )


def _each_in_sequences(method: Callable[..., Any]) -> Callable[..., Any]:
    """Let an op take a tuple or list (nested or not) of tensors, as the rotary ``(cos, sin)``:
    each element moves as a tensor would, in order, and the result has the input's type."""

    @functools.wraps(method)
    def each(self: AxisCollectives, x: Any, *args: Any, **kwargs: Any) -> Any:
        if type(x) in (tuple, list):
            return type(x)(each(self, v, *args, **kwargs) for v in x)
        return method(self, x, *args, **kwargs)

    return each


def _norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} is out of range for a tensor of {ndim} dims")
    return dim % ndim


def _owned(y: Tensor, x: Tensor) -> Tensor:
    """``y`` as a fresh contiguous tensor. Autograd forbids in-place ops on an output of a
    Function that aliases its input or is a view, and callers may update results in place."""
    if y is x or y._is_view() or not y.is_contiguous():
        return y.clone(memory_format=torch.contiguous_format)
    return y


class AxisCollectives:
    """The collectives of one mesh axis, as generated forwards call them (``self._hp_<axis>``).

    ``group`` is the axis's process group; ``None`` (unlike in ``torch.distributed``, where
    it means the default group) or a group of one rank makes every op return its input.
    Every rank of the group must call the same ops in the same order, as with any collective.
    """

    def __init__(self, group: dist.ProcessGroup | None, name: str) -> None:
        self.name = name
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size < 1 or self.rank < 0:
            raise ValueError(f"axis {name!r}: this process is not a member of the group given for it")
        self._natives = NativeOps(group, self.size)  # which single-tensor collectives its backend has
        # the shard sizes this axis's ops saw in the current model forward, per dim;
        # None outside a model forward (see ShardScope), where nothing is recorded or used
        self._known: ShardRecords | None = None
        # (dim, every rank's size) given by serving code for the next model forward (give_shard_sizes)
        self._given: list[tuple[int, tuple[int, ...]]] = []

    def __repr__(self) -> str:
        return f"AxisCollectives({self.name!r}, rank={self.rank}, size={self.size})"

    def __deepcopy__(self, memo: dict) -> AxisCollectives:
        return self  # a handle on a process group: copies of a model share it

    # ---- the ops (placements as docs/plan-format.md defines them) -----------------------

    @_each_in_sequences
    def all_reduce(self, x: Tensor | None, op: str = "sum", *, backward: str = "identity") -> Tensor | None:
        """``P(op) -> R``: reduce the ranks' partial values. ``op``: sum, avg, max or min."""
        _check("all_reduce", backward, op)
        if x is None or self.size == 1:
            return x
        if op == "sum" and not (torch.is_grad_enabled() and x.requires_grad) and not _tracing():
            # The eager decode hot path: no autograd node, one clone, one in-place all-reduce.
            out = x.clone(memory_format=torch.contiguous_format)
            call(dist.all_reduce, out, group=self.group)
            return out
        return self._run(x, _Move("all_reduce", None, None, op), backward)

    @_each_in_sequences
    def all_gather(
        self,
        x: Tensor | None,
        dim: int,
        *,
        backward: str = "reduce_scatter",
        total: Size | None = None,
        sizes: tuple[Size, ...] | None = None,
    ) -> Tensor | None:
        """``S(dim) -> R``: concatenate the ranks' shards along ``dim``, whatever their sizes.

        ``total``: the full size of ``dim``, when the caller knows it (no size exchange);
        ``sizes``: every rank's size of ``dim``, for shards not cut like ``tensor_split``.
        """
        _check("all_gather", backward)
        if x is None or self.size == 1:
            return x
        d = _norm_dim(dim, x.dim())
        if sizes is None:
            sizes = self._shard_sizes(x, d, total, "all_gather")
        else:
            sizes = self._given_sizes(x, d, sizes, "all_gather")
        return self._run(x, _Move("all_gather", _Shard(d, sizes), None), backward)

    @_each_in_sequences
    def reduce_scatter(self, x: Tensor | None, dim: int, *, backward: str = "all_gather") -> Tensor | None:
        """``P(sum) -> S(dim)``: sum the ranks' partial values, keep this rank's chunk of ``dim``."""
        _check("reduce_scatter", backward)
        if x is None or self.size == 1:
            return x
        d = _norm_dim(dim, x.dim())
        dst = self._made(x, d)
        return self._run(x, _Move("reduce_scatter", None, dst), backward)

    @_each_in_sequences
    def split(
        self, x: Tensor | None, dim: int, *, backward: str = "all_gather", sizes: tuple[Size, ...] | None = None
    ) -> Tensor | None:
        """``R -> S(dim)``: keep this rank's chunk of ``dim``; no communication.

        ``sizes``: every rank's size of ``dim`` in rank order, summing to the whole (by
        default ``tensor_split``'s); rank ``i`` keeps the ``i``-th run of them.
        """
        _check("split", backward)
        if x is None or self.size == 1:
            return x
        d = _norm_dim(dim, x.dim())
        if sizes is None:
            dst = self._made(x, d)
        else:
            if len(sizes) != self.size or (not _tracing() and sum(sizes) != x.size(d)):
                raise ValueError(f"axis {self.name!r}: split sizes {tuple(sizes)} do not cut {x.size(d)} over {self.size} ranks")
            dst = _Shard(d, tuple(sizes))
        return self._run(x, _Move("split", None, dst), backward)

    @_each_in_sequences
    def all_to_all(
        self,
        x: Tensor | None,
        src_dim: int,
        dst_dim: int,
        *,
        backward: str = "all_to_all",
        total: Size | None = None,
    ) -> Tensor | None:
        """``S(src_dim) -> S(dst_dim)``: trade chunks of ``dst_dim`` for the others' shards of ``src_dim``.

        ``total``: the full size of ``src_dim``, when the caller knows it (no size exchange).
        """
        _check("all_to_all", backward)
        if x is None or self.size == 1:
            return x
        src, dst = _norm_dim(src_dim, x.dim()), _norm_dim(dst_dim, x.dim())
        if src == dst:
            raise ValueError(f"all_to_all needs two different dims, got src_dim={src_dim}, dst_dim={dst_dim}")
        src_shard = _Shard(src, self._shard_sizes(x, src, total, "all_to_all"))
        move = _Move("all_to_all", src_shard, self._made(x, dst))
        return self._run(x, move, backward)

    @_each_in_sequences
    def copy(self, x: Tensor | None, *, backward: str = "all_reduce") -> Tensor | None:
        """``R -> R`` into a region sharded on this axis: identity forward; by default the
        gradient, partial inside the region, is all-reduced (Megatron's ``f``)."""
        _check("identity", backward)
        if x is None or self.size == 1 or backward == "identity":
            return x
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x  # nothing flows back: the forward is the identity, no copy needed
        return self._run(x, _Move("identity", None, None), backward)

    def copy_if_grad(self, value: Any) -> Any:
        """An argument the plan does not declare, entering a body sharded on this axis: ``R``.

        A tensor that requires grad (or a tuple/list holding some) gets :meth:`copy`, so its
        partial gradient is all-reduced; anything else passes on as it is, at the cost of
        a type check.
        """
        if self.size == 1:
            return value
        if isinstance(value, Tensor):
            return self.copy(value) if value.requires_grad else value
        if type(value) in (tuple, list) and any(isinstance(v, Tensor) and v.requires_grad for v in value):
            return type(value)(self.copy(v) if isinstance(v, Tensor) else v for v in value)
        return value

    def copy_if_grad_kwargs(self, kwargs: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """:meth:`copy_if_grad` on each value of ``**kwargs`` but ``skip`` (declared inputs, moved apart)."""
        if self.size == 1 or not kwargs:
            return kwargs
        return {name: value if name in skip else self.copy_if_grad(value) for name, value in kwargs.items()}

    def end_forward(self) -> None:
        """The model's forward returned: forget what it recorded beyond the shard sizes."""

    # ---- shard sizes ------------------------------------------------------------------

    def shard_sizes(self, *shards: Tensor | None, dim: int) -> tuple[Size, ...] | None:
        """Every rank's size of ``dim`` of the first of ``shards`` that is not ``None`` (this
        rank's shard), found as a gather finds it: a record of this forward, else one exchange.
        ``None`` where every one is ``None``, or on an axis of one rank.

        A generated ``forward`` whose inputs are cut alike (the experts' tokens, routing ids
        and weights) asks once and hands the answer to each of their gathers (``sizes=``).
        """
        x = next((shard for shard in shards if shard is not None), None)
        if x is None or self.size == 1:
            return None
        return self._shard_sizes(x, _norm_dim(dim, x.dim()), None, "all_gather")

    def split_sizes(self, *wholes: Tensor | None, dim: int) -> tuple[Size, ...] | None:
        """What :meth:`split` gives each rank of ``dim`` of the first of ``wholes`` that is not
        ``None``; ``None`` as for :meth:`shard_sizes`.

        A generated ``forward`` that splits several inputs alike (a batch at a data-parallel
        model's entry) asks once, splits each with these sizes, and gathers the body's
        outputs with them (``sizes=``): no gather of that boundary exchanges.
        """
        x = next((whole for whole in wholes if whole is not None), None)
        if x is None or self.size == 1:
            return None
        d = _norm_dim(dim, x.dim())
        # not recorded: every op that needs these sizes is handed them, and a batch split at a
        # model's entry is no answer for the token gathers inside its body, which cut another dim 0
        return self._scatter_sizes(d, x.size(d))

    def _made(self, x: Tensor, dim: int) -> _Shard:
        """The shard a scatter makes of ``x``'s whole ``dim``, recorded for the gathers after it:
        what a gather of the same forward took on that dim, if one took that total, else
        ``torch.tensor_split``'s sizes."""
        shard = _Shard(dim, self._scatter_sizes(dim, x.size(dim)))
        if self._known is not None:
            self._known.add(dim, shard.sizes, gathered=False)
        return shard

    def _scatter_sizes(self, dim: int, n: Size) -> tuple[Size, ...]:
        """Every rank's piece of a whole ``dim`` of ``n``: what a gather of this forward took of
        that total, if one did, else ``torch.tensor_split``'s sizes."""
        sizes = self._known.for_scatter(dim, n) if self._known is not None else None
        return split_sizes(n, self.size) if sizes is None else sizes

    def _shard_sizes(self, x: Tensor, dim: int, total: Size | None, what: str) -> tuple[Size, ...]:
        """Every rank's size of ``x`` along ``dim``: from ``total``, a record, or an exchange."""
        known = self._known.for_gather(dim) if self._known is not None and total is None else None
        if total is not None:
            sizes, origin = split_sizes(total, self.size), f"total={total} gives"
        elif known is not None:
            sizes, origin = known, "the shard last made on that dim in this forward gives"
        else:
            sizes = self._exchange_sizes(x.size(dim), x.device)
            if self._known is not None:  # what each rank gave: the conjugate scatter returns it
                self._known.add(dim, sizes, gathered=True)
            return sizes
        return self._checked(
            x, dim, sizes, what, origin,
            "; pass the right total, or shard the tensor on this dim with this axis's split or reduce_scatter first "
            "(a second cut of one dim in a forward needs its sizes handed to it: sizes=)",
        )

    def _given_sizes(self, x: Tensor, dim: int, sizes: tuple[Size, ...], what: str) -> tuple[Size, ...]:
        """``sizes`` (every rank's size of ``dim``), checked against this rank's shard."""
        if len(sizes) != self.size:
            raise ValueError(f"axis {self.name!r}: {what}: {len(sizes)} sizes for {self.size} ranks")
        return self._checked(x, dim, tuple(sizes), what, "the sizes given give")

    def _checked(
        self, x: Tensor, dim: int, sizes: tuple[Size, ...], what: str, origin: str, advice: str = ""
    ) -> tuple[Size, ...]:
        """``sizes``, once this rank's shard of ``x`` is found to hold ``sizes[rank]`` on ``dim``
        (``origin``: where they came from, with its verb, for the error)."""
        mine = x.size(dim)
        if _tracing():
            torch._check(mine == sizes[self.rank])  # (Dynamo takes no message built from locals)
        elif mine != sizes[self.rank]:
            raise RuntimeError(
                f"axis {self.name!r}: {what} on dim {dim}: rank {self.rank} holds {mine}, but {origin} it "
                f"{sizes[self.rank]} (sizes {sizes}){advice}"
            )
        return sizes

    def _exchange_sizes(self, n: Size, device: torch.device) -> tuple[Size, ...]:
        """Every rank's ``n``, by one all-gather of one int64 per rank (a host sync on CUDA).

        Under torch.compile the sizes become unbacked symbolic ints, which needs
        ``torch._dynamo.config.capture_scalar_outputs = True`` (else the graph breaks here).
        """
        mine = torch.full((1,), n, dtype=torch.int64, device=device)
        if _tracing():
            sizes = tuple(_fc_all_gather(mine, 0, self.group).tolist())
            for size in sizes:
                torch._check(size >= 0)
            torch._check(sizes[self.rank] == n)
            return sizes
        every = torch.empty(self.size, dtype=torch.int64, device=device)
        self._gather_into(every, mine)
        return tuple(every.tolist())

    # ---- machinery --------------------------------------------------------------------

    def _run(self, x: Tensor, move: _Move, backward: str) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _Collective.apply(x, self, move, move.reversed(backward))
        if _tracing():
            return _TRACED[move.op](self, x, move)
        return _owned(_OPS[move.op](self, x, move), x)  # no gradient: skip the autograd node

    def find_native_ops(self, device: torch.device) -> None:
        """Probe now which native single-tensor collectives this group runs on ``device``.

        ``parallelize`` calls it at install, where every rank of the group is present, so that
        no probe runs inside a model forward, where collectives are counted, timed or captured;
        another device type is still probed at its first use.
        """
        if self.size > 1:
            like = torch.empty(0, 0, device=device)  # hidden states' float32 and two dims
            for collective in (_all_gather_single, _reduce_scatter_single, dist.all_to_all_single):
                self._natives.runs(collective, like)

    def _native(self, collective: Callable[..., object], out: Tensor, *args: object) -> bool:
        """Run ``collective(out, *args)`` on this group; False (nothing run) where its backend lacks it (a probe
        finds out, once per device type: :mod:`~hpgen.runtime.forward.native_ops`)."""
        if not self._natives.runs(collective, out):
            return False
        call(collective, out, *args, group=self.group)
        return True

    def _gather_into(self, out: Tensor, inp: Tensor) -> None:
        """Rank ``i``'s contiguous ``inp`` into the ``i``-th block of contiguous ``out``."""
        stacked = out.view(self.size * inp.shape[0], *inp.shape[1:])  # the shape gloo checks
        if not self._native(_all_gather_single, stacked, inp):
            call(dist.all_gather, list(stacked.chunk(self.size)), inp, group=self.group)

    def _reduce_scatter_into(self, out: Tensor, blocks: Tensor) -> None:
        """``out`` = the sum over ranks of their block ``rank`` of ``blocks`` (``[size, *out.shape]``)."""
        stacked = blocks.view(self.size * out.shape[0], *out.shape[1:])  # the shape gloo checks
        if not self._native(_reduce_scatter_single, out, stacked):
            total = blocks.clone(memory_format=torch.contiguous_format)  # fallback: all-reduce, keep ours
            call(dist.all_reduce, total, group=self.group)
            out.copy_(total[self.rank])


class ShardScope:
    """Forward pre-hook and hook of a parallelized model: shard sizes recorded by its
    collectives (see the module docstring) live from the start of one forward to its end.

    Outside a model forward nothing is recorded, so a record never outlives the tensors
    it describes: a later forward, or a submodule called on its own, exchanges sizes
    rather than trusting a stale record.
    """

    def __init__(self, axes: Iterable[AxisCollectives]) -> None:
        self.axes = tuple(ax for ax in axes if ax.size > 1)

    def enter(self, module: nn.Module, args: Any) -> None:
        for ax in self.axes:
            ax._known = ShardRecords()
            for dim, sizes in ax._given:  # what serving code said this forward's shards are
                ax._known.add(dim, sizes, gathered=False)
            ax._given.clear()

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        for ax in self.axes:
            ax._known = None
            ax.end_forward()

    def __deepcopy__(self, memo: dict) -> ShardScope:
        return self  # holds process-group handles, shared by copies of a model


def scope_shard_sizes(model: nn.Module, axes: Iterable[AxisCollectives]) -> ShardScope:
    """Let ``axes``' gathers use the sizes of shards made earlier in the same ``model`` forward."""
    scope = ShardScope(axes)
    if scope.axes:
        model.register_forward_pre_hook(scope.enter)
        model.register_forward_hook(scope.exit, always_call=True)
    return scope


def give_shard_sizes(model: nn.Module, axis: str, sizes: Sequence[int], *, dim: int = 0) -> None:
    """Every rank's size of ``dim`` on mesh ``axis`` in the next forward of parallelized ``model``.

    Serving code that already knows each rank's token count (a data-parallel attention
    scheduler does: it batched the requests) gives it here, before the forward; that
    forward's gathers of that dim then take these sizes as if a split had made them, and
    nothing exchanges them (docs/runtime.md, data-parallel attention). Every rank calls it
    alike, with the same ``sizes``; a rank whose shard is not ``sizes[rank]`` raises in the
    first gather of the dim. Given sizes last one forward.
    """
    if dim < 0:
        raise ValueError(f"give_shard_sizes: dim must be a dim of the sharded tensors counted from 0, got {dim}")
    found = {id(ax): ax for ax in (getattr(module, f"_hp_{axis}", None) for module in model.modules())}
    axes = [ax for ax in found.values() if isinstance(ax, AxisCollectives) and ax.size > 1]
    if not axes:
        raise ValueError(f"give_shard_sizes: the model has no axis {axis!r} of more than one rank")
    given = tuple(int(n) for n in sizes)
    for ax in axes:
        if len(given) != ax.size or min(given) < 0:
            raise ValueError(f"give_shard_sizes: axis {axis!r} has {ax.size} ranks; got sizes {given}")
        ax._given.append((dim, given))


# the eager and the traced forms run the same ops, whose kinds the conjugate table states
assert _OPS.keys() == _KIND.keys() == _TRACED.keys()


class _Collective(torch.autograd.Function):
    """Runs the forward move; in backward, runs the reversed move on the gradient, then the
    reduction's own derivative (1/size for avg, the argmax/argmin mask for max/min).

    Dynamo traces it (forward and backward) when it is compiling; the traced ops run then.
    """

    @staticmethod
    def forward(ctx, x: Tensor, ax: AxisCollectives, move: _Move, back: _Move) -> Tensor:  # type: ignore[override]
        if _tracing():
            y = _TRACED[move.op](ax, x, move)
        else:
            y = _owned(_OPS[move.op](ax, x, move), x)
        ctx.ax, ctx.back = ax, back
        ctx.scale = 1.0 / ax.size if move.reduce == "avg" else None
        ctx.masked = move.reduce in ("max", "min")
        if ctx.masked:
            ctx.save_for_backward(x == y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        if ctx.back.op != "identity":  # (the traced identity copies; a gradient need not)
            ops = _TRACED if _tracing() else _OPS
            grad = ops[ctx.back.op](ctx.ax, grad, ctx.back)
        if ctx.scale is not None:
            grad = grad * ctx.scale
        if ctx.masked:
            grad = grad * ctx.saved_tensors[0]
        return grad, None, None, None


IDENTITY_AXIS = AxisCollectives(None, "identity")
"""The class-level default ``_hp_<axis>`` of generated files: every op returns its input."""
