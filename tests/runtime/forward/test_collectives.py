"""hpgen.runtime.forward.collectives on real gloo process groups, checked against one-process references.

Every collective keeps the logical tensor and changes only its layout, so one reference
serves them all: build the logical tensor ``X`` from per-rank pieces (the shards of
``S(d)``, the parts of ``P(op)``, the one tensor of ``R``), take the loss
``(X * G).sum()`` for a random ``G`` and backpropagate. On the ranks, each rank feeds its
piece to the collective, checks the result against ``X`` laid out in the output placement,
and backpropagates its share of ``G`` as the gradient placement says (``R``: all of it,
``P``: a random part, ``S(d)``: its shard); its input gradient must equal the reference
gradient of its piece. The ranks run many cases per process spawn to keep the file fast.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from hpgen.runtime.forward import collectives
from hpgen.runtime.forward.collectives import IDENTITY_AXIS, AxisCollectives, ShardScope
from tests.support.dist import RankFailed, run_distributed
from tests.support.refusing_backend import refusing_group

REDUCE = {
    "sum": lambda t: t.sum(0),
    "avg": lambda t: t.mean(0),
    "max": lambda t: t.amax(0),
    "min": lambda t: t.amin(0),
}


def _pieces(placement: str, shape: tuple[int, ...], k: int, gen: torch.Generator, sizes=None):
    """Reference leaves (one per rank; ``R`` shares one) and the logical tensor they make."""
    kind, _, arg = placement.partition("(")
    arg = arg.rstrip(")")
    if kind == "R":
        leaf = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
        return [leaf] * k, leaf
    if kind == "P":
        parts = [torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(k)]
        return parts, REDUCE[arg](torch.stack(parts))
    dim = int(arg)
    full = torch.randn(shape, generator=gen, dtype=torch.float64)
    shards = full.split(sizes, dim) if sizes else full.tensor_split(k, dim)
    shards = [s.clone().requires_grad_() for s in shards]
    return shards, torch.cat(shards, dim)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 1e-12) -> None:
    # not torch.testing.assert_close: its first call imports sympy, a second per rank
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: got {actual.dtype}{list(actual.shape)}, expected {expected.dtype}{list(expected.shape)}"
    )
    assert torch.allclose(actual, expected, rtol=tol, atol=tol), (
        f"{what}: got\n{actual}\nexpected\n{expected}"
    )


def _local(placement: str, full: torch.Tensor, rank: int, k: int, parts=None) -> torch.Tensor:
    """Rank ``rank``'s view of ``full`` in ``placement`` (``P``: the given ``parts``)."""
    if placement == "R":
        return full
    if placement.startswith("P"):
        return parts[rank]
    return full.tensor_split(k, int(placement[2:-1]))[rank]


def _cases(ndim: int):
    """(method, args, kwargs, input, output, gradient-of-output placement) for each check."""
    dims = [0, 1, -1][:ndim]
    for op in REDUCE:
        yield "all_reduce", (op,), {}, f"P({op})", "R", "R"
        yield "all_reduce", (op,), {"backward": "all_reduce"}, f"P({op})", "R", "P"
    yield "copy", (), {}, "R", "R", "P"
    yield "copy", (), {"backward": "identity"}, "R", "R", "R"
    for d in dims:
        yield "all_gather", (d,), {}, f"S({d})", "R", "P"
        yield "all_gather", (d,), {"backward": "split"}, f"S({d})", "R", "R"
        yield "reduce_scatter", (d,), {}, "P(sum)", f"S({d})", f"S({d})"
        yield "split", (d,), {}, "R", f"S({d})", f"S({d})"
        for e in dims:
            if d % ndim != e % ndim:
                yield "all_to_all", (d, e), {}, f"S({d})", f"S({e})", f"S({e})"


def _check(ax: AxisCollectives, case: tuple, shape: tuple[int, ...], seed: int, in_sizes=None) -> None:
    """One case on one shape: values, gradient, fresh output, untouched input, no-grad path.

    ``in_sizes``: shard sizes of an ``S`` input other than ``tensor_split``'s.
    """
    method, args, kwargs, src, dst, grad = case
    k, r = ax.size, ax.rank
    gen = torch.Generator().manual_seed(seed)
    leaves, logical = _pieces(src, shape, k, gen, in_sizes)
    g_parts = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(k)]
    g_full = torch.stack(g_parts).sum(0)
    (logical * g_full).sum().backward()

    x = leaves[r].detach().clone().requires_grad_()
    before = x.detach().clone()
    y = getattr(ax, method)(x, *args, **kwargs)
    what = f"{method}{args} {kwargs} shape={shape} rank={r}/{k}"
    _assert_close(y, _local(dst, logical.detach(), r, k), what)
    plain_no_op = method == "copy" and kwargs.get("backward") == "identity"  # returns x itself
    if not plain_no_op:
        assert y.is_contiguous() and (y.numel() == 0 or y.data_ptr() != x.data_ptr()), what
        y.add_(0)  # results are fresh tensors: in-place use is allowed under autograd
    (y * _local(grad, g_full, r, k, g_parts)).sum().backward()
    _assert_close(x.grad, leaves[r].grad, f"{what} grad")
    assert torch.equal(x.detach(), before), f"{what} changed its input"

    with torch.no_grad():  # the path without an autograd node gives the same values
        plain = getattr(ax, method)(x, *args, **kwargs)
        _assert_close(plain, y.detach(), f"{what} without grad", tol=0)
        if method == "copy":  # nothing flows back, so nothing is copied at inference
            assert plain is x, what


# even on every dim (for 2 ranks); 7 and 5 uneven; 1 leaves a rank with nothing on that dim
SHAPES = [(4, 6, 2), (7, 5, 3), (1, 3, 1), (5, 7)]


def _battery(
    rank: int, world_size: int, groups: list[tuple[list[int], list[tuple]]], fallbacks=False, traced=False
) -> int:
    """Every case on each of the shapes, for each (group ranks, shapes) this rank is in.

    ``fallbacks``: the groups on a backend that lacks the single-tensor collectives, as some do
    (``tests/support/refusing_backend.py``): each axis finds that out by a probe and falls back.
    ``traced``: run the form the ops take under torch.compile (functional collectives), eagerly.
    """
    if traced:
        collectives._tracing = lambda: True  # this spawned process only
    new_group = refusing_group if fallbacks else dist.new_group
    handles = [new_group(ranks) for ranks, _ in groups]  # every rank creates every group
    checks = 0
    for (ranks, shapes), group in zip(groups, handles, strict=True):
        if rank not in ranks:
            continue
        ax = AxisCollectives(group, "tp")
        assert ax.rank == ranks.index(rank) and ax.size == len(ranks)
        for seed, shape in enumerate(shapes):
            for case in _cases(len(shape)):
                _check(ax, case, shape, seed)
                checks += 1
        # all_gather of shards that are not tensor_split-shaped; backward reuses their sizes
        sizes = [2] + [5] * (ax.size - 1)
        shape = (3, sum(sizes), 2)
        _check(ax, ("all_gather", (1,), {}, "S(1)", "R", "P"), shape, 98, in_sizes=sizes)
        _check(ax, ("all_gather", (1,), {"backward": "split"}, "S(1)", "R", "R"), shape, 99, in_sizes=sizes)
        checks += 2
        # integer tensors (no gradient) and optional inputs
        ids = torch.arange(7).tensor_split(ax.size)[ax.rank]
        assert torch.equal(ax.all_gather(ids, dim=0), torch.arange(7))
        assert all(op(ax, None) is None for op in _EVERY_OP)
        checks += 1
        _check_copy_if_grad(ax)
        checks += 1
        if not traced:
            _check_native_ops(ax, lacking=fallbacks)
            checks += 1
    # a group of one rank: every op hands back its input, with no autograd node
    for ranks in [[r] for r in range(world_size)]:
        group = dist.new_group(ranks)
        if rank in ranks:
            _check_no_ops(AxisCollectives(group, "solo"))
            checks += 1
    return checks


NATIVE = {("cpu", "all_gather_single"), ("cpu", "reduce_scatter_single"), ("cpu", "all_to_all_single")}


def _check_native_ops(ax: AxisCollectives, lacking: bool) -> None:
    """The axis probed each single-tensor collective once and found what its backend has (gloo: all three; the
    refusing backend: none, whatever torch's refusal says); a real call's own error is never taken for a refusal."""
    assert set(ax._natives.found) == NATIVE
    assert ax._natives.lacking() == (NATIVE if lacking else set())
    if not lacking:
        with pytest.raises(RuntimeError):  # an output of the wrong size, on every rank: raised, not a fallback
            ax._native(collectives._all_gather_single, torch.zeros(ax.size + 1), torch.ones(1))
        assert ax._natives.lacking() == set()


def _check_copy_if_grad(ax: AxisCollectives) -> None:
    """Undeclared arguments: tensors (alone, in a tuple/list, in **kwargs) that require grad get ``copy``
    (their gradient all-reduced); others, and declared ``skip`` names, come back as they were."""
    x = torch.full((2,), float(ax.rank + 1), requires_grad=True)
    plain, ids = torch.ones(2), torch.arange(3)
    y, pair, listed = ax.copy_if_grad(x), ax.copy_if_grad((x, plain)), ax.copy_if_grad([plain, x])
    assert isinstance(pair, tuple) and isinstance(listed, list) and pair[1] is plain and listed[0] is plain
    kwargs = ax.copy_if_grad_kwargs({"w": x, "ids": ids, "declared": x}, skip=("declared",))
    assert kwargs["ids"] is ids and kwargs["declared"] is x
    (y + pair[0] + listed[1] + kwargs["w"]).sum().backward()
    # four copies, each all-reducing its gradient of 1 over the ranks; the skipped one adds nothing here
    assert torch.equal(x.grad, torch.full((2,), 4.0 * ax.size))
    for value in (plain, ids, (plain, ids), [ids], None, 3, "text"):
        assert ax.copy_if_grad(value) is value
    with torch.no_grad():
        assert ax.copy_if_grad(x) is x


_EVERY_OP = [
    lambda ax, v: ax.all_reduce(v),
    lambda ax, v: ax.all_reduce(v, "max", backward="all_reduce"),
    lambda ax, v: ax.all_gather(v, 1),
    lambda ax, v: ax.all_gather(v, -1, backward="split"),
    lambda ax, v: ax.reduce_scatter(v, 0),
    lambda ax, v: ax.split(v, 1),
    lambda ax, v: ax.all_to_all(v, 0, 1),
    lambda ax, v: ax.copy(v),
    lambda ax, v: ax.copy(v, backward="identity"),
]


def _check_no_ops(ax: AxisCollectives) -> None:
    """A one-rank axis returns its input itself from every op (no copy, no autograd node)."""
    assert ax.size == 1 and ax.rank == 0
    x = torch.randn(3, 4, requires_grad=True)
    for op in _EVERY_OP:
        assert op(ax, x) is x and op(ax, None) is None
    pair, kwargs = (x, x), {"x": x}
    assert ax.copy_if_grad(x) is x and ax.copy_if_grad(pair) is pair and ax.copy_if_grad_kwargs(kwargs) is kwargs


def test_two_ranks():
    checks = run_distributed(_battery, [([0, 1], SHAPES)], world_size=2, timeout=180)
    assert checks[0] == checks[1] >= 100


def test_three_ranks_a_subgroup_and_the_fallbacks():
    # ranks 1 and 2 also form a group, in which they are ranks 0 and 1
    groups = [([0, 1, 2], SHAPES), ([1, 2], SHAPES[1:2])]
    checks = run_distributed(_battery, groups, True, world_size=3, timeout=180)
    assert checks[1] == checks[2] > checks[0] >= 100


def _int64_gathers(graphs) -> int:
    """All-gathers of int64 values (size exchanges) in Dynamo's graphs."""
    return sum(
        1
        for graph in graphs
        for node in graph.graph.nodes
        if str(node.target).startswith("_c10d_functional.all_gather")
        and node.args[0].meta["example_value"].dtype == torch.int64
    )


def _known_sizes(rank: int, world_size: int) -> list[int]:
    """Where a gather takes its shard sizes from, eagerly and compiled; returns the exchanges seen."""
    ax = AxisCollectives(dist.group.WORLD, "tp")
    exchanges = []
    exchange = ax._exchange_sizes
    ax._exchange_sizes = lambda n, device: exchanges.append(n) or exchange(n, device)
    full = torch.arange(14.0).reshape(2, 7)
    mine = full.tensor_split(world_size, 1)[rank]
    assert torch.equal(ax.all_gather(mine, 1), full)  # outside a forward: exchanged
    assert torch.equal(ax.all_gather(mine, 1, total=7), full)  # the caller knows the total
    with pytest.raises(RuntimeError, match=r"holds \d, but total=9 gives it"):  # 5 + 4: wrong on both ranks
        ax.all_gather(mine, 1, total=9)
    assert len(exchanges) == 1

    scope = ShardScope([ax])
    scope.enter(None, ())  # a model forward starts
    piece = ax.split(full, 1)
    assert torch.equal(ax.all_gather(piece * 2, 1), full * 2)  # the split's sizes: no exchange
    assert torch.equal(ax.all_gather(ax.reduce_scatter(full, 1), 1), full * world_size)
    with pytest.raises(RuntimeError, match="holds 5, but the shard last made on that dim in this forward"):
        ax.all_gather(torch.zeros(2, 5), 1)
    assert len(exchanges) == 1
    # compiled: the split's sizes are symbolic ints of the graph, and no size exchange is traced
    report = torch._dynamo.explain(lambda x: ax.all_gather(ax.split(x, 1) + 1, 1))(full)
    assert report.graph_count == 1 and report.graph_break_count == 0
    assert _int64_gathers(report.graphs) == 0
    scope.exit(None, (), None)  # the forward ends: nothing is known any more
    assert ax._known is None
    assert torch.equal(ax.all_gather(mine, 1), full) and len(exchanges) == 2
    eager_exchanges = list(exchanges)

    # a size only the ranks know, compiled: exchanged as a tensor, read as unbacked ints
    torch._dynamo.reset()
    report = torch._dynamo.explain(lambda x: ax.all_gather(x, 1) + 1)(mine)
    assert report.graph_break_count >= 1  # without capture_scalar_outputs, reading the sizes breaks the graph
    assert "capture_scalar_outputs" in str(report.break_reasons[0].reason)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch._dynamo.reset()
        x = mine.clone().requires_grad_()
        out = torch.compile(lambda x: ax.all_gather(x, 1) * 3, fullgraph=True, backend="eager")(x)
        assert torch.equal(out, full * 3)
        out.sum().backward()  # reduce_scatter of a gradient of 3s: 2 ranks' worth
        assert torch.equal(x.grad, torch.full_like(mine, 3.0 * world_size))
    return eager_exchanges


def _compile_forms(rank: int, world_size: int) -> tuple[list[int], int]:
    """Where shard sizes come from; then the battery in the form the ops take under torch.compile."""
    exchanges = _known_sizes(rank, world_size)
    return exchanges, _battery(rank, world_size, [([0, 1], SHAPES)], traced=True)


@pytest.fixture(scope="module")
def compile_forms() -> list[tuple[list[int], int]]:
    return run_distributed(_compile_forms, world_size=2, timeout=240)


def test_shard_sizes_from_total_a_record_or_an_exchange(compile_forms):
    assert [exchanges for exchanges, _ in compile_forms] == [[4, 4], [3, 3]]  # each rank's own size, twice


def test_functional_collectives_give_the_same_values_and_gradients(compile_forms):
    # the form every op takes under torch.compile (functional collectives), run eagerly
    assert compile_forms[0][1] == compile_forms[1][1] >= 100


def test_identity_axis_needs_no_process_group():
    _check_no_ops(IDENTITY_AXIS)
    assert AxisCollectives(None, "tp").size == 1
    assert copy.deepcopy(IDENTITY_AXIS) is IDENTITY_AXIS


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda ax, x: ax.all_reduce(x, "prod"), "valid: sum, avg, max, min"),
        (lambda ax, x: ax.all_reduce(x, backward="split"), "valid: identity, all_reduce"),
        (lambda ax, x: ax.all_gather(x, 0, backward="identity"), "valid: reduce_scatter, split"),
        (lambda ax, x: ax.reduce_scatter(x, 0, backward="bogus"), "valid: all_gather"),
        (lambda ax, x: ax.split(x, 0, backward="reduce_scatter"), "valid: all_gather"),
        (lambda ax, x: ax.all_to_all(x, 0, 1, backward="all_gather"), "valid: all_to_all"),
        (lambda ax, x: ax.copy(x, backward="all_gather"), "valid: identity, all_reduce"),
    ],
)
def test_invalid_ops_are_rejected_even_on_one_rank(call, message):
    with pytest.raises(ValueError, match=message):
        call(IDENTITY_AXIS, torch.ones(2, 2))


# ---- the harness itself ----------------------------------------------------------------


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits for a peer that never comes


class _Reduce(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ax = AxisCollectives(dist.group.WORLD, "ep")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ax.all_reduce(x)


def _hang(rank: int, world_size: int) -> None:
    """Rank 0 waits in a collective its peer never joins (rank 1 never reaches it)."""
    import time

    from hpgen.verify.hang import CollectiveWatch

    if rank == 1:
        time.sleep(600)
    model = torch.nn.Sequential()
    model.add_module("block", _Reduce())
    with CollectiveWatch(model, {dist.group.WORLD: "ep"}):
        model(torch.ones(2))


def test_a_failing_rank_is_reported_without_hanging():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed:.*ValueError: boom on rank one") as info:
        run_distributed(_fail_on_rank_one, timeout=60)
    assert "_fail_on_rank_one" in str(info.value)  # the rank's traceback


def test_a_hung_rank_times_out_naming_the_collective_and_the_module_that_entered_it():
    with pytest.raises(RankFailed) as info:
        run_distributed(_hang, timeout=5)
    assert info.value.failures == {
        0: "did not finish within 5s: in all_reduce on ep (forward), entered by block",
        1: "did not finish within 5s (a hung collective?)",
    }


def _what_the_rank_started_with(rank: int, world_size: int) -> tuple[list[str], int]:
    import os
    import sys

    from hpgen.verify.spawn import PRELOAD

    return [name for name in PRELOAD if name in sys.modules], os.getppid()


def test_ranks_fork_from_a_server_that_preloaded_the_heavy_imports():
    """This module imports neither transformers nor hpgen.runtime's model code: a rank that has
    them was forked from the preloaded server (a child of that server, not of this process)."""
    import os

    from hpgen.verify.spawn import PRELOAD

    for loaded, parent in run_distributed(_what_the_rank_started_with, timeout=60):
        assert loaded == list(PRELOAD)
        assert parent != os.getpid()


def test_fn_must_be_picklable():
    with pytest.raises(TypeError, match="module-level"):
        run_distributed(lambda rank, world_size: None)
