"""The random streams of a parallelized model: which numbers each rank's random ops draw.

The rule (Megatron's model-parallel RNG tracker, torchtitan's one-seed rule): a random
op on a value that is replicated or a partial sum on an axis draws the same numbers on
every rank of that axis, whatever each rank's global seed (dropout of a partial sum is
exact only with one mask everywhere); a random op on a value sharded on an axis draws
numbers of its own on each rank (head-sharded attention dropout is not one mask repeated
on every rank's heads).

Random ops (``nn.Dropout``, ``F.dropout``, the ``dropout_p`` of sdpa, a LayerDrop's
``torch.rand``) take no generator argument: they draw from the default generator of
their device. So in train mode the model's forward runs with the default generators
(the CPU one and the model's CUDA one) set to the model's own streams, and the user's
states are put back when it returns:

- :class:`ModelStreams` (pre-hook and hook of the model ``parallelize`` was given): the
  *replicated stream*, seeded from ``(seed, step)``: ``seed`` is the first rank's
  ``torch.initial_seed()`` taken at ``parallelize`` (the same on every rank of the plan's
  axes), ``step`` counts the train-mode forwards. Code outside the sharded bodies (the
  embeddings' dropout, a decoder layer's ``F.dropout``) draws from it.
- :class:`BodyStreams` (around the body of each boundary sharded on some axis): the
  value's layout changes inside the body at known places, and the stream follows it.
  The body starts *local* when its inputs arrive sharded (a sequence-sharded decoder
  layer) and *replicated* otherwise; after a column-parallel projection (its output
  features sharded: ``q_proj``, GPT-2's ``c_attn``, ``fc1``) it is local, after a
  row-parallel one (a partial sum: ``o_proj``, ``c_proj``, ``fc2``) replicated again
  (:class:`LayoutChange`, a hook of each projection, registered only while the model
  draws: eval mode and decode run without them). Each change reseeds the default
  generators from a seed derived from the body's frame: the replicated seeds from the
  stream the body was entered with (the same on every rank), the local ones with this
  rank's coordinates on the axes the body is sharded on added. A summed block's body (a
  parallel-residual layer reducing its two branches once) starts replicated even on a
  sequence-sharded stream: its branches read their input gathered whole and leave partial
  sums, whose dropouts before the one reduction must draw one mask on every rank; the
  branches have no body of their own, and their projections change the block's layout.
  (A random op after that reduction on a sequence-sharded stream, Falcon's ``dropout_add``,
  then draws from the replicated stream: the same numbers on each rank's tokens.)
- :class:`WrappedProjection` (hook of a wrapped ``nn.Linear`` boundary): outside the bodies,
  a column-parallel linear whose output stays sharded opens a per-rank region, and the
  row-parallel linear that reduces it closes it (BioGPT's ``fc1``, activation dropout, ``fc2``).

Every seed is derived from the state of the default generator when the outermost body
is entered, so ``torch.utils.checkpoint`` (which saves and restores exactly that state
around a recomputed decoder layer) redraws the same masks in backward. Eval mode, and a
model whose dropout probabilities are all zero, skip all of it at the cost of one check
per hook; under ``torch.compile`` the hooks step aside (the graph keeps the user's
generators).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpgen.runtime.forward.handback import call

__all__ = ["BodyStreams", "LayoutChange", "ModelStreams", "default_generators", "mix", "reseed_random_streams"]

_MASK = (1 << 64) - 1
# domains, so that no two kinds of derived seed collide
_STEP, _CHILD, _LOCAL, _REPLICATED, _EXIT = 1, 2, 3, 4, 5
# config attributes that hold probabilities or scales of random ops (dropout, LayerDrop, router jitter)
_RANDOM_CONFIG_WORDS = ("drop", "jitter", "noise")


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 over them): the same on every process."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK)) & _MASK
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        state = z ^ (z >> 31)
    return state >> 1


def _compiling() -> bool:
    return torch.compiler.is_compiling()


@dataclass
class _Frame:
    """One sharded body being run: its root seed, its layout now, and how many seeds it has derived."""

    seed: int
    local: bool
    coordinates: tuple[int, ...]  # this rank's on the axes the body is sharded on
    changes: int = 0
    children: int = 0
    region: bool = False  # opened by a wrapped column-parallel linear outside any body (see open_region)


@dataclass
class ModelStreams:
    """The model's streams and the state shared by its hooks (see the module docstring)."""

    seed: int
    dropouts: list[nn.Module] = field(default_factory=list)  # nn.Dropout* modules: their p
    config: Any = None
    config_keys: tuple[str, ...] = ()
    step: int = 0
    enabled: bool = False  # set at each train-mode forward: some random op can draw
    generators: list[torch.Generator] = field(default_factory=list)
    frames: list[_Frame] = field(default_factory=list)
    _saved: list[list[torch.Tensor] | None] = field(default_factory=list)
    # (FQN, column-parallel) of the projections whose hook moves a body's stream: registered on a model while it
    # draws (train mode), removed by its next forward that does not, so eval and decode run without them
    projections: list[tuple[str, bool]] = field(default_factory=list)
    _armed: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def __deepcopy__(self, memo: dict) -> ModelStreams:
        return self  # hooks of copies of a model share one stream, as they share the process groups

    # ---- the model's forward ----------------------------------------------------------

    def enter_model(self, module: nn.Module, args: Any) -> None:
        if _compiling():  # traced: the graph keeps the user's generators (see the module docstring)
            return
        if not module.training or not self._draws():
            for handle in self._armed.pop(module, ()):
                handle.remove()
            self._saved.append(None)
            self.enabled = False
            return
        if module not in self._armed:
            self._armed[module] = [
                module.get_submodule(fqn).register_forward_hook(LayoutChange(self, column))
                for fqn, column in self.projections
            ]
        self.enabled = True
        self.generators = default_generators(module)
        self._saved.append([generator.get_state() for generator in self.generators])
        self._reseed(mix(self.seed, _STEP, self.step))
        self.step += 1

    def exit_model(self, module: nn.Module, args: Any, output: Any) -> None:
        if _compiling():
            return None
        saved = self._saved.pop() if self._saved else None
        if saved is not None:
            for generator, state in zip(self.generators, saved):
                generator.set_state(state)
            self.frames.clear()  # a forward that raised inside a body leaves no frame behind
        return None

    def reseed(self, seed: int, step: int = 0) -> None:
        """Start the model's streams again from ``seed`` (give every rank the same)."""
        self.seed, self.step = int(seed), int(step)

    def _draws(self) -> bool:
        """Whether any random op of the model can draw (a probability above zero)."""
        if any(getattr(module, "p", 0) > 0 for module in self.dropouts):
            return True
        return any(_positive(getattr(self.config, key, 0)) for key in self.config_keys)

    # ---- bodies -------------------------------------------------------------------------

    def active(self, module: nn.Module) -> bool:
        return self.enabled and module.training and not _compiling()

    def enter_body(self, local: bool, coordinates: tuple[int, ...], *, region: bool = False) -> int:
        """Push a frame for a body (or a region); return its depth, for :meth:`exit_body`."""
        if self.frames:
            parent = self.frames[-1]
            parent.children += 1
            seed = mix(parent.seed, _CHILD, parent.children)
        else:  # from the stream the body runs in: the replicated one, or what checkpoint restored
            seed = int(torch.randint(0, 1 << 62, (1,), generator=self.generators[0]).item())
        self.frames.append(_Frame(seed, local, coordinates, region=region))
        self.change(local)
        return len(self.frames) - 1

    def open_region(self, coordinates: tuple[int, ...]) -> None:
        """A wrapped column-parallel linear made a sharded value: inside a body its layout changes; outside
        one, a region opens, so that a dropout of the value (BioGPT's ``activation_dropout`` between
        ``fc1`` and ``fc2``) draws per rank, and a shard of another size draws nothing from the
        replicated stream (ranks that drew different amounts from it would diverge after)."""
        if self.frames:
            self.change(True)
        else:
            self.enter_body(True, coordinates, region=True)

    def close_region(self) -> None:
        """A wrapped row-parallel linear reduced its sharded input: replicated again."""
        if self.frames and self.frames[-1].region:
            self.exit_body(len(self.frames) - 1)
        elif self.frames:
            self.change(False)

    def change(self, local: bool) -> None:
        """The value the innermost body computes on is now sharded (``local``) or replicated/partial."""
        if not self.frames:
            return
        frame = self.frames[-1]
        frame.local = local
        frame.changes += 1
        if local:
            self._reseed(mix(frame.seed, _LOCAL, frame.changes, *frame.coordinates))
        else:
            self._reseed(mix(frame.seed, _REPLICATED, frame.changes))

    def exit_body(self, depth: int) -> None:
        """Pop the frame at ``depth`` and any region left open above it."""
        if len(self.frames) <= depth:
            return
        frame = self.frames[depth]
        del self.frames[depth:]
        if self.frames:  # the enclosing body goes on in its own layout, with fresh numbers
            self.change(self.frames[-1].local)
        else:
            self._reseed(mix(frame.seed, _EXIT))

    def _reseed(self, seed: int) -> None:
        for generator in self.generators:
            generator.manual_seed(seed)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def default_generators(model: nn.Module) -> list[torch.Generator]:
    """The default generators the model's random ops draw from: the CPU one, and its CUDA device's."""
    found = [torch.default_generator]
    device = next((tensor.device for tensor in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        found.append(torch.cuda.default_generators[index])
    return found


class BodyStreams:
    """The body of a boundary sharded on some axis (its ``_forward_impl`` or ``__hp_compute__``), run in a
    frame of the streams.

    It wraps the body the generated ``forward`` calls, not the module's ``__call__``: transformers'
    gradient checkpointing wraps ``forward`` and leaves module hooks outside, so only what runs inside
    ``forward`` is recomputed, from the generator state checkpointing restores.
    """

    def __init__(
        self, streams: ModelStreams, module: nn.Module, body: Any, local: bool, coordinates: Sequence[int]
    ) -> None:
        self.streams = streams
        self.module = module
        self.body = body
        self.local = local
        self.coordinates = tuple(coordinates)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.streams.active(self.module):
            return self.body(*args, **kwargs)
        depth = self.streams.enter_body(self.local, self.coordinates)
        try:
            return self.body(*args, **kwargs)
        finally:
            self.streams.exit_body(depth)


class WrappedProjection:
    """Hook of a wrapped ``nn.Linear`` boundary: column-parallel with a sharded output (``opens``) or
    row-parallel reducing a sharded input (see :meth:`ModelStreams.open_region`)."""

    def __init__(self, streams: ModelStreams, opens: bool, coordinates: Sequence[int]) -> None:
        self.streams = streams
        self.opens = opens
        self.coordinates = tuple(coordinates)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.streams.active(module):
            if self.opens:
                self.streams.open_region(self.coordinates)
            else:
                self.streams.close_region()
        return None


class LayoutChange:
    """Hook of a projection inside a sharded body: after it the value is sharded (column-parallel)
    or a partial sum (row-parallel), and the body's stream follows."""

    def __init__(self, streams: ModelStreams, local: bool) -> None:
        self.streams = streams
        self.local = local

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.streams.active(module):
            self.streams.change(self.local)
        return None

    def __deepcopy__(self, memo: dict) -> LayoutChange:
        return self


def first_rank_seed(groups: Iterable[dist.ProcessGroup | None], device: torch.device) -> int:
    """``torch.initial_seed()`` of the rank at coordinate 0 of every group (one broadcast per axis)."""
    seed = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64, device=device)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            call(dist.broadcast, seed, src=dist.get_global_rank(group, 0), group=group)
    return int(seed.item())


def random_config_keys(config: Any) -> tuple[str, ...]:
    """Attributes of a model config that hold a random op's probability or scale (``attention_dropout``, ...)."""
    if config is None:
        return ()
    names = vars(config) if hasattr(config, "__dict__") else {}
    return tuple(
        sorted(
            name
            for name, value in names.items()
            if any(word in name.lower() for word in _RANDOM_CONFIG_WORDS) and isinstance(value, (int, float))
            and not isinstance(value, bool)
        )
    )


# --------------------------------------------------------------------------- install


def projection_layout(module: nn.Module, placements: Iterable[Any]) -> str | None:
    """``column`` (output features sharded), ``row`` (input features sharded) or None, from the
    weight's placements: ``nn.Linear`` weights are ``[out, in]``, transformers' ``Conv1D`` ``[in, out]``."""
    # (a deferred bias has already swapped a Conv1D's forward: its attributes say what it is)
    conv1d = type(module).__name__.endswith("Conv1D") and isinstance(getattr(module, "nf", None), int)
    if not (isinstance(module, nn.Linear) or conv1d):
        return None
    dims = {p.dim % 2 for p in placements if p.kind in ("S", "SS", "RS", "B") and p.dim is not None}
    if not dims or len(dims) > 1:
        return None
    (dim,) = dims
    out_dim = 1 if conv1d else 0
    return "column" if dim == out_dim else "row"


def install_streams(
    model: nn.Module,
    records: Sequence[Any],
    mesh_names: Sequence[str],
    axes: Mapping[str, Any],
    device: torch.device,
    branches: Iterable[str] = (),
) -> ModelStreams:
    """Seed the model's streams from the first rank and hook the model, its sharded bodies and
    their projections. ``records``: the survey's decision of each planned module (its item, form, entry and
    sharded axes), ``mesh_names``: the plan's axes in mesh order; ``branches``: the FQNs
    of the summed blocks' branches (modules with no body of their own, run inside their block's)."""
    groups = [axes[axis].group for axis in mesh_names if axes[axis].size > 1]
    config = getattr(model, "config", None)
    streams = ModelStreams(
        first_rank_seed(groups, device),
        dropouts=[m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)],
        config=config,
        config_keys=random_config_keys(config),
    )
    model.register_forward_pre_hook(streams.enter_model)
    model.register_forward_hook(streams.exit_model, always_call=True)
    branches = frozenset(branches)
    for record in records:
        item, form, entry, body_axes = record.item, record.form, record.entry, record.decision.sharded_axes
        # a summed block computes on its branches' shards even where its own inputs and outputs are whole
        sharded = [
            a for a in mesh_names
            if axes[a].size > 1 and (a in body_axes or (a == "tp" and entry.summed_reduction is not None))
        ]
        if not sharded:
            continue
        if form == "linear":  # a wrapped nn.Linear: its output sharded (column) or its sharded input reduced (row)
            outputs = [entry.output_layouts(name, mesh_names)[1] for name in entry.output_names]
            inputs = [entry.input_layouts(name, mesh_names)[0] for name in entry.input_names]
            opens = any(layout.on(a).kind in ("S", "SS") for layout in outputs for a in sharded)
            closes = any(layout.on(a).kind in ("S", "SS") for layout in inputs for a in sharded) and not opens
            if opens or closes:
                item.module.register_forward_hook(WrappedProjection(streams, opens, [axes[a].rank for a in sharded]))
            continue
        if item.fqn in branches:  # its projections change the layout of its block's body
            _follow_projections(streams, item, sharded)
            continue
        if form not in ("tp_collective", "generic", "region"):
            continue
        # a summed block's body computes on its branches' inputs, gathered whole, and on their partial outputs,
        # whose dropouts (before the one reduction) must draw one mask everywhere: it starts replicated
        local = entry.summed_reduction is None and any(
            layout.on(a).kind in ("S", "SS", "RS") for layout in entry.in_dst.values() for a in sharded
        )
        name = "__hp_compute__" if form == "region" else "_forward_impl"  # what the generated forward calls
        body = getattr(item.module, name, None)
        if body is None:
            continue
        setattr(item.module, name, BodyStreams(streams, item.module, body, local, [axes[a].rank for a in sharded]))
        _follow_projections(streams, item, sharded)
    model._hp_streams = streams
    return streams


def _follow_projections(streams: ModelStreams, item: Any, sharded: Sequence[str]) -> None:
    """Record each projection of ``item`` the plan shards (hooked in train mode only): after a column-parallel
    one the body's value is sharded (local), after a row-parallel one a partial sum (replicated)."""
    seen: set[str] = set()
    for name, layout in item.entry.params.items():
        owner_path, _, leaf = name.rpartition(".")
        if leaf != "weight" or not owner_path or owner_path in seen:
            continue
        kind = projection_layout(item.module.get_submodule(owner_path), [layout.on(a) for a in sharded])
        if kind is not None:
            seen.add(owner_path)
            fqn = f"{item.fqn}.{owner_path}" if item.fqn else owner_path
            streams.projections.append((fqn, kind == "column"))


def reseed_random_streams(model: nn.Module, seed: int, step: int = 0) -> None:
    """Start a parallelized model's random streams again from ``seed`` at train-mode forward ``step``.

    Call it with the same ``seed`` on every rank (when resuming a run, with the ``step`` it
    had reached: ``model._hp_streams.step``). A model that was not parallelized has none.
    """
    streams = getattr(model, "_hp_streams", None)
    if not isinstance(streams, ModelStreams):
        raise ValueError(f"{type(model).__name__} was not parallelized: it has no random streams to reseed")
    streams.reseed(seed, step)
