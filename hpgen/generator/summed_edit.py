"""The one edit hpgen makes inside a body: a parallel-residual block's sum, reduced once.

A block entry with ``summed_reduction`` names its two branches (``attention``, ``mlp``);
their entries leave their outputs partial. In the block's ``forward`` the expression
that adds the two outputs (``mlp_output + attn_output + hidden_states``, or Falcon's
``mlp_output += attention_output``) is rewritten so that their sum goes through one
collective: ``self._hp_tp.all_reduce(mlp_output + attn_output) + hidden_states``. The
statement gets a comment line saying so; every other statement of the body is left
exactly as it was.

A branch's value is a name assigned from ``self.<branch>(...)`` (the first item when the
call's result is unpacked) or from a one-argument call of one of the block's modules on
such a value or call (``self.post_attention_dropout(attn_output)``). The planner has checked that what lies
between a branch and the sum is linear; here the site is only located, and it must be
the only one. The planner reads the body on the path the instance takes; of its ``if`` tests,
those on a branch module itself (``if self.shared_experts is not None:``, Ernie-4.5-MoE's
guard around both the call and the sum) are decided here too: the plan names the branch,
so the block holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from hpgen.core.transitions import SummedOps


class SummedSiteError(ValueError):
    """The block's body has no single expression adding the two branches' outputs."""


@dataclass(frozen=True)
class _Site:
    node: cst.CSTNode  # the Add chain or the AugAssign
    terms: tuple[int, int]  # positions of the two branch terms in the chain (AugAssign: (0, 1))


def _self_path(node: cst.BaseExpression, self_name: str) -> str | None:
    """``a.b`` for ``self.a.b``; None for anything else."""
    parts = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name) and node.value == self_name and parts:
        return ".".join(reversed(parts))
    return None


class _BranchValues:
    """Which names hold a branch's output at a point of the body (flow-sensitive).

    ``names`` maps a name to its branch. An assignment of anything else to a name ends
    it (``attn_output = attn_output + hidden_states`` in a sequential-residual branch).
    """

    def __init__(self, branches: tuple[str, str], self_name: str, names: dict[str, str] | None = None) -> None:
        self.branches = branches
        self.self_name = self_name
        self.names: dict[str, str] = dict(names or {})

    def copy(self) -> _BranchValues:
        return _BranchValues(self.branches, self.self_name, self.names)

    def meet(self, others: list[_BranchValues]) -> None:
        """After an ``if``: what every path agrees on."""
        self.names = {
            name: branch for name, branch in others[0].names.items() if all(o.names.get(name) == branch for o in others)
        }

    def branch_of(self, node: cst.BaseExpression) -> str | None:
        if isinstance(node, cst.Name):
            return self.names.get(node.value)
        if not isinstance(node, cst.Call):
            return None
        path = _self_path(node.func, self.self_name)
        if path in self.branches:
            return path
        positional = [arg for arg in node.args if arg.keyword is None and not arg.star]
        if path is not None and len(node.args) == 1 and len(positional) == 1:  # a module of the block: a dropout
            return self.branch_of(positional[0].value)
        return None

    def assign(self, small: cst.BaseSmallStatement) -> None:
        targets: list[cst.BaseExpression] = []
        value = None
        if isinstance(small, cst.Assign):
            targets = [t.target for t in small.targets]
            value = small.value if len(small.targets) == 1 else None
        elif isinstance(small, (cst.AugAssign, cst.AnnAssign)):
            targets = [small.target]
            value = small.value if isinstance(small, cst.AnnAssign) else None
        branch = self.branch_of(value) if value is not None else None
        for index, target in enumerate(targets):
            items = [e.value for e in target.elements] if isinstance(target, (cst.Tuple, cst.List)) else [target]
            for position, item in enumerate(items):
                if isinstance(item, cst.Name):
                    self.names.pop(item.value, None)
                    if branch is not None and index == 0 and position == 0:
                        self.names[item.value] = branch


def _chain(node: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The terms of a left-nested chain of ``+`` (unparenthesized)."""
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add) and not node.lpar:
        return [*_chain(node.left), node.right]
    return [node]


def _positions(values: _BranchValues, terms: list[cst.BaseExpression]) -> tuple[int, int] | None:
    """Where the two branches' values sit among ``terms`` (each exactly once), or None."""
    found: dict[str, int] = {}
    for index, term in enumerate(terms):
        branch = values.branch_of(term) if isinstance(term, cst.Name) else None
        if branch is not None:
            if branch in found:
                return None
            found[branch] = index
    if len(found) != 2:
        return None
    first, second = sorted(found.values())
    return first, second


def _branch_test(test: cst.BaseExpression, values: _BranchValues) -> bool | None:
    """``self.<branch> is not None``: True, ``is None``: False; None for any other test."""
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return None
    (comparison,) = test.comparisons
    if not (isinstance(comparison.comparator, cst.Name) and comparison.comparator.value == "None"):
        return None
    if _self_path(test.left, values.self_name) not in values.branches:
        return None
    if isinstance(comparison.operator, cst.IsNot):
        return True
    return False if isinstance(comparison.operator, cst.Is) else None


class _FindSites(cst.CSTVisitor):
    """The sums of the two branches' values in one statement, with the names as they stand there."""

    def __init__(self, values: _BranchValues, sites: list[_Site]) -> None:
        self.values = values
        self.sites = sites

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # a nested function is not the block's body

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> bool:
        if not isinstance(node.operator, cst.Add):
            return True
        positions = _positions(self.values, _chain(node))
        if positions is not None:
            self.sites.append(_Site(node, positions))
            return False
        return True

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if isinstance(node.operator, cst.AddAssign):
            positions = _positions(self.values, [node.target, node.value])  # type: ignore[list-item]
            if positions is not None:
                self.sites.append(_Site(node, positions))


def _walk(statements: list[cst.BaseStatement], values: _BranchValues, sites: list[_Site]) -> None:
    """Follow the body in order, recording each site with the branch values it sees."""
    for statement in statements:
        if isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                small.visit(_FindSites(values, sites))
                values.assign(small)
        elif isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            continue
        elif isinstance(statement, cst.If) and _branch_test(statement.test, values) is not None:
            # the path the instance takes, alone (the planner reads no other)
            if _branch_test(statement.test, values):
                _walk(_body(statement.body), values, sites)
            elif isinstance(statement.orelse, cst.If):  # elif
                _walk([statement.orelse], values, sites)
            elif statement.orelse is not None:
                _walk(_body(statement.orelse.body), values, sites)
        elif isinstance(statement, cst.If):
            paths = []
            branch: cst.BaseSuite | cst.If | cst.Else | None = statement
            while branch is not None:
                if isinstance(branch, cst.If):
                    branch.test.visit(_FindSites(values, sites))
                path = values.copy()
                _walk(_body(branch.body), path, sites)
                paths.append(path)
                branch = branch.orelse if isinstance(branch, cst.If) else None
            if not isinstance(_last_else(statement), cst.Else):
                paths.append(values.copy())  # no else: the test may be false
            values.meet(paths)
        else:  # loops, with, try: each block from what holds before it, then what all agree on
            blocks = [_body(getattr(statement, "body", None))]
            for part in ("orelse", "finalbody"):
                block = getattr(statement, part, None)
                if block is not None:
                    blocks.append(_body(block.body))
            for handler in getattr(statement, "handlers", ()):
                blocks.append(_body(handler.body))
            paths = [values.copy()]
            for block in blocks:
                path = values.copy()
                _walk(block, path, sites)
                paths.append(path)
            values.meet(paths)


def _body(suite: object) -> list[cst.BaseStatement]:
    if isinstance(suite, cst.IndentedBlock):
        return list(suite.body)
    if isinstance(suite, cst.SimpleStatementSuite):
        return [cst.SimpleStatementLine(body=suite.body)]
    return []


def _last_else(statement: cst.If) -> cst.If | cst.Else | None:
    current: cst.If | cst.Else | None = statement
    while isinstance(current, cst.If) and current.orelse is not None:
        current = current.orelse
    return current


class _Rewrite(cst.CSTTransformer):
    def __init__(self, site: _Site, reduced: str, comment: str) -> None:
        self.site = site
        self.reduced = reduced  # "self._hp_tp.all_reduce({})"
        self.comment = comment
        self.done = False  # the site is rewritten
        self.marked = False  # the statement holding it carries the comment

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        # the first statement line to end after the rewrite is the one that holds it
        if self.done and not self.marked:
            self.marked = True
            line = cst.EmptyLine(indent=True, comment=cst.Comment(f"# {self.comment}"))
            return updated_node.with_changes(leading_lines=[*updated_node.leading_lines, line])
        return updated_node

    def leave_BinaryOperation(
        self, original_node: cst.BinaryOperation, updated_node: cst.BinaryOperation
    ) -> cst.BaseExpression:
        if original_node is not self.site.node:
            return updated_node
        self.done = True
        terms = _chain(original_node)
        first, second = self.site.terms
        code = cst.Module([]).code_for_node
        summed = self.reduced.format(f"{code(terms[first])} + {code(terms[second])}")
        kept = [code(term) for index, term in enumerate(terms) if index not in (first, second)]
        kept.insert(first, summed)
        replaced = cst.parse_expression(" + ".join(kept))
        return replaced.with_changes(lpar=original_node.lpar, rpar=original_node.rpar)

    def leave_AugAssign(self, original_node: cst.AugAssign, updated_node: cst.AugAssign) -> cst.BaseSmallStatement:
        if original_node is not self.site.node:
            return updated_node
        self.done = True
        code = cst.Module([]).code_for_node
        value = self.reduced.format(f"{code(original_node.target)} + {code(original_node.value)}")
        return cst.Assign(
            targets=[cst.AssignTarget(target=original_node.target)],
            value=cst.parse_expression(value),
            semicolon=original_node.semicolon,
        )


def _sites(function: cst.FunctionDef, branches: tuple[str, str]) -> list[_Site]:
    self_name = [*function.params.posonly_params, *function.params.params][0].name.value
    sites: list[_Site] = []
    _walk(_body(function.body), _BranchValues(branches, self_name), sites)
    return sites


def rewrite_summed(function: cst.FunctionDef, summed: SummedOps) -> cst.FunctionDef:
    """``function`` with the sum of the two branches' outputs reduced once, and marked."""
    sites = _sites(function, summed.branches)
    if len(sites) != 1:
        found = "no expression adds" if not sites else f"{len(sites)} expressions add"
        raise SummedSiteError(
            f"{found} the outputs of self.{summed.branches[0]} and self.{summed.branches[1]}; "
            "a summed reduction needs exactly one"
        )
    self_name = [*function.params.posonly_params, *function.params.params][0].name.value
    reduced = f"{self_name}._hp_{summed.axis}.{summed.reduce.kind}({{}}{summed.reduce.call_arguments()})"
    rewrite = _Rewrite(sites[0], reduced, summed.comment())
    result = function.visit(rewrite)
    assert isinstance(result, cst.FunctionDef) and rewrite.done
    return result
