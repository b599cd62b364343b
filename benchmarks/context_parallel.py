"""Context parallelism (``hpgen plan --cp 2``) against one process: memory and time of a training step.

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py [--lengths 1024,2048,4096,8192] [--cap-mib 256]

A 4-layer Llama (hidden 256, 8 heads, 4 key/value heads, vocabulary 1000, sdpa: transformers'
default), batch 1, one training step (forward, loss, backward) per sequence length, one thread
a rank. For each length, side by side in one run:

- one process: rank 0 runs the unsharded model alone (rank 1 waits);
- cp 2: both ranks run the model parallelized by the plan ``hpgen plan --cp 2`` writes.

Measured per rank: the bytes saved for backward (``torch.autograd.graph.saved_tensors_hooks``,
each storage counted once), the step's peak resident memory above the resident memory before it
(sampled every millisecond by a thread), and the step's time; the largest length whose step peak
fits under ``--cap-mib`` with and without cp; and the keys/values all-gather of one layer alone
(its time and the bytes each rank receives), to show how the gather grows with the sequence.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
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
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=16384,
)


def lower_llama(plan: dict, directory: Path) -> object:
    source = Path(importlib.util.find_spec("transformers.models.llama.modeling_llama").origin)
    text = lower(source.read_text(), plan_from_dict(plan, name="cp.json"), source_name=source.name,
                 package="transformers.models.llama")
    path = directory / "modeling_llama_cp.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("modeling_llama_cp_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class PeakRss:
    """The largest resident set size seen while the block runs, above the size before it."""

    def __init__(self) -> None:
        self.process = psutil.Process()

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2**20


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, float, float]:
    """(bytes saved for backward, step peak RSS MiB above the start, seconds) of one training step."""
    seen: dict[tuple[int, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return tensor

    model.zero_grad(set_to_none=True)
    with PeakRss() as rss:
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids).loss
        loss.backward()
        seconds = time.perf_counter() - start
    return sum(seen.values()), rss.mib, seconds


def gather_cost(model: torch.nn.Module, n: int) -> tuple[float, int]:
    """Seconds of one layer's key and value all-gathers at ``n`` tokens, and the bytes each rank receives."""
    ax = model.model.layers[0].self_attn._hp_cp
    layout = ax.layout(n, torch.device("cpu"))
    heads, dim = CONFIG["num_key_value_heads"], CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    local = torch.randn(1, heads, layout.sizes[ax.rank], dim)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(2):
        ax.all_gather(local, dim=2, total=n)
    seconds = time.perf_counter() - start
    received = 2 * (n - layout.sizes[ax.rank]) * heads * dim * local.element_size()
    return seconds, received


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--cap-mib", type=float, default=256.0)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    config = LlamaConfig(**CONFIG)
    plan = plan_model(meta_model(config), cp=world)
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"hpgen-bench-{rank}-") as directory:
        generated = lower_llama(plan, Path(directory))
        torch.manual_seed(0)
        single = LlamaForCausalLM(config).train()
        model = generated.LlamaForCausalLM(config).train()
        model.load_state_dict(single.state_dict())
        parallelize(model, plan, mesh)
        for n in lengths:
            ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            one = step(single, ids) if rank == 0 else (0, 0.0, 0.0)
            dist.barrier()
            cp = step(model, ids)
            gather = gather_cost(model, n)
            every = [None] * world
            dist.all_gather_object(every, (cp, gather))
            rows.append((n, one, every))
    if rank == 0:
        print(f"4-layer Llama, hidden 256, batch 1, training step, cp {world} (gloo, one thread a rank) vs one process")
        print("| tokens | saved for backward: one process | cp, per rank | ratio | step peak RSS: one process | "
              "cp, per rank | step s: one process | cp | K/V gather, one layer fwd: ms | MiB received per rank |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, (saved, peak, seconds), every in rows:
            cp_saved = max(item[0][0] for item in every)
            cp_peak = max(item[0][1] for item in every)
            cp_seconds = max(item[0][2] for item in every)
            gather_s = max(item[1][0] for item in every)
            received = max(item[1][1] for item in every)
            print(f"| {n} | {saved / 2**20:.1f} MiB | {cp_saved / 2**20:.1f} MiB | {cp_saved / saved:.2f} | "
                  f"{peak:.0f} MiB | {cp_peak:.0f} MiB | {seconds:.2f} | {cp_seconds:.2f} | "
                  f"{gather_s * 1e3 / 2:.1f} | {received / 2**20:.2f} |")
        fits_one = [n for n, (saved, peak, seconds), every in rows if peak <= args.cap_mib]
        fits_cp = [n for n, one, every in rows if max(item[0][1] for item in every) <= args.cap_mib]
        print(f"longest measured sequence whose step peak fits under {args.cap_mib:.0f} MiB: one process "
              f"{max(fits_one, default=0)}, cp {world} {max(fits_cp, default=0)} tokens per rank-group")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
