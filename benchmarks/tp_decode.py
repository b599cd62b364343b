"""Decode and prefill of a small Llama over 2 gloo ranks: hpgen against hand-written TP and transformers' tp_plan.

    torchrun --nproc-per-node 2 benchmarks/tp_decode.py [--rounds 24] [--no-host-only] [--json out.json]

One torchrun, one thread a rank, CPU. The same seeded weights are built five ways:

- ``unsharded``: transformers' ``LlamaForCausalLM`` on every rank (no communication);
- ``hand-written``: the same model sliced by hand, one all-reduce per attention and MLP
  block in forward hooks (gpt-fast style, :mod:`handwritten_tp`);
- ``hpgen``: transformers' ``modeling_llama.py`` lowered by hpgen under
  ``tests/plans/llama_tp.json`` (attention + MLP, like the hand-written baseline), then
  ``hpgen.runtime.parallelize``;
- ``hpgen+vocab``: the same under ``tests/plans/llama_tp_vocab.json``, which also shards
  the embedding (vocab-parallel) and ``lm_head`` (gathered): the layout of transformers' plan;
- ``transformers``: ``from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_plan="auto"))``
  from a checkpoint rank 0 saved (the config's ``base_model_tp_plan`` plus the class's
  ``_tp_plan``; transformers builds its own device mesh, see ``build_transformers``).

Each variant runs a decode step (batch 1, one token, a KV cache holding a 32-token prefix,
cropped back after every step) and a prefill (batch 1, 128 tokens, no cache). Variants
take turns within every round (the order rotates each round); a round's value is the mean
of a few calls on the slower rank; the tables give the median, p10 and p90 over rounds.

Then, on rank 0 alone, the same variants are built again over a *fake* process group
(``torch.testing._internal.distributed.fake_pg``: every collective returns at once, with
wrong values) and timed the same way: what is left is each variant's host cost (Python,
DTensor dispatch, kernels) without the communication latency. On a small shared CPU
machine that latency is large and noisy (gloo hands each collective through threads and
sockets, so it waits on the scheduler); the host-only table, in the thread's CPU time,
shows the framework overheads that make the variants differ.

Collectives are counted from torch.profiler's backend events (``gloo:all_reduce``, ...):
one event per collective the process group really ran, whether it came from
``torch.distributed``, a DTensor redistribute or a hook. Markers around the embedding,
each decoder layer and ``lm_head`` attribute them to where they ran. An ``all_gather`` of
one element is the runtime's size exchange before a gather (shards may be uneven) and is
counted apart.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten_tp import shard_llama_

ROOT = Path(__file__).resolve().parent.parent
PLANS = {"hpgen": ROOT / "tests/plans/llama_tp.json", "hpgen+vocab": ROOT / "tests/plans/llama_tp_vocab.json"}

CONFIG = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,  # larger than the default 0.02: clear greedy choices, meaningful logits
}
PREFIX, PREFILL = 32, 128  # tokens in the decode step's KV cache; tokens of the prefill
SEED = 0


# --------------------------------------------------------------------------- the variants


@dataclass
class Variant:
    """A model and what was measured on it."""

    name: str
    model: nn.Module
    decode_ms: list[float] = field(default_factory=list)  # one value a round
    prefill_ms: list[float] = field(default_factory=list)


def build_reference() -> nn.Module:
    """The unsharded model; every rank builds the same one from the seed."""
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).eval()


def build_handwritten(reference: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """transformers' model with the reference's weights, sliced by hand (:mod:`handwritten_tp`)."""
    model = transformers.LlamaForCausalLM(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    return shard_llama_(model, mesh.get_group("tp"))


def lower_llama(plan: Path, out: Path) -> None:
    """Lower the installed ``modeling_llama.py`` under ``plan`` into ``out`` (imports made absolute)."""
    from hpgen.generator.lower import lower
    from hpgen.core.plan import load_plan

    source = Path(transformers.models.llama.modeling_llama.__file__)
    text = lower(source.read_text(), load_plan(plan), source_name=source.name, package="transformers.models.llama")
    out.write_text(text)


_IMPORTS = itertools.count()


def build_hpgen(reference: nn.Module, generated: Path, plan: Path, mesh: DeviceMesh) -> nn.Module:
    """The generated file's ``LlamaForCausalLM`` with the reference's weights, parallelized."""
    from hpgen.runtime import parallelize

    name = f"_bench_{generated.stem}_{next(_IMPORTS)}"
    spec = importlib.util.spec_from_file_location(name, generated)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # transformers looks classes' modules up
    spec.loader.exec_module(module)
    model = module.LlamaForCausalLM(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    return parallelize(model, plan, mesh)


def build_transformers(checkpoint: Path) -> nn.Module:
    """transformers' own TP. ``DistributedConfig(tp_plan="auto")`` takes ``tp_size`` from
    ``WORLD_SIZE`` (divided by the other parallel sizes, all 1 here); ``initialize_distributed_mesh``
    then picks the device type from ``torch._C._get_accelerator()`` (CPU here, so gloo) and
    builds its own mesh ``(pp, dp_replicate, fsdp, tp) = (1, 1, 1, 2)`` with new process
    groups; the model shards over its ``tp`` dim."""
    config = transformers.DistributedConfig(tp_plan="auto")
    return transformers.LlamaForCausalLM.from_pretrained(
        checkpoint, distributed_config=config, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def generated_file(folder: Path, name: str) -> Path:
    """Where the modeling file of the hpgen variant ``name`` is generated."""
    return folder / f"modeling_llama_{name.replace('+', '_')}.py"


def build_variants(reference: nn.Module, folder: Path, mesh: DeviceMesh) -> list[Variant]:
    """The five variants, from the reference and what rank 0 wrote into ``folder``."""
    return [
        Variant("unsharded", reference),
        Variant("hand-written", build_handwritten(reference, mesh)),
        *(
            Variant(name, build_hpgen(reference, generated_file(folder, name), plan, mesh))
            for name, plan in PLANS.items()
        ),
        Variant("transformers", build_transformers(folder / "checkpoint")),
    ]


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (a DTensor counts its local shard; tied ones once)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


# --------------------------------------------------------------------------- workloads


class Workloads:
    """The decode step and the prefill of one model, with fixed inputs."""

    def __init__(self, model: nn.Module, prompt: torch.Tensor, token: torch.Tensor) -> None:
        self.model, self.prompt, self.token = model, prompt, token
        with torch.no_grad():
            self.cache = model(prompt[:, :PREFIX], use_cache=True).cache

    def decode(self) -> torch.Tensor:
        logits = self.model(self.token, cache=self.cache, use_cache=True).logits
        self.cache.crop(-1)  # back to the prefix: every step sees the same cache
        return logits

    def prefill(self) -> torch.Tensor:
        return self.model(self.prompt, use_cache=False).logits


def timed_ms(step: Callable[[], object], calls: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Mean time of ``calls`` calls on ``clock``, in ms (the ranks start together)."""
    dist.barrier()
    total = 0.0
    for _ in range(calls):
        start = clock()
        step()
        total += clock() - start
    return total / calls * 1e3


# --------------------------------------------------------------------------- collectives


@contextlib.contextmanager
def region_markers(model: nn.Module):
    """Profiler ranges around the embedding, each decoder layer and lm_head."""
    regions = {"embed": model.model.embed_tokens, "lm_head": model.lm_head}
    regions.update({f"layer{i}": layer for i, layer in enumerate(model.model.layers)})
    handles, open_ranges = [], {}

    def enter(name):
        def hook(module, args):
            open_ranges[name] = record_function(f"region:{name}")
            open_ranges[name].__enter__()

        return hook

    def leave(name):
        def hook(module, args, output):
            open_ranges.pop(name).__exit__(None, None, None)

        return hook

    for name, module in regions.items():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave(name), always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def count_collectives(model: nn.Module, step: Callable[[], object]) -> dict[str, int]:
    """The collectives one call of ``step`` runs, as ``"<op> @ <region>"`` -> count.

    ``region`` is ``layers`` (any decoder layer), ``embed``, ``lm_head`` or ``other``;
    ``op`` is the backend's name (``all_reduce``, ``all_gather``, ...), or ``size_exchange``
    for an all-gather of one element.
    """
    with region_markers(model), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    events = prof.events()
    regions = [(e.name.removeprefix("region:"), e.time_range) for e in events if e.name.startswith("region:")]
    counts: Counter[str] = Counter()
    for event in events:
        backend, _, op = event.name.partition(":")
        if backend not in ("gloo", "nccl") or op == "barrier":
            continue
        shapes = [shape for shape in event.input_shapes if shape]
        if op == "all_gather" and shapes and all(_numel(shape) <= 1 for shape in shapes):
            op = "size_exchange"
        start = event.time_range.start
        where = next((name for name, span in regions if span.start <= start <= span.end), "other")
        counts[f"{op} @ {'layers' if where.startswith('layer') else where}"] += 1
    return dict(sorted(counts.items()))


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


# --------------------------------------------------------------------------- statistics


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), quantile(values, 0.1), quantile(values, 0.9)


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of the round's ratio: robust to load that shifts between rounds."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


# --------------------------------------------------------------------------- main


def interleaved_rounds(
    variants: list[Variant],
    loads: dict[str, Workloads],
    args: argparse.Namespace,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Warm up, then time every variant in every round, the order rotating by one each round."""
    for v in variants:
        timed_ms(loads[v.name].decode, 5, clock)
        timed_ms(loads[v.name].prefill, 2, clock)
    for round_ in range(args.rounds):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for v in order:
            v.decode_ms.append(timed_ms(loads[v.name].decode, args.decode_calls, clock))
        for v in order:
            v.prefill_ms.append(timed_ms(loads[v.name].prefill, args.prefill_calls, clock))


def check_parity(variants: list[Variant], loads: dict[str, Workloads]) -> tuple[dict, dict]:
    """Each variant's logits against the unsharded model's, and the greedy margin of the latter."""
    want = {"decode": loads["unsharded"].decode(), "prefill": loads["unsharded"].prefill()}
    margin = {}
    for kind, logits in want.items():
        top = logits[0, -1].topk(2).values
        margin[kind] = (top[0] - top[1]).item()
    parity = {}
    for v in variants:
        got = {"decode": loads[v.name].decode(), "prefill": loads[v.name].prefill()}
        length = loads[v.name].cache.get_seq_length()
        assert length == PREFIX, f"{v.name}: the decode step left {length} tokens in the cache, not {PREFIX}"
        parity[v.name] = {
            kind: {
                "max_abs_diff": (got[kind] - want[kind]).abs().max().item(),
                "same_next_token": bool(got[kind][0, -1].argmax() == want[kind][0, -1].argmax()),
            }
            for kind in want
        }
    return parity, margin


def host_only_timings(folder: Path, world: int, args: argparse.Namespace, inputs: tuple) -> dict:
    """Rank 0 alone: the variants rebuilt over a fake process group of ``world`` ranks, timed
    in this thread's CPU time (one thread does all the work; time spent descheduled while
    other processes run does not count)."""
    # Importing it registers the "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    variants = build_variants(build_reference(), folder, mesh)
    with torch.no_grad():
        loads = {v.name: Workloads(v.model, *inputs) for v in variants}
        interleaved_rounds(variants, loads, args, clock=time.thread_time)
    dist.destroy_process_group()
    return {v.name: {"decode": v.decode_ms, "prefill": v.prefill_ms} for v in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24, help="timed rounds (default 24)")
    parser.add_argument("--decode-calls", type=int, default=8, help="decode steps per variant per round")
    parser.add_argument("--prefill-calls", type=int, default=2, help="prefills per variant per round")
    parser.add_argument("--no-host-only", action="store_true", help="skip the fake-process-group timings")
    parser.add_argument("--json", type=Path, help="also write the results (rank 0) to this file")
    args = parser.parse_args()

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    started = time.perf_counter()

    # Rank 0 saves the checkpoint and lowers the modeling file into a folder all ranks read.
    shared = [tempfile.mkdtemp(prefix="hpgen_bench_") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    folder = Path(shared[0])
    reference = build_reference()
    if rank == 0:
        reference.save_pretrained(folder / "checkpoint")
        for name, plan in PLANS.items():
            lower_llama(plan, generated_file(folder, name))
    dist.barrier()

    variants = build_variants(reference, folder, mesh)
    attention = {v.name: v.model.config._attn_implementation for v in variants}
    assert len(set(attention.values())) == 1, f"the variants attend differently: {attention}"
    generator = torch.Generator().manual_seed(SEED + 1)
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, PREFILL), generator=generator)
    token = torch.randint(0, CONFIG["vocab_size"], (1, 1), generator=generator)

    with torch.no_grad():
        loads = {v.name: Workloads(v.model, prompt, token) for v in variants}
        parity, margin = check_parity(variants, loads)
        collectives = {
            v.name: {kind: count_collectives(v.model, getattr(loads[v.name], kind)) for kind in ("decode", "prefill")}
            for v in variants
        }
        interleaved_rounds(variants, loads, args)

    per_rank = [None] * world
    mine = {v.name: (v.decode_ms, v.prefill_ms, local_param_bytes(v.model)) for v in variants}
    dist.all_gather_object(per_rank, mine)
    dist.destroy_process_group()
    if rank != 0:
        return
    results = {
        "setup": setup_info(args, world, attention["unsharded"]),
        "timing_ms": {},  # per round, the slower rank: it is what the step costs
        "param_bytes": {},
        "collectives_per_forward": collectives,
        "parity": parity,
        "greedy_margin": margin,
    }
    for v in variants:
        decode = [max(ranks[v.name][0][i] for ranks in per_rank) for i in range(args.rounds)]
        prefill = [max(ranks[v.name][1][i] for ranks in per_rank) for i in range(args.rounds)]
        results["timing_ms"][v.name] = {"decode": decode, "prefill": prefill}
        results["param_bytes"][v.name] = [ranks[v.name][2] for ranks in per_rank]
    del variants, loads
    if not args.no_host_only:
        results["host_only_ms"] = host_only_timings(folder, world, args, (prompt, token))
    shutil.rmtree(folder, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - started
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def setup_info(args: argparse.Namespace, world: int, attention: str) -> dict[str, object]:
    return {
        "ranks": world,
        "backend": "gloo",
        "threads_per_rank": torch.get_num_threads(),
        "model": {**CONFIG, "attn_implementation": attention},
        "decode": f"batch 1, 1 token, KV cache of {PREFIX} tokens",
        "prefill": f"batch 1, {PREFILL} tokens",
        "rounds": args.rounds,
        "calls_per_round": {"decode": args.decode_calls, "prefill": args.prefill_calls},
        "plans": {name: str(path.relative_to(ROOT)) for name, path in PLANS.items()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": _cpu_model(),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs visible)"
    return platform.processor() or "unknown"


# --------------------------------------------------------------------------- the report


RATIOS = (  # (numerator, denominator, target)
    ("hpgen", "hand-written", "<= 1.05"),
    ("transformers", "hpgen", ">= 1.3 at decode"),
    ("transformers", "hpgen+vocab", "same layout as transformers"),
    ("hpgen+vocab", "hpgen", ""),
    ("hand-written", "unsharded", ""),
)


def timing_tables(
    timing: dict[str, dict[str, list[float]]], title: str, ratios: tuple[tuple[str, str, str], ...] = RATIOS
) -> list[str]:
    """Medians with p10-p90 per variant, then ``ratios`` (numerator, denominator, target)."""
    lines = [
        f"### {title}",
        "",
        "| variant | decode ms | p10-p90 | prefill ms | p10-p90 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, kinds in timing.items():
        d, p = summary(kinds["decode"]), summary(kinds["prefill"])
        lines.append(f"| {name} | {d[0]:.3f} | {d[1]:.3f}-{d[2]:.3f} | {p[0]:.2f} | {p[1]:.2f}-{p[2]:.2f} |")
    lines += ["", "| ratio | decode | prefill | target |", "|---|---:|---:|---|"]
    for a, b, target in ratios:
        cells = []
        for kind in ("decode", "prefill"):
            x, y = timing[a][kind], timing[b][kind]
            cells.append(f"{statistics.median(x) / statistics.median(y):.3f} ({paired_ratio(x, y):.3f})")
        lines.append(f"| {a} / {b} | {cells[0]} | {cells[1]} | {target} |")
    return lines + [""]


def report(results: dict) -> str:
    """Markdown (it reads fine in a terminal too)."""
    s = results["setup"]
    lines = [
        (
            f"{s['ranks']} ranks, {s['backend']}, {s['threads_per_rank']} thread a rank; {s['cpu']}; "
            f"python {s['python']}, torch {s['torch']}, transformers {s['transformers']}. Decode: {s['decode']}; "
            f"prefill: {s['prefill']}; {s['rounds']} rounds of {s['calls_per_round']['decode']} decode and "
            f"{s['calls_per_round']['prefill']} prefill calls per variant. Ratios: of the medians, and in brackets "
            "the median of the per-round ratios."
        ),
        "",
    ]
    lines += timing_tables(results["timing_ms"], "Time per call over gloo (slower rank per round)")
    if "host_only_ms" in results:
        title = "Host CPU time per call, no communication (fake process group, rank 0's thread CPU time)"
        lines += timing_tables(results["host_only_ms"], title)

    layers = s["model"]["num_hidden_layers"]
    lines += ["### Collectives per forward (profiler backend events, `op @ where`)", ""]
    lines += ["| variant | decode | prefill | all-reduces per decoder layer |", "|---|---|---|---:|"]
    for name, counts in results["collectives_per_forward"].items():
        decode = ", ".join(f"{k}: {n}" for k, n in counts["decode"].items()) or "none"
        prefill = ", ".join(f"{k}: {n}" for k, n in counts["prefill"].items()) or "none"
        per_layer = counts["decode"].get("all_reduce @ layers", 0) / layers
        lines.append(f"| {name} | {decode} | {'same' if prefill == decode else prefill} | {per_layer:g} |")

    full = results["param_bytes"]["unsharded"][0]
    lines += [
        "",
        "### Parameter bytes per rank",
        "",
        "| variant | rank 0 | rank 1 | of unsharded |",
        "|---|---:|---:|---:|",
    ]
    for name, per_rank in results["param_bytes"].items():
        lines.append(f"| {name} | {' | '.join(f'{n:,}' for n in per_rank)} | {per_rank[0] / full:.1%} |")

    margin = results["greedy_margin"]
    lines += [
        "",
        "### Logits against the unsharded model (rank 0)",
        "",
        f"The unsharded model's top-1 minus top-2 logit: decode {margin['decode']:.3f}, prefill {margin['prefill']:.3f}.",
        "",
        "| variant | decode max abs diff | prefill max abs diff | same greedy token (decode, prefill) |",
        "|---|---:|---:|---|",
    ]
    for name, kinds in results["parity"].items():
        same = ", ".join("yes" if kinds[k]["same_next_token"] else "NO" for k in ("decode", "prefill"))
        lines.append(
            f"| {name} | {kinds['decode']['max_abs_diff']:.2e} | {kinds['prefill']['max_abs_diff']:.2e} | {same} |"
        )
    lines += ["", f"Wall time of the benchmark: {results['wall_s']:.0f} s."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
