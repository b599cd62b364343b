"""Pipeline stages with hpgen: a small Llama cut into 2 stages (of 2 tensor-parallel ranks each with 4 ranks).

    torchrun --nproc-per-node 2 examples/pipeline_llama.py    # pp 2
    torchrun --nproc-per-node 4 examples/pipeline_llama.py    # pp 2 x tp 2
    # the way a two-node job starts (here both "nodes" on this machine): a stage on each, tp within
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id job \
        examples/pipeline_llama.py                             # on each node

Runs on CPUs with gloo. Nothing is downloaded: the model is an 8-layer Llama built from a
config. Every rank:

1. writes the plan ``hpgen plan llama --pp 2 [--tp 2]`` would write for this config, and
   with tp lowers the installed ``modeling_llama.py`` with it;
2. builds the unsharded model (the reference) and the staged one from the same weights,
   and ``parallelize``s the latter: each rank keeps its stage's layers only;
3. runs greedy generation next to the reference's tokens, then one ``pipeline_step`` (1F1B,
   4 microbatches), clipping and an optimizer step, next to the reference's loss;
4. prints each rank's parameter bytes against the unsharded model's.
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
from hpgen.planner.entry.make import plan_model
from hpgen.planner.model.load import meta_model
from hpgen.planner.passes.pipeline_stages import add_pipeline, stage_cut
from hpgen.runtime import clip_grad_norm_, parallelize
from hpgen.runtime.pipeline import pipeline_step

CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = 2 if world == 4 else None
    config = LlamaConfig(**CONFIG)
    plan = add_pipeline(plan_model(meta_model(config), tp=tp) if tp else None, stage_cut(meta_model(config), 2), "LlamaForCausalLM")
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    if tp:
        import transformers.models.llama.modeling_llama as source

        text = lower(Path(source.__file__).read_text(), plan_from_dict(plan), source_name="modeling_llama.py",
                     package="transformers.models.llama")
        path = Path(tempfile.mkdtemp()) / "modeling_llama_pp.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location("modeling_llama_pp", path)
        generated = importlib.util.module_from_spec(spec)
        sys.modules["modeling_llama_pp"] = generated
        spec.loader.exec_module(generated)
        model = generated.LlamaForCausalLM(config)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    else:
        model = LlamaForCausalLM(config)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    model.load_state_dict(reference.state_dict())
    parallelize(model, plan, mesh)

    ids = torch.randint(0, config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:3, :20] = -100  # ignored labels, unevenly over the microbatches
    prompt = ids[:1, :6]
    with torch.no_grad():  # before training: the reference is not trained
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
        want_tokens = reference.generate(prompt, max_new_tokens=8, do_sample=False)
    want = reference(ids, labels=labels).loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = pipeline_step(model, input_ids=ids, labels=labels, microbatches=4, schedule="1F1B")
    norm = clip_grad_norm_(model, 1.0)
    optimizer.step()
    full = sum(p.numel() * p.element_size() for p in reference.parameters())
    mine = sum(p.numel() * p.element_size() for p in model.parameters())
    node = os.environ.get("GROUP_RANK", "0")  # torchrun's node (agent) index: stages across nodes, tp within
    print(
        f"rank {rank} (node {node}, stage {mesh.get_local_rank('pp')}): loss {loss.item():.6f} (unsharded {want.item():.6f}), grad norm {norm.item():.4f}; "
        f"generate {'matches' if torch.equal(tokens, want_tokens) else 'DIFFERS'}; "
        f"parameters {mine / full:.2f} of the model's {full / 2**20:.1f} MiB",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
