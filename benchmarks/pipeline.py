"""Pipeline stages against one process: bubble, step time, parameter and activation bytes per rank.

    python benchmarks/pipeline.py [--rounds 3] [--microbatches 4 8 16]

An 8-layer Llama (hidden 128) trains one step on a batch of 16 sequences of 32 tokens:
in one process (the baseline), and cut by ``hpgen plan --pp``'s planner into 2 and 4 stages
on gloo ranks of this machine, with ``pipeline_step`` under GPipe and 1F1B at each
microbatch count. For each run:

- **bubble**: read from the timeline of the run: every stage's forward and backward of a
  microbatch is timed (``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``, wrapped
  for the benchmark), and the idle fraction is ``1 - busy / window`` averaged over the ranks,
  the window running from the first action's start to the last action's end on any rank
  (one machine: the clocks agree); next to the ideal ``(p - 1) / (m + p - 1)``;
- **step**: the median wall time of ``pipeline_step`` over the rounds (after one warm-up),
  and its ratio to the one-process step (loss and backward of the whole batch);
- **params**: the largest rank's parameter bytes over the model's, against ``1 / p`` of the
  layers plus the embedding's share;
- **activations**: the largest rank's peak of bytes saved for backward (tensors the autograd
  graph keeps, counted by a saved-tensors hook: added at each microbatch's forward, released
  at its backward), over the one-process step's.

On a small shared CPU machine the ranks time-share the cores (4 ranks on 2 cores inflate
each action), so the bubble is what to read, and step times say what this machine does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)
BATCH, LENGTH = 16, 32


def _data(vocab: int):
    ids = torch.randint(0, vocab, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:4, :16] = -100
    return ids, labels


class _Saved:
    """Bytes saved for backward, by microbatch: the live total's peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.current: list[int] | None = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.current is not None:
            size = tensor.numel() * tensor.element_size()
            self.current[0] += size
            self.live += size
            self.peak = max(self.peak, self.live)
        return tensor


def _instrument(saved: _Saved, timeline: list) -> None:
    """Time each stage action and count its saved bytes (the benchmark's process only)."""
    from torch.distributed.pipelining import stage

    cls = stage._PipelineStageBase
    forward, backward = cls.forward_one_chunk, cls.backward_one_chunk
    per_chunk: dict[tuple[int, int], list[int]] = {}

    def timed_forward(self, fwd_chunk_id, *args, **kwargs):
        per_chunk[(self.stage_index, fwd_chunk_id)] = saved.current = [0]
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = forward(self, fwd_chunk_id, *args, **kwargs)
        timeline.append(("F", start, time.perf_counter()))
        saved.current = None
        return out

    def timed_backward(self, bwd_chunk_id, *args, **kwargs):
        start = time.perf_counter()
        out = backward(self, bwd_chunk_id, *args, **kwargs)
        timeline.append(("B", start, time.perf_counter()))
        saved.live -= per_chunk.pop((self.stage_index, bwd_chunk_id), [0])[0]
        return out

    cls.forward_one_chunk, cls.backward_one_chunk = timed_forward, timed_backward


def _rank_run(rank: int, world: int, plan: dict, schedule: str, microbatches: int, rounds: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpgen.runtime import parallelize
    from hpgen.runtime.pipeline import pipeline_step

    torch.set_num_threads(1)
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    parallelize(model, plan, init_device_mesh("cpu", (world,), mesh_dim_names=("pp",)))
    model.train()
    ids, labels = _data(config.vocab_size)
    saved, timeline = _Saved(), []
    _instrument(saved, timeline)
    times, windows = [], []
    for round_ in range(rounds + 1):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        del timeline[:]
        saved.peak = saved.live = 0
        start = time.perf_counter()
        pipeline_step(model, input_ids=ids, labels=labels, microbatches=microbatches, schedule=schedule)
        if round_:  # the first is the warm-up
            times.append(time.perf_counter() - start)
            windows.append(list(timeline))
    return {
        "times": times,
        "timelines": windows,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "full_bytes": full_bytes,
        "saved_peak": saved.peak,
    }


def _baseline(rounds: int) -> tuple[float, int]:
    """One process: the median step time and the bytes saved for backward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    ids, labels = _data(config.vocab_size)
    saved = _Saved()
    times = []
    for round_ in range(rounds + 1):
        model.zero_grad(set_to_none=True)
        saved.current, saved.live, saved.peak = [0], 0, 0
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss = model(ids, labels=labels).loss
        loss.backward()
        if round_:
            times.append(time.perf_counter() - start)
    return statistics.median(times), saved.peak


def _bubble(timelines_by_rank: list[list[list]]) -> float:
    """1 - busy / window, averaged over ranks, then the median over rounds."""
    fractions = []
    for round_ in range(len(timelines_by_rank[0])):
        events = [timeline[round_] for timeline in timelines_by_rank]
        first = min(start for rank in events for _, start, _ in rank)
        last = max(end for rank in events for _, _, end in rank)
        busy = [sum(end - start for _, start, end in rank) for rank in events]
        fractions.append(statistics.mean(1 - b / (last - first) for b in busy))
    return statistics.median(fractions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()

    from transformers import LlamaConfig

    from hpgen.planner.model.load import meta_model
    from hpgen.planner.passes.pipeline_stages import add_pipeline, stage_cut
    from hpgen.verify.spawn import run_distributed

    base_time, base_saved = _baseline(args.rounds)
    layer_share = None
    print(f"one process: step {base_time * 1e3:.1f} ms, saved for backward {base_saved / 2**20:.2f} MiB")
    print("| p | schedule | m | bubble (timeline) | (p-1)/(m+p-1) | step ms | step / one process | params (max rank / model) | target | activations (max rank / one process) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pp in args.stages:
        cut = stage_cut(meta_model(LlamaConfig(**CONFIG)), pp)
        plan = add_pipeline(None, cut, "LlamaForCausalLM")
        total = sum(cut.params)
        embed = CONFIG["vocab_size"] * CONFIG["hidden_size"]
        layers = total - 2 * embed - CONFIG["hidden_size"]
        layer_share = (layers / pp + embed) / total  # 1/p of the layers + the embedding's share
        for schedule in ("GPipe", "1F1B"):
            for m in args.microbatches:
                runs = run_distributed(_rank_run, plan, schedule, m, args.rounds, world_size=pp, timeout=900)
                step = statistics.median(statistics.median(run["times"]) for run in runs)
                bubble = _bubble([run["timelines"] for run in runs])
                params = max(run["param_bytes"] for run in runs) / runs[0]["full_bytes"]
                saved = max(run["saved_peak"] for run in runs) / base_saved
                ideal = (pp - 1) / (m + pp - 1)
                print(
                    f"| {pp} | {schedule} | {m} | {bubble:.2f} | {ideal:.2f} | {step * 1e3:.1f} | {step / base_time:.2f} "
                    f"| {params:.2f} | {layer_share:.2f} | {saved:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
