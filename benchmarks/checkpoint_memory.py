"""Peak memory and load time of loading a Llama checkpoint: unsharded, transformers' tp_plan, hpgen.

    python benchmarks/checkpoint_memory.py [--layers 10] [--rounds 2] [--json out.json]
    python benchmarks/checkpoint_memory.py --gb 0.7 2 4 --variants "transformers tp_plan" hpgen
    python benchmarks/checkpoint_memory.py --gb 0.7 2 4 --variants "transformers tp_plan" hpgen --baseline ../main

``--gb`` gives checkpoint sizes (the layer count that comes closest to each); ``--layers``
takes several counts too; each size is one table, then one line per size with hpgen's
load time over ``tp_plan``'s. ``--variants`` runs only those (the ratio needs
``transformers tp_plan``; the memory columns ``transformers``). ``--baseline DIR`` also
runs hpgen imported from the source tree ``DIR`` (another checkout) as ``hpgen, baseline``,
so that a change is measured against the code before it in the same run.

Writes a random Llama-shaped checkpoint (fp32 safetensors, sharded files as transformers
writes them; nothing downloaded) to a temporary folder, then loads it, each variant in
fresh processes (gloo, one thread a rank), one forward included:

- ``transformers``: ``LlamaForCausalLM.from_pretrained(folder)`` in one process;
- ``transformers tp_plan``: ``from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))``
  on 2 ranks (transformers' own TP loader, which shards on read);
- ``hpgen``: ``hpgen.runtime.from_pretrained(generated.LlamaForCausalLM, folder,
  "tests/plans/llama_tp_vocab.json", mesh)`` on 2 ranks (the same layout as transformers');
- ``hpgen, whole model first``: the generated class's own ``from_pretrained`` on every
  rank, then ``parallelize`` (what the README did before ``from_pretrained`` existed);
- ``hpgen, baseline``: ``hpgen`` with the ranks importing hpgen from ``--baseline``.

The time to the first logits (loading and one forward) is also reported: a loader that
leaves its parameters as lazy views of the mapped files (transformers' does, for every
slice) reads the weights from the page cache, or the disk, in that first forward.
Memory is each process's peak resident set (``VmHWM``, which counts mapped file pages
that were touched) above its resident set just before loading (``/proc/self/clear_refs``
resets the peak there), over loading and one forward. Load time is the wall time of the
loading call and its CPU time (user + system, all threads: copies and page faults),
each the slower rank's; on a shared machine the CPU time is the steadier of the two.
Minor page faults of the loading call (the slower rank's) count the fresh pages copies
fill and the file pages mapped.
Each variant runs ``--rounds`` times in turn; the table gives medians. Logits of the
forward are compared with the unsharded model's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "tests/plans/llama_tp_vocab.json"
VARIANTS = {  # name -> ranks
    "transformers": 1,
    "transformers tp_plan": 2,
    "hpgen": 2,
    "hpgen, baseline": 2,  # hpgen from another source tree (--baseline): before and after in one run
    "hpgen, whole model first": 2,
}


def llama_config(layers: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


# --------------------------------------------------------------------------- worker (one process)


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _cpu_s() -> float:
    """User + system CPU seconds of this process, all threads (page faults and copies are system time)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _minor_faults() -> int:
    """Minor page faults of this process so far: each fresh page a copy fills, each file page mapped."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker(variant: str, checkpoint: str, generated: str, out: str) -> None:
    import importlib.util

    import torch
    import torch.distributed as dist
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    ranks = VARIANTS[variant]
    rank = 0
    if ranks > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import from_pretrained, parallelize

    spec = importlib.util.spec_from_file_location("_bench_generated_llama", generated)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",)) if ranks > 1 else None
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
    if dist.is_initialized():
        dist.barrier()

    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now
    before = _status("VmRSS")
    cpu_started = _cpu_s()
    faults_started = _minor_faults()
    started = time.perf_counter()
    if variant == "transformers":
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
    elif variant == "transformers tp_plan":
        config = transformers.DistributedConfig(tp_plan="auto")
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, distributed_config=config)
    elif variant in ("hpgen", "hpgen, baseline"):
        model = from_pretrained(module.LlamaForCausalLM, checkpoint, PLAN, mesh)
    else:
        model = module.LlamaForCausalLM.from_pretrained(checkpoint)
        parallelize(model, PLAN, mesh)
    load_s = time.perf_counter() - started
    load_cpu_s = _cpu_s() - cpu_started
    load_faults = _minor_faults() - faults_started
    with torch.no_grad():
        logits = model.eval()(ids).logits
    first_s = time.perf_counter() - started  # a loader that maps lazily reads the weights here
    peak = _status("VmHWM") - before
    if rank == 0:
        torch.save(logits, f"{out}.logits.pt")
    result = {
        "peak_bytes": peak,
        "load_s": load_s,
        "load_cpu_s": load_cpu_s,
        "load_faults": load_faults,
        "first_logits_s": first_s,
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- parent


def write_checkpoint(folder: Path, layers: int) -> int:
    """A random Llama in ``folder`` (transformers' ``save_pretrained``, 300MB files); returns its bytes."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(layers))
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(folder, max_shard_size="300MB")
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def lower_llama(out: Path) -> None:
    import transformers

    from hpgen.generator.lower import lower
    from hpgen.core.plan import load_plan

    source = Path(transformers.models.llama.modeling_llama.__file__)
    out.write_text(
        lower(source.read_text(), load_plan(PLAN), source_name=source.name, package="transformers.models.llama")
    )


def run_variant(
    variant: str, checkpoint: Path, generated: Path, folder: Path, tag: str, baseline: Path | None = None
) -> dict:
    out = folder / tag
    source = baseline if variant == "hpgen, baseline" else ROOT  # whose hpgen the ranks import
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(source)}
    script = [str(Path(__file__).resolve()), "--worker", variant, "--checkpoint", str(checkpoint)]
    script += ["--generated", str(generated), "--out", str(out)]
    ranks = VARIANTS[variant]
    if ranks == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), *script]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    per_rank = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]
    return {
        "peak_bytes": [r["peak_bytes"] for r in per_rank],
        "load_s": max(r["load_s"] for r in per_rank),
        "load_cpu_s": max(r["load_cpu_s"] for r in per_rank),
        "load_faults": max(r["load_faults"] for r in per_rank),
        "first_logits_s": max(r["first_logits_s"] for r in per_rank),
        "logits": f"{out}.logits.pt",
    }


LAYER_BYTES = 4 * (2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 1024 * 2816 + 2 * 1024)  # fp32, llama_config's sizes
FIXED_BYTES = 4 * (2 * 32000 * 1024 + 1024)  # embedding, lm_head, final norm


def layers_for(gigabytes: float) -> int:
    """The decoder layer count whose checkpoint comes closest to ``gigabytes`` (10**9 bytes)."""
    return max(1, round((gigabytes * 1e9 - FIXED_BYTES) / LAYER_BYTES))


def measure(layers: int, rounds: int, names: list[str], baseline: Path | None = None) -> dict:
    """Write a checkpoint of ``layers`` layers, load it with each variant ``rounds`` times in turn; medians."""
    import torch

    with tempfile.TemporaryDirectory(prefix="hpgen_ckpt_bench_") as tmp:
        folder = Path(tmp)
        checkpoint = folder / "checkpoint"
        size = write_checkpoint(checkpoint, layers)
        generated = folder / "modeling_llama_tp_vocab.py"
        lower_llama(generated)
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for round_ in range(rounds):
            for name in names:
                tag = f"{name.replace(' ', '_').replace(',', '')}_{round_}"
                runs[name].append(run_variant(name, checkpoint, generated, folder, tag, baseline))
        first = names[0]  # the logits reference: the unsharded load when it ran
        reference = torch.load(runs[first][0]["logits"])
        results = {"checkpoint_bytes": size, "layers": layers, "rounds": rounds, "reference": first, "variants": {}}
        for name, items in runs.items():
            ranks = VARIANTS[name]
            peaks = [statistics.median(item["peak_bytes"][r] for item in items) for r in range(ranks)]
            logits_err = max((torch.load(item["logits"]) - reference).abs().max().item() for item in items)
            results["variants"][name] = {
                "ranks": ranks,
                "peak_bytes_per_rank": peaks,
                "load_s": statistics.median(item["load_s"] for item in items),
                "load_s_all": [item["load_s"] for item in items],
                "load_cpu_s": statistics.median(item["load_cpu_s"] for item in items),
                "load_faults": statistics.median(item["load_faults"] for item in items),
                "first_logits_s": statistics.median(item["first_logits_s"] for item in items),
                "first_logits_s_all": [item["first_logits_s"] for item in items],
                "logits_err": logits_err,
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--layers", type=int, nargs="+", default=[10], help="decoder layers (10: about 0.73 GB in fp32)")
    sizes.add_argument("--gb", type=float, nargs="+", help="checkpoint sizes in GB, e.g. 0.7 2 4")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant (median reported)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="also run hpgen from this source tree (e.g. a worktree of main) as 'hpgen, baseline'",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--generated", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.checkpoint, args.generated, args.out)
        return
    counts = [layers_for(gb) for gb in args.gb] if args.gb else args.layers
    names = [name for name in VARIANTS if name in args.variants and name != "hpgen, baseline"]
    if args.baseline:
        names.append("hpgen, baseline")
    every = []
    for layers in counts:
        results = measure(layers, args.rounds, names, args.baseline)
        every.append(results)
        print(report(results), flush=True)
        print(flush=True)
    if len(every) > 1 and {"hpgen", "transformers tp_plan"} <= set(names):
        print(scaling(every))
    if args.json:
        args.json.write_text(json.dumps(every if len(every) > 1 else every[0], indent=1))


def scaling(every: list[dict]) -> str:
    """One line per size: hpgen's load time over transformers' tp_plan's (wall, CPU, to the first
    logits), minor faults and peak memory per rank; the baseline tree's too when it ran."""
    baseline = "hpgen, baseline" in every[0]["variants"]
    lines = [
        "| layers | checkpoint MiB | hpgen load s | tp_plan load s | × tp_plan (wall) | × tp_plan (CPU) "
        "| × tp_plan (to first logits) | minor faults per rank, hpgen / tp_plan | peak per rank MiB, hpgen / tp_plan |"
        + (" baseline × tp_plan (wall / CPU / to first logits) | baseline faults, peak MiB |" if baseline else "")
    ]
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if baseline else ""))
    for results in every:
        variants = results["variants"]
        ours, theirs = variants["hpgen"], variants["transformers tp_plan"]
        line = (
            f"| {results['layers']} | {results['checkpoint_bytes'] / 2**20:,.0f} | {ours['load_s']:.2f} | "
            f"{theirs['load_s']:.2f} | {_ratios(ours, theirs)} | "
            f"{ours['load_faults'] / 1000:,.0f}k / {theirs['load_faults'] / 1000:,.0f}k | "
            f"{_peak(ours):,.0f} / {_peak(theirs):,.0f} |"
        )
        if baseline:
            before = variants["hpgen, baseline"]
            line += f" {_ratios(before, theirs, ' / ')} | {before['load_faults'] / 1000:,.0f}k, {_peak(before):,.0f} |"
        lines.append(line)
    return "\n".join(lines)


def _ratios(item: dict, base: dict, between: str = " | ") -> str:
    """Load time (wall, CPU) and time to the first logits of ``item`` over ``base``'s."""
    keys = ("load_s", "load_cpu_s", "first_logits_s")
    return between.join(f"{item[key] / base[key]:.2f}" for key in keys)


def _peak(item: dict) -> float:
    return max(item["peak_bytes_per_rank"]) / 2**20


def report(results: dict) -> str:
    variants = results["variants"]
    unsharded = variants.get("transformers")
    base = max(unsharded["peak_bytes_per_rank"]) if unsharded else None
    tp = variants.get("transformers tp_plan")
    tp_load = tp["load_s"] if tp else None
    tp_cpu = tp["load_cpu_s"] if tp else None
    mib = 2**20
    lines = [
        f"Random Llama, {results['layers']} layers, {results['checkpoint_bytes'] / mib:,.0f} MiB of fp32 safetensors; "
        f"peak RSS growth per rank over loading + one forward; median of {results['rounds']} runs",
        "",
        "| variant | ranks | peak RSS per rank (MiB) | × unsharded | load s (wall) | × tp_plan | "
        "load CPU s | × tp_plan | minor faults | to first logits s | × tp_plan | max logits diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tp_first = tp["first_logits_s"] if tp else None
    for name, item in variants.items():
        peak = max(item["peak_bytes_per_rank"])
        per_rank = " / ".join(f"{p / mib:,.0f}" for p in item["peak_bytes_per_rank"])
        lines.append(
            f"| {name} | {item['ranks']} | {per_rank} | {_ratio(peak, base)} | {item['load_s']:.2f} | "
            f"{_ratio(item['load_s'], tp_load)} | {item['load_cpu_s']:.2f} | {_ratio(item['load_cpu_s'], tp_cpu)} | "
            f"{item['load_faults'] / 1000:,.0f}k | {item['first_logits_s']:.2f} | {_ratio(item['first_logits_s'], tp_first)} | {item['logits_err']:.1e} |"
        )
    return "\n".join(lines)


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


if __name__ == "__main__":
    main()
