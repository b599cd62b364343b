"""Parallelized models compile whole: ``torch.compile(fullgraph=True)``, eager's numbers.

Every plan form of the parity tests (tensor parallel, vocab-parallel embedding and
column-parallel ``lm_head``, sequence parallel on even and uneven lengths, toggle mode,
deferred biases, the generic form, expert-parallel regions) is built from its generated
file, parallelized over 2 gloo ranks and run eagerly and compiled on the same inputs:

- inference, run by ``torch._dynamo.explain`` (its graphs run as captured): one graph, no
  break, eager's logits, and the graph holds the plan's collectives and no size exchange
  (an all-gather of int64 sizes: a host synchronisation);
- training, the same for forward + backward: every parameter's gradient;
- for some, a decode loop over transformers' ``StaticCache``: one graph for every step
  (no recompilation), eager's logits.

``explain`` runs Dynamo alone; AOTAutograd (``aot_eager``) compiles the training step of
the sequence-parallel case once more, and the default backend, Inductor, compiles one
small case: it generates and builds C++, the slowest part of this file.

One spawn of 2 processes runs every case (``FORMS``); each test checks one property.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.models import load_plan_dict, lower_family


@dataclass(frozen=True)
class CompileCase:
    """One model and plan, and what to compile on it."""

    name: str
    family: str
    generated: str  # path of the generated file
    plan: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 7
    train: bool = False  # also trace forward + backward and compare every gradient
    decode_steps: int = 0  # also decode these many tokens over a StaticCache, compiled
    backend: str | None = None  # also compile inference with this backend ("inductor")
    train_backend: str | None = None  # compile training with this backend ("aot_eager"), not explain


@dataclass
class CompileResult:
    """What one rank measured for one :class:`CompileCase` (picklable)."""

    graph_breaks: int  # over the traces explain ran (fullgraph=True compiles cannot break)
    graphs: list[int]  # graphs of each trace or compiled function
    break_reasons: list[str]
    collectives: dict[str, int]  # in the inference graph: op -> count ("size_exchange" apart)
    logits_err: float
    tol: float
    grad_failures: list[str]
    grads_checked: int
    decode_err: float | None
    decode_graphs: int | None  # graphs compiled for all the decode steps (fullgraph: no break)


ONE_LAYER = {"num_hidden_layers": 1}  # where the plan allows: half the tracing
TRAIN = {"train": True}

# name: (family, plan, lowering mode, config overrides, case options)
FORMS: dict[str, tuple[str, str, str, dict[str, Any], dict[str, Any]]] = {
    # attention heads and MLP columns/rows sharded: 2 all-reduces per layer (of one: the 2-layer stream is
    # llama_sp_uneven's)
    "llama_tp": ("llama", "llama_tp", "default", ONE_LAYER, {}),
    # a plan like docs/plan-format.md's example: + vocab-parallel embedding (all-reduce) and column-parallel
    # lm_head (a gather whose sizes follow from out_features)
    "llama_spec": ("llama", "llama_spec", "default", ONE_LAYER, TRAIN),
    # the vocab plan lowered in toggle mode (``if self.tp_enable:`` blocks around the same ops)
    "llama_vocab_toggle": ("llama", "llama_tp_vocab", "toggle", ONE_LAYER, {}),
    # + sequence parallel over 2 layers: 7 tokens split 4 + 3 (a decode step's 1 token: 1 + 0; training
    # through AOTAutograd), and, in one layer, 8 split 4 + 4
    "llama_sp_uneven": (
        "llama",
        "llama_tp_sp",
        "default",
        {},
        {**TRAIN, "train_backend": "aot_eager", "decode_steps": 3},
    ),
    "llama_sp_even": ("llama", "llama_tp_sp_one_layer", "default", ONE_LAYER, {**TRAIN, "seq_len": 8}),
    # sharded biases; o_proj and down_proj biases deferred, added by a hook after the reduction
    "llama_bias": ("llama", "llama_bias", "default", {**ONE_LAYER, "attention_bias": True, "mlp_bias": True}, {}),
    # attention in the generic form, lm_head R -> P through DTensor
    "llama_generic": ("llama", "llama_generic", "default", ONE_LAYER, TRAIN),
    # per-head q_norm/k_norm (gradients all-reduced by tensor hooks), vocab-parallel embedding
    "qwen3_tp": ("qwen3", "qwen3_tp", "default", ONE_LAYER, {}),
    # experts in the region form (experts_parallel, transformers' default grouped_mm kernel)
    "qwen3_moe_ep": ("qwen3_moe", "qwen3_moe_tp_ep", "default", ONE_LAYER, TRAIN),
    # the default backend, Inductor, on the uneven sequence-parallel plan of one layer
    "llama_sp_inductor": ("llama", "llama_tp_sp_one_layer", "default", ONE_LAYER, {"backend": "inductor"}),
}


# --------------------------------------------------------------------------- on the ranks


def _graph_collectives(graphs: list[Any]) -> dict[str, int]:
    """Functional collectives in Dynamo's graphs (``wait_tensor`` aside); an all-gather of
    int64 values is a size exchange, counted apart."""
    import torch

    counts: dict[str, int] = {}
    for graph_module in graphs:
        for module in graph_module.modules():  # autograd Functions trace into submodules
            if not isinstance(module, torch.fx.GraphModule):
                continue
            for node in module.graph.nodes:
                namespace, _, op = str(node.target).partition(".")
                if node.op != "call_function" or namespace != "_c10d_functional" or op.startswith("wait_tensor"):
                    continue
                kind = op.split(".")[0].removesuffix("_into_tensor").removesuffix("_tensor").removesuffix("_single")
                value = node.args[0].meta.get("example_value") if node.args else None
                if kind == "all_gather" and value is not None and value.dtype == torch.int64:
                    kind = "size_exchange"
                counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def _explained(fn: Any, *args: Any) -> tuple[Any, Any]:
    """``fn(*args)`` run by ``torch._dynamo.explain`` (its graphs run eagerly), and the report."""
    import torch

    torch._dynamo.reset()
    result = []
    report = torch._dynamo.explain(lambda *a: result.append(fn(*a)))(*args)
    torch._dynamo.reset()
    return result[0], report


class _Counting:
    """A ``torch.compile`` backend that counts the graphs it is given, then hands them on."""

    def __init__(self, backend: str) -> None:
        import torch

        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, graph_module: Any, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return self.backend(graph_module, example_inputs)


def _decode(model: Any, config: Any, prompt: Any, steps: int, step: Any) -> list[Any]:
    """Logits of ``steps`` one-token decode steps after an eager prefill of ``prompt``, over
    a StaticCache. The tokens fed are the prompt's own, so every run sees the same inputs."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=prompt.shape[1] + steps)
    model(prompt, cache=cache, use_cache=True)
    return [step(prompt[:, i : i + 1], cache).clone() for i in range(steps)]


def _grad_failures(model: Any, want: dict[str, Any]) -> list[str]:
    from tests.support.models import tolerance

    failures = []
    for name, param in model.named_parameters():
        err, tol = (param.grad - want[name]).abs().max().item(), tolerance(want[name])
        if not err <= tol:
            failures.append(f"{name}: {err:.3g} > {tol:.3g}")
    return failures


def run_case(case: CompileCase, mesh: Any) -> CompileResult:
    """Eager, then compiled, on one rank; what the tests check."""
    import torch

    from hpgen.runtime import parallelize
    from tests.support.models import generated_model, import_file, make_config, reference_model, tolerance

    config = make_config(case.family, **case.config)
    model = generated_model(
        import_file(case.generated), case.family, config, reference_model(case.family, config, seed=0)
    )
    parallelize(model, case.plan, mesh)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, case.seq_len), generator=generator)
    projection = torch.randn((2, case.seq_len, config.vocab_size), generator=generator)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return model(ids).logits

    def loss(ids: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
        return (model(ids).logits * projection).sum()

    # inference: explain's graphs run it (no autograd node: the collectives' no-grad path)
    with torch.no_grad():
        eager = logits(ids)
        compiled, report = _explained(logits, ids)
        if case.backend is not None:
            compiled = torch.compile(logits, fullgraph=True, backend=case.backend)(ids)
        breaks, graphs = report.graph_break_count, [report.graph_count]
        reasons = [str(reason.reason)[:400] for reason in report.break_reasons]
        collectives = _graph_collectives(report.graphs)
        logits_err, tol = (compiled - eager).abs().max().item(), tolerance(eager)

    # training: forward + backward through the traced autograd Functions (explain), or
    # compiled with fullgraph=True by a backend that runs AOTAutograd too
    failures, checked = [], 0
    if case.train:
        loss(ids, projection).backward()
        want = {name: p.grad.clone() for name, p in model.named_parameters()}
        checked = len(want)
        model.zero_grad()
        if case.train_backend is not None:
            backend = _Counting(case.train_backend)
            torch.compile(loss, fullgraph=True, backend=backend)(ids, projection).backward()
            graphs.append(backend.graphs)
        else:
            value, report = _explained(loss, ids, projection)
            value.backward()
            breaks, graphs = breaks + report.graph_break_count, [*graphs, report.graph_count]
            reasons += [str(reason.reason)[:400] for reason in report.break_reasons]
        failures = _grad_failures(model, want)
        model.zero_grad()

    decode_err = decode_graphs = None
    if case.decode_steps:

        def step(token: torch.Tensor, cache: Any) -> torch.Tensor:
            return model(token, cache=cache, use_cache=True).logits

        prompt = ids[:1]
        with torch.no_grad():
            want = _decode(model, config, prompt, case.decode_steps, step)
            torch._dynamo.reset()
            backend = _Counting("eager")
            got = _decode(model, config, prompt, case.decode_steps, torch.compile(step, fullgraph=True, backend=backend))
        decode_err = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
        decode_graphs = backend.graphs
        tol = max(tol, *(tolerance(w) for w in want))
    torch._dynamo.reset()
    return CompileResult(
        breaks, graphs, reasons, collectives, logits_err, tol, failures, checked, decode_err, decode_graphs
    )


def run_cases(rank: int, world_size: int, cases: list[CompileCase]) -> dict[str, CompileResult]:
    """Rank body for ``run_distributed``: every case on a 1-D ``tp`` mesh over both ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.config.cache_size_limit = 64  # many models, one process
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return {case.name: run_case(case, mesh) for case in cases}


# --------------------------------------------------------------------------- the tests


def _plan(name: str) -> dict[str, Any]:
    """A plan of tests/plans; ``llama_tp_sp_one_layer``: llama_tp_sp for a model of one layer."""
    if name == "llama_tp_sp_one_layer":
        plan = load_plan_dict("llama_tp_sp")
        del plan["param_plan"]["model.layers.1"]
        return plan
    return load_plan_dict(name)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, CompileResult]]:
    directory = tmp_path_factory.mktemp("compile")
    cases = []
    for name, (family, plan, mode, config, options) in FORMS.items():
        generated = lower_family(family, _plan(plan), directory, mode=mode).rename(directory / f"{name}.py")
        cases.append(CompileCase(name, family, str(generated), _plan(plan), config, **options))
    return run_distributed(run_cases, cases, timeout=600)


@pytest.mark.parametrize("name", FORMS)
def test_compiles_whole(results: list[dict[str, CompileResult]], name: str) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert result.graph_breaks == 0 and set(result.graphs) == {1}, f"rank {rank}: {result.break_reasons}"


@pytest.mark.parametrize("name", FORMS)
def test_compiled_logits_are_eager_ones(results: list[dict[str, CompileResult]], name: str) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert result.logits_err <= result.tol, f"rank {rank}: {result.logits_err} > {result.tol}"


@pytest.mark.parametrize("name", [name for name, form in FORMS.items() if form[4].get("train")])
def test_compiled_gradients_are_eager_ones(results: list[dict[str, CompileResult]], name: str) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert result.grads_checked > 0
        assert not result.grad_failures, f"rank {rank}: " + "; ".join(result.grad_failures)


@pytest.mark.parametrize("name", [name for name, form in FORMS.items() if form[4].get("decode_steps")])
def test_compiled_static_cache_decode(results: list[dict[str, CompileResult]], name: str) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert result.decode_graphs == 1, f"rank {rank}: {result.decode_graphs} graphs (recompiled)"
        assert result.decode_err is not None and result.decode_err <= result.tol, f"rank {rank}: {result.decode_err}"


def test_graphs_hold_the_plans_collectives_and_no_size_exchange(results: list[dict[str, CompileResult]]) -> None:
    sp = {"all_reduce": 1, "all_gather": 2 * 2 + 2, "reduce_scatter": 2 * 2}  # 2 layers
    sp_one_layer = {"all_reduce": 1, "all_gather": 2 + 2, "reduce_scatter": 2}
    expected = {
        "llama_tp": {"all_reduce": 2},  # 1 layer
        # + the embedding's all-reduce and lm_head's gather (1 layer)
        "llama_spec": {"all_reduce": 2 + 1, "all_gather": 1},
        "llama_vocab_toggle": {"all_reduce": 2 + 1, "all_gather": 1},
        # the embedding's all-reduce; split at layer 0; per layer 2 gathers and 2 reduce-scatters;
        # the norm's and lm_head's gathers: each gather's sizes come from the split, the
        # reduce-scatters or out_features
        "llama_sp_uneven": sp,
        "llama_sp_even": sp_one_layer,
        "llama_sp_inductor": sp_one_layer,
        "qwen3_moe_ep": {"all_reduce": 2},  # attention and experts
    }
    for by_case in results:
        for name, counts in expected.items():
            assert by_case[name].collectives == counts, name
        for name, result in by_case.items():
            assert "size_exchange" not in result.collectives, name
