"""Inference through pipeline stages: ``model(input_ids)`` and ``generate`` give every rank the logits.

The model's ``forward`` is wrapped: every rank calls it with the same arguments; the stages
run one after another, each handing its hidden states to the next stage's ranks (a send
and a receive on the pipeline axis's group, between ranks of the same position on the
other axes), and the last stage's output (logits, and the loss when labels are given) is
broadcast to every rank of the pipeline. Each rank's cache holds its own layers' keys and
values (their ``layer_idx`` renumbered from 0, :mod:`hpgen.runtime.pipeline.stages`), so
``generate`` runs unchanged on every rank and picks the same tokens. A rank holding several
stages (an interleaved layout) gives each of its later stages an empty copy of the cache
``generate`` passes, kept while that cache lives.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpgen.runtime.pipeline.attach import Staged
from hpgen.runtime.pipeline.stage_forward import run_stage

__all__ = ["install_relay", "relay_forward"]


def install_relay(model: nn.Module) -> None:
    """Wrap ``model.forward`` (an instance attribute) in :func:`relay_forward`."""
    pipeline: Staged = model._hp_stage
    model.forward = functools.wraps(pipeline.forward)(functools.partial(relay_forward, model, pipeline))


def relay_forward(model: nn.Module, pipeline: Staged, input_ids: Tensor | None = None, **kwargs: Any) -> Any:
    """The causal LM's forward run stage after stage; its output on every rank.

    Inference only: the hand-overs between stages carry no gradient, so the outputs carry
    none (on every rank: ``loss.backward()`` fails everywhere alike rather than giving the
    last stage alone its gradients); training goes through ``pipeline_step``, whose calls of one
    stage pass straight through."""
    if pipeline.running is not None:  # pipeline_step's call of one stage (stage_forward.call_stage)
        embeds = kwargs.pop("inputs_embeds", None)
        return run_stage(model, pipeline, pipeline.running, input_ids if embeds is None else embeds, **kwargs)
    with torch.no_grad():
        return _relay(model, pipeline, input_ids, **kwargs)


def _relay(model: nn.Module, pipeline: Staged, input_ids: Tensor | None, **kwargs: Any) -> Any:
    cut = pipeline.cut
    embeds = kwargs.pop("inputs_embeds", None)
    value = input_ids if embeds is None else embeds
    if value is None:
        raise ValueError("the pipeline needs input_ids or inputs_embeds")
    given = kwargs.get("cache")
    caches = _stage_caches(pipeline, given) if given is not None else {}
    shape = tuple(value.shape[:2])
    holder = -1
    output = cache = None
    for stage in range(cut.num_stages):
        previous, holder = holder, stage % cut.size
        if stage > 0 and previous != holder:
            if pipeline.rank == previous:
                dist.send(value.contiguous(), group_dst=holder, group=pipeline.group)
            elif pipeline.rank == holder:
                value = torch.empty((*shape, _hidden_size(model)), dtype=_dtype(model), device=_device(value))
                dist.recv(value, group_src=previous, group=pipeline.group)
        if pipeline.rank != holder:
            continue
        if given is not None:  # several stages a rank: each its own cache (their layers are numbered from 0 each)
            kwargs["cache"] = caches[stage]
        # the user's embeddings: the first stage skips its embedding
        output = run_stage(model, pipeline, stage, value, embedded=stage == 0 and embeds is not None, **kwargs)
        cache = getattr(output, "cache", None)
        if stage < cut.num_stages - 1:
            value = output.last_hidden_state
    return _from_last(output if pipeline.rank == holder else None, pipeline, holder, given if given is not None else cache)


def _stage_caches(pipeline: Staged, given: Any) -> dict[int, Any]:
    """Each of this rank's stages' cache: ``given`` for the first, an empty copy of it (made once, kept on
    ``given`` as ``_hp_stage_caches``) for each other."""
    stages = pipeline.cut.stages
    if len(stages) == 1:
        return {stages[0]: given}
    others = getattr(given, "_hp_stage_caches", None)
    if others is None:
        if given.get_seq_length() != 0:
            raise ValueError("a cache filled before the pipeline saw it: pass a fresh cache (or none) to a staged model")
        others = {stage: copy.deepcopy(given) for stage in stages[1:]}
        given._hp_stage_caches = others
    return {stages[0]: given, **others}


def _from_last(output: Any, pipeline: Staged, last: int, cache: Any) -> Any:
    """The last stage's output, its tensors broadcast to every rank; each rank keeps its own ``cache``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    meta = [None]
    if output is not None:
        meta = [{key: (tuple(v.shape), v.dtype) for key, v in output.items() if isinstance(v, Tensor)}]
    dist.broadcast_object_list(meta, group_src=last, group=pipeline.group)
    tensors = {}
    for key, (shape, dtype) in sorted(meta[0].items()):
        tensor = output[key] if output is not None else torch.empty(shape, dtype=dtype, device=_device_of(pipeline))
        dist.broadcast(tensor, group_src=last, group=pipeline.group)
        tensors[key] = tensor
    if output is not None:
        if cache is not None and getattr(output, "cache", None) is not None:
            output.cache = cache  # the cache generate passed, not the last stage's own copy of it
        return output
    return CausalLMOutputWithPast(**tensors, cache=cache)


def _hidden_size(model: nn.Module) -> int:
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(config.hidden_size)


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _device(value: Tensor) -> torch.device:
    return value.device


def _device_of(pipeline: Staged) -> torch.device:
    """Where the broadcast logits go on ranks that did not compute them: the mesh's device."""
    if pipeline.cut.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(pipeline.cut.mesh.device_type)
