"""What the random streams and the input check cost: a model's forward with and without them.

    python benchmarks/random_streams.py [--rounds 15] [--layers 4] [--hidden 256] [--tokens 64]

One process over a fake process group of 2 ranks (collectives return at once), so only the
host cost of hpgen's mechanism shows: a Llama lowered with its ``hpgen plan --tp 2`` plan,
parallelized twice, once as ``parallelize`` does it (streams, input check) and once with
both left out. Variants take turns round by round. Rows: eval forward under ``no_grad``
(what inference pays), a train-mode forward and backward with every dropout at zero (what
training without dropout pays), and the same with ``attention_dropout`` 0.1 (the streams
switching at every body).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def build(directory: Path, layers: int, hidden: int) -> tuple[Any, dict, Any]:
    import transformers

    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, max_position_embeddings=256,
    )  # fmt: skip
    plan = plan_model(meta_model(config), tp=2, name="llama")
    source = Path(inspect.getsourcefile(transformers.models.llama.modeling_llama) or "")
    text = lower(source.read_text(), plan_from_dict(plan), source_name=source.name, package=infer_package(source))
    path = directory / "gen_llama_streams.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module, plan, config


def variant(module: Any, plan: dict, config: Any, mesh: Any, state: dict, *, mechanism: bool) -> Any:
    import hpgen.runtime.install.parallelize as install
    from hpgen.runtime import parallelize

    model = module.LlamaForCausalLM(copy.deepcopy(config))
    model.load_state_dict(state)
    saved = install.install_streams
    if not mechanism:
        install.install_streams = lambda *args, **kwargs: None  # the model as before the streams existed
    try:
        parallelize(model, plan, mesh, check_inputs=mechanism)
    finally:
        install.install_streams = saved
    return model


def timed(step: Any) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with tempfile.TemporaryDirectory() as folder:
        module, plan, config = build(Path(folder), args.layers, args.hidden)
        torch.manual_seed(0)
        state = module.LlamaForCausalLM(config).state_dict()
        models = {
            name: variant(module, plan, config, mesh, state, mechanism=name == "with") for name in ("with", "without")
        }
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1))

    def eval_forward(model: Any) -> Any:
        def run() -> None:
            with torch.no_grad():
                model(input_ids=ids)

        return run

    def train_step(model: Any, dropout: float) -> Any:
        def run() -> None:
            model.config.attention_dropout = dropout
            for layer in model.model.layers:
                layer.self_attn.attention_dropout = dropout
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    rows = {
        "eval forward (no_grad)": lambda m: (m.eval(), eval_forward(m))[1],
        "train forward+backward, dropout 0": lambda m: (m.train(), train_step(m, 0.0))[1],
        "train forward+backward, attention_dropout 0.1": lambda m: (m.train(), train_step(m, 0.1))[1],
    }
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.tokens} tokens, tp 2 over a fake process group")
    print(f"median of {args.rounds} rounds (variants take turns); ratio = with / without the streams and input check\n")
    print("| what | with (ms) | without (ms) | ratio of medians | median of ratios |")
    print("|---|---|---|---|---|")
    for title, make in rows.items():
        steps = {name: make(model) for name, model in models.items()}
        for step in steps.values():  # warm-up (and the input check's first forwards)
            for _ in range(4):
                step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        order = list(steps)
        for round_ in range(args.rounds):
            for name in order[round_ % 2 :] + order[: round_ % 2]:
                times[name].append(timed(steps[name]))
        with_, without = statistics.median(times["with"]), statistics.median(times["without"])
        ratios = statistics.median(a / b for a, b in zip(times["with"], times["without"]))
        print(f"| {title} | {with_ * 1e3:.2f} | {without * 1e3:.2f} | {with_ / without:.3f} | {ratios:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
