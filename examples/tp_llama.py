"""Tensor-parallel Llama with hpgen: lower modeling_llama.py, load the weights, parallelize.

    torchrun --nproc-per-node 2 examples/tp_llama.py

Runs on CPUs with gloo, or on GPUs with NCCL when CUDA is available. Nothing is
downloaded: the model is a small Llama built from a config, and the file lowered is the
``modeling_llama.py`` of the installed transformers. Every rank:

1. lowers ``modeling_llama.py`` with the plan below into a temporary directory and
   imports the generated file (each rank lowers its own copy; the output is
   deterministic, so all ranks run the same code);
2. builds the unsharded transformers model (the reference) and the same model from the
   generated file, and copies the reference's weights into it;
3. calls ``hpgen.runtime.parallelize``: attention heads and MLP columns/rows sharded
   (one all-reduce each), a vocab-parallel ``embed_tokens`` and a column-parallel
   ``lm_head`` whose output is gathered;
4. compares logits and greedy generation with the reference, and reports each rank's
   parameter bytes against the unsharded model's.
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
from hpgen.runtime import parallelize

R, COLWISE, ROWWISE, PARTIAL = {"tp": "R"}, {"tp": "S(0)"}, {"tp": "S(1)"}, {"tp": "P(sum)"}

PLAN = {
    "format": "hpgen.plan/1",
    "model_class": "LlamaForCausalLM",
    "mesh_dim_names": ["tp"],
    "param_plan": {
        # vocab-parallel: each rank looks up its rows, the partial sums are all-reduced
        "model.embed_tokens": {"out_src": {"output": PARTIAL}, "out_dst": {"output": R}, "params": {"weight": COLWISE}},
        "model.layers.*.self_attn": {
            "in_src": {"hidden_states": R},
            "in_dst": {"hidden_states": R},
            "out_names": ["attn_output", "attn_weights"],
            "out_src": {"attn_output": PARTIAL},
            "out_dst": {"attn_output": R},
            "params": {
                "q_proj.weight": COLWISE,
                "k_proj.weight": COLWISE,
                "v_proj.weight": COLWISE,
                "o_proj.weight": ROWWISE,
            },
        },
        "model.layers.*.mlp": {
            "in_src": {"x": R},
            "in_dst": {"x": R},
            "out_src": {"output": PARTIAL},
            "out_dst": {"output": R},
            "params": {"gate_proj.weight": COLWISE, "up_proj.weight": COLWISE, "down_proj.weight": ROWWISE},
        },
        # column-parallel head: each rank computes its vocab columns, gathered on the last dim
        "lm_head": {
            "in_src": {"input": R},
            "in_dst": {"input": R},
            "out_src": {"output": {"tp": "S(-1)"}},
            "out_dst": {"output": R},
            "params": {"weight": COLWISE},
        },
    },
}

CONFIG = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
)


def lower_llama(directory: Path) -> object:
    """Lower the installed modeling_llama.py under ``PLAN`` and import the generated file."""
    spec = importlib.util.find_spec("transformers.models.llama.modeling_llama")
    source = Path(spec.origin)
    text = lower(
        source.read_text(),
        plan_from_dict(PLAN, name="tp_llama_plan.json"),
        source_name=source.name,
        package="transformers.models.llama",  # relative imports become absolute
    )
    path = directory / "modeling_llama_tp.py"
    path.write_text(text)
    module_spec = importlib.util.spec_from_file_location("modeling_llama_tp", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(generated, mesh, device) -> tuple[float, bool, int, int, torch.Tensor]:
    """Build the reference and the generated model, parallelize, compare logits and tokens."""
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)  # the same reference weights on every rank
    reference = LlamaForCausalLM(config).to(device).eval()
    model = generated.LlamaForCausalLM(config).to(device).eval()
    model.load_state_dict(reference.state_dict())
    full_bytes = param_bytes(model)
    parallelize(model, PLAN, mesh)
    local_bytes = param_bytes(model)

    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = reference(ids).logits
        diff = (model(ids).logits - expected).abs().max().item()
        options = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        same_tokens = torch.equal(model.generate(ids[:1], **options), reference.generate(ids[:1], **options))
    return diff, same_tokens, local_bytes, full_bytes, expected


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))

    # The generated file stays on disk while it runs: parallelize compares its header across ranks.
    with tempfile.TemporaryDirectory(prefix=f"hpgen-rank{rank}-") as directory:
        generated = lower_llama(Path(directory))
        diff, same_tokens, local_bytes, full_bytes, expected = run(generated, mesh, device)

    reports = [None] * world
    dist.all_gather_object(reports, (rank, diff, same_tokens, local_bytes, full_bytes))
    if rank == 0:
        print(f"backend {dist.get_backend()}, {world} ranks, logits max |value| {expected.abs().max().item():.4f}")
        for r, d, same, local, full in reports:
            print(
                f"rank {r}: max logit diff {d:.3e}, greedy tokens {'match' if same else 'DIFFER'}, "
                f"parameters {local:,} bytes of {full:,} unsharded ({local / full:.1%})"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
