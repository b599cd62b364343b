"""A summed block with two norms moved as a pair compiles whole, and gives the unsharded model's numbers.

GPT-NeoX (``use_parallel_residual``: ``x + attn(ln1(x)) + mlp(ln2(x))``) under ``hpgen plan --tp 2``,
with and without ``--sp``, on 2 gloo ranks; ``torch.compile(fullgraph=True)`` of:

- inference (``torch._dynamo.explain``, whose graphs run as captured): one graph, no break, the
  unsharded model's logits, and one reduction a layer in the graph;
- a training step compiled by AOTAutograd (``aot_eager``): the unsharded model's gradients (this
  rank's slice of each), and its backward graph reduces once a layer: the two norms' outputs
  still move as one pair when traced (the fallback, each norm moving its own, would give two).

The eager runs of the same plans are in ``test_parity_derived.py``.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from tests.support.derived_configs import tiny
from tests.support.dist import run_distributed

LAYERS = 2  # the tiny config's
CASES = {"gpt_neox": False, "gpt_neox_sp": True}  # case -> sequence parallel
SEQ = 8  # even over 2 ranks: the sequence-parallel plan splits it


def _lowered(case: str, directory: Path) -> tuple[dict, str]:
    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import meta_model, model_class_for
    from hpgen.planner.entry.make import plan_model

    config = tiny("gpt_neox")
    plan = plan_model(meta_model(config), tp=2, sp=CASES[case], from_source=True, name="gpt_neox")
    pairs = [entry["summed_reduction"].get("paired_input") for entry in plan["param_plan"].values() if "summed_reduction" in entry]
    assert pairs and set(pairs) == {"post_attention_layernorm"}, pairs  # (with --sp, one entry a layer)
    source = Path(inspect.getsourcefile(model_class_for(config)) or "")
    path = directory / f"{case}_compiled.py"
    path.write_text(lower(source.read_text(), plan_from_dict(plan), source_name=source.name, package=infer_package(source)))
    return plan, str(path)


class _Graphs:
    """An ``aot_eager`` backend that keeps the forward and backward graphs it is given."""

    def __init__(self) -> None:
        from torch._dynamo.backends.common import aot_autograd

        self.forward: list[Any] = []
        self.backward: list[Any] = []
        self.backend = aot_autograd(fw_compiler=self._keep(self.forward), bw_compiler=self._keep(self.backward))

    @staticmethod
    def _keep(into: list[Any]) -> Any:
        def compiler(graph_module: Any, example_inputs: list[Any]) -> Any:
            into.append(graph_module)
            return graph_module.forward

        return compiler


def _collectives(graphs: list[Any]) -> dict[str, int]:
    """Functional collectives in traced graphs (``wait_tensor`` aside), by kind."""
    import torch

    counts: dict[str, int] = {}
    for graph_module in graphs:
        for module in graph_module.modules():
            if not isinstance(module, torch.fx.GraphModule):
                continue
            for node in module.graph.nodes:
                namespace, _, op = str(node.target).partition(".")
                if node.op == "call_function" and namespace == "_c10d_functional" and not op.startswith("wait_tensor"):
                    kind = op.split(".")[0].removesuffix("_into_tensor").removesuffix("_tensor")
                    counts[kind] = counts.get(kind, 0) + 1
    return counts


def _run(case: str, plan: dict, generated: str, mesh: Any) -> dict[str, Any]:
    import torch

    from hpgen.planner.model.load import model_class_for
    from hpgen.runtime import parallelize
    from tests.support.models import expected_shard, import_file, param_layouts, perturb_, tolerance

    config = tiny("gpt_neox")
    cls = model_class_for(config)
    torch.manual_seed(0)
    reference = cls(config)
    perturb_(reference, 0)
    reference.eval()
    model = getattr(import_file(generated), cls.__name__)(config)
    model.load_state_dict(reference.state_dict())
    model.eval()
    parallelize(model, plan, mesh)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=generator)
    projection = torch.randn((2, SEQ, config.vocab_size), generator=generator)

    with torch.no_grad():
        want = reference(ids).logits
        torch._dynamo.reset()
        got: list[Any] = []
        report = torch._dynamo.explain(lambda ids: got.append(model(ids).logits))(ids)

    (reference(ids).logits * projection).sum().backward()
    torch._dynamo.reset()
    graphs = _Graphs()
    step = torch.compile(lambda ids, p: (model(ids).logits * p).sum(), fullgraph=True, backend=graphs.backend)
    step(ids, projection).backward()
    torch._dynamo.reset()

    rank, size = mesh.get_local_rank(), mesh.size()
    layouts = param_layouts(reference, plan)
    mine = dict(model.named_parameters())
    failures = []
    for name, ref_param in reference.named_parameters():
        shard = expected_shard(ref_param.grad, layouts.get(name, {}).get("tp", "R"), rank, size)
        grad = mine[name].grad
        if grad is None or not (grad - shard).abs().max().item() <= tolerance(ref_param.grad):
            failures.append(name)
    return {
        "graphs": report.graph_count,
        "breaks": [str(reason.reason)[:300] for reason in report.break_reasons],
        "logits_err": (got[0] - want).abs().max().item(),
        "logits_tol": tolerance(want),
        "inference": _collectives(report.graphs),
        "train_graphs": (len(graphs.forward), len(graphs.backward)),
        "forward": _collectives(graphs.forward),
        "backward": _collectives(graphs.backward),
        "grad_failures": failures,
        "grads": len(mine),
    }


def _rank(rank: int, world_size: int, files: dict[str, tuple[dict, str]]) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.config.cache_size_limit = 64
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return {case: _run(case, *files[case], mesh) for case in files}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("compile_summed")
    return run_distributed(_rank, {case: _lowered(case, directory) for case in CASES}, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_inference_compiles_whole_to_the_unsharded_logits(results: list[dict[str, Any]], case: str) -> None:
    for by_case in results:
        result = by_case[case]
        assert result["graphs"] == 1 and not result["breaks"], result["breaks"]
        assert result["logits_err"] <= result["logits_tol"], result["logits_err"]


@pytest.mark.parametrize("case", CASES)
def test_a_compiled_training_step_gives_the_unsharded_gradients(results: list[dict[str, Any]], case: str) -> None:
    for by_case in results:
        result = by_case[case]
        assert result["train_graphs"] == (1, 1)
        assert result["grads"] > 10 and not result["grad_failures"], result["grad_failures"]


@pytest.mark.parametrize("case", CASES)
def test_the_compiled_graphs_reduce_once_a_layer(results: list[dict[str, Any]], case: str) -> None:
    """One reduction a layer: an all-reduce (besides the embedding's in forward and the lm_head input's in
    backward), or with --sp a reduce-scatter of the sequence-sharded stream. In backward it reduces both norms'
    partial gradients at once; were each norm moving its own output, there would be two a layer."""
    layer, besides = ("reduce_scatter", 0) if CASES[case] else ("all_reduce", 1)
    for by_case in results:
        result = by_case[case]
        for graphs in ("inference", "forward", "backward"):
            assert result[graphs].get(layer, 0) == LAYERS + besides, (graphs, result[graphs])
