"""Eager against ``torch.compile``: decode and prefill of a small Llama over 2 gloo ranks.

    torchrun --nproc-per-node 2 benchmarks/tp_compile.py [--rounds 12] [--backend inductor] [--json out.json]

One torchrun, one thread a rank, CPU; the model, weights and plans of ``tp_decode.py``.
Four tensor-parallel variants, each run eagerly and compiled:

- ``hand-written``: transformers' Llama sliced by hand, one all-reduce per attention and
  MLP block in forward hooks (gpt-fast style, :mod:`handwritten_tp`). Eagerly the hooks
  reduce in place with ``dist.all_reduce``; compiled they return torch's functional
  ``all_reduce`` (gpt-fast's ``tp.py``), which Dynamo traces;
- ``hpgen`` (``tests/plans/llama_tp.json``, the hand-written layout) and ``hpgen+vocab``
  (``tests/plans/llama_tp_vocab.json``: also the vocab-parallel embedding and a gathered
  ``lm_head``, transformers' layout);
- ``transformers``: ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``.

Decode: batch 1, one token on a 32-token KV cache, cropped back after every step: a
``DynamicCache`` eagerly, transformers' ``StaticCache`` compiled (fixed shapes, no
recompilation). Prefill: batch 1, 128 tokens, no cache. hpgen and hand-written compile
with ``fullgraph=True``; transformers' compiles where it can (``fullgraph=False``), and
the report gives each compiled function's graphs and graph breaks (``torch._dynamo.explain``).
Variants take turns in every round, the order rotating; the tables give the median over
rounds (a round: the mean of a few calls on the slower rank) and p10-p90.

Collectives are counted from torch.profiler's backend events (``gloo:all_reduce``, ...):
what the process group really ran in one call, whoever issued it; an ``all_gather`` of
one element is a size exchange, counted apart.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten_tp import shard_llama_
from tp_decode import (
    CONFIG,
    PLANS,
    PREFILL,
    PREFIX,
    SEED,
    build_hpgen,
    build_reference,
    build_transformers,
    generated_file,
    lower_llama,
    setup_info,
    timed_ms,
    timing_tables,
)

FRAMEWORKS = ("hand-written", "hpgen", "hpgen+vocab", "transformers")


@dataclass
class Run:
    """One framework in one mode (eager or compiled): its two workloads and what they measured."""

    framework: str
    compiled: bool
    decode: Callable[[], torch.Tensor]
    prefill: Callable[[], torch.Tensor]
    decode_ms: list[float] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.framework} {'compiled' if self.compiled else 'eager'}"


def build_framework(name: str, reference: nn.Module, folder: Path, mesh: Any, *, functional: bool) -> nn.Module:
    """The model of framework ``name`` with the reference's weights."""
    if name == "hand-written":
        model = transformers.LlamaForCausalLM(reference.config).eval()
        model.load_state_dict(reference.state_dict())
        return shard_llama_(model, mesh.get_group("tp"), functional=functional)
    if name == "transformers":
        return build_transformers(folder / "checkpoint")
    return build_hpgen(reference, generated_file(folder, name), PLANS[name], mesh)


def eager_run(framework: str, model: nn.Module, prompt: torch.Tensor, token: torch.Tensor) -> Run:
    """Decode over a DynamicCache of ``PREFIX`` tokens, cropped back each step; prefill without cache."""
    cache = model(prompt[:, :PREFIX], use_cache=True).cache

    def decode() -> torch.Tensor:
        logits = model(token, cache=cache, use_cache=True).logits
        cache.crop(-1)
        return logits

    return Run(framework, False, decode, lambda: model(prompt, use_cache=False).logits)


def compiled_run(
    framework: str, model: nn.Module, prompt: torch.Tensor, token: torch.Tensor, backend: str, mode: str | None
) -> Run:
    """The same two workloads compiled; decode over a StaticCache (prefilled eagerly), cropped back each step."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=PREFIX + 1)
    model(prompt[:, :PREFIX], cache=cache, use_cache=True)

    def step(token: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(token, cache=cache, use_cache=True).logits

    def whole(prompt: torch.Tensor) -> torch.Tensor:
        return model(prompt, use_cache=False).logits

    fullgraph = framework != "transformers"
    info: dict[str, Any] = {"fullgraph": fullgraph}
    for label, fn, args in (("decode", step, (token, cache)), ("prefill", whole, (prompt,))):
        report = torch._dynamo.explain(fn)(*args)
        if label == "decode":
            cache.crop(-1)
        info[label] = {"graphs": report.graph_count, "graph_breaks": report.graph_break_count}
        info[label]["break_reasons"] = sorted({str(reason.reason).split("\n")[0][:120] for reason in report.break_reasons})
    compiled_step = torch.compile(step, fullgraph=fullgraph, backend=backend, mode=mode)
    compiled_whole = torch.compile(whole, fullgraph=fullgraph, backend=backend, mode=mode)

    def decode() -> torch.Tensor:
        logits = compiled_step(token, cache)
        cache.crop(-1)
        return logits

    run = Run(framework, True, decode, lambda: compiled_whole(prompt), info=info)
    for label, workload in (("decode", run.decode), ("prefill", run.prefill)):
        dist.barrier()
        started = time.perf_counter()
        workload()
        info[label]["compile_s"] = time.perf_counter() - started
    return run


def build_runs(
    reference: nn.Module, folder: Path, mesh: Any, prompt: torch.Tensor, token: torch.Tensor, args: argparse.Namespace
) -> list[Run]:
    """Every framework eagerly and compiled (the eager hand-written TP reduces in place; its
    compiled twin, a model of its own, returns functional all-reduces from its hooks)."""
    runs = []
    for framework in FRAMEWORKS:
        eager_model = build_framework(framework, reference, folder, mesh, functional=False)
        compiled_model = (
            build_framework(framework, reference, folder, mesh, functional=True)
            if framework == "hand-written"
            else eager_model
        )
        runs.append(eager_run(framework, eager_model, prompt, token))
        runs.append(compiled_run(framework, compiled_model, prompt, token, args.backend, args.mode))
    return runs


def host_only_timings(folder: Path, world: int, args: argparse.Namespace, prompt: torch.Tensor, token: torch.Tensor) -> dict:
    """Rank 0 alone: every run rebuilt over a fake process group of ``world`` ranks (collectives
    return at once, with wrong values) and timed in this thread's CPU time: each framework's
    host cost, compiled or not, without the communication latency and the scheduler's noise."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch._dynamo.reset()
    with torch.no_grad():
        runs = build_runs(build_reference(), folder, mesh, prompt, token, args)
        interleaved(runs, args.rounds, args.decode_calls, args.prefill_calls, clock=time.thread_time)
    dist.destroy_process_group()
    return {run.name: {"decode": run.decode_ms, "prefill": run.prefill_ms} for run in runs}


def count_collectives(step: Callable[[], object]) -> dict[str, int]:
    """The collectives one call of ``step`` runs: backend op name (or ``size_exchange``) -> count."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    counts: Counter[str] = Counter()
    for event in prof.events():
        backend, _, op = event.name.partition(":")
        if backend not in ("gloo", "nccl") or op == "barrier":
            continue
        shapes = [shape for shape in event.input_shapes if shape]
        if op == "all_gather" and shapes and all(_numel(shape) <= 1 for shape in shapes):
            op = "size_exchange"
        counts[op] += 1
    return dict(sorted(counts.items()))


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def interleaved(
    runs: list[Run], rounds: int, decode_calls: int, prefill_calls: int, clock: Callable[[], float] = time.perf_counter
) -> None:
    """Warm up, then time every run once per round, the order rotating by one each round."""
    for run in runs:
        timed_ms(run.decode, 3, clock)
        timed_ms(run.prefill, 1, clock)
    for index in range(rounds):
        order = runs[index % len(runs) :] + runs[: index % len(runs)]
        for run in order:
            run.decode_ms.append(timed_ms(run.decode, decode_calls, clock))
        for run in order:
            run.prefill_ms.append(timed_ms(run.prefill, prefill_calls, clock))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds (default 12)")
    parser.add_argument("--decode-calls", type=int, default=8)
    parser.add_argument("--prefill-calls", type=int, default=2)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--mode", default=None, help="torch.compile mode (reduce-overhead needs CUDA)")
    parser.add_argument("--no-host-only", action="store_true", help="skip the fake-process-group timings")
    parser.add_argument("--json", type=Path, help="also write the results (rank 0) to this file")
    args = parser.parse_args()

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    torch._dynamo.config.cache_size_limit = 64
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    started = time.perf_counter()

    shared = [tempfile.mkdtemp(prefix="hpgen_bench_") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    folder = Path(shared[0])
    reference = build_reference()
    if rank == 0:
        reference.save_pretrained(folder / "checkpoint")
        for name in ("hpgen", "hpgen+vocab"):
            lower_llama(PLANS[name], generated_file(folder, name))
    dist.barrier()
    generator = torch.Generator().manual_seed(SEED + 1)
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, PREFILL), generator=generator)
    token = torch.randint(0, CONFIG["vocab_size"], (1, 1), generator=generator)

    with torch.no_grad():
        want = eager_run("unsharded", reference, prompt, token)
        want_logits = {"decode": want.decode(), "prefill": want.prefill()}
        runs = build_runs(reference, folder, mesh, prompt, token, args)
        parity: dict[str, dict[str, float | bool]] = {}
        collectives: dict[str, dict[str, dict[str, int]]] = {}
        for run in runs:
            got = {"decode": run.decode(), "prefill": run.prefill()}
            parity[run.name] = {f"{kind}_max_abs_diff": (got[kind] - want_logits[kind]).abs().max().item() for kind in got}
            parity[run.name]["same_greedy_tokens"] = all(
                bool(got[kind][0, -1].argmax() == want_logits[kind][0, -1].argmax()) for kind in got
            )
            collectives[run.name] = {kind: count_collectives(getattr(run, kind)) for kind in ("decode", "prefill")}
        interleaved(runs, args.rounds, args.decode_calls, args.prefill_calls)

    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, {run.name: (run.decode_ms, run.prefill_ms) for run in runs})
    dist.destroy_process_group()
    if rank != 0:
        return
    results = {
        "setup": {**setup_info(args, world, "sdpa"), "compile": {"backend": args.backend, "mode": args.mode}},
        "timing_ms": {},
        "compiled": {run.name: run.info for run in runs if run.compiled},
        "collectives_per_call": collectives,
        "parity": parity,
    }
    for run in runs:
        results["timing_ms"][run.name] = {
            kind: [max(ranks[run.name][i][index] for ranks in per_rank) for index in range(args.rounds)]
            for i, kind in enumerate(("decode", "prefill"))
        }
    del runs
    if not args.no_host_only:
        results["host_only_ms"] = host_only_timings(folder, world, args, prompt, token)
    shutil.rmtree(folder, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - started
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


RATIOS = (  # (numerator, denominator, target)
    ("hpgen compiled", "hand-written compiled", "<= 1.05"),
    ("hpgen eager", "hand-written eager", "<= 1.05"),
    ("transformers compiled", "hpgen compiled", ""),
    ("transformers compiled", "hpgen+vocab compiled", "same layout as transformers"),
    ("hpgen+vocab compiled", "hpgen compiled", ""),
    ("hpgen compiled", "hpgen eager", "compiled over eager"),
    ("hand-written compiled", "hand-written eager", "compiled over eager"),
    ("transformers compiled", "transformers eager", "compiled over eager"),
)


def report(results: dict[str, Any]) -> str:
    s = results["setup"]
    compile_setup = s["compile"]
    lines = [
        (
            f"{s['ranks']} ranks, {s['backend']}, {s['threads_per_rank']} thread a rank; {s['cpu']}; python "
            f"{s['python']}, torch {s['torch']}, transformers {s['transformers']}. torch.compile backend "
            f"{compile_setup['backend']}, mode {compile_setup['mode'] or 'default'}. Decode: {s['decode']} "
            f"(compiled: StaticCache); prefill: {s['prefill']}; {s['rounds']} rounds. Ratios: of the medians, "
            "and in brackets the median of the per-round ratios."
        ),
        "",
    ]
    lines += timing_tables(results["timing_ms"], "Time per call over gloo (slower rank per round)", RATIOS)
    if "host_only_ms" in results:
        title = "Host CPU time per call, no communication (fake process group, rank 0's thread CPU time)"
        lines += timing_tables(results["host_only_ms"], title, RATIOS)

    layers = s["model"]["num_hidden_layers"]
    lines += [
        "",
        "### Compiled functions (rank 0): graphs, graph breaks, first call (compile) time",
        "",
        "| variant | fullgraph | decode graphs / breaks | decode compile s | prefill graphs / breaks | prefill compile s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, info in results["compiled"].items():
        d, p = info["decode"], info["prefill"]
        lines.append(
            f"| {name} | {info['fullgraph']} | {d['graphs']} / {d['graph_breaks']} | {d['compile_s']:.1f} | "
            f"{p['graphs']} / {p['graph_breaks']} | {p['compile_s']:.1f} |"
        )
    reasons = {name: info["decode"]["break_reasons"] for name, info in results["compiled"].items()}
    for name, found in reasons.items():
        if found:
            lines.append(f"\n{name}, decode graph breaks: " + "; ".join(found))
    lines += [
        "",
        "### Collectives per call (profiler backend events)",
        "",
        "| variant | decode | prefill | all-reduces per decoder layer |",
        "|---|---|---|---:|",
    ]
    for name, counts in results["collectives_per_call"].items():
        decode = ", ".join(f"{k}: {n}" for k, n in counts["decode"].items()) or "none"
        prefill = ", ".join(f"{k}: {n}" for k, n in counts["prefill"].items()) or "none"
        extra = 1 if "vocab" in name or "transformers" in name else 0  # the vocab-parallel embedding's
        per_layer = (counts["decode"].get("all_reduce", 0) - extra) / layers
        lines.append(f"| {name} | {decode} | {'same' if prefill == decode else prefill} | {per_layer:g} |")
    lines += [
        "",
        "### Logits against the unsharded eager model (rank 0)",
        "",
        "| variant | decode max abs diff | prefill max abs diff | same greedy tokens |",
        "|---|---:|---:|---|",
    ]
    for name, found in results["parity"].items():
        lines.append(
            f"| {name} | {found['decode_max_abs_diff']:.2e} | {found['prefill_max_abs_diff']:.2e} | "
            f"{'yes' if found['same_greedy_tokens'] else 'NO'} |"
        )
    lines += ["", f"Wall time of the benchmark: {results['wall_s']:.0f} s."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
