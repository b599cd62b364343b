"""The adapter's lifecycle on a parallelized model, against peft on one process (rank body of ``test_lora``).

After the training steps of :func:`tests.support.lora.run_lora_case`:

- ``save``: ``peft_model.save_pretrained(dir)`` on the ranks writes a normal adapter (full
  ``lora_A``/``lora_B`` shapes, ``adapter_config.json``), which peft loads onto the
  unsharded base on one process with the sharded model's logits;
- ``load``: an adapter saved by peft on one process (the trained reference) loads with
  ``PeftModel.from_pretrained(parallelized_base, dir)``, each rank taking its slice: the
  reference's logits;
- ``merge``: ``merge_and_unload()`` of that model leaves a parallelized base whose local
  weights are the slices of the unsharded merge;
- ``dcp``: the trainable state (adapters and optimizer state) saved with
  ``torch.distributed.checkpoint`` and loaded into a fresh sharded peft model resumes
  training: the next steps' losses equal those of the model that kept going.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.support.models import expected_local, param_layouts, tolerance


def lifecycle(
    case: Any,
    model: nn.Module,
    reference: nn.Module,
    base: nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Any,
    workdir: str,
) -> dict[str, Any]:
    from peft import PeftModel, get_peft_model_state_dict

    from hpgen.runtime import load_optimizer_state_dict, optimizer_state_dict, parallelize
    from tests.support.lora import fresh_generated, lora_batches

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    ids = lora_batches(base.config.vocab_size)[0]
    model.eval()
    reference.eval()

    # save on the ranks, load on one process
    saved = os.path.join(workdir, f"{case.name}_saved")
    model.save_pretrained(saved, is_main_process=rank == 0)
    dist.barrier()
    from safetensors import safe_open

    with safe_open(os.path.join(saved, "adapter_model.safetensors"), "pt") as handle:
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    want = {key: tuple(value.shape) for key, value in get_peft_model_state_dict(reference).items()}
    out["saved_shapes_match"] = shapes == want
    out["saved_config"] = json.loads(open(os.path.join(saved, "adapter_config.json")).read())["peft_type"]
    one_process = PeftModel.from_pretrained(copy.deepcopy(base).eval(), saved).eval()
    with torch.no_grad():
        logits = model(ids).logits
        out["save"] = ((one_process(ids).logits - logits).abs().max().item(), tolerance(logits))

    # saved on one process (the trained reference), loaded onto a parallelized base
    single = os.path.join(workdir, f"{case.name}_single")
    if rank == 0:
        reference.save_pretrained(single)
    dist.barrier()
    sharded_base = fresh_generated(case, base)
    parallelize(sharded_base, case.plan, mesh)
    loaded = PeftModel.from_pretrained(sharded_base, single).eval()
    with torch.no_grad():
        ref_logits = reference(ids).logits
        out["load"] = ((loaded(ids).logits - ref_logits).abs().max().item(), tolerance(ref_logits))

    # merge_and_unload: the parallelized base holds the slices of the unsharded merge
    merged = loaded.merge_and_unload()
    ref_merged = copy.deepcopy(reference).merge_and_unload()
    layouts = param_layouts(ref_merged, case.plan)
    failures, checked = [], 0
    mine = dict(merged.named_parameters())
    for name, full in ref_merged.named_parameters():
        local = expected_local(full.detach(), layouts.get(name, {}), case.plan["mesh_dim_names"], mesh)
        checked += 1
        if mine[name].shape != local.shape or not (mine[name].detach() - local).abs().max().item() <= tolerance(full):
            failures.append(name)
    out["merge"] = (checked, failures)
    with torch.no_grad():
        merged_logits = ref_merged(ids).logits
        out["merge_logits"] = ((merged(ids).logits - merged_logits).abs().max().item(), tolerance(merged_logits))

    # DCP of the trainable state resumes training
    import torch.distributed.checkpoint as dcp

    model.train()
    folder = os.path.join(workdir, f"{case.name}_dcp")
    state = {
        "adapters": {k: v for k, v in model.state_dict().items() if "lora_" in k},
        "optim": optimizer_state_dict(model, optimizer),
    }
    dcp.save(state, checkpoint_id=folder)
    batches = lora_batches(base.config.vocab_size)
    kept_going = _steps(model, optimizer, batches)
    resumed = _fresh_peft(case, base, mesh)
    trainable = [p for p in resumed.parameters() if p.requires_grad]
    fresh_optimizer = torch.optim.SGD(trainable, lr=optimizer.defaults["lr"], momentum=0.9)
    _steps(resumed, fresh_optimizer, batches[:1])  # an optimizer state of the right structure, then overwritten
    target = {
        "adapters": {k: v for k, v in resumed.state_dict().items() if "lora_" in k},
        "optim": optimizer_state_dict(resumed, fresh_optimizer),
    }
    dcp.load(target, checkpoint_id=folder)
    resumed.load_state_dict(target["adapters"], strict=False)
    load_optimizer_state_dict(resumed, fresh_optimizer, target["optim"])
    out["dcp"] = (kept_going, _steps(resumed, fresh_optimizer, batches))
    return out


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _fresh_peft(case: Any, base: nn.Module, mesh: Any) -> nn.Module:
    """A sharded peft model of ``case`` with adapters of its own (peft's initialisation)."""
    from peft import get_peft_model

    from hpgen.runtime import parallelize
    from tests.support.lora import fresh_generated, lora_config

    torch.manual_seed(1234 + dist.get_rank())
    model = fresh_generated(case, base)
    parallelize(model, case.plan, mesh)
    return get_peft_model(model, lora_config(case)).train()
