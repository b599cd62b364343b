"""Summed reductions: parallel-residual blocks whose two branches are reduced once.

``h = x + attn(ln1(x)) + mlp(ln2(x))`` (GPT-J, GPT-NeoX with ``use_parallel_residual``,
Falcon, Cohere, Phi, CodeGen, StableLM): where both branches are boundaries that reduce
a partial output themselves, the block can add the two partial outputs and reduce their
sum once. :func:`add_summed_reductions` finds such blocks from the source of the
block's ``forward``, as the instance runs it (``if`` tests on module attributes and the
config decide the branch taken), and rewrites the plan:

- the block's entry gets ``summed_reduction`` (the block is a new entry where the plan
  had none);
- each branch leaves its output ``P(sum)``; its deferred biases stay deferred (the
  runtime adds them on one rank into the sum) and need no gradient reduction;
- where both branches read the output of one norm (the ``shared_input``), their input's
  transition moves onto that output, once: the branches' inputs arrive replicated and
  their gradients leave partial (``in_grad_partial``), so backward reduces the sum of
  both in one collective.

What the source must show, on the path the instance takes: each branch called once; its
value reaching the sum directly or through ``nn.Dropout`` modules (linear, and with equal
masks on every rank, the same on partial sums); the two values added in one expression
(with anything else: the residual) and read nowhere else. Anything else leaves the block
as it was.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hpgen.core.placement import PARTIAL_SUM, REPLICATE
from hpgen.core.plan import fqn_matches
from hpgen.core.plan_entries import Layout, SummedReduction
from hpgen.planner.flow.constants import Constants, self_path
from hpgen.planner.flow.runner import function_def
from hpgen.planner.flow.values import UNKNOWN
from hpgen.planner.translate.draft import DraftEntry, DraftPlan

__all__ = ["SummedBlock", "add_summed_reductions", "find_summed_block"]


@dataclass(frozen=True)
class SummedBlock:
    """A recognised block: its two branches (in the order the sum adds them) and the shared norm."""

    branches: tuple[str, str]
    shared_input: str | None
    paired_input: str | None = None  # the second norm of the same input (two norms: GPT-NeoX)


@dataclass
class _State:
    """What the names hold at a point of the block's body."""

    branch: dict[str, str] = field(default_factory=dict)  # name -> branch whose output it holds
    made_by: dict[str, str] = field(default_factory=dict)  # name -> child module whose output it is
    version: dict[str, int] = field(default_factory=dict)  # name -> its last assignment (absent: never)

    def copy(self) -> _State:
        return _State(dict(self.branch), dict(self.made_by), dict(self.version))


class _Reader(Constants):
    """Walks a block's ``forward`` on the path its instance takes, collecting what the check needs."""

    def __init__(self, module: Any, candidates: tuple[str, ...], inputs: Mapping[str, str]) -> None:
        self.module = module
        self.consts = {}
        self.candidates = candidates
        self.inputs = inputs  # branch -> its declared input name (a keyword of its call)
        self.calls: dict[str, int] = {name: 0 for name in candidates}
        self.child_calls: dict[str, int] = {}  # every child module called, how often
        self.branch_inputs: dict[str, str | None] = {}  # branch -> child module that made its input
        self.sites: list[tuple[str, str]] = []  # the branches each sum adds, in source order
        self.stray: set[str] = set()  # branches whose value is read other than by the sum
        self.producer_reads: dict[str, int] = {}  # child module -> reads of its output's names
        # child module -> (the name it was called on, that name's version, call order)
        self.maker_input: dict[str, tuple[str, int, int]] = {}
        self.assignments = itertools.count(1)
        self.unknown = False  # a construct the check does not follow

    # -- helpers

    def _child(self, node: ast.expr) -> str | None:
        path = self_path(node)
        if path is None or "." in path:
            return None
        return path if isinstance(getattr(self.module, path, None), _module_type()) else None

    def _is_dropout(self, node: ast.expr) -> bool:
        import torch.nn as nn

        path = self._child(node)
        return path is not None and isinstance(getattr(self.module, path), nn.Dropout)

    def branch_value(self, node: ast.expr, state: _State) -> str | None:
        """The branch whose output ``node`` is (a call of the branch, a name, through dropouts)."""
        if isinstance(node, ast.Name):
            return state.branch.get(node.id)
        if isinstance(node, ast.Call) and not node.keywords and len(node.args) == 1 and self._is_dropout(node.func):
            return self.branch_value(node.args[0], state)
        if isinstance(node, ast.Call) and self._child(node.func) in self.candidates:
            return self._child(node.func)
        return None

    # -- expressions: count branch calls, record their inputs, find the sums, flag other reads

    def expression(self, node: ast.expr | None, state: _State, allowed: frozenset[int] = frozenset()) -> None:
        if node is None:
            return
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and self._child(sub.func) is not None:
                child = self._child(sub.func)
                self.child_calls[child] = self.child_calls.get(child, 0) + 1
            if isinstance(sub, ast.Call) and self._child(sub.func) in self.candidates:
                branch = self._child(sub.func)
                self.calls[branch] += 1
                self.branch_inputs[branch] = self._input_maker(sub, branch, state)
            if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Add) and id(sub) not in allowed:
                terms = _chain(sub)
                found = [self.branch_value(term, state) for term in terms if isinstance(term, ast.Name)]
                found = [branch for branch in found if branch is not None]
                if len(found) == 2 and found[0] != found[1]:
                    self.sites.append((found[0], found[1]))
                    allowed = allowed | {id(t) for t in terms} | {id(s) for s in ast.walk(sub) if isinstance(s, ast.BinOp)}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                if sub.id in state.branch and id(sub) not in allowed:
                    self.stray.add(state.branch[sub.id])
                if sub.id in state.made_by:
                    maker = state.made_by[sub.id]
                    self.producer_reads[maker] = self.producer_reads.get(maker, 0) + 1

    def _input_maker(self, call: ast.Call, branch: str, state: _State) -> str | None:
        """The child module whose output this call of ``branch`` takes as its declared input."""
        argument = None
        for keyword in call.keywords:
            if keyword.arg == self.inputs.get(branch):
                argument = keyword.value
        if argument is None and call.args:
            argument = call.args[0]
        if isinstance(argument, ast.Name):
            return state.made_by.get(argument.id)
        maker = self._child(argument.func) if isinstance(argument, ast.Call) else None
        if maker is not None and maker not in self.candidates:
            self._record_input(maker, argument, state)  # an inline norm: ``self.attn(self.ln_1(x))``
            return maker
        return None

    def _record_input(self, maker: str, call: ast.Call, state: _State) -> None:
        """What ``maker`` was called on: one plain name (and its version), or nothing known."""
        if not call.keywords and len(call.args) == 1 and isinstance(call.args[0], ast.Name):
            name = call.args[0].id
            self.maker_input[maker] = (name, state.version.get(name, 0), next(self.assignments))

    # -- statements

    def block(self, statements: list[ast.stmt], state: _State) -> None:
        for statement in statements:
            self.statement(statement, state)

    def statement(self, node: ast.stmt, state: _State) -> None:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            self.assign(node.targets[0], node.value, state)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name):
            left, right = state.branch.get(node.target.id), self.branch_value(node.value, state)
            allowed = frozenset({id(node.value)}) if left and right and left != right else frozenset()
            if allowed:
                self.sites.append((left, right))
            elif left:
                self.stray.add(left)
            self.expression(node.value, state, allowed)
            state.branch.pop(node.target.id, None)
            state.made_by.pop(node.target.id, None)
            state.version[node.target.id] = next(self.assignments)
        elif isinstance(node, ast.If):
            test = self.const(node.test)
            self.expression(node.test, state)
            if test is UNKNOWN:
                taken, other = state.copy(), state.copy()
                self.block(node.body, taken)
                self.block(node.orelse, other)
                state.branch = {k: v for k, v in taken.branch.items() if other.branch.get(k) == v}
                state.made_by = {k: v for k, v in taken.made_by.items() if other.made_by.get(k) == v}
                state.version = {
                    k: taken.version.get(k) if taken.version.get(k) == other.version.get(k) else next(self.assignments)
                    for k in {*taken.version, *other.version}
                }
            else:
                self.block(node.body if test else node.orelse, state)
        elif isinstance(node, (ast.Return, ast.Expr)):
            self.expression(node.value, state)
        elif isinstance(node, ast.Pass):
            return
        else:
            self.unknown = True  # a loop, with, try, del, annotated or multiple assignment

    def assign(self, target: ast.expr, value: ast.expr, state: _State) -> None:
        names = [target] if isinstance(target, ast.Name) else list(getattr(target, "elts", []))
        if not all(isinstance(name, ast.Name) for name in names):
            self.unknown = True
            return
        branch = self.branch_value(value, state)
        wrapped = branch is not None and not (isinstance(value, ast.Call) and self._child(value.func) == branch)
        # a dropout of a branch value reads it legitimately; the name it read is then replaced
        allowed = frozenset(id(sub) for sub in ast.walk(value) if isinstance(sub, ast.Name)) if wrapped else frozenset()
        self.expression(value, state, allowed)
        maker = None
        if isinstance(value, ast.Call) and self._child(value.func) is not None and branch is None:
            maker = self._child(value.func)
            self._record_input(maker, value, state)
        elif isinstance(value, ast.Name):
            maker = state.made_by.get(value.id)
            if maker is not None:  # an alias: the read is not a use of the output
                self.producer_reads[maker] -= 1
        for position, name in enumerate(names):
            state.branch.pop(name.id, None)
            state.made_by.pop(name.id, None)
            state.version[name.id] = next(self.assignments)
            if position == 0 and branch is not None:
                state.branch[name.id] = branch
            if position == 0 and maker is not None and len(names) == 1:
                state.made_by[name.id] = maker


def _module_type() -> type:
    import torch.nn as nn

    return nn.Module


def _chain(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [*_chain(node.left), node.right]
    return [node]


def find_summed_block(module: Any, candidates: tuple[str, ...], inputs: Mapping[str, str]) -> SummedBlock | None:
    """The summed reduction ``module``'s forward allows over two of ``candidates``, or None."""
    function = function_def(type(module), "forward")
    if function is None:
        return None
    reader = _Reader(module, candidates, inputs)
    reader.block(function.body, _State())
    if reader.unknown or len(reader.sites) != 1:
        return None
    first, second = reader.sites[0]
    if reader.calls.get(first) != 1 or reader.calls.get(second) != 1 or {first, second} & reader.stray:
        return None
    shared = reader.branch_inputs.get(first)
    if (
        shared is None
        or shared != reader.branch_inputs.get(second)
        or reader.producer_reads.get(shared) != 2
        or reader.child_calls.get(shared) != 1
    ):
        shared = None  # each branch reads its own input (two norms), or the norm runs or is read elsewhere too
        pair = _paired_norms(reader, first, second)
        if pair is not None:
            return SummedBlock((first, second), *pair)
    return SummedBlock((first, second), shared)


def _paired_norms(reader: _Reader, first: str, second: str) -> tuple[str, str] | None:
    """(the norm run first, the other) where each branch reads its own norm of one unchanged block input.

    Each norm runs once, on the same name not assigned in between, and its output is
    read only by its branch: then both outputs can be made, and moved, at once.
    """
    norms = (reader.branch_inputs.get(first), reader.branch_inputs.get(second))
    if None in norms or norms[0] == norms[1]:
        return None
    made = [reader.maker_input.get(norm) for norm in norms]
    if None in made or made[0][:2] != made[1][:2]:
        return None
    if any(reader.child_calls.get(norm) != 1 or reader.producer_reads.get(norm, 0) > 1 for norm in norms):
        return None
    return (norms[0], norms[1]) if made[0][2] < made[1][2] else (norms[1], norms[0])


# --------------------------------------------------------------------------- the plan


def _reducing_branch(plan: DraftPlan, fqn: str) -> tuple[str, str, str] | None:
    """(key, output, axis) when ``fqn`` is a boundary reducing one partial output itself."""
    match = plan.entry_for(fqn)
    if match is None or match[1].summed_reduction is not None:
        return None
    key, entry = match
    found = []
    for name in entry.output_names:
        src, dst = entry.output_layouts(name)
        for axis in plan.mesh:
            if src.on(axis) == PARTIAL_SUM and not dst.on(axis).is_partial:
                found.append((key, name, axis))
    return found[0] if len(found) == 1 else None


def add_summed_reductions(model: Any, plan: DraftPlan) -> DraftPlan:
    """``plan`` with every parallel-residual block of ``model`` reducing its branches once."""
    found: dict[str, tuple[SummedBlock, dict[str, tuple[str, str, str]]]] = {}
    for fqn, module in model.named_modules():
        branches = {}
        for name, _ in module.named_children():
            branch = _reducing_branch(plan, f"{fqn}.{name}" if fqn else name)
            if branch is not None:
                branches[name] = branch
        if len(branches) < 2 or len({axis for _, _, axis in branches.values()}) != 1:
            continue
        inputs = {name: _single_input(plan, key) for name, (key, _, _) in branches.items()}
        try:
            block = find_summed_block(module, tuple(branches), {k: v for k, v in inputs.items() if v})
        except Exception:  # noqa: BLE001 - the summed reduction is an optimisation: a block it cannot read keeps two
            block = None
        if block is not None and block.shared_input is not None and not all(inputs[b] for b in block.branches):
            block = SummedBlock(block.branches, None)  # an undeclared input would get a copy of its own
        if block is not None:
            found[fqn] = (block, branches)
    if not found:
        return plan
    entries = dict(plan.entries)
    notes = {}
    for fqn, (block, branches) in found.items():
        keys = [key for key in entries if fqn_matches(key, fqn)]
        key = keys[0] if keys else _pattern(fqn, [branches[b][0] for b in block.branches])
        if key in notes:
            continue
        summed = SummedReduction(block.branches, block.shared_input, block.paired_input)
        entries[key] = replace(entries.get(key, DraftEntry()), summed_reduction=summed)
        for branch in block.branches:
            branch_key, output, axis = branches[branch]
            entries[branch_key] = _leave_partial(entries[branch_key], output, axis, shared=block.shared_input is not None)
        shared = f", their shared input {block.shared_input} moved once" if block.shared_input else ""
        if block.paired_input:
            shared = f", their inputs {block.shared_input} and {block.paired_input} moved together"
        notes[key] = f"{' + '.join(block.branches)} reduced once, summed{shared}"
    result = plan.replace(entries=entries)
    try:
        result.validated()
    except Exception:  # noqa: BLE001 - the rewrite does not fit this plan: keep it as it was
        return plan
    return result.with_comments(summed_reduction=notes)


def _single_input(plan: DraftPlan, key: str) -> str | None:
    entry = plan.entries[key]
    names = tuple(sorted({*entry.in_src, *entry.in_dst}))
    return names[0] if len(names) == 1 else None


def _pattern(fqn: str, branch_keys: list[str]) -> str:
    """The block's key: the branches' keys without their last segment (``model.layers.*``), else ``fqn``."""
    prefixes = {key.rpartition(".")[0] for key in branch_keys}
    if len(prefixes) == 1:
        prefix = prefixes.pop()
        if fqn_matches(prefix, fqn):
            return prefix
    return fqn


def _leave_partial(entry: DraftEntry, output: str, axis: str, *, shared: bool) -> DraftEntry:
    """A branch's entry: its output left ``P(sum)``; with a shared input, that input replicated, gradient partial.

    Its deferred biases stay deferred (added on one rank into the sum) and need no gradient reduction."""
    out_dst = {**entry.out_dst, output: entry.out_dst[output].with_axis(axis, PARTIAL_SUM)}
    deferred = set(entry.deferred_bias_params)
    grad_reduce = tuple(name for name in entry.grad_reduce_params if name not in deferred)
    changed = replace(entry, out_dst=out_dst, grad_reduce_params=grad_reduce)
    if not shared:
        return changed
    names = tuple(sorted({*entry.in_src, *entry.in_dst}))
    return replace(
        changed,
        in_src={**entry.in_src, **{name: entry.in_src.get(name, Layout(())).with_axis(axis, REPLICATE) for name in names}},
        in_dst={**entry.in_dst, **{name: entry.in_dst.get(name, Layout(())).with_axis(axis, REPLICATE) for name in names}},
        in_grad_partial=names,
    )
