"""Context parallelism with hpgen: one long sequence cut over the ranks of a ``cp`` axis.

    torchrun --nproc-per-node 2 examples/long_context.py

Runs on CPUs with gloo, or on GPUs with NCCL when CUDA is available. Nothing is
downloaded: the model is a small Llama built from a config. Every rank:

1. writes the plan ``hpgen plan --cp 2`` writes (:func:`hpgen.planner.entry.make.plan_model`),
   lowers the installed ``modeling_llama.py`` with it and imports the generated file;
2. builds the unsharded model (the reference) and the generated one with its weights,
   and calls ``parallelize`` on a ``cp`` mesh: every rank is given the whole batch, each
   computes its head-tail share of the tokens, attention gathers keys and values;
3. trains a few SGD steps on a sequence of 300 tokens (not a multiple of 2 * cp), next to
   the reference trained on one process, and prints both losses;
4. generates greedily after a cp prefill and compares the tokens with the reference's.
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
from transformers import LlamaConfig, LlamaForCausalLM

from hpgen.generator.lower import lower
from hpgen.core.plan import plan_from_dict
from hpgen.planner.model.load import meta_model
from hpgen.planner.entry.make import plan_model
from hpgen.runtime import parallelize

CONFIG = dict(
    vocab_size=500,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TOKENS = 300
STEPS = 3


def lower_llama(plan: dict, directory: Path) -> object:
    """Lower the installed modeling_llama.py under ``plan`` and import the generated file."""
    source = Path(importlib.util.find_spec("transformers.models.llama.modeling_llama").origin)
    text = lower(source.read_text(), plan_from_dict(plan, name="cp_plan.json"), source_name=source.name,
                 package="transformers.models.llama")
    path = directory / "modeling_llama_cp.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("modeling_llama_cp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    config = LlamaConfig(**CONFIG)
    plan = plan_model(meta_model(config), cp=world)  # what `hpgen plan config.json --cp N` writes

    with tempfile.TemporaryDirectory(prefix=f"hpgen-rank{rank}-") as directory:
        generated = lower_llama(plan, Path(directory))
        torch.manual_seed(0)  # the same weights on every rank
        reference = LlamaForCausalLM(config).to(device).train()
        model = generated.LlamaForCausalLM(config).to(device).train()
        model.load_state_dict(reference.state_dict())
        parallelize(model, plan, mesh)

        ids = torch.randint(0, config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(1)).to(device)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
        lines = []
        for step in range(STEPS):
            losses = []
            for m, optimizer in zip((model, reference), optimizers):
                optimizer.zero_grad()
                loss = m(ids, labels=ids).loss  # the whole batch on every rank: hpgen cuts the sequence
                loss.backward()  # the layers' gradients are summed over cp: every rank steps alike
                optimizer.step()
                losses.append(loss.item())
            lines.append(f"step {step}: loss {losses[0]:.6f}  (unsharded model on one process: {losses[1]:.6f})")
        model.eval()
        reference.eval()
        options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        with torch.no_grad():  # prefill cut over cp; each rank caches its positions, decode merges the ranks' attention
            same = torch.equal(model.generate(ids[:, :40], **options), reference.generate(ids[:, :40], **options))
    if rank == 0:
        print(f"{world} ranks on cp, {TOKENS} tokens ({TOKENS // world} or so per rank in each layer)")
        print("\n".join(lines))
        print(f"greedy tokens after a cp prefill {'match' if same else 'DIFFER'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
