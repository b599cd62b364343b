"""Where each variant's decode step spends its host time, by layer of the stack.

    pip install pyinstrument
    python benchmarks/profile_decode.py [--rounds 10] [--steps 15] [--workload decode|prefill]

One process, no torchrun: the variants of ``tp_decode.py`` are built over a *fake* process
group of 2 ranks (this process is rank 0; collectives return at once), so what is measured
is host work only. pyinstrument samples the steps, and each sample's innermost frame is put
in one bucket by its file:

- kernels: built-in functions (``linear``, ``cat``, ``mean``, ...: the ATen calls);
- model code: the modeling file (transformers' or the generated one), cache, masks, rotary;
- nn.Module calls: ``torch/nn/modules/module.py`` (``_call_impl``, hooks dispatch);
- hpgen runtime: ``hpgen/runtime/`` (the collectives the generated forwards call);
- hand-written hooks: ``benchmarks/handwritten_tp.py``;
- transformers TP: ``transformers/distributed/`` (its per-Linear forward wrappers);
- c10d: ``torch/distributed/distributed_c10d.py`` and its logger (``dist.all_reduce``);
- DTensor: the rest of ``torch/distributed/`` (DTensor, functional collectives, device
  mesh) and the glue its dispatch goes through (pytree, custom ops, ``autograd.Function.apply``,
  the dynamo-disable wrappers);
- other.

The shares are the result. The totals are wall time with the profiler on: its per-call
hook and, on a shared machine, time spent descheduled inflate them (a preemption lands at
a random point, so it does not bias the shares); ``tp_decode.py`` gives the real host
times. Standard-library frames (``contextlib``, ``functools``, ...) count for the bucket
of the code that called them: transformers' context managers are transformers TP. The
variants take turns (``--rounds`` rounds of ``--steps`` steps each), as load on a shared
machine drifts; sampling at 1 ms gives a few thousand samples per variant.

Then it times one MLP block alone, the hand-written one (forward hook) against hpgen's
generated one, with the runtime as it is and with the no-grad ``all_reduce`` of
:class:`NoGradFastPath` (a subclass defined here, not in the runtime): the cost of one
boundary, and what that change to ``hpgen/runtime/forward/collectives.py`` would save.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hpgen.runtime.forward.collectives import AxisCollectives

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_decode

BUCKETS = (  # (bucket, substrings of the frame's file path), first match wins
    ("hpgen runtime", ("/hpgen/runtime/",)),
    ("hand-written hooks", ("handwritten_tp.py",)),
    ("transformers TP", ("/transformers/distributed/",)),
    ("c10d", ("distributed_c10d.py", "c10d_logger.py")),
    (
        "DTensor",  # and the glue its dispatch goes through
        (
            "/torch/distributed/",
            "/torch/utils/_pytree",
            "/torch/_library/",
            "/torch/_ops.py",
            "/torch/autograd/function.py",
            "/torch/_dynamo/",
            "/torch/_compile.py",
            "/torch/_opaque_base.py",
            "/torch/utils/_debug_mode",
        ),
    ),
    ("nn.Module calls", ("/torch/nn/modules/module.py",)),
    ("model code", ("/transformers/", "modeling_llama_", "/torch/nn/")),
)
ORDER = ("kernels", *(name for name, _ in BUCKETS), "other")
STDLIB = sysconfig.get_paths()["stdlib"]


def bucket_of(frame, caller: str) -> str:
    """The bucket of ``frame``; ``caller`` is its caller's bucket."""
    if frame.is_synthetic:  # "[self]" and the like: the time of the parent's own code
        return caller
    path, function = frame.file_path or "", frame.function or ""
    if not path or path.startswith("<") or function.startswith("<built-in"):
        return "kernels"
    for name, needles in BUCKETS:
        if any(needle in path for needle in needles):
            return name
    if path.startswith(STDLIB) and "site-packages" not in path:
        return caller
    return "other"


def self_times(frame, totals: dict[str, float], caller: str = "other") -> None:
    """Add each frame's own time (its time less its children's) to its bucket."""
    bucket = bucket_of(frame, caller)
    own = frame.time - sum(child.time for child in frame.children)
    totals[bucket] += max(own, 0.0)
    for child in frame.children:
        self_times(child, totals, bucket)


class NoGradFastPath(AxisCollectives):
    """The change proposed for ``AxisCollectives.all_reduce`` (measured here, installed nowhere).

    Without autograd, ``all_reduce(sum)`` is one clone and one ``dist.all_reduce``: no
    per-call validation, move record, dispatch table or second ownership check. (The same
    fast path for ``copy``, which cloned its input, is in the runtime since commit 0232cc1.)
    """

    def all_reduce(self, x, op="sum", *, backward="identity"):
        if x is None or self.size == 1 or op != "sum" or (torch.is_grad_enabled() and x.requires_grad):
            return super().all_reduce(x, op, backward=backward)
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=self.group)
        return out


def boundary_costs(variants: list, rounds: int = 60, calls: int = 50) -> list[str]:
    """Microseconds of thread CPU time per call of layer 0's MLP: hand-written vs hpgen.

    The contenders take turns; each one's best round is its cost (what is left when no
    other process got in the way: the usual estimator for a micro-benchmark).
    """
    handwritten = {v.name: v.model for v in variants}["hand-written"].model.layers[0].mlp
    generated = {v.name: v.model for v in variants}["hpgen"].model.layers[0].mlp
    current = generated._hp_tp
    fast = NoGradFastPath(current.group, current.name)

    def with_axis(axis: AxisCollectives) -> Callable[[torch.Tensor], torch.Tensor]:
        def call(x):
            generated._hp_tp = axis
            try:
                return generated(x)
            finally:
                generated._hp_tp = current

        return call

    contenders = {
        "hand-written (forward hook)": handwritten,
        "hpgen, runtime as it is": with_axis(current),
        "hpgen, NoGradFastPath": with_axis(fast),
    }
    lines = ["", "One MLP block (layer 0), us of thread CPU time per call (best of interleaved rounds)", ""]
    lines += ["| block | decode [1, 1, 256] | prefill [1, 128, 256] |", "|---|---:|---:|"]
    results = {name: [] for name in contenders}
    for tokens in (1, tp_decode.PREFILL):
        x = torch.randn(1, tokens, tp_decode.CONFIG["hidden_size"])
        samples = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, block in contenders.items():
                block(x)
                start = time.thread_time()
                for _ in range(calls):
                    block(x)
                samples[name].append((time.thread_time() - start) / calls * 1e6)
        for name in contenders:
            results[name].append(min(samples[name]))
    for name, (decode, prefill) in results.items():
        lines.append(f"| {name} | {decode:.1f} | {prefill:.1f} |")
    return lines


def main() -> None:
    from pyinstrument import Profiler
    from torch.testing._internal.distributed.fake_pg import FakeStore

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=15, help="steps per variant per round")
    parser.add_argument("--workload", choices=("decode", "prefill"), default="decode")
    args = parser.parse_args()

    torch.set_num_threads(1)
    tp_decode.transformers.utils.logging.disable_progress_bar()
    os.environ.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")  # transformers reads these
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    generator = torch.Generator().manual_seed(tp_decode.SEED + 1)
    prompt = torch.randint(0, tp_decode.CONFIG["vocab_size"], (1, tp_decode.PREFILL), generator=generator)
    token = torch.randint(0, tp_decode.CONFIG["vocab_size"], (1, 1), generator=generator)

    rows = {}
    with tempfile.TemporaryDirectory(prefix="hpgen_profile_") as name, torch.no_grad():
        folder = Path(name)
        reference = tp_decode.build_reference()
        reference.save_pretrained(folder / "checkpoint")
        for variant, plan in tp_decode.PLANS.items():
            tp_decode.lower_llama(plan, tp_decode.generated_file(folder, variant))
        variants = tp_decode.build_variants(reference, folder, mesh)
        steps = {v.name: getattr(tp_decode.Workloads(v.model, prompt, token), args.workload) for v in variants}
        profilers = {v.name: Profiler(interval=0.001) for v in variants}
        for round_ in range(args.rounds + 1):  # round 0 warms up, unprofiled
            for name, step in steps.items():
                if round_:
                    profilers[name].start()
                for _ in range(args.steps):
                    step()
                if round_:
                    profilers[name].stop()
        for name, profiler in profilers.items():
            totals = dict.fromkeys(ORDER, 0.0)
            self_times(profiler.last_session.root_frame(), totals)
            rows[name] = {bucket: seconds / (args.rounds * args.steps) * 1e3 for bucket, seconds in totals.items()}
        boundary = boundary_costs(variants)
    dist.destroy_process_group()

    used = [bucket for bucket in ORDER if any(row[bucket] > 0.005 for row in rows.values())]
    print(
        f"Host time per {args.workload} step by bucket (share; ms of profiled wall time; fake process group, rank 0)\n"
    )
    print("| variant | total | " + " | ".join(used) + " |")
    print("|---|---:|" + "---:|" * len(used))
    for variant, row in rows.items():
        total = sum(row.values())
        print(f"| {variant} | {total:.2f} | " + " | ".join(f"{row[b] / total:.0%} ({row[b]:.2f})" for b in used) + " |")
    print("\n".join(boundary))


if __name__ == "__main__":
    main()
