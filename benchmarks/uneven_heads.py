"""Heads that do not divide ``--tp``: what ``hpgen plan`` gives each rank of real models (no weights, no download).

    python benchmarks/uneven_heads.py

For each model (its published config values, written here) and tp size, the plan ``hpgen
plan`` writes and its sizing report (:func:`hpgen.planner.entry.sizing_report.size_report`, on the meta
device): the parameter bytes of every rank in bf16 and the largest as a share of the model,
the query heads each rank holds, and the slowest rank's share of the attention's FLOPs
against the even ``1 / tp``: of the score and value products (one per query head) and of
the attention's projections (the weight elements it holds). Seconds, not minutes.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    # name: (config class, published values, tp)
    "Falcon-7B": (
        "FalconConfig",
        dict(
            vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
            parallel_attn=True, bias=False, alibi=False, new_decoder_architecture=False,
        ),
        2,
    ),
    "Qwen2.5-7B": (
        "Qwen2Config",
        dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
        ),
        8,
    ),
    "Falcon-40B": (
        "FalconConfig",
        dict(
            vocab_size=65024, hidden_size=8192, num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8,
            new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False,
        ),
        8,
    ),
    "Qwen2-0.5B": (
        "Qwen2Config",
        dict(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
        ),
        4,
    ),
}


def _projection_share(model: Any, plan: dict[str, Any], tp: int) -> tuple[float, str] | None:
    """The largest share of one attention's projection weights a rank holds (their FLOPs per token), and the pattern."""
    from hpgen.core.plan import plan_from_dict
    from hpgen.core.shards import ShardLayout

    loaded = plan_from_dict(plan)
    for fqn, module in model.named_modules():
        entry = loaded.entry_for(fqn) if fqn else None
        name = type(module).__name__.lower()
        if entry is None or not ("attn" in name or "attention" in name) or not entry.params:
            continue
        held, total = [0] * tp, 0
        for param_name, layout in entry.params.items():
            param = module.get_parameter(param_name)
            if param.dim() != 2:
                continue
            total += param.numel()
            for rank in range(tp):
                shape = ShardLayout(tuple(param.shape), ((layout.on("tp"), rank, tp),)).local_shape
                held[rank] += shape[0] * shape[1]
        return (max(held) / total, fqn) if total else None
    return None


def main() -> None:
    import transformers

    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.entry.sizing_report import size_report

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    print("| model | tp | bytes per rank (bf16) | largest / model | query heads per rank | slowest rank, score and value "
          "products (even) | slowest rank, attention projections (even) |")
    print("|---|---|---|---|---|---|---|")
    for name, (cls, values, tp) in MODELS.items():
        model = meta_model(getattr(transformers, cls)(**values))
        plan = plan_model(model, tp=tp, name=name)
        report = size_report(model, plan, tp=tp, dtype="bfloat16")
        ranks = ", ".join(f"{b / 2**30:.3f}" for b in report.rank_bytes)
        largest = max(report.rank_bytes) / report.total_bytes
        held = next(iter(report.heads.values()), None)
        heads = ", ".join(map(str, held.query)) if held else "even"
        products = f"{held.busiest_share:.3f}" if held else f"{1 / tp:.3f}"
        projections = _projection_share(model, plan, tp)
        projected = f"{projections[0]:.3f}" if projections else "-"
        print(
            f"| {name} | {tp} | {ranks} GiB | {largest:.3f} | {heads} | {products} ({1 / tp:.3f}) | "
            f"{projected} ({1 / tp:.3f}) |"
        )


if __name__ == "__main__":
    main()
