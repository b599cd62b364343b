"""Decoding under context parallelism: the key/value cache split over ``cp`` against the whole
cache on every rank (replicated decoding) and against one process.

    torchrun --nproc-per-node 4 benchmarks/context_decode.py [--prompts 1024,4096] [--steps 16] [--cap-mib 64]

A 4-layer Llama (hidden 256, 8 heads, 4 key/value heads, float32, sdpa: transformers' default),
batch 1, one thread a rank, prompts cut over ``cp`` (``hpgen plan --cp N``). Side by side in one
run, for each prompt length:

- one process: rank 0 runs the unsharded model alone (the others wait);
- cp 2 (ranks 0 and 1; ranks 2 and 3 wait): the cache replicated, as decoding ran before the
  split (``keep_whole_cache(model)``: every rank keeps every position, decode steps run whole),
  then split (the default: each rank keeps its positions, each decode step merges the ranks'
  partial attention);
- cp 4 (all four ranks), split.

Measured per rank: the cache's bytes after the prefill (every layer's keys and values), the
median time of a one-token decode step over ``--steps`` steps (the slowest rank's), and the
collectives each decode step runs per layer (counted at hpgen's collective calls). The longest
prompt a rank can hold under ``--cap-mib`` of cache is computed from the cache's bytes per
token per rank (no real memory cap is set). Timings of 4 ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_parallel import CONFIG, lower_llama  # noqa: E402  (the same model and lowering)

import hpgen.runtime.forward.collectives as collectives  # noqa: E402
from hpgen.planner.entry.make import plan_model  # noqa: E402
from hpgen.planner.model.load import meta_model  # noqa: E402
from hpgen.runtime import parallelize  # noqa: E402
from hpgen.runtime.context.cache import keep_whole_cache  # noqa: E402

LAYERS = CONFIG["num_hidden_layers"]


class CountCalls:
    """Counts hpgen's collective calls (``collectives.call``) while enabled."""

    def __init__(self) -> None:
        self.count = 0
        self.on = False
        self.inner = collectives.call

        def counted(*args: object, **kwargs: object) -> object:
            if self.on:
                self.count += 1
            return self.inner(*args, **kwargs)

        collectives.call = counted


def cache_bytes(cache: object) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def decode(model: torch.nn.Module, ids: torch.Tensor, steps: int, counter: CountCalls) -> tuple[int, float, float]:
    """(cache bytes after the prefill, median seconds of a decode step, collectives per layer per step)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        held = cache_bytes(out.cache)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        counter.count = 0
        for _ in range(steps):
            start = time.perf_counter()
            counter.on = True
            out = model(token, cache=out.cache, use_cache=True)
            counter.on = False
            times.append(time.perf_counter() - start)
            token = out.logits[:, -1:].argmax(-1)
    return held, statistics.median(times), counter.count / steps / LAYERS


def cp_model(config: LlamaConfig, single: torch.nn.Module, mesh: object, directory: Path) -> torch.nn.Module:
    plan = plan_model(meta_model(config), cp=mesh.size())
    directory.mkdir()
    generated = lower_llama(plan, directory)
    model = generated.LlamaForCausalLM(config).eval()
    model.load_state_dict(single.state_dict())
    parallelize(model, plan, mesh)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", default="1024,4096")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--cap-mib", type=float, default=64.0)
    args = parser.parse_args()
    prompts = [int(n) for n in args.prompts.split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("run with torchrun --nproc-per-node 4 (cp 2 on ranks 0-1, cp 4 on all)")
    counter = CountCalls()
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    single = LlamaForCausalLM(config).eval()
    pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    four = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"hpgen-decode-{rank}-") as directory:
        cp2 = cp_model(config, single, pairs["cp"], Path(directory) / "cp2")
        cp4 = cp_model(config, single, four["cp"], Path(directory) / "cp4")
        for n in prompts:
            ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            row = {}
            row["one process"] = decode(single, ids, args.steps, counter) if rank == 0 else None
            dist.barrier()
            for label, whole in (("cp 2, replicated", True), ("cp 2, split", False)):
                keep_whole_cache(cp2, whole)
                row[label] = decode(cp2, ids, args.steps, counter) if rank < 2 else None
                dist.barrier()
            row["cp 4, split"] = decode(cp4, ids, args.steps, counter)
            every = [None] * world
            dist.all_gather_object(every, row)
            rows.append((n, every))
    if rank == 0:
        report(rows, args.cap_mib)
    dist.destroy_process_group()


def report(rows: list, cap_mib: float) -> None:
    print(f"4-layer Llama, hidden 256, 4 key/value heads of 32, float32, batch 1, one thread a rank (gloo)")
    print("| prompt | decoding | cache bytes per rank | vs one process | decode step ms (slowest rank) | "
          "vs one process | vs cp 2 replicated | collectives per layer per step |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    per_token = {}
    for n, every in rows:
        one_bytes, one_s, _ = every[0]["one process"]
        replicated_s = max(r["cp 2, replicated"][1] for r in every[:2])
        for label in ("one process", "cp 2, replicated", "cp 2, split", "cp 4, split"):
            found = [r[label] for r in every if r[label] is not None]
            held = max(f[0] for f in found)
            seconds = max(f[1] for f in found)
            calls = max(f[2] for f in found)
            per_token[label] = held / n
            print(f"| {n} | {label} | {held / 2**20:.2f} MiB | {held / one_bytes:.2f}x | {seconds * 1e3:.2f} | "
                  f"{seconds / one_s:.2f}x | {seconds / replicated_s:.2f}x | {calls:g} |")
    cap = cap_mib * 2**20
    one = cap / per_token["one process"]
    print(f"\nlongest prompt whose cache fits in {cap_mib:.0f} MiB per rank (computed from the cache bytes per "
          f"token per rank at the longest prompt):")
    for label, per in per_token.items():
        print(f"- {label}: {cap / per:.0f} tokens ({cap / per / one:.2f}x one process)")


if __name__ == "__main__":
    main()
