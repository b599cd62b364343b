"""One reduction a parallel-residual layer: decode and prefill of GPT-NeoX, GPT-J, Phi and Falcon over 2 gloo ranks.

    torchrun --nproc-per-node 2 benchmarks/parallel_residual.py [--rounds 12] [--compile] [--json out.json]

One torchrun, one thread a rank, CPU. For each architecture (hidden 256, 8 heads,
4 layers, fp32, SDPA; multi-query Falcon also with 7 heads, hidden 224, cut 4/3) the same
seeded weights are built as:

- ``unsharded``: transformers' model on every rank;
- ``hand-written``: sliced by hand, the attention and the MLP each all-reducing its output
  (two all-reduces a layer, as vLLM's GPT-NeoX, GPT-J and Phi; :mod:`handwritten_parallel`);
- ``hpgen summed``: the modeling file lowered under ``hpgen plan --tp 2``'s layers, with the
  summed reduction (one all-reduce a layer in forward);
- ``hpgen two``: the same with ``--no-summed-reduction`` (two a layer, the hand-written layout);
- ``transformers``: ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``.

The hpgen plans keep only the decoder layers' entries (embedding and ``lm_head`` replicated,
as in the hand-written baseline): like with like. With ``--compile`` the hand-written and
hpgen variants also run under ``torch.compile(fullgraph=True)`` (decode over a StaticCache).
Decode: batch 1, one token, a KV cache of 32 tokens cropped back after every step; prefill:
batch 1, 128 tokens. Variants take turns in every round; the tables give the median over
rounds of the slower rank and p10-p90. Collectives are counted from torch.profiler's
backend events (``gloo:all_reduce``, ...) over one call.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten_parallel import shard_parallel_residual_
from tp_compile import Run, compiled_run, count_collectives, eager_run, interleaved
from tp_decode import PREFILL, SEED, timing_tables

MODELS = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=256, num_attention_heads=8, num_hidden_layers=4, intermediate_size=1024, use_parallel_residual=True,
    )),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=256, n_head=8, n_layer=4, n_inner=1024, rotary_dim=16)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(
        hidden_size=256, num_attention_heads=8, num_hidden_layers=4, intermediate_size=1024,
    )),
    # Falcon-40B/180B's layout: grouped key/value heads in one fused query_key_value, two norms
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(
        hidden_size=256, num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True, num_hidden_layers=4,
        ffn_hidden_size=1024,
    )),
    # Falcon-7B's layout (transformers' default): multi-query, one key/value head in the fused [queries | key |
    # value]; with 8 heads (4 a rank) and 7 (4 and 3: hpgen's B(0, ...) with S(0,32), whole heads)
    "falcon_mq": ("FalconConfig", "FalconForCausalLM", dict(
        hidden_size=256, num_attention_heads=8, num_hidden_layers=4, ffn_hidden_size=1024,
    )),
    "falcon_mq7": ("FalconConfig", "FalconForCausalLM", dict(
        hidden_size=224, num_attention_heads=7, num_hidden_layers=4, ffn_hidden_size=1024,
    )),
}  # fmt: skip
NO_TP_PLAN = ("falcon", "falcon_mq", "falcon_mq7")  # transformers 5.24 has no tp_plan for these
COMMON = dict(vocab_size=1024, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)


def build_reference(model_type: str) -> nn.Module:
    config_name, class_name, options = MODELS[model_type]
    torch.manual_seed(SEED)
    config = getattr(transformers, config_name)(**options, **COMMON)
    config._attn_implementation = "sdpa"
    return getattr(transformers, class_name)(config).eval()


def layer_plan(model_type: str, *, summed: bool) -> dict[str, Any]:
    """``hpgen plan``'s plan for the reference's config, its decoder layers' entries only."""
    from hpgen.planner.entry.make import plan_model

    reference = build_reference(model_type)
    with torch.device("meta"):
        meta = type(reference)(reference.config)
    plan = plan_model(meta, tp=2, name=model_type, summed=summed)
    plan["param_plan"] = {key: entry for key, entry in plan["param_plan"].items() if "*" in key}
    return plan


def lower_into(model_type: str, plan: dict[str, Any], out: Path) -> None:
    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict

    source = Path(sys.modules[type(build_reference(model_type)).__module__].__file__)
    out.write_text(lower(source.read_text(), plan_from_dict(plan), source_name=source.name, package=infer_package(source)))


def build(name: str, model_type: str, folder: Path, mesh: Any, *, functional: bool = False) -> nn.Module:
    reference = build_reference(model_type)
    if name == "unsharded":
        return reference
    if name == "hand-written":
        return shard_parallel_residual_(reference, mesh.get_group("tp"), functional=functional)
    if name == "transformers":
        config = transformers.DistributedConfig(tp_plan="auto")
        return type(reference).from_pretrained(
            folder / f"{model_type}_checkpoint", distributed_config=config, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
    stem = f"{model_type}_{name.replace(' ', '_')}"
    return build_generated(reference, folder / f"{stem}.py", json.loads((folder / f"{stem}.json").read_text()), mesh)


_IMPORTS = itertools.count()


def build_generated(reference: nn.Module, generated: Path, plan: dict[str, Any], mesh: Any) -> nn.Module:
    """The generated file's class of ``reference`` with its weights, parallelized."""
    from hpgen.runtime import parallelize

    name = f"_bench_{generated.stem}_{next(_IMPORTS)}"
    spec = importlib.util.spec_from_file_location(name, generated)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # transformers looks classes' modules up
    spec.loader.exec_module(module)
    model = getattr(module, type(reference).__name__)(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    return parallelize(model, plan, mesh)


EAGER = ("unsharded", "hand-written", "hpgen summed", "hpgen two", "transformers")
COMPILED = ("hand-written", "hpgen summed", "hpgen two")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--decode-calls", type=int, default=8)
    parser.add_argument("--prefill-calls", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--compile", action="store_true", help="also torch.compile(fullgraph=True) the TP variants")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    started = time.perf_counter()
    load = [os.getloadavg()]
    shared = [tempfile.mkdtemp(prefix="hpgen_pr_") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    folder = Path(shared[0])
    model_types = args.models.split(",")
    if rank == 0:
        for model_type in model_types:
            build_reference(model_type).save_pretrained(folder / f"{model_type}_checkpoint")
            for name, summed in (("hpgen_summed", True), ("hpgen_two", False)):
                plan = layer_plan(model_type, summed=summed)
                (folder / f"{model_type}_{name}.json").write_text(json.dumps(plan))
                lower_into(model_type, plan, folder / f"{model_type}_{name}.py")
    dist.barrier()

    generator = torch.Generator().manual_seed(SEED + 1)
    prompt = torch.randint(0, COMMON["vocab_size"], (1, PREFILL), generator=generator)
    token = torch.randint(0, COMMON["vocab_size"], (1, 1), generator=generator)
    results: dict[str, Any] = {"models": {}, "args": vars(args) | {"json": str(args.json)}}
    for model_type in model_types:
        with torch.no_grad():
            names = [name for name in EAGER if not (name == "transformers" and model_type in NO_TP_PLAN)]
            runs: list[Run] = [eager_run(name, build(name, model_type, folder, mesh), prompt, token) for name in names]
            if args.compile:
                torch._dynamo.reset()
                for name in COMPILED:
                    model = build(name, model_type, folder, mesh, functional=True)
                    runs.append(compiled_run(name, model, prompt, token, args.backend, None))
            want = {"decode": runs[0].decode(), "prefill": runs[0].prefill()}
            parity = {run.name: {k: (getattr(run, k)() - v).abs().max().item() for k, v in want.items()} for run in runs}
            collectives = {run.name: {k: count_collectives(getattr(run, k)) for k in want} for run in runs}
            interleaved(runs, args.rounds, args.decode_calls, args.prefill_calls)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {run.name: (run.decode_ms, run.prefill_ms) for run in runs})
        timing = {
            run.name: {
                kind: [max(ranks[run.name][index][i] for ranks in gathered) for i in range(args.rounds)]
                for index, kind in enumerate(("decode", "prefill"))
            }
            for run in runs
        }
        results["models"][model_type] = {
            "timing_ms": timing,
            "collectives": collectives,
            "parity": parity,
            "compile": {run.name: run.info for run in runs if run.compiled},
        }
    dist.destroy_process_group()
    if rank != 0:
        return
    shutil.rmtree(folder, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - started
    results["load_average"] = [*load, os.getloadavg()]  # (1, 5, 15 min) at the start and at the end
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


RATIOS = (
    ("hpgen summed eager", "hand-written eager", "<= 0.75 at decode"),
    ("hpgen summed eager", "hpgen two eager", ""),
    ("hpgen two eager", "hand-written eager", ""),
    ("transformers eager", "hpgen summed eager", ""),
)
COMPILED_RATIOS = (
    ("hpgen summed compiled", "hand-written compiled", ""),
    ("hpgen summed compiled", "hpgen two compiled", ""),
)


def report(results: dict[str, Any]) -> str:
    lines = []
    for model_type, measured in results["models"].items():
        timing = measured["timing_ms"]
        ratios = RATIOS + (COMPILED_RATIOS if "hpgen summed compiled" in timing else ())
        ratios = tuple(r for r in ratios if r[0] in timing and r[1] in timing)  # no transformers row without a tp_plan
        lines += timing_tables(timing, f"{model_type}: time per call over gloo (slower rank per round)", ratios)
        lines += ["| variant | collectives per decode step | per prefill | max abs diff decode / prefill |", "|---|---|---|---|"]
        for name, counts in measured["collectives"].items():
            decode = ", ".join(f"{k}: {n}" for k, n in counts["decode"].items()) or "none"
            prefill = ", ".join(f"{k}: {n}" for k, n in counts["prefill"].items()) or "none"
            diff = measured["parity"][name]
            lines.append(f"| {name} | {decode} | {prefill} | {diff['decode']:.1e} / {diff['prefill']:.1e} |")
        for name, info in measured["compile"].items():
            graphs = {k: (v["graphs"], v["graph_breaks"]) for k, v in info.items() if isinstance(v, dict)}
            lines.append(f"\n{name}: (graphs, breaks) {graphs}")
        lines.append("")
    start, end = (", ".join(f"{v:.1f}" for v in load) for load in results["load_average"])
    lines.append(f"Wall time: {results['wall_s']:.0f} s; load average {start} at the start, {end} at the end.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
