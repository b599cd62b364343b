"""``pipeline_step``: one training step's forward and backward over microbatches, with torch's schedules.

Every rank passes the same whole batch. The batch is cut into ``microbatches`` equal
parts along dim 0 and run through ``torch.distributed.pipelining``'s ``PipelineStage``
and the schedule named as torch names it (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ...).
The loss is the unsharded model's: transformers' causal-LM loss summed over each
microbatch's label tokens and divided by the label tokens of the whole batch (-100 not
counted), so the microbatches' losses add up to the batch's mean and their gradients to
its gradient (the schedule's own per-microbatch scaling is off). The loss is broadcast
from the last stage; a parameter two stages hold (a tied embedding) has its gradient
summed between them (:mod:`hpgen.runtime.pipeline.tied`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.pipeline.attach import Staged, staged
from hpgen.runtime.pipeline.stage_forward import call_stage
from hpgen.runtime.pipeline.tied import sum_tied_grads

__all__ = ["pipeline_step"]

IGNORE_INDEX = -100  # transformers' label for "no loss here"


class _StageModule(nn.Module):
    """Stage ``stage`` of ``model`` as the module torch's ``PipelineStage`` runs (no copy of the model)."""

    def __init__(self, model: nn.Module, pipeline: Staged, stage: int) -> None:
        super().__init__()
        self.__dict__["model"] = model  # not a submodule: torch must not see it as this stage's alone
        self.pipeline = pipeline
        self.stage = stage
        self.last = stage == pipeline.cut.num_stages - 1

    def forward(self, value: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        kwargs: dict[str, Any] = {"use_cache": False}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        output = call_stage(self.__dict__["model"], self.pipeline, self.stage, value, **kwargs)
        return output.logits if self.last else output.last_hidden_state


def pipeline_step(
    model: nn.Module,
    *,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    microbatches: int,
    schedule: str = "1F1B",
    num_items_in_batch: Tensor | int | None = None,
) -> Tensor:
    """Forward and backward of the whole batch through the pipeline; the batch's loss on every rank.

    ``model`` is a model ``parallelize`` cut into pipeline stages; every rank of a pipeline passes
    the same ``input_ids``, ``labels`` (``-100`` where no loss is taken) and ``attention_mask``.
    On a mesh with a data-parallel dim beside the plan's (FSDP2 or DDP on it), each data-parallel
    rank passes its share of the batch: the loss is normalised over every share's label tokens
    and scaled by the data-parallel size, so the engine's average of the gradients is the
    whole batch's gradient.
    Afterwards each stage's parameters hold the gradients the unsharded model's
    ``model(input_ids, labels=labels).loss.backward()`` would give them (added to what
    ``.grad`` held). ``schedule``: a torch schedule name (``GPipe``, ``1F1B``,
    ``Interleaved1F1B``, ``LoopedBFS``, ...); interleaved ones need several stages a rank.
    ``num_items_in_batch``: the label tokens to divide by, where the loss is one part of a
    larger batch (gradient accumulation: every accumulated batch of every data-parallel rank);
    by default this batch's, over the data-parallel ranks. The loss returned is then this
    batch's part of that mean.
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    pipeline = staged(model)
    if pipeline is None:
        raise ParallelizeError("pipeline_step: the model has no pipeline stages (parallelize it with a plan made with --pp)")
    cut = pipeline.cut
    batch = int(input_ids.shape[0])
    if microbatches < 1 or batch % microbatches:
        raise ParallelizeError(f"pipeline_step: a batch of {batch} does not cut into {microbatches} equal microbatches")
    if tuple(labels.shape) != tuple(input_ids.shape):
        raise ParallelizeError(f"pipeline_step: labels of shape {tuple(labels.shape)} for input_ids of {tuple(input_ids.shape)}")
    try:
        schedule_class = get_schedule_class(schedule)
    except ValueError as error:
        raise ParallelizeError(f"pipeline_step: {error}") from None
    multi = issubclass(schedule_class, PipelineScheduleMulti)
    if multi != (len(cut.stages) > 1):
        raise ParallelizeError(
            f"pipeline_step: schedule {schedule!r} runs {'several stages' if multi else 'one stage'} a rank; "
            f"this plan has {cut.num_stages} stages on {cut.size} ranks"
        )
    # transformers' causal-LM loss shifts labels by one: the tokens counted are labels[:, 1:]
    data = _data_parallel(cut)
    if num_items_in_batch is not None:
        counted = torch.as_tensor(num_items_in_batch, device=input_ids.device)
    else:
        counted = (labels[..., 1:] != IGNORE_INDEX).sum()
        if data is not None:  # each data-parallel rank passes its share: the loss is over every rank's tokens
            dist.all_reduce(counted, group=data[0])
    # FSDP2 and DDP average the gradients over the data-parallel ranks: scaled up, the average is the sum
    scale = data[1] if data is not None else 1
    vocab = _vocab_size(model)

    def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
        loss = model.loss_function(logits=logits, labels=target, vocab_size=vocab, num_items_in_batch=counted)
        return loss * scale if scale != 1 else loss

    device = input_ids.device
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    micro = input_ids[: batch // microbatches]
    # example tensors of each stage's input and output; a float one requires grad, so that its gradient
    # travels back to the stage before (torch reads requires_grad from these)
    hidden = micro.new_empty((*micro.shape, _hidden_size(model)), dtype=dtype).requires_grad_()
    stages = []
    for index in cut.stages:
        last = index == cut.num_stages - 1
        output = micro.new_empty((*micro.shape, vocab), dtype=dtype).requires_grad_() if last else hidden
        stages.append(
            PipelineStage(
                _StageModule(model, pipeline, index),
                index,
                cut.num_stages,
                device,
                input_args=(micro if index == 0 else hidden,),
                output_args=(output,),
                group=pipeline.group,
            )
        )
    runner = schedule_class(stages if multi else stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
    losses: list[Tensor] = []
    args = (input_ids,) if 0 in cut.stages else ()
    runner.step(*args, target=labels, losses=losses, **kwargs)
    sum_tied_grads(model, pipeline.tied)
    last_rank = (cut.num_stages - 1) % cut.size
    loss = torch.stack([loss.detach().float() for loss in losses]).sum() / scale if losses else torch.zeros((), device=device)
    dist.broadcast(loss, group_src=last_rank, group=pipeline.group)
    if data is not None:
        dist.all_reduce(loss, group=data[0])  # each data-parallel rank's part of the batch's mean
    return loss


def _data_parallel(cut: Any) -> tuple[Any, int] | None:
    """The data-parallel axis's group and size (the mesh dim the plan does not name), or None."""
    axes = cut.data_axes
    if not axes:
        return None
    if len(axes) > 1:
        raise ParallelizeError(f"pipeline_step: one data-parallel mesh dim is covered, the mesh has {', '.join(axes)}")
    size = cut.mesh.size(list(cut.mesh.mesh_dim_names).index(axes[0]))
    return (cut.mesh.get_group(axes[0]), size) if size > 1 else None


def _config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _vocab_size(model: nn.Module) -> int:
    return int(_config(model).vocab_size)


def _hidden_size(model: nn.Module) -> int:
    return int(_config(model).hidden_size)
