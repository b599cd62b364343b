"""The wrapped torch modules and the generic boundary's movers, on 2 real gloo ranks.

Plain torch modules (no generated file needed: ``nn.Embedding`` and ``nn.Linear`` are
wrapped by ``parallelize``) and hand-made plans, each compared with the unsharded module:
outputs in the plan's output layout, and every gradient as the local slice of the
reference gradient. The generic boundary's movers are driven directly with values in
their src layouts, against the logical values they stand for.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.dist import run_distributed

R, S0, S1, SL, P = {"tp": "R"}, {"tp": "S(0)"}, {"tp": "S(1)"}, {"tp": "S(-1)"}, {"tp": "P(sum)"}


def _plan(entries: dict[str, Any]) -> dict[str, Any]:
    return {"mesh_dim_names": ["tp"], "param_plan": entries}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape and bool((a - b).abs().max() <= 1e-6 + 1e-5 * b.abs().max())
        if a.numel()
        else a.shape == b.shape
    )


def _embedding(rank: int, size: int, mesh: Any) -> dict[str, bool]:
    """Vocab-parallel embedding (11 rows: 6 + 5) whose output is reduce-scattered on the sequence."""
    from hpgen.runtime import parallelize
    from hpgen.runtime.forward.wrappers import ParallelEmbedding

    torch.manual_seed(0)
    reference = nn.ModuleDict({"embed": nn.Embedding(11, 6, padding_idx=7)})
    model = nn.ModuleDict({"embed": nn.Embedding(11, 6, padding_idx=7)})
    model.load_state_dict(reference.state_dict())
    keys = list(model.state_dict())
    parallelize(
        model, _plan({"embed": {"out_src": {"output": P}, "out_dst": {"output": S1}, "params": {"weight": S0}}}), mesh
    )

    ids = torch.tensor([[0, 7, 10, 5, 6], [3, 3, 9, 1, 7]])  # 5 tokens: 3 + 2 per rank
    grad = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1))
    full = reference["embed"](ids)
    (full * grad).sum().backward()
    out = model["embed"](ids)
    (out * grad.tensor_split(size, 1)[rank]).sum().backward()
    return {
        "class": type(model["embed"]) is ParallelEmbedding,
        "state_dict keys": list(model.state_dict()) == keys,
        "padding_idx": model["embed"].padding_idx == (None if rank == 0 else 1),
        "output": _close(out, full.tensor_split(size, 1)[rank]),
        "weight grad": _close(model["embed"].weight.grad, reference["embed"].weight.grad.tensor_split(size, 0)[rank]),
    }


def _linears(rank: int, size: int, mesh: Any) -> dict[str, bool]:
    """Column-parallel Linear left sharded, row-parallel Linear with a deferred bias, and a
    column-parallel head gathered to R: Megatron's MLP pair and lm_head, as bare modules."""
    from hpgen.runtime import parallelize
    from hpgen.runtime.forward.wrappers import ParallelLinear

    torch.manual_seed(0)

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 7), nn.GELU(), nn.Linear(7, 8), nn.Linear(8, 9, bias=False))

    reference, model = build(), build()
    model.load_state_dict(reference.state_dict())
    keys = list(model.state_dict())
    plan = _plan(
        {
            "0": {
                "in_src": {"input": R},
                "in_dst": {"input": R},
                "out_src": {"output": SL},
                "out_dst": {"output": SL},
                "params": {"weight": S0, "bias": S0},
            },
            "2": {
                "in_src": {"input": SL},
                "in_dst": {"input": SL},
                "out_src": {"output": P},
                "out_dst": {"output": R},
                "params": {"weight": S1, "bias": R},
                "deferred_bias_params": ["bias"],
            },
            "3": {
                "in_src": {"input": R},
                "in_dst": {"input": R},
                "out_src": {"output": SL},
                "out_dst": {"output": R},
                "params": {"weight": S0},
            },
        }
    )
    parallelize(model, plan, mesh)

    x_ref = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    grad = torch.randn(3, 4, 9, generator=torch.Generator().manual_seed(3))
    full = reference(x_ref)
    (full * grad).sum().backward()
    out = model(x)
    (out * grad).sum().backward()
    slices = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "3.weight": 0}
    mine = dict(model.named_parameters())
    checks = {
        "classes": all(type(model[i]) is ParallelLinear for i in (0, 2, 3)),
        "state_dict keys": list(model.state_dict()) == keys,
        "local sizes": (model[0].out_features, model[2].in_features) == ((4, 4) if rank == 0 else (3, 3)),
        "output": _close(out, full),
        "input grad": _close(x.grad, x_ref.grad),
    }
    for name, param in reference.named_parameters():
        dim = slices.get(name)
        want = param.grad if dim is None else param.grad.tensor_split(size, dim)[rank]
        checks[f"{name} grad"] = _close(mine[name].grad, want)
    return checks


COLUMN_BLOCK_SOURCE = """
import torch
from torch import nn


class ColumnBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x, scale=1.0, **kwargs):
        return torch.relu(self.proj(x)) * scale
"""

COPY_ONLY_PLAN = {
    "0": {
        "in_src": {"x": R},
        "in_dst": {"x": R},
        "out_src": {"output": SL},
        "out_dst": {"output": SL},
        "params": {"proj.weight": S0, "proj.bias": S0},
    },
    "1": {
        "in_src": {"input": SL},
        "in_dst": {"input": SL},
        "out_src": {"output": P},
        "out_dst": {"output": R},
        "params": {"weight": S1},
    },
}


def _copy_only(rank: int, size: int, mesh: Any) -> dict[str, bool]:
    """A contract whose only op is a ``copy`` (replicated input of a column-parallel block
    whose output stays sharded) is lowered, and its backward all-reduces the input's gradient."""
    import types

    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.runtime import parallelize

    plan = _plan(COPY_ONLY_PLAN)
    generated = types.ModuleType("column_block_tp")
    lowered = lower(COLUMN_BLOCK_SOURCE, plan_from_dict({**plan, "boundary_classes": {"0": "ColumnBlock", "1": "nn.Linear"}}))
    exec(compile(lowered, "column_block_tp.py", "exec"), generated.__dict__)
    source = types.ModuleType("column_block")
    exec(compile(COLUMN_BLOCK_SOURCE, "column_block.py", "exec"), source.__dict__)
    ColumnBlock = generated.ColumnBlock
    torch.manual_seed(0)

    def build(block: type) -> nn.Module:
        return nn.Sequential(block(), nn.Linear(6, 5, bias=False))

    reference, model = build(source.ColumnBlock), build(ColumnBlock)
    model.load_state_dict(reference.state_dict())
    parallelize(model, plan, mesh)
    x_ref = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    grad = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    full = reference(x_ref)
    (full * grad).sum().backward()
    out = model(x)
    (out * grad).sum().backward()
    return {
        "lowered with its copy": "self._hp_tp.copy(x)" in lowered and type(model[0]) is ColumnBlock,
        "output": _close(out, full),
        "input grad": _close(x.grad, x_ref.grad),
        "weight grad": _close(model[0].proj.weight.grad, reference[0].proj.weight.grad.tensor_split(size, 0)[rank]),
    }


def _movers(rank: int, size: int, mesh: Any) -> dict[str, bool]:
    """The generic boundary's movers: DTensor for R -> P and S -> P, all_reduce + split for
    P(avg|max) -> S; forward values against the logical values, gradients against autograd
    of the logical computation."""
    from hpgen.core.plan import plan_from_dict
    from hpgen.runtime.forward.boundary import DTensorMove, StaticMove, boundary_movers
    from hpgen.runtime.install.parallelize import mesh_axes

    plan = plan_from_dict(
        _plan(
            {
                "m": {
                    "in_src": {"a": R, "b": S1, "c": {"tp": "P(avg)"}, "d": {"tp": "P(max)"}},
                    "in_dst": {"a": P, "b": P, "c": S0, "d": S1},
                    "out_src": {"o": R},
                    "out_dst": {"o": P},
                }
            }
        )
    )
    movers_in, movers_out = boundary_movers(plan, "m", mesh, mesh_axes(plan, mesh), "m")
    gen = torch.Generator().manual_seed(5)
    checks = {
        "kinds": [type(movers_in[n]) for n in "abcd"] + [type(movers_out["o"])]
        == [DTensorMove, DTensorMove, StaticMove, StaticMove, DTensorMove]
    }

    def total(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t)
        return t

    # R -> P(sum): the ranks' parts add up to the value; its gradient is the replicated one
    for name, mover in (("a", movers_in["a"]), ("o", movers_out["o"])):
        x = torch.randn(2, 3, generator=gen).requires_grad_()
        g = torch.randn(2, 3, generator=gen)
        y = mover(x)
        (y * g).sum().backward()
        checks[f"{name} value"] = _close(total(y), x.detach())
        checks[f"{name} grad"] = _close(x.grad, g)

    # S(1) -> P(sum), 5 columns split 3 + 2
    full = torch.randn(2, 5, 4, generator=gen)
    g = torch.randn(2, 5, 4, generator=gen)
    x = full.tensor_split(size, 1)[rank].clone().requires_grad_()
    y = movers_in["b"](x)
    (y * g).sum().backward()
    checks["b value"] = _close(total(y), full)
    checks["b grad"] = _close(x.grad, g.tensor_split(size, 1)[rank])

    # P(avg) -> S(0) and P(max) -> S(1): every rank's part is known to every rank here
    for name, reduce, dim in (("c", "avg", 0), ("d", "max", 1)):
        parts = torch.randn(size, 5, 3, generator=gen)
        g = torch.randn(5, 3, generator=gen)
        logical = parts.mean(0) if reduce == "avg" else parts.amax(0)
        x = parts[rank].clone().requires_grad_()
        y = movers_in[name](x)
        (y * g.tensor_split(size, dim)[rank]).sum().backward()
        want_grad = g / size if reduce == "avg" else g * (parts[rank] == logical)
        checks[f"{name} value"] = _close(y, logical.tensor_split(size, dim)[rank])
        checks[f"{name} grad"] = _close(x.grad, want_grad)
    return checks


def _run(rank: int, world_size: int) -> dict[str, dict[str, bool]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return {
        "embedding": _embedding(rank, world_size, mesh),
        "linears": _linears(rank, world_size, mesh),
        "copy_only": _copy_only(rank, world_size, mesh),
        "movers": _movers(rank, world_size, mesh),
    }


@pytest.fixture(scope="module")
def checks() -> list[dict[str, dict[str, bool]]]:
    return run_distributed(_run, timeout=120)


@pytest.mark.parametrize("group", ["embedding", "linears", "copy_only", "movers"])
def test_matches_the_unsharded_module(checks: list[dict[str, dict[str, bool]]], group: str) -> None:
    for rank, by_group in enumerate(checks):
        failed = [name for name, ok in by_group[group].items() if not ok]
        assert by_group[group] and not failed, f"rank {rank}: {failed}"
