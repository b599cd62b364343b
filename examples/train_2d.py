"""2-D training: FSDP2 on ``dp`` over hpgen's tensor + sequence parallelism on ``tp``.

    torchrun --nproc-per-node 4 examples/train_2d.py

Runs on CPUs with gloo (or GPUs with NCCL when CUDA is available); nothing is
downloaded. The mesh is ``dp x tp`` with ``tp`` = 2 and ``dp`` = the other ranks. Every
rank:

1. writes the plan with ``hpgen plan``'s translator (transformers' own
   ``base_model_tp_plan``, ``--tp 2 --sp``: attention and MLP sharded, the residual
   stream sequence-sharded between layers, the norms' gradients summed over ``tp``),
   lowers the installed ``modeling_llama.py`` with it and imports the generated file;
2. builds the model from it with the weights of an unsharded reference, and calls
   ``parallelize`` on the ``tp`` axis;
3. wraps it with FSDP2 in torchtitan's order: ``fully_shard`` on each decoder layer,
   then on the root, over ``dp`` (hpgen first, the engine of the other axis second);
4. trains a few AdamW steps on its share of a batch (FSDP2 averages the gradients over
   ``dp``, so the mean loss per share is the mean over the batch), next to the unsharded
   reference trained on the whole batch, and prints both losses.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
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
TP, STEPS, BATCH, SEQ = 2, 6, 8, 32


def lower_llama(plan: dict, directory: Path) -> object:
    """Lower the installed modeling_llama.py under ``plan`` and import the generated file."""
    source = Path(importlib.util.find_spec("transformers.models.llama.modeling_llama").origin)
    text = lower(
        source.read_text(),
        plan_from_dict(plan, name="train_2d_plan.json"),
        source_name=source.name,
        package="transformers.models.llama",
    )
    path = directory / "modeling_llama_tp_sp.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("modeling_llama_tp_sp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % TP:
        raise SystemExit(f"run with a multiple of {TP} processes (tp = {TP}), e.g. --nproc-per-node 4")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world // TP, TP), mesh_dim_names=("dp", "tp"))
    dp, dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")

    config = LlamaConfig(**CONFIG)
    plan = translated_plan(meta_model(config), tp=TP, sp=True, name="llama")
    # kept until the end: parallelize reads the generated file's header to check that all
    # ranks run the same code
    directory = tempfile.TemporaryDirectory(prefix=f"hpgen-rank{rank}-")
    generated = lower_llama(plan, Path(directory.name))

    torch.manual_seed(0)  # the same reference weights on every rank
    reference = LlamaForCausalLM(config).to(device)
    model = generated.LlamaForCausalLM(config).to(device)
    model.load_state_dict(reference.state_dict())
    parallelize(model, plan, mesh)  # tp: hpgen's collectives; the mesh's dp axis is left to FSDP2
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    # one batch, seen every step: the loss falls as the model learns it
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    for step in range(1, STEPS + 1):
        loss = model(ids[rows], labels=ids[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = reference(ids, labels=ids).loss
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        if rank == 0:
            print(
                f"step {step}: loss {mean.item() / dp:.6f}  (unsharded model on the whole batch: "
                f"{ref_loss.item():.6f})"
            )
    if rank == 0:
        print(f"{world} ranks as dp {dp} x tp {TP}, backend {dist.get_backend()}")
    dist.destroy_process_group()
    directory.cleanup()


if __name__ == "__main__":
    main()
