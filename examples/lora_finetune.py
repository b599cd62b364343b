"""LoRA fine-tuning with peft on a tensor-parallel Llama, checked against peft on one process.

    torchrun --nproc-per-node 2 examples/lora_finetune.py

Runs on CPUs with gloo (or GPUs with NCCL when CUDA is available); nothing is
downloaded. Every rank:

1. writes the plan with ``hpgen plan``'s translator (``--tp 2``: attention heads and MLP
   columns sharded), lowers the installed ``modeling_llama.py`` with it and imports the
   generated file;
2. builds the model from it with the weights of an unsharded reference, calls
   ``parallelize``, then ``get_peft_model`` with LoRA on q, k, v, o and the MLP
   projections: each adapter is laid out like its base layer (on a column-parallel
   layer ``lora_A`` replicated, ``lora_B`` sharded; on a row-parallel one ``lora_A``
   sharded, ``lora_B`` replicated);
3. gives the unsharded reference the same LoRA and loads its adapter into the sharded
   model with peft's own ``set_peft_model_state_dict`` (each rank keeps its slice);
4. trains a few AdamW steps on both, printing both losses at every step;
5. saves the adapter with peft's ``save_pretrained`` (full ``lora_A``/``lora_B``, one
   writer) and loads it onto the unsharded base on one process, which gives the sharded
   model's logits.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

from hpgen.generator.lower import lower
from hpgen.core.plan import plan_from_dict
from hpgen.planner.model.load import meta_model
from hpgen.planner.translate.translator import translated_plan
from hpgen.runtime import parallelize

CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
TP, STEPS, BATCH, SEQ = 2, 5, 4, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lower_llama(plan: dict, directory: Path) -> object:
    """Lower the installed modeling_llama.py under ``plan`` and import the generated file."""
    source = Path(importlib.util.find_spec("transformers.models.llama.modeling_llama").origin)
    text = lower(
        source.read_text(),
        plan_from_dict(plan, name="lora_plan.json"),
        source_name=source.name,
        package="transformers.models.llama",
    )
    path = directory / "modeling_llama_tp.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("modeling_llama_tp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != TP:
        raise SystemExit(f"run with {TP} processes: torchrun --nproc-per-node {TP} examples/lora_finetune.py")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (TP,), mesh_dim_names=("tp",))

    config = LlamaConfig(**CONFIG)
    plan = translated_plan(meta_model(config), tp=TP, name="llama")
    # kept until the end: parallelize reads the generated file's header to check that all ranks run the same code
    directory = tempfile.TemporaryDirectory(prefix=f"hpgen-rank{rank}-")
    generated = lower_llama(plan, Path(directory.name))

    torch.manual_seed(0)  # the same reference weights and adapters on every rank
    base = LlamaForCausalLM(config).to(device)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
    reference = get_peft_model(copy.deepcopy(base), lora)

    model = generated.LlamaForCausalLM(config).to(device)
    model.load_state_dict(base.state_dict())
    parallelize(model, plan, mesh)
    model = get_peft_model(model, lora)  # the adapters are sharded like their base layers
    set_peft_model_state_dict(model, get_peft_model_state_dict(reference))  # full tensors: each rank its slice
    if rank == 0:
        model.print_trainable_parameters()

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    for step in range(1, STEPS + 1):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = reference(ids, labels=ids).loss
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}  (unsharded peft model: {ref_loss.item():.6f})")

    # a normal peft adapter: every rank takes part in gathering it, rank 0 writes it
    saved = os.path.join(directory.name, "adapter") if rank == 0 else None
    shared = [saved]
    dist.broadcast_object_list(shared, src=0)
    model.save_pretrained(shared[0], is_main_process=rank == 0)
    dist.barrier()
    with torch.no_grad():
        logits = model.eval()(ids).logits  # every rank: the forward runs collectives
        if rank == 0:
            one_process = PeftModel.from_pretrained(copy.deepcopy(base), shared[0]).eval()
            err = (one_process(ids).logits - logits).abs().max().item()
            print(f"saved adapter on one process: logits max |diff| {err:.3g}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
