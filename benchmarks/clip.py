"""Gradient clipping of a parallelized Llama over 2 gloo ranks: hpgen's clip_grad_norm_ against torch's local one.

    torchrun --nproc-per-node 2 benchmarks/clip.py [--rounds 30] [--calls 20] [--json out.json]
    python benchmarks/clip.py --smoke      # spawns 2 ranks itself, a few rounds: checks the script runs

One torchrun, one thread a rank, CPU. The 4-layer bench model of ``tp_decode.py`` (hidden
256, vocab 1024), lowered under ``tests/plans/llama_tp.json`` and parallelized on ``tp``,
takes one backward on a batch of 2 x 64 tokens; then each variant clips those gradients
(``max_norm`` large, so the scale is 1 and the gradients stay as they are, while every
variant still multiplies them, as torch does without a branch):

- ``torch local``: ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on the
  parallelized model: what a loop runs today, the norm of this rank's shards (wrong on a
  parallelized model, and the cost to match);
- ``hpgen``: ``hpgen.runtime.clip_grad_norm_(model.parameters(), ...)``: the unsharded
  model's norm, one all-reduce of one element;
- ``hpgen (model)``: the same given the model instead of its parameters;
- ``torch unsharded``: torch's clip on the unsharded model's gradients (twice the
  elements, no communication), for scale.

Variants take turns within every round (the order rotates each round); a round's value is
the mean of ``--calls`` calls on the slower rank; the table gives the median and p10-p90
over rounds, and each variant's ratio to ``torch local`` (of the medians, and the median
of the per-round ratios). The norms are checked against the unsharded model's, and the
collectives of one call counted from the profiler's gloo events. Then rank 0 alone times
the variants again over a fake process group (collectives return at once), in its
thread's CPU time: the host cost without gloo's latency, which on a small shared machine
is large and noisy (``--no-host-only`` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_decode import CONFIG, PLANS, _cpu_model, build_hpgen, build_reference, lower_llama, paired_ratio, summary

ROOT = Path(__file__).resolve().parent.parent
MAX_NORM = 1e9  # the scale clamps to 1: the gradients stay the same from call to call
BATCH, TOKENS = 2, 64
VARIANTS = ("torch local", "hpgen", "hpgen (model)", "torch unsharded")


def clippers(model: nn.Module, reference: nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    from hpgen.runtime import clip_grad_norm_

    params, ref_params = list(model.parameters()), list(reference.parameters())
    return {
        "torch local": lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM),
        "hpgen": lambda: clip_grad_norm_(params, MAX_NORM),
        "hpgen (model)": lambda: clip_grad_norm_(model, MAX_NORM),
        "torch unsharded": lambda: torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM),
    }


def timed_ms(step: Callable[[], object], calls: int, clock: Callable[[], float] = time.perf_counter) -> float:
    dist.barrier()  # the ranks start together: hpgen's all-reduce waits for the slower one
    start = clock()
    for _ in range(calls):
        step()
    return (clock() - start) / calls * 1e3


def prepared(mesh: Any, generated: Path) -> dict[str, Callable[[], torch.Tensor]]:
    """The two models after one backward on the same batch, and each variant's call."""
    reference = build_reference().train()
    model = build_hpgen(reference, generated, PLANS["hpgen"], mesh).train()
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, TOKENS), generator=torch.Generator().manual_seed(1))
    for net in (model, reference):
        net(ids, labels=ids).loss.backward()
    return clippers(model, reference)


def interleaved(
    steps: dict[str, Callable[[], torch.Tensor]], rounds: int, calls: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, list[float]]:
    """Warm up, then every variant once a round, the order rotating by one each round."""
    for step in steps.values():
        timed_ms(step, 3, clock)
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for round_ in range(rounds):
        for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
            times[name].append(timed_ms(steps[name], calls, clock))
    return times


def host_only(world: int, rounds: int, calls: int, generated: Path) -> dict[str, list[float]]:
    """Rank 0 alone over a fake process group of ``world`` ranks (collectives return at once), in this
    thread's CPU time: each variant's host cost without gloo's latency."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    times = interleaved(prepared(mesh, generated), rounds, calls, clock=time.thread_time)
    dist.destroy_process_group()
    return times


def collectives(step: Callable[[], object]) -> dict[str, int]:
    """The collectives one call runs, from the profiler's backend events."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: Counter[str] = Counter()
    for event in prof.events():
        backend, _, op = event.name.partition(":")
        if backend == "gloo" and op != "barrier":
            counts[op] += 1
    return dict(counts)


def run(rank: int, world: int, rounds: int, calls: int, folder: str, host: bool = False) -> dict | None:
    """The body of each rank (torchrun, or the spawner of ``--smoke``); rank 0 returns the results.

    ``host``: rank 0 then times the variants again over a fake process group (it ends the real one)."""
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    generated = Path(folder) / "modeling_llama_clip.py"
    if rank == 0:
        lower_llama(PLANS["hpgen"], generated)
    dist.barrier()
    steps = prepared(mesh, generated)
    norms = {name: step().item() for name, step in steps.items()}
    counted = {name: collectives(step) for name, step in steps.items()}
    times = interleaved(steps, rounds, calls)
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, times)
    if rank != 0:
        return None
    results = {
        "setup": {
            "ranks": world,
            "backend": "gloo",
            "threads_per_rank": 1,
            "model": CONFIG,
            "plan": str(PLANS["hpgen"].relative_to(ROOT)),
            "rounds": rounds,
            "calls_per_round": calls,
            "torch": torch.__version__,
            "cpu": _cpu_model(),
        },
        "timing_ms": {name: [max(ranks[name][i] for ranks in per_rank) for i in range(rounds)] for name in steps},
        "norms": norms,
        "collectives_per_call": counted,
    }
    if host:
        dist.destroy_process_group()
        results["host_only_ms"] = host_only(world, rounds, calls, generated)
    return results


def table(timing: dict[str, list[float]], results: dict) -> list[str]:
    base = timing["torch local"]
    lines = [
        "| variant | ms per call | p10-p90 | / torch local (paired) | collectives per call | norm |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for name, values in timing.items():
        median, p10, p90 = summary(values)
        ratio = f"{median / statistics.median(base):.3f} ({paired_ratio(values, base):.3f})"
        counted = ", ".join(f"{count} {op}" for op, count in results["collectives_per_call"][name].items()) or "none"
        lines.append(
            f"| {name} | {median:.3f} | {p10:.3f}-{p90:.3f} | {ratio} | {counted} | {results['norms'][name]:.6f} |"
        )
    return lines


def report(results: dict) -> str:
    setup = results["setup"]
    lines = [
        f"clip_grad_norm_ of the bench Llama ({setup['model']['num_hidden_layers']} layers, hidden "
        f"{setup['model']['hidden_size']}) on {setup['ranks']} gloo ranks, {setup['plan']}; {setup['rounds']} rounds of "
        f"{setup['calls_per_round']} calls, the slower rank's mean per round",
        "",
        *table(results["timing_ms"], results),
    ]
    if "host_only_ms" in results:
        lines += ["", "Host only (rank 0, fake process group, thread CPU time):", "", *table(results["host_only_ms"], results)]
    norms = results["norms"]
    lines += [
        "",
        f"hpgen's norm - the unsharded model's: {abs(norms['hpgen'] - norms['torch unsharded']):.3g}; "
        f"torch local's (rank 0's shards): {abs(norms['torch local'] - norms['torch unsharded']):.3g}",
        "target: hpgen / torch local <= 1.2",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (default 30)")
    parser.add_argument("--calls", type=int, default=20, help="calls per variant per round (default 20)")
    parser.add_argument("--smoke", action="store_true", help="spawn 2 ranks here, 2 rounds of 2 calls")
    parser.add_argument("--no-host-only", action="store_true", help="skip the fake-process-group timings")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    if args.smoke and "RANK" not in os.environ:
        sys.path.insert(0, str(ROOT))
        from tests.support.dist import run_distributed

        with tempfile.TemporaryDirectory(prefix="hpgen_clip_bench_") as folder:
            results = run_distributed(run, 2, 2, folder, timeout=600)[0]
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        shared = [tempfile.mkdtemp(prefix="hpgen_clip_bench_") if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        results = run(rank, world, args.rounds, args.calls, shared[0], host=not args.no_host_only)
        if dist.is_initialized():
            dist.destroy_process_group()
        if rank != 0:
            return
        shutil.rmtree(shared[0], ignore_errors=True)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
