"""Gradient sums over ``cp`` by hpgen's hooks or by the data-parallel engine: collectives, optimizer state, time.

    torchrun --nproc-per-node 2 benchmarks/data_parallel_cp.py [--length 1024] [--steps 3]

A 4-layer Llama (the model of ``benchmarks/context_parallel.py``: hidden 256, 8 heads, 4 key/value
heads, vocabulary 1000, sdpa, float32), batch 1, one thread a rank. A training step is 4 micro-batches
(gradient accumulation, each loss divided by 4), ``clip_grad_norm_`` (hpgen's; torch's for one
process) and an AdamW step. Side by side in one run:

- one process: rank 0 trains the unsharded model alone (rank 1 waits);
- cp 2, hooks: the model parallelized by ``hpgen plan --cp 2``, no engine: hpgen's tensor hooks
  all-reduce each parameter's gradient over cp at every micro-batch;
- cp 2, DDP / FSDP2: the same model under ``hpgen.runtime.training.data_parallel(model, engine)``,
  ``hpgen.runtime.training.no_sync`` (DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``) on the
  first 3 micro-batches.

Measured on rank 0: the gradient collectives each micro-batch's backward runs (torch.profiler's
backend events, ``gloo:all_reduce`` and the like, of a step after the first: a collective whose
input is 1-D or 2-D is a gradient's or a bucket's, the attention's key/value collectives are 4-D),
the AdamW state bytes on the rank (``exp_avg`` and ``exp_avg_sq``, local shards), and the median
step time over ``--steps`` rounds, each variant stepping once a round in turn (after a warm-up round
and the profiled one; interleaved, so that the load of a shared machine falls on all alike).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.context_parallel import CONFIG, lower_llama  # noqa: E402
from hpgen.planner.entry.make import plan_model  # noqa: E402
from hpgen.planner.model.load import meta_model  # noqa: E402
from hpgen.runtime import clip_grad_norm_, parallelize  # noqa: E402
from hpgen.runtime.training import data_parallel, no_sync  # noqa: E402
from tests.support.engine_runs import gradient_collectives, state_bytes  # noqa: E402

ACCUMULATION = 4


class Variant:
    """One model and its optimizer, stepped one whole training step at a time."""

    def __init__(self, label: str, wrapped: torch.nn.Module, model: torch.nn.Module, clip: object) -> None:
        self.label, self.wrapped, self.model, self.clip = label, wrapped, model, clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.per_micro: list[tuple[int, int]] = []  # gradient collectives of the profiled step, per micro-batch
        self.times: list[float] = []

    def step(self, batches: list[torch.Tensor], profiled: bool = False, timed: bool = False) -> None:
        start = time.perf_counter()
        for micro, ids in enumerate(batches):
            with contextlib.nullcontext() if micro == len(batches) - 1 else no_sync(self.wrapped):
                loss = self.wrapped(ids, labels=ids).loss / len(batches)
                if profiled:
                    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                        loss.backward()
                    self.per_micro.append(gradient_collectives(prof.events()))
                else:
                    loss.backward()
        self.clip(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if timed:
            self.times.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    config = LlamaConfig(**CONFIG)
    plan = plan_model(meta_model(config), cp=world)
    torch.manual_seed(0)
    full = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (1, args.length), generator=generator) for _ in range(ACCUMULATION)]
    with tempfile.TemporaryDirectory() as folder:
        generated = lower_llama(plan, Path(folder))
        variants = []
        if rank == 0:  # one process
            single = LlamaForCausalLM(config)
            single.load_state_dict(full.state_dict())
            variants.append(Variant("one process", single, single, torch.nn.utils.clip_grad_norm_))
        for label, engine in (("cp 2, hooks", "none"), ("cp 2, DDP", "ddp"), ("cp 2, FSDP2", "fsdp2")):
            model = generated.LlamaForCausalLM(config)
            model.load_state_dict(full.state_dict())
            parallelize(model, plan, mesh)
            wrapped = model if engine == "none" else data_parallel(model, engine)
            variants.append(Variant(label, wrapped, model, clip_grad_norm_))
    # rounds: each variant one step in turn (the machine's load drifts; interleaving shares it out); round 0
    # warms up, round 1 is profiled, the others are timed
    for round_ in range(args.steps + 2):
        if rank != 0:
            dist.barrier()  # rank 0 runs one process alone
        for variant in variants:
            variant.step(batches, profiled=round_ == 1, timed=round_ >= 2)
            dist.barrier()
    rows = [(v.label, v.per_micro, state_bytes(v.optimizer), statistics.median(v.times)) for v in variants]
    if rank == 0:
        base_bytes, base_time = rows[0][2], rows[0][3]
        print(f"{args.length} tokens x {ACCUMULATION} micro-batches a step, {args.steps} steps, rank 0\n")
        print("| variant | gradient collectives per micro-batch (1, 2, 3, 4) | MiB they move, per micro-batch "
              "| AdamW state per rank | ratio | step s (median) | ratio |")
        print("|---|---|---|---:|---:|---:|---:|")
        for label, per_micro, nbytes, seconds in rows:
            counts = ", ".join(str(count) for count, _ in per_micro)
            moved = ", ".join(f"{b / 2**20:.1f}" for _, b in per_micro)
            print(f"| {label} | {counts} | {moved} | {nbytes / 2**20:.2f} MiB | {nbytes / base_bytes:.2f} "
                  f"| {seconds:.2f} | {seconds / base_time:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
