"""Decode and prefill tokens/s on CUDA: hpgen, hand-written TP and transformers' tp_plan, eager and compiled.

    torchrun --nproc-per-node N benchmarks/gpu_decode.py [--layers 8] [--steps 64] [--json out.json]
    python benchmarks/gpu_decode.py --cpu-smoke      # 2 gloo ranks, a tiny model, a few steps
    torchrun --nproc-per-node N benchmarks/gpu_decode.py --model gpt_neox   # a parallel-residual model

With N GPUs, one rank a GPU over NCCL, tensor parallel over all N (one GPU: ``tp`` of size
1, every collective a no-op, still a comparison of the frameworks' overheads). A
Llama-shaped model (hidden 4096, 32 heads, 8 key/value heads, MLP 14336, vocab 32000,
``--layers`` layers) with random weights in bf16, SDPA attention, built three ways:

- ``hand-written``: transformers' Llama sliced by hand, an all-reduce after each attention
  and MLP block in forward hooks (gpt-fast style, :mod:`handwritten_tp`; compiled, the
  hooks return torch's functional ``all_reduce``);
- ``hpgen``: ``modeling_llama.py`` lowered under ``tests/plans/llama_tp.json``, parallelized;
- ``transformers``: ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``
  from a checkpoint rank 0 writes.

``--model gpt_neox``: a Pythia-6.9B-shaped GPT-NeoX instead (hidden 4096, 32 heads, MLP
16384, vocab 50432, parallel residual), hand-written with two all-reduces a layer
(:mod:`handwritten_parallel`, as vLLM's GPT-NeoX), and hpgen twice: ``hpgen`` with the
summed reduction (one all-reduce a layer) and ``hpgen two`` without it; both from
``hpgen plan --tp N``'s decoder-layer entries (embedding and ``lm_head`` replicated, as
hand-written).

Each runs eagerly (decode over a ``DynamicCache``) and compiled with
``torch.compile(mode="reduce-overhead")`` (CUDA graphs; decode over a ``StaticCache``,
``fullgraph=True`` except for transformers). Decode: batch 1, a ``--prompt``-token prefill,
then ``--steps`` greedy tokens, timed; prefill: batch 1, ``--prompt`` tokens, no cache.
One untimed round of every variant comes first (compiles, and recompiles one model's first
forward causes in another's graphs); then variants take turns in every round, and the report
gives the median tokens/s over rounds of the slower rank and the ratios side by side.

``--cpu-smoke`` runs the same code on 2 gloo ranks with a tiny float32 model, Dynamo's
``eager`` backend and a few steps, so that a test keeps this script working on machines
without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten_parallel import shard_parallel_residual_
from handwritten_tp import shard_llama_

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "tests/plans/llama_tp.json"

LLAMA = {  # Llama-3-8B's shapes, fewer layers by default
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
NEOX = {  # Pythia-6.9B's shapes, fewer layers by default
    "vocab_size": 50432,
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "num_attention_heads": 32,
    "max_position_embeddings": 4096,
    "use_parallel_residual": True,
    "tie_word_embeddings": False,
}
TINY_NEOX = {**NEOX, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
TINY_NEOX["max_position_embeddings"] = 128
SHAPES = {"llama": (LLAMA, TINY, "LlamaConfig", "LlamaForCausalLM"), "gpt_neox": (NEOX, TINY_NEOX, "GPTNeoXConfig", "GPTNeoXForCausalLM")}
FRAMEWORKS = {"llama": ("hand-written", "hpgen", "transformers"), "gpt_neox": ("hand-written", "hpgen", "hpgen two", "transformers")}


@dataclass
class Options:
    """What to run (the command line, or the smoke settings)."""

    layers: int = 8
    steps: int = 64
    prompt: int = 512
    rounds: int = 5
    smoke: bool = False
    backend: str = "inductor"
    mode: str | None = "reduce-overhead"
    folder: str = ""  # shared by the ranks: the generated file and the checkpoint
    model: str = "llama"  # or gpt_neox

    @property
    def config(self) -> dict[str, Any]:
        full, tiny, _, _ = SHAPES[self.model]
        return {**(tiny if self.smoke else full), "num_hidden_layers": self.layers}

    @property
    def classes(self) -> tuple[Any, Any]:
        _, _, config, model = SHAPES[self.model]
        return getattr(transformers, config), getattr(transformers, model)


@dataclass
class Variant:
    framework: str
    compiled: bool
    decode: Callable[[torch.Tensor], torch.Tensor]  # prompt -> the generated tokens
    prefill: Callable[[torch.Tensor], torch.Tensor]  # prompt -> logits
    decode_tps: list[float] = field(default_factory=list)
    prefill_tps: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.framework} {'compiled' if self.compiled else 'eager'}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_reference(options: Options, device: torch.device, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    config_class, model_class = options.classes
    config = config_class(**options.config, initializer_range=0.1)
    config._attn_implementation = "sdpa"
    with device:
        return model_class(config).to(dtype).eval()


def _generated(framework: str, options: Options) -> tuple[Path, Path]:
    """Where rank 0 lowers ``framework``'s file, and its plan."""
    path = Path(options.folder) / f"modeling_{options.model}_{framework.replace(' ', '_')}.py"
    return path, PLAN if options.model == "llama" else path.with_suffix(".json")


def lower_all(options: Options, reference: nn.Module) -> None:
    """Rank 0: the hpgen variants' files (and, for GPT-NeoX, their plans: ``hpgen plan``'s layer entries)."""
    if options.model == "llama":
        from tp_decode import lower_llama

        lower_llama(PLAN, _generated("hpgen", options)[0])
        return
    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.entry.make import plan_model

    world = dist.get_world_size()
    with torch.device("meta"):
        meta = type(reference)(reference.config)
    source = Path(sys.modules[type(reference).__module__].__file__)
    for framework, summed in (("hpgen", True), ("hpgen two", False)):
        plan = plan_model(meta, tp=world, name=options.model, summed=summed)
        plan["param_plan"] = {key: entry for key, entry in plan["param_plan"].items() if "*" in key}
        path, plan_path = _generated(framework, options)
        plan_path.write_text(json.dumps(plan))
        text = lower(source.read_text(), plan_from_dict(plan), source_name=source.name, package=infer_package(source))
        path.write_text(text)


def build(framework: str, reference: nn.Module, options: Options, mesh: Any, *, functional: bool) -> nn.Module:
    """The model of ``framework`` holding the reference's weights, on the reference's device."""
    device, dtype = reference.device, reference.dtype
    model_class = type(reference)
    if framework == "transformers":
        return model_class.from_pretrained(
            Path(options.folder) / "checkpoint",
            distributed_config=transformers.DistributedConfig(tp_plan="auto"),
            dtype=dtype,
            attn_implementation="sdpa",
        ).eval()
    if framework == "hand-written":
        with device:
            model = model_class(reference.config).to(dtype).eval()
        model.load_state_dict(reference.state_dict())
        shard = shard_llama_ if options.model == "llama" else shard_parallel_residual_
        return shard(model, mesh.get_group("tp"), functional=functional)
    import importlib.util

    from hpgen.runtime import parallelize

    path, plan = _generated(framework, options)
    spec = importlib.util.spec_from_file_location(f"_gpu_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    with device:
        model = getattr(module, model_class.__name__)(reference.config).to(dtype).eval()
    model.load_state_dict(reference.state_dict())
    return parallelize(model, plan, mesh)


def variant(framework: str, model: nn.Module, options: Options, *, compiled: bool) -> Variant:
    """Greedy decode of ``options.steps`` tokens after a prefill, and a cache-less prefill."""

    def step(token: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(token, cache=cache, use_cache=True).logits

    def whole(prompt: torch.Tensor) -> torch.Tensor:
        return model(prompt, use_cache=False).logits

    if compiled:
        fullgraph = framework != "transformers"
        kwargs = dict(fullgraph=fullgraph, backend=options.backend, mode=options.mode)
        if options.backend != "inductor":
            kwargs.pop("mode")
        step = torch.compile(step, **kwargs)
        whole = torch.compile(whole, **kwargs)
        cache = transformers.StaticCache(config=model.config, max_cache_len=options.prompt + options.steps)

    def decode(prompt: torch.Tensor) -> torch.Tensor:
        if compiled:
            cache.reset()
            logits = model(prompt, cache=cache, use_cache=True).logits  # the prefill stays eager
            current = cache
        else:
            output = model(prompt, use_cache=True)
            logits, current = output.logits, output.cache
        token = logits[:, -1:].argmax(-1)
        tokens = [token]
        for _ in range(options.steps - 1):
            token = step(token, current)[:, -1:].argmax(-1)  # read before the next replay overwrites it
            tokens.append(token)
        return torch.cat(tokens, dim=1)

    return Variant(framework, compiled, decode, whole)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    dist.barrier()
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def run_benchmark(rank: int, world: int, options: Options) -> dict[str, Any] | None:
    """The body of each rank (torchrun or ``tests.support.dist.run_distributed``); rank 0 returns the results."""
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cpu") if options.smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    dtype = torch.float32 if options.smoke else torch.bfloat16
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    reference = build_reference(options, device, dtype)
    if rank == 0:
        reference.save_pretrained(Path(options.folder) / "checkpoint")
        lower_all(options, reference)
    dist.barrier()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, options.config["vocab_size"], (1, options.prompt), generator=generator).to(device)

    variants, parity, compile_s = [], {}, {}
    with torch.no_grad():
        want = variant("unsharded", reference, options, compiled=False).decode(prompt)
        for framework in FRAMEWORKS[options.model]:
            eager_model = build(framework, reference, options, mesh, functional=False)
            compiled_model = (
                build(framework, reference, options, mesh, functional=True)
                if framework == "hand-written"
                else eager_model
            )
            for model, compiled in ((eager_model, False), (compiled_model, True)):
                v = variant(framework, model, options, compiled=compiled)
                started = time.perf_counter()
                tokens = v.decode(prompt)  # the first call compiles
                v.prefill(prompt)
                compile_s[v.name] = time.perf_counter() - started
                # greedy tokens agree with the unsharded model's as long as its choices are clear;
                # in bf16, a near tie may differ, so the report counts the agreeing prefix
                agree = (tokens == want).int().cumprod(dim=1).sum().item()
                parity[v.name] = int(agree)
                variants.append(v)
        del reference
        # one untimed round once every variant exists: a model's first forward changes state that
        # graphs compiled before it guard on (transformers' output-capturing registry), and the
        # recompile that follows belongs to no timed round
        for v in variants:
            v.decode(prompt)
            v.prefill(prompt)
        for index in range(options.rounds):
            order = variants[index % len(variants) :] + variants[: index % len(variants)]
            for v in order:
                v.decode_tps.append(options.steps / timed(lambda v=v: v.decode(prompt), device))
            for v in order:
                v.prefill_tps.append(options.prompt / timed(lambda v=v: v.prefill(prompt), device))
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, {v.name: (v.decode_tps, v.prefill_tps) for v in variants})
    if rank != 0:
        return None
    slowest = {  # the slower rank of each round: tokens/s is its
        name: {
            kind: [min(ranks[name][i][r] for ranks in per_rank) for r in range(options.rounds)]
            for i, kind in enumerate(("decode", "prefill"))
        }
        for name in per_rank[0]
    }
    return {
        "setup": {
            "ranks": world,
            "backend": dist.get_backend(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype),
            "model": {"model_type": options.model, **options.config},
            "steps": options.steps,
            "prompt": options.prompt,
            "rounds": options.rounds,
            "compile": {"backend": options.backend, "mode": options.mode},
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "tokens_per_s": slowest,
        "first_call_s": compile_s,
        "greedy_tokens_agreeing": parity,
    }


RATIOS = (
    ("hpgen compiled", "hand-written compiled"),
    ("hpgen eager", "hand-written eager"),
    ("hpgen compiled", "transformers compiled"),
    ("hpgen compiled", "hpgen eager"),
    ("hpgen eager", "hpgen two eager"),  # GPT-NeoX: one reduction a layer against two
    ("hpgen compiled", "hpgen two compiled"),
)


def report(results: dict[str, Any]) -> str:
    s = results["setup"]
    lines = [
        (
            f"{s['ranks']} ranks ({s['backend']}, {s['device']}, {s['dtype']}), torch {s['torch']}, transformers "
            f"{s['transformers']}; {s['model']['model_type']}-shaped, {s['model']['num_hidden_layers']} layers, random weights. "
            f"Decode: batch 1, {s['steps']} greedy tokens after a {s['prompt']}-token prompt; prefill: "
            f"{s['prompt']} tokens. Compiled: backend {s['compile']['backend']}, mode {s['compile']['mode']}. "
            f"Median over {s['rounds']} rounds (slower rank)."
        ),
        "",
        "| variant | decode tokens/s | prefill tokens/s | first call s | greedy tokens as unsharded |",
        "|---|---:|---:|---:|---:|",
    ]
    tps = results["tokens_per_s"]
    for name, kinds in tps.items():
        lines.append(
            f"| {name} | {statistics.median(kinds['decode']):.1f} | {statistics.median(kinds['prefill']):.0f} | "
            f"{results['first_call_s'][name]:.1f} | {results['greedy_tokens_agreeing'][name]} of {s['steps']} |"
        )
    lines += ["", "| tokens/s ratio | decode | prefill |", "|---|---:|---:|"]
    for a, b in RATIOS:
        if a not in tps or b not in tps:
            continue
        cells = [f"{statistics.median(tps[a][k]) / statistics.median(tps[b][k]):.3f}" for k in ("decode", "prefill")]
        lines.append(f"| {a} / {b} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def smoke_options(folder: str, model: str = "llama") -> Options:
    """The settings of ``--cpu-smoke``: tiny, float32, Dynamo's eager backend, a few steps."""
    return Options(
        layers=1, steps=2, prompt=8, rounds=1, smoke=True, backend="eager", mode=None, folder=folder, model=model
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64, help="greedy tokens decoded per round")
    parser.add_argument("--prompt", type=int, default=512, help="prompt (prefill) length")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu-smoke", action="store_true", help="2 gloo ranks, tiny model: checks the script runs")
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama", help="llama, or gpt_neox (parallel residual)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()
    torch._dynamo.config.cache_size_limit = 64
    if args.cpu_smoke and "RANK" not in os.environ:  # not under torchrun: spawn the 2 ranks here
        sys.path.insert(0, str(ROOT))
        from tests.support.dist import run_distributed

        with tempfile.TemporaryDirectory(prefix="hpgen_gpu_bench_") as folder:
            results = run_distributed(run_benchmark, smoke_options(folder, args.model), timeout=600)[0]
    else:
        dist.init_process_group("gloo" if args.cpu_smoke else "nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        shared = [tempfile.mkdtemp(prefix="hpgen_gpu_bench_") if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        options = (
            smoke_options(shared[0], args.model)
            if args.cpu_smoke
            else Options(args.layers, args.steps, args.prompt, args.rounds, folder=shared[0], model=args.model)
        )
        results = run_benchmark(rank, world, options)
        dist.destroy_process_group()
        if rank != 0:
            return
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
