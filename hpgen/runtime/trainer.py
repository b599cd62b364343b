"""``Trainer``: transformers' ``Trainer`` for models parallelized by hpgen (same constructor).

A stock ``transformers.Trainer`` under torchrun treats every rank as a data-parallel
replica: it wraps the model in DDP over the whole world (whose constructor broadcasts rank
0's shards), shards the data over every rank, clips by each rank's local norm, saves from
rank 0 alone (hpgen's ``save_pretrained`` gathers, so every rank must join) and writes rank
0's optimizer state for all. This subclass keeps transformers' loop and changes only those
steps, where the Trainer and accelerate offer them:

- the model: no DDP over the plan's (tensor-parallel) axes; when the mesh has one other
  axis of more than one rank, DDP on it (or nothing, when the model is already FSDP2 on it);
  accelerate still applies mixed precision and compilation;
- the data: sharded over the data-parallel ranks only (every rank of a tensor-parallel group
  gets the same batches), through accelerate's own ``prepare_data_loader``;
- accelerate's state: on a CPU mesh, set up as with ``use_cpu=True`` (``TrainingArguments()``
  alone leaves accelerate seeing one process, and transformers scales the loss by ``1 // tp``),
  and checked to count every rank of the world, else every rank stops before training;
- the tensor-parallel size answered by ``get_tp_size``, which the Trainer reads for its loss
  scaling (``average_tokens_across_devices``) and batch sizes;
- ``evaluate``/``predict``: predictions gathered over the data-parallel ranks only (the ranks
  of a tensor-parallel group hold the same ones);
- accelerate's ``prepare``/``prepare_model`` let through the model's guards against stock
  loops (``hpgen.runtime.install.stock_loops``, ``wrapped.AccelerateCheck``), which refuse a stock
  ``transformers.Trainer`` in its constructor; ``fsdp=``, ``parallelism_config=`` and
  ``deepspeed=`` in the arguments are refused (accelerate would shard the model over every rank);
- clipping and the logged ``grad_norm``: :func:`hpgen.runtime.clip_grad_norm_`, the unsharded
  model's norm;
- a model cut into pipeline stages (a plan made with ``--pp``): each training step runs
  :func:`hpgen.runtime.pipeline.pipeline_step` on the batch (every stage fed the same one) in
  place of the forward and ``accelerator.backward``, over ``pipeline_microbatches``
  microbatches with ``pipeline_schedule``; the loss is divided by the label tokens of the
  whole optimizer step (every accumulated batch of every data-parallel rank), as transformers'
  ``num_items_in_batch`` is;
- checkpoints: every rank joins ``save_pretrained`` (one writer, loadable by plain
  transformers), each rank writes its own optimizer state, rank 0 the scheduler, and
  ``hpgen_trainer.json`` the mesh and the model's random-stream step; resuming checks that
  file first and refuses another mesh, then loads the weights, each rank's optimizer state,
  the scheduler, per-rank RNG states (transformers' own) and the random streams.

Accelerate's ``ParallelismConfig`` is not used: on the CPU accelerate refuses it, and its
data sharding assumes the tensor-parallel axis is the mesh's last; the mesh's own
coordinates are used instead.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
import transformers
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from hpgen.runtime.forward.handback import all_gather_object
from hpgen.runtime.install.wrapped import AccelerateCheck, MeshAxes, mesh_axes_of, prepared_by_hpgen_trainer

__all__ = ["LAYOUT_FILE", "Trainer"]

LAYOUT_FILE = "hpgen_trainer.json"
_OPTIMIZER_FILE = "optimizer-rank{rank}-of-{world}.pt"
_SCHEDULER_FILE = "scheduler.pt"


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` for a model parallelized by hpgen (or a peft model over one).

    Build the model, ``parallelize`` it (and ``fully_shard`` it on the mesh's data-parallel
    axis, if you want FSDP2 there), then pass it as to ``transformers.Trainer``; run under
    torchrun, every rank alike. See docs/training.md.
    """

    _hpgen_trainer = True  # let through by the parallelized model's checks of a stock Trainer (install.stock_loops)

    def __init__(
        self,
        model: nn.Module | None = None,
        *args: Any,
        pipeline_microbatches: int | None = None,
        pipeline_schedule: str = "1F1B",
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise ValueError(
                "hpgen.runtime.trainer.Trainer needs the parallelized model itself (model=...): model_init is not "
                "supported, since the model must be parallelized on every rank before the Trainer wraps it"
            )
        found = mesh_axes_of(model)
        if found is None:
            raise ValueError(
                f"hpgen.runtime.trainer.Trainer: {type(model).__name__} was not parallelized by hpgen "
                "(call hpgen.runtime.parallelize first); for an unparallelized model use transformers.Trainer"
            )
        self._hp_mesh: MeshAxes = found
        data_axes = found.data_axes
        if len(data_axes) > 1:
            raise ValueError(
                f"hpgen.runtime.trainer.Trainer: the mesh has {len(data_axes)} axes besides the plan's "
                f"({', '.join(data_axes)}); it takes at most one data-parallel axis (flatten them into one)"
            )
        self._hp_data_axis = data_axes[0] if data_axes else None
        self._hp_pipeline = _pipeline_settings(model, found, pipeline_microbatches, pipeline_schedule)
        if args:
            args = (_on_the_mesh_device(args[0], found), *args[1:])
        else:
            kwargs["args"] = _on_the_mesh_device(kwargs.get("args"), found)
        with _transformers_tp_hidden(model):
            super().__init__(model, *args, **kwargs)
        # hpgen owns placement and gradient reduction, not transformers' load-time sharding (whose path would
        # broadcast rank 0's plain tensors, hpgen's shards among them)
        self.is_distributed_loading_by_transformers = False
        # instance attributes: Accelerator.prepare (the Trainer's dataloaders) calls prepare_data_loader for every
        # DataLoader; prepare_model, given a parallelized model, refuses anyone but this Trainer
        accelerator = self.accelerator
        accelerator.prepare_data_loader = self._prepare_data_loader_over_dp
        accelerator.prepare = _as_hpgen_trainer(accelerator, accelerator.prepare)
        accelerator.prepare_model = _as_hpgen_trainer(accelerator, accelerator.prepare_model)
        if self._hp_pipeline is not None:  # no DDP over the world: the stages hold different parameters
            accelerator.prepare_model = functools.partial(accelerator.prepare_model, evaluation_mode=True)
        accelerator.gather_for_metrics = self._gather_for_metrics_over_dp
        # transformers bound the original to gather_function already (and binds accelerator's again after each loop)
        self.gather_function = functools.partial(
            self._gather_for_metrics_over_dp, use_gather_object=self.args.eval_use_gather_object
        )

    # ---- data and model ---------------------------------------------------------------

    def get_tp_size(self) -> int:
        """The ranks that share one batch (the plan axes' size), which transformers reads to scale the loss and count
        the batch. Answered here rather than set as the model's ``_tp_size``, which transformers' Trainer and
        accelerate would read as their own tensor parallelism (``ParallelismConfig``) in a later Trainer."""
        return self._hp_mesh.size(self._hp_mesh.plan_axes)

    @property
    def data_parallel_size(self) -> int:
        """The number of data-parallel replicas (ranks of the mesh's axis besides the plan's, or 1)."""
        return self._hp_mesh.size([self._hp_data_axis]) if self._hp_data_axis else 1

    @property
    def data_parallel_rank(self) -> int:
        return self._hp_mesh.mesh.get_local_rank(self._hp_data_axis) if self._hp_data_axis else 0

    def _prepare_data_loader_over_dp(
        self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None
    ) -> torch.utils.data.DataLoader:
        """accelerate's ``prepare_data_loader`` with the data-parallel ranks as its processes."""
        from accelerate.data_loader import prepare_data_loader

        accelerator = self.accelerator
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in accelerator._dataloaders:
                accelerator._dataloaders.append(data_loader)
            return data_loader
        if accelerator.dispatch_batches:
            raise ValueError(
                "hpgen.runtime.trainer.Trainer: dispatch_batches=True slices each batch over every rank; the ranks of "
                "a tensor-parallel group must see the same batch. Leave dispatch_batches unset"
            )
        prepared = prepare_data_loader(
            data_loader,
            accelerator.device,
            num_processes=self.data_parallel_size,
            process_index=self.data_parallel_rank,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement if device_placement is None else device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=False,
            even_batches=accelerator.even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(prepared)
        return prepared

    def _gather_for_metrics_over_dp(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """accelerate's ``gather_for_metrics`` over the data-parallel ranks only: the ranks of a tensor-parallel group
        evaluate the same batch, so gathering over every rank would repeat each prediction once per rank of it.

        What it returns is what one process's ``gather_for_metrics`` returns for the whole batch: tensors
        concatenated along dim 0, also when gathered as objects (``eval_use_gather_object``, or data that is not all
        tensors; the ranks' shapes may then differ), lists of per-sample items concatenated; with no data-parallel
        axis, the data as given."""
        from accelerate.utils import recursively_apply

        accelerator = self.accelerator
        # transformers binds eval_use_gather_object to the first evaluation's gather only (it puts back the bare
        # gather_for_metrics after each loop): read here, it holds for every evaluation, as it does in one process
        use_gather_object = use_gather_object or self.args.eval_use_gather_object
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        group = self._hp_mesh.mesh.get_group(self._hp_data_axis) if self._hp_data_axis else None
        if group is None:
            data = input_data
        elif use_gather_object or not all_tensors:
            data = _gather_objects(input_data, group)
        else:
            data = recursively_apply(lambda tensor: _gather_tensor(tensor, group), input_data)
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the last batch was padded with repeated samples
            if (use_gather_object or not all_tensors) and isinstance(data, list):  # one item per sample
                return data[: state.remainder]
            return recursively_apply(lambda tensor: tensor[: state.remainder], data, error_on_other_type=False)
        return data

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """DDP on the data-parallel axis only (none when FSDP2 owns it or it is absent), then accelerate's
        mixed precision and compilation without its own DDP."""
        if self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model or not training:
            return model
        if self.data_parallel_size > 1 and not any(isinstance(p, DTensor) for p in model.parameters()):
            if self._hp_pipeline is not None:
                raise ValueError(
                    "hpgen.runtime.trainer.Trainer: DDP on the data-parallel axis of a model cut into pipeline stages "
                    "is not covered (torch's pipeline schedules run each stage's module outside DDP's forward); "
                    f"fully_shard the stage's layers and the model on mesh[{self._hp_data_axis!r}] (FSDP2) instead"
                )
            kwargs = self.accelerator.ddp_handler.to_kwargs() if self.accelerator.ddp_handler is not None else {}
            device = self.accelerator.device
            model = DistributedDataParallel(
                model,
                process_group=self._hp_mesh.mesh.get_group(self._hp_data_axis),
                device_ids=[device] if device.type == "cuda" else None,
                **kwargs,
            )
        return self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)

    # ---- the pipeline's training step ---------------------------------------------------------

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """On a staged model: the label tokens of the optimizer step's batches on every data-parallel rank (the
        causal shift counted: ``labels[..., 1:]``), which each ``pipeline_step`` divides its summed loss by, so the
        accumulated gradients are the whole step's mean (transformers' ``average_tokens_across_devices``)."""
        if self._hp_pipeline is None:
            return super()._get_num_items_in_batch(batch_samples, device)
        from hpgen.runtime.pipeline.schedule import IGNORE_INDEX

        counted = sum((batch["labels"][..., 1:] != IGNORE_INDEX).sum() for batch in batch_samples if "labels" in batch)
        counted = torch.as_tensor(counted, device=device)
        if self._hp_data_axis is not None and self.data_parallel_size > 1:
            import torch.distributed as dist

            dist.all_reduce(counted, group=self._hp_mesh.mesh.get_group(self._hp_data_axis))
        return counted

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """transformers' step, or on a staged model ``pipeline_step`` (its forward and backward): the batch's part of
        the step's loss, the same on every rank."""
        if self._hp_pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        from hpgen.runtime.pipeline import pipeline_step

        microbatches, schedule = self._hp_pipeline
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        unexpected = sorted(set(inputs) - {"input_ids", "labels", "attention_mask"})
        if unexpected or "labels" not in inputs:
            raise ValueError(
                "hpgen.runtime.trainer.Trainer: a model cut into pipeline stages trains on input_ids, labels and "
                f"attention_mask; the batch has {sorted(inputs)}"
            )
        if num_items_in_batch is None:  # not counted by transformers: this batch's tokens, over the data-parallel ranks
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        rows = int(inputs["input_ids"].shape[0])
        return pipeline_step(
            self.accelerator.unwrap_model(model, keep_torch_compile=False),
            input_ids=inputs["input_ids"],
            labels=inputs["labels"],
            attention_mask=inputs.get("attention_mask"),
            microbatches=_dividing(rows, microbatches),
            schedule=schedule,
            num_items_in_batch=num_items_in_batch,
        ).detach()

    # ---- clipping -----------------------------------------------------------------------

    def _norm_of(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model, keep_torch_compile=False)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        from hpgen.runtime import clip_grad_norm_

        self.accelerator.unscale_gradients()
        return clip_grad_norm_(self._norm_of(model), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            from hpgen.runtime import grad_norm as whole_norm

            self.accelerator.unscale_gradients()
            grad_norm = whole_norm(self._norm_of(model))
        return super()._get_grad_norm(model, grad_norm)

    # ---- saving -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _every_rank_saves(self) -> Iterator[None]:
        """transformers' ``_save`` keeps every rank for the model's collective ``save_pretrained`` under this flag."""
        before = self.is_distributed_loading_by_transformers
        self.is_distributed_loading_by_transformers = True
        try:
            yield
        finally:
            self.is_distributed_loading_by_transformers = before

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        with self._every_rank_saves():
            super()._save(output_dir, state_dict=state_dict)

    def _layout(self) -> dict[str, Any]:
        mesh = self._hp_mesh.mesh
        return {
            "world_size": self.args.world_size,
            "mesh": dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape)),
            "plan_axes": list(self._hp_mesh.plan_axes),
        }

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        rank, world = self.args.process_index, self.args.world_size
        state = _local_tensors(self.optimizer.state_dict())
        torch.save(state, os.path.join(output_dir, _OPTIMIZER_FILE.format(rank=rank, world=world)))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_FILE))
            streams = getattr(_hpgen_model(self.model), "_hp_streams", None)
            record = {**self._layout(), "streams": [streams.seed, streams.step] if streams is not None else None}
            with open(os.path.join(output_dir, LAYOUT_FILE), "w") as handle:
                json.dump(record, handle, indent=2)

    # ---- resuming -----------------------------------------------------------------------

    def _checked_layout(self, checkpoint: str) -> dict[str, Any]:
        """The checkpoint's ``hpgen_trainer.json``, refused unless written on a mesh like this one."""
        path = os.path.join(checkpoint, LAYOUT_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint}: no {LAYOUT_FILE}; it was not written by hpgen.runtime.trainer.Trainer, so its "
                "optimizer state is not per rank. Start from its weights instead (load them, then train without "
                "resume_from_checkpoint)"
            )
        with open(path) as handle:
            saved = json.load(handle)
        mine = self._layout()
        if {key: saved.get(key) for key in mine} != mine:
            raise ValueError(
                f"{checkpoint}: written on mesh {saved.get('mesh')} (plan axes {saved.get('plan_axes')}, "
                f"{saved.get('world_size')} ranks), resumed on {mine['mesh']} (plan axes {mine['plan_axes']}, "
                f"{mine['world_size']} ranks). Its optimizer state is one file per rank's shards, so it resumes only "
                "on the same mesh. Resume there, or start from its weights (model.safetensors, any mesh) without the "
                "optimizer state"
            )
        return saved

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self._checked_layout(resume_from_checkpoint)  # before any weight changes
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        saved = self._checked_layout(checkpoint)
        rank, world = self.args.process_index, self.args.world_size
        path = os.path.join(checkpoint, _OPTIMIZER_FILE.format(rank=rank, world=world))
        device = self.args.device
        state = torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=True)
        self.optimizer.load_state_dict(_as_parameters(state, self.optimizer))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER_FILE), weights_only=True))
        if saved.get("streams") is not None:
            from hpgen.runtime import reseed_random_streams

            reseed_random_streams(_hpgen_model(self.model), *saved["streams"])


def _pipeline_settings(model: nn.Module, mesh: MeshAxes, microbatches: int | None, schedule: str) -> tuple[int, str] | None:
    """``(microbatches, schedule)`` for a staged model (microbatches defaulting to its stage count), else None."""
    from hpgen.runtime.pipeline.attach import staged

    pipeline = staged(model)
    if pipeline is None:
        if microbatches is not None:
            raise ValueError(
                "hpgen.runtime.trainer.Trainer: pipeline_microbatches is for a model cut into pipeline stages "
                "(a plan made with --pp); this model has none"
            )
        return None
    if microbatches is None:
        microbatches = pipeline.cut.num_stages
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"hpgen.runtime.trainer.Trainer: pipeline_microbatches must be a positive integer, not {microbatches!r}")
    return microbatches, schedule


def _dividing(rows: int, microbatches: int) -> int:
    """The largest count of equal microbatches, at most ``microbatches``, that a batch of ``rows`` cuts into (a
    last, smaller batch of an epoch)."""
    return max(count for count in range(1, min(rows, microbatches) + 1) if rows % count == 0)


def _on_the_mesh_device(args: Any, mesh: MeshAxes) -> Any:
    """The training arguments with accelerate's state set up for the mesh's devices, checked against the world.

    On the CPU, ``TrainingArguments()`` as constructed leaves accelerate seeing one process (it
    looks for a distributed CPU run only with ``use_cpu=True``), and transformers then scales the
    loss by ``1 // tp`` (zero). A mesh on the CPU is such a run: a copy of ``args`` with ``use_cpu``
    set makes accelerate see it. Wherever accelerate still counts other than the world (torch's
    process group made without torchrun's environment, a pre-configured accelerate state), every
    rank stops here, before the model is touched, with the same message.
    """
    import copy

    import torch.distributed as dist

    if args is None:
        args = transformers.TrainingArguments(output_dir="tmp_trainer")  # what transformers' Trainer makes
    _refuse_accelerate_sharding(args)
    if mesh.mesh.device_type == "cpu" and not args.use_cpu:
        args = copy.copy(args)
        for cached in ("_setup_devices", "distributed_state", "_n_gpu"):
            args.__dict__.pop(cached, None)
        args.use_cpu = True
        args.dataloader_pin_memory = False  # what TrainingArguments sets with use_cpu
        args.device  # accelerate's state, made again
    mine = (args.world_size, args.process_index, args.device.type)
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    expected = [(len(seen), rank, mesh.mesh.device_type) for rank in range(len(seen))]
    if [(count, index, device) for count, index, device in seen] != expected:
        wrong = [(rank, view) for rank, view in enumerate(seen) if view != expected[rank]]
        rank, (count, index, device) = wrong[0]
        raise RuntimeError(
            f"hpgen.runtime.trainer.Trainer: accelerate sees {count} process(es) on rank {rank} (as index {index}, "
            f"device {device}) where torch.distributed has {len(seen)} ranks on a {mesh.mesh.device_type} mesh "
            f"({len(wrong)} of {len(seen)} ranks disagree). transformers would scale the loss and shard the data by "
            "accelerate's count, so training is stopped before it starts. Launch with torchrun (accelerate reads its "
            "RANK, WORLD_SIZE and LOCAL_RANK), and do not pre-configure accelerate's state (use_configured_state) "
            "differently from the mesh"
        )
    return args


def _refuse_accelerate_sharding(args: Any) -> None:
    """Stop (every rank alike, before anything is made) where the arguments ask accelerate to shard or split the
    model itself: it would do so over every rank, across the plan's shards (FSDP and DeepSpeed on GPUs; silently
    nothing on the CPU)."""
    asked = [
        (name, value)
        for name, value in (("fsdp", args.fsdp), ("parallelism_config", args.parallelism_config), ("deepspeed", args.deepspeed))
        if value
    ]
    if asked:
        name, value = asked[0]
        shown = repr(value) if isinstance(value, (bool, str, list, dict)) else f"{type(value).__name__}(...)"
        raise ValueError(
            f"hpgen.runtime.trainer.Trainer: TrainingArguments({name}={shown}) asks accelerate to shard or split the "
            "model over every rank, across the shards parallelize made. Leave it unset: the mesh's data-parallel axis "
            "takes DDP (the default) or FSDP2 (fully_shard the model's layers and the model on mesh['dp'] after "
            "parallelize), and the plan's axes are hpgen's"
        )


@contextlib.contextmanager
def _transformers_tp_hidden(model: nn.Module) -> Iterator[None]:
    """transformers' own tensor-parallel markers (``_tp_size``, which a previous hpgen Trainer sets, and load-time
    sharding's flag) hidden while the Trainer builds its accelerator: they would ask accelerate for its own
    tensor parallelism (``ParallelismConfig``), which does not know hpgen's shards."""
    hidden = {"_tp_size": None, "_is_distributed_loading_by_transformers": False}
    holders = [model, _hpgen_model(model)]
    saved = [(holder, {name: holder.__dict__[name] for name in hidden if name in holder.__dict__}) for holder in holders]
    for holder in holders:
        holder.__dict__.update(hidden)
    try:
        yield
    finally:
        for holder, values in saved:
            for name in hidden:
                holder.__dict__.pop(name, None)
            holder.__dict__.update(values)


def _as_hpgen_trainer(accelerator: Any, prepare: Any) -> Any:
    """``accelerator.prepare`` or ``prepare_model`` that may prepare a parallelized model (see ``AccelerateCheck``)."""

    def prepared(*objects: Any, **kwargs: Any) -> Any:
        with prepared_by_hpgen_trainer(accelerator):
            result = prepare(*objects, **kwargs)
        for obj in (*objects, *(result if isinstance(result, tuple) else (result,))):
            if isinstance(obj, nn.Module):
                AccelerateCheck.restore(obj, accelerator)
        return result

    return prepared


def _gather_tensor(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` of each rank of ``group`` concatenated along dim 0 (a 0-d tensor counts as one row)."""
    import torch.distributed as dist

    tensor = tensor.reshape(1) if tensor.ndim == 0 else tensor
    if group is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def _gather_objects(data: Any, group: Any) -> Any:
    """``data`` of each rank of ``group`` through ``all_gather_object``, joined as one process would hold the whole
    batch (:func:`_joined`)."""
    return _joined(all_gather_object(data, group))


def _joined(parts: list[Any]) -> Any:
    """The ranks' parts of one batch as one: tensors concatenated along dim 0 (a 0-d tensor counts as one row), lists
    concatenated, tuples and dicts joined element by element; anything else listed, one item per rank."""
    first = parts[0]
    if all(isinstance(part, torch.Tensor) for part in parts):
        return torch.cat([part.reshape(1) if part.ndim == 0 else part for part in parts])
    if all(isinstance(part, list) for part in parts):
        return [item for part in parts for item in part]
    if all(isinstance(part, tuple) and len(part) == len(first) for part in parts):
        return type(first)(*[_joined(list(items)) for items in zip(*parts)]) if hasattr(first, "_fields") else tuple(
            _joined(list(items)) for items in zip(*parts)
        )
    if all(isinstance(part, dict) and part.keys() == first.keys() for part in parts):
        return type(first)({key: _joined([part[key] for part in parts]) for key in first})
    return list(parts)


def _hpgen_model(model: nn.Module) -> nn.Module:
    """The parallelized model inside peft's wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _local_tensors(state: Any) -> Any:
    """An optimizer state dict with each DTensor (FSDP2's shards) replaced by its local tensor."""
    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {key: _local_tensors(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_local_tensors(value) for value in state]
    return state


def _as_parameters(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The saved local tensors as DTensors again where the optimizer's parameter is one (FSDP2)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    ids = [index for group in state["param_groups"] for index in group["params"]]
    by_id = dict(zip(ids, params))
    restored = {}
    for index, per_param in state["state"].items():
        param = by_id.get(index)
        if isinstance(param, DTensor):
            per_param = {
                name: DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
                if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape == param.to_local().shape
                else value
                for name, value in per_param.items()
            }
        restored[index] = per_param
    return {**state, "state": restored}
