"""Context parallelism (``hpgen plan --cp 2``) against one process: memory and time of a training step.

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py [--lengths 1024,2048,4096,8192] [--cap-mib 256] [--rounds 2]

A 4-layer Llama (hidden 256, 8 heads, 4 key/value heads, vocabulary 1000, sdpa: transformers'
default), batch 1, one training step (forward, loss, backward) per sequence length, one thread
a rank. For each length, side by side in one run:

- one process: rank 0 runs the unsharded model alone (rank 1 waits);
- cp 2: both ranks run the model parallelized by the plan ``hpgen plan --cp 2`` writes.

Measured per rank: the bytes saved for backward (``torch.autograd.graph.saved_tensors_hooks``,
each storage counted once), the step's peak resident memory above the resident memory before it
(sampled every millisecond by a thread), and the step's time (the fastest of ``--rounds`` rounds,
one process and cp alternating, so that both see the same load) and its ratio; the attention
FLOPs of one forward per rank (the score and value products of every layer: one process's
causal ``n²/2`` query/key pairs, the cp rank's by blocks, and the cp rank's before the blocks,
when each chunk ran causally behind zero rows), and one layer's attention call alone, forward and
backward (one process's sdpa against each cp rank's call with its gathers); the largest length whose step peak fits under
``--cap-mib`` with and without cp; and the keys/values all-gather of one layer alone (its time
and the bytes each rank receives), to show how the gather grows with the sequence.
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


def attention_alone(model: torch.nn.Module, n: int, rank: int) -> tuple[float, float]:
    """Seconds of one layer's attention call alone, forward and backward, batch 1: (one process's sdpa
    over the whole sequence on rank 0, this cp rank's call on its tokens with the gathers), fastest of 2."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hpgen.runtime.context.sequence import KEYWORD, CutSequence
    from hpgen.runtime.context.attention import context_attention

    attention = model.model.layers[0].self_attn
    ax = attention._hp_cp
    layout = ax.layout(n, torch.device("cpu"))
    heads, kv, dim = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    generator = torch.Generator().manual_seed(n)
    whole = [torch.randn(1, h, n, dim, generator=generator) for h in (heads, kv, kv)]
    local = [t.index_select(2, layout.local) for t in whole]

    def run(call: object, tensors: list[torch.Tensor], **kwargs: object) -> float:
        best = float("inf")
        for _ in range(2):
            inputs = [t.clone().requires_grad_() for t in tensors]
            start = time.perf_counter()
            out, _ = call(attention, *inputs, None, scaling=dim**-0.5, **kwargs)
            out.sum().backward()
            best = min(best, time.perf_counter() - start)
        return best

    one = run(sdpa_attention_forward, whole) if rank == 0 else 0.0
    dist.barrier()
    return one, run(context_attention, local, **{KEYWORD: CutSequence(ax, layout)})


def attention_flops(n: int, layout: object | None) -> tuple[float, float]:
    """Forward attention FLOPs of every layer: (by blocks, behind zero rows) for a cp rank's
    ``layout``; the unsharded causal count twice for one process (``layout`` None)."""
    per_pair = 4 * CONFIG["num_attention_heads"] * (CONFIG["hidden_size"] // CONFIG["num_attention_heads"])
    if layout is None:
        pairs = n * (n + 1) / 2
        return pairs * per_pair * CONFIG["num_hidden_layers"], pairs * per_pair * CONFIG["num_hidden_layers"]
    blocks = padded = 0.0
    for chunk in (layout.rank, 2 * layout.size - 1 - layout.rank):
        start, length = layout.chunks[chunk]
        blocks += length * start + length * (length + 1) / 2  # the keys before the chunk, then its own causally
        padded += (start + length) * (start + length + 1) / 2  # start zero rows and the chunk, causal
    return blocks * per_pair * CONFIG["num_hidden_layers"], padded * per_pair * CONFIG["num_hidden_layers"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--cap-mib", type=float, default=256.0)
    parser.add_argument("--rounds", type=int, default=2)
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
            ones, cps = [], []
            for _ in range(args.rounds):
                ones.append(step(single, ids) if rank == 0 else (0, 0.0, 0.0))
                dist.barrier()
                cps.append(step(model, ids))
                dist.barrier()
            one = (ones[0][0], max(o[1] for o in ones), min(o[2] for o in ones))
            cp = (cps[0][0], max(c[1] for c in cps), min(c[2] for c in cps))
            gather = gather_cost(model, n)
            flops = attention_flops(n, model.model.layers[0].self_attn._hp_cp.layout(n, torch.device("cpu")))
            alone = attention_alone(model, n, rank)
            every = [None] * world
            dist.all_gather_object(every, (cp, gather, flops, alone))
            rows.append((n, one, every))
    if rank == 0:
        print(f"4-layer Llama, hidden 256, batch 1, training step, cp {world} (gloo, one thread a rank) vs one process")
        print("| tokens | saved for backward: one process | cp, per rank | ratio | step peak RSS: one process | "
              "cp, per rank | step s: one process | cp | cp / one | attention fwd GFLOP: one process | cp rank, blocks "
              "| cp rank, zero rows (before) | K/V gather, one layer fwd: ms | MiB received per rank |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, (saved, peak, seconds), every in rows:
            cp_saved = max(item[0][0] for item in every)
            cp_peak = max(item[0][1] for item in every)
            cp_seconds = max(item[0][2] for item in every)
            gather_s = max(item[1][0] for item in every)
            received = max(item[1][1] for item in every)
            whole = attention_flops(n, None)[0]
            blocks = max(item[2][0] for item in every)
            padded = max(item[2][1] for item in every)
            print(f"| {n} | {saved / 2**20:.1f} MiB | {cp_saved / 2**20:.1f} MiB | {cp_saved / saved:.2f} | "
                  f"{peak:.0f} MiB | {cp_peak:.0f} MiB | {seconds:.2f} | {cp_seconds:.2f} | {cp_seconds / seconds:.2f} | "
                  f"{whole / 1e9:.2f} | {blocks / 1e9:.2f} ({blocks / whole:.2f}) | {padded / 1e9:.2f} ({padded / whole:.2f}) | "
                  f"{gather_s * 1e3 / 2:.1f} | {received / 2**20:.2f} |")
        print("\none layer's attention call alone, forward and backward (cp: with its key/value gathers), seconds")
        print("| tokens | one process (sdpa, whole sequence) | cp rank 0 | cp rank 1 | slowest cp rank / one |")
        print("|---:|---:|---:|---:|---:|")
        for n, _, every in rows:
            one_s = every[0][3][0]
            ranks = [item[3][1] for item in every]
            print(f"| {n} | {one_s:.3f} | " + " | ".join(f"{r:.3f}" for r in ranks) + f" | {max(ranks) / one_s:.2f} |")
        fits_one = [n for n, (saved, peak, seconds), every in rows if peak <= args.cap_mib]
        fits_cp = [n for n, one, every in rows if max(item[0][1] for item in every) <= args.cap_mib]
        print(f"longest measured sequence whose step peak fits under {args.cap_mib:.0f} MiB: one process "
              f"{max(fits_one, default=0)}, cp {world} {max(fits_cp, default=0)} tokens per rank-group")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
