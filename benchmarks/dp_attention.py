"""Decode and prefill of a 4-layer Qwen3-MoE under data-parallel attention + EP, ``--ep`` alone and TP + EP.

    python benchmarks/dp_attention.py [--ranks 2 4] [--rounds 5] [--json out.json] [--baseline main]

One run; for each rank count, gloo ranks forked on the CPU, one thread a rank. The model:
hidden 256, 4 layers, 8 heads (4 key/value), 8 experts (top 2, intermediate 128), vocab
1024, float32, sdpa, transformers' default experts kernel. Every layout serves the same
work per step, one sequence per rank (``N`` sequences on ``N`` ranks):

- ``dp-attn+ep`` (``hpgen plan --ep N --attn-dp``, served: each rank its own sequence): the
  decoder stack on 1 sequence, the experts gathering every rank's tokens;
- ``ep`` (``hpgen plan --ep N``): every rank runs the whole stack on all ``N`` sequences,
  the experts sharded and their output all-reduced;
- ``tp+ep`` (``hpgen plan --tp N --ep N``): attention tensor-parallel and the experts
  sharded on the same axis, all ``N`` sequences on every rank.

A decode step is one token per sequence with a cache of 32 tokens (cropped back after each
step); a prefill is 128 tokens per sequence, no cache. Time per step: the median over
rounds of the slower rank's mean. Collectives per step: torch.profiler's backend events
(``gloo:*``), with the elements they carried (their input shapes: a gather's input is one
rank's piece); an all-gather of one element is the size exchange before a gather of shards
only their senders know. Parameter bytes: what each rank holds after ``parallelize``.

``--baseline REV`` also runs the same benchmark on hpgen as of git revision ``REV`` (its
``hpgen`` and ``templates``, exported to a temporary folder put first on the path of a
child run of this script, before this run) and prints the size exchanges per step side by
side.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from torch.profiler import ProfilerActivity, profile

CONFIG = dict(
    vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=512,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512, tie_word_embeddings=False,
)
PREFIX, PREFILL, CALLS = 32, 128, 3
LAYOUTS = ("dp-attn+ep", "ep", "tp+ep")


def plan_for(layout: str, ranks: int) -> tuple[dict[str, Any], str]:
    """The plan document and its one axis."""
    from hpgen.planner.passes.data_parallel_attention import data_parallel_attention
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    meta = meta_model(transformers.Qwen3MoeConfig(**CONFIG))
    if layout == "tp+ep":
        return plan_model(meta, tp=ranks, ep=ranks), "tp"
    plan = plan_model(meta, ep=ranks)
    if layout == "dp-attn+ep":  # served: each rank's batch is its shard, given back as it is
        plan = data_parallel_attention(meta, plan, "qwen3_moe")
        entry = plan["param_plan"]["model"]
        entry["in_src"], entry["out_dst"] = dict(entry["in_dst"]), dict(entry["out_src"])
    return plan, "ep"


def lower_to(plan: dict[str, Any], out: Path) -> None:
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict

    source = Path(transformers.models.qwen3_moe.modeling_qwen3_moe.__file__)
    text = lower(source.read_text(), plan_from_dict(plan, name="plan.json"), source_name=source.name,
                 package="transformers.models.qwen3_moe")
    out.write_text(text)


def _collectives(step) -> tuple[int, int, int]:
    """(collectives, size exchanges, elements carried) of one call of ``step``."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    count = exchanges = elements = 0
    for event in prof.events():
        backend, _, op = event.name.partition(":")
        if backend != "gloo" or op == "barrier":
            continue
        numel = sum(math.prod(shape) for shape in event.input_shapes if shape)
        if op == "all_gather" and numel <= 1:
            exchanges += 1
        else:
            count += 1
            elements += numel
    return count, exchanges, elements


def _rank(rank: int, ranks: int, store_dir: str, files: dict[str, str], plans: dict, rounds: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), ranks)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**CONFIG)
    reference = transformers.Qwen3MoeForCausalLM(config).eval()
    found = {}
    for layout in LAYOUTS:
        plan, axis = plans[layout]
        spec = importlib.util.spec_from_file_location(f"_bench_dp_{layout.replace('+', '_')}", files[layout])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        model = module.Qwen3MoeForCausalLM(config).eval()
        model.load_state_dict(reference.state_dict())
        mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=(axis,))
        parallelize(model, plan, mesh, check_inputs=layout != "dp-attn+ep")
        batch = 1 if layout == "dp-attn+ep" else ranks  # the same N sequences per step in all layouts
        gen = torch.Generator().manual_seed(rank if layout == "dp-attn+ep" else 0)
        prompt = torch.randint(0, CONFIG["vocab_size"], (batch, PREFILL), generator=gen)
        with torch.no_grad():
            cache = model(prompt[:, :PREFIX], use_cache=True).past_key_values
            token = prompt[:, PREFIX : PREFIX + 1]

            def decode():
                model(token, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # back to the prefix: every step sees the same cache

            def prefill():
                model(prompt)

            row = {"param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
            for name, step in (("decode", decode), ("prefill", prefill)):
                step()  # warm
                times = []
                for _ in range(rounds):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(CALLS):
                        step()
                    mine = torch.tensor([(time.perf_counter() - start) / CALLS * 1e3])
                    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
                    times.append(mine.item())
                row[f"{name}_ms"] = statistics.median(times)
                row[f"{name}_collectives"] = _collectives(step)
        found[layout] = row
        dist.barrier()
    if rank == 0:
        out[ranks] = found
    dist.destroy_process_group()


def baseline(rev: str, ranks: list[int], rounds: int) -> dict[str, Any]:
    """This benchmark's results on hpgen as of ``rev`` (a child run with that tree first on its path)."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, "hpgen", "templates"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        # the installed package finds its templates as hpgen.templates: put that revision's there
        (Path(tmp) / "templates").rename(Path(tmp) / "hpgen" / "templates")
        out = Path(tmp) / "baseline.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, __file__, "--ranks", *map(str, ranks), "--rounds", str(rounds),
                        "--json", str(out)], check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--baseline", metavar="REV", help="also run hpgen as of this git revision")
    args = parser.parse_args()
    import hpgen

    before = baseline(args.baseline, args.ranks, args.rounds) if args.baseline else None
    print(f"hpgen from {Path(hpgen.__file__).parent}")
    results: dict[int, dict] = {}
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            plans = {layout: plan_for(layout, ranks) for layout in LAYOUTS}
            files = {}
            for layout, (plan, _) in plans.items():
                files[layout] = str(Path(tmp) / f"gen_{layout.replace('+', '_')}.py")
                lower_to(plan, Path(files[layout]))
            out = mp.Manager().dict()
            mp.start_processes(_rank, args=(ranks, tmp, files, plans, args.rounds, out), nprocs=ranks,
                               start_method="fork")
            results[ranks] = dict(out)[ranks]
    print(f"Qwen3-MoE, 4 layers, hidden 256, 8 experts (top 2), float32, gloo on the CPU; one sequence per rank a step")
    print(f"decode: 1 token per sequence, cache {PREFIX}; prefill: {PREFILL} tokens per sequence; "
          "collectives per step (size exchanges), elements carried")
    print()
    header = "| ranks | layout | decode ms | prefill ms | decode collectives | prefill collectives | param bytes / rank |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for ranks, found in results.items():
        base = found["ep"]
        for layout in LAYOUTS:
            row = found[layout]
            cells = []
            for name in ("decode", "prefill"):
                n, x, e = row[f"{name}_collectives"]
                cells.append(f"{n} ({x}), {e:,}")
            ratio = lambda key: f"{row[key]:.2f} ({row[key] / base[key]:.2f}x)"  # noqa: E731
            print(f"| {ranks} | {layout} | {ratio('decode_ms')} | {ratio('prefill_ms')} | {cells[0]} | {cells[1]} | "
                  f"{row['param_bytes']:,} ({row['param_bytes'] / base['param_bytes']:.2f}x) |")
    print("\n(x): against --ep alone on the same ranks.")
    if before is not None:
        print(f"\nSize exchanges per step (one all-gather of an int64 per rank, a host sync on GPUs): "
              f"hpgen {args.baseline} -> this tree, same run")
        print()
        print("| ranks | layout | decode exchanges | prefill exchanges | decode ms | prefill ms |")
        print("|---|---|---|---|---|---|")
        for ranks, found in results.items():
            for layout in LAYOUTS:
                row, old = found[layout], before[str(ranks)][layout]
                cells = [f"{old[f'{name}_collectives'][1]} -> {row[f'{name}_collectives'][1]}" for name in ("decode", "prefill")]
                times = [f"{old[f'{name}_ms']:.2f} -> {row[f'{name}_ms']:.2f}" for name in ("decode", "prefill")]
                print(f"| {ranks} | {layout} | {cells[0]} | {cells[1]} | {times[0]} | {times[1]} |")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
