"""Translating transformers' plan into boundaries: the blocks its styles imply, and the parameters inside them.

- a ``rowwise`` layer reduces: the lowest module above it that holds a ``colwise`` layer
  (``mlp`` for ``mlp.down_proj``) becomes a *block* boundary, ``R -> R`` at its input
  (Megatron's *f*: identity forward, all-reduce backward) and ``P(sum) -> R`` at its
  output, and the ``colwise`` layers below it shard inside it. A ``colwise`` layer that
  reaches the reducing layer through a sibling module widens the block to their common
  parent. An experts module (``moe_tp_experts``, ``ep_dispatch_experts``) and an
  ``all_reduce`` module are blocks themselves;
- ``colwise_gather_output``, ``rowwise_split_input`` and ``embedding_*`` are boundaries of
  one ``nn.Linear`` / ``nn.Embedding``, which ``parallelize`` wraps;
- a replicated parameter inside a sharded boundary sees only its rank's share of the
  gradient: it goes to ``grad_reduce_params`` (transformers gets this from an all-reduce
  in every ``colwise`` layer's backward; hpgen has one at the boundary, so every
  parameter the plan leaves replicated inside it is listed);
- a row-parallel bias stays replicated and goes to ``deferred_bias_params``.
"""

from __future__ import annotations

from typing import Any

from hpgen.errors import HpgenError
from hpgen.planner.boundary import Boundary
from hpgen.planner.modules import relative
from hpgen.planner.styles import (
    COLWISE,
    EMBEDDING_LEAVES,
    EXPERTS,
    GRAD_REDUCE,
    LINEAR_LEAVES,
    ROWWISE,
    SHARDING,
    Rule,
    placement,
)

__all__ = ["BoundaryFinding"]


class BoundaryFinding:
    """The boundaries of a :class:`~hpgen.planner.translator.Translator`, from its rules.

    Reads ``model``, ``modules``, ``rules``, ``expert_tp_rules`` and ``name``; fills ``boundaries``.
    """

    model: Any
    modules: dict[str, Any]
    rules: dict[str, Rule]
    expert_tp_rules: dict[str, Rule]
    boundaries: dict[str, Boundary]
    name: str

    def _boundary(self, fqn: str, kind: str) -> Boundary:
        found = self.boundaries.get(fqn)
        if found is None:
            found = self.boundaries[fqn] = Boundary(fqn, self.modules[fqn], kind)
        elif found.kind != kind and {found.kind, kind} != {"block", "experts"}:
            raise HpgenError(f"{self.name}: {fqn} would be both a {found.kind} and a {kind} boundary")
        elif kind == "experts":
            found.kind = kind
        return found

    def _find_boundaries(self) -> None:
        """Blocks (a reduction at their output) and leaves (one wrapped layer), from the rules.

        A rowwise layer's block is its lowest ancestor holding a colwise layer (``mlp`` for
        ``mlp.down_proj``, also when the projections sit one wrapper deeper, as in
        ``mlp.down_proj.linear``). A colwise layer no block holds (its output reaches the
        rowwise layer through a sibling module, as ``q_proj`` reaches
        ``output_projection.o_proj``) widens the nearest block below a common ancestor to
        that ancestor. Neither search climbs out of a ``ModuleList`` element (a decoder layer).
        """
        import torch.nn as nn

        columns = sorted(
            fqn if fqn in self.modules else fqn.rpartition(".")[0]
            for fqn, rule in self.rules.items()
            if rule.style in COLWISE and not rule.via_module
        )
        for fqn, rule in sorted(self.rules.items()):
            if fqn not in self.modules:
                continue  # a parameter: placed by _place_params
            module, style = self.modules[fqn], rule.style
            if style in ROWWISE:
                self._boundary(self._block_of_rowwise(fqn, columns), "block").axes.add(rule.axis)
            elif style in EXPERTS or style == "all_reduce":
                boundary = self._boundary(fqn, "experts" if style in EXPERTS else "block")
                boundary.axes.add(rule.axis)
                if style == "ep_dispatch_experts":
                    boundary.injection_axis = rule.axis
            elif style == "moe_identity_expert":
                if not isinstance(module, nn.Identity) or self._enclosing(fqn) is None:
                    raise HpgenError(
                        f"{self.name}: {style} on {fqn} ({type(module).__name__}): hpgen maps it on an nn.Identity "
                        "inside an experts module"
                    )
                self._boundary(fqn, "identity").axes.add(rule.axis)
            elif style in LINEAR_LEAVES:
                if not isinstance(module, nn.Linear):
                    raise HpgenError(
                        f"{self.name}: {style} on {fqn} ({type(module).__name__}): hpgen wraps only nn.Linear "
                        "as a column- or row-parallel layer of its own"
                    )
                self._boundary(fqn, "linear").axes.add(rule.axis)
            elif style in EMBEDDING_LEAVES:
                if not isinstance(module, nn.Embedding):
                    raise HpgenError(
                        f"{self.name}: {style} on {fqn} ({type(module).__name__}), which is not an nn.Embedding"
                    )
                self._boundary(fqn, "embedding").axes.add(rule.axis)
        # A row-sharded parameter with a rule of its own (``experts.down_proj``) reduces in the
        # module holding it, unless a boundary above already does.
        for fqn, rule in sorted(self.rules.items()):
            if fqn in self.modules or rule.via_module or rule.style not in ROWWISE:
                continue
            owner = fqn.rpartition(".")[0]
            if self._enclosing(owner) is None:
                self._boundary(owner, "block").axes.add(rule.axis)
        for column in columns:
            if self._enclosing(column) is None:
                self._widen_for(column)
        for boundary in self.boundaries.values():
            if len(boundary.axes) > 1:
                raise HpgenError(
                    f"{self.name}: {boundary.fqn} is sharded on several axes ({', '.join(sorted(boundary.axes))}); "
                    "hpgen plans one axis per block"
                )
        # Experts on an axis of their own also shard their intermediate dim on tp, when
        # the TP plan does: the one kind of block on two axes.
        for fqn, rule in sorted(self.expert_tp_rules.items()):
            boundary = self._enclosing(fqn if fqn in self.modules else fqn.rpartition(".")[0])
            if boundary is not None and boundary.kind == "experts" and rule.style in EXPERTS | SHARDING:
                boundary.axes.add(rule.axis)

    def _ancestors(self, fqn: str, *, include_self: bool = False) -> list[str]:
        """The modules above ``fqn`` (and ``fqn`` itself), nearest first, up to the first
        ``ModuleList`` element: a decoder layer is as far as a block may reach."""
        import torch.nn as nn

        found = []
        path = fqn if include_self else fqn.rpartition(".")[0]
        while path in self.modules and path:
            found.append(path)
            parent = path.rpartition(".")[0]
            if "." in path and isinstance(self.modules.get(parent), nn.ModuleList):
                break
            path = parent
        return found

    def _block_of_rowwise(self, fqn: str, columns: list[str]) -> str:
        for ancestor in self._ancestors(fqn):
            if any(column == ancestor or column.startswith(ancestor + ".") for column in columns):
                return ancestor
        raise HpgenError(
            f"{self.name}: rowwise {fqn} has no colwise layer in an enclosing module to shard its input; "
            "hpgen has no block to put it in"
        )

    def _widen_for(self, column: str) -> None:
        """Make the nearest ancestor of ``column`` that holds a block the block instead."""
        for ancestor in self._ancestors(column, include_self=True):
            inner = [key for key, b in self.boundaries.items() if key.startswith(ancestor + ".") and b.kind == "block"]
            if not inner:
                continue
            axes = {axis for key in inner for axis in self.boundaries[key].axes}
            for key in inner:
                del self.boundaries[key]
            self._boundary(ancestor, "block").axes.update(axes)
            return
        raise HpgenError(
            f"{self.name}: colwise {column} is sharded, but no rowwise layer or experts module near it reduces "
            "its output: hpgen has no block to put it in"
        )

    def _enclosing(self, fqn: str) -> Boundary | None:
        """The nearest boundary at ``fqn`` or above it."""
        path = fqn
        while True:
            if path in self.boundaries:
                return self.boundaries[path]
            if not path:
                return None
            path = path.rpartition(".")[0] if "." in path else ""

    def _place_params(self) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        expert_rules = [(fqn, rule) for fqn, rule in sorted(self.expert_tp_rules.items()) if fqn not in self.modules]
        for fqn, rule in [*sorted(self.rules.items()), *expert_rules]:
            style = rule.style
            if fqn in self.modules:
                if style in GRAD_REDUCE:
                    for param_name, _ in self.modules[fqn].named_parameters(recurse=False):
                        self._add_grad_reduce(f"{fqn}.{param_name}", style)
                continue
            if style not in SHARDING:
                if style in GRAD_REDUCE and not rule.via_module:
                    self._add_grad_reduce(fqn, style)
                continue  # markers (experts, all_reduce) and no-ops; module rules handled above
            owner, _, leaf = fqn.rpartition(".")
            boundary = self._enclosing(owner)
            if boundary is None:
                raise HpgenError(
                    f"{self.name}: {style} {fqn} is sharded, but no rowwise layer or experts module above it "
                    "reduces its output: hpgen has no boundary to put it in"
                )
            if rule.axis not in boundary.axes:
                raise HpgenError(
                    f"{self.name}: {fqn} is sharded on {rule.axis} inside {boundary.fqn}, which is sharded on "
                    f"{', '.join(sorted(boundary.axes))}"
                )
            inner = relative(fqn, boundary.fqn)
            layout = placement(style, params[fqn].ndim, leaf)
            boundary.params.setdefault(inner, {})[rule.axis] = layout
            if layout == "R":  # a row-parallel bias: added once, after the reduction
                boundary.deferred.add(inner)

    def _add_grad_reduce(self, fqn: str, style: str) -> None:
        boundary = self._enclosing(fqn.rpartition(".")[0])
        if boundary is None or boundary.kind in ("linear", "embedding"):
            raise HpgenError(f"{self.name}: {style} {fqn} sits in no sharded block whose gradient it could reduce over")
        boundary.grad_reduce.add(relative(fqn, boundary.fqn))

    def _implicit_grad_reduce(self) -> None:
        """Every parameter a boundary leaves replicated in its sharded body gets a partial gradient.

        In a block, each rank's backward runs through its shard of the heads or features
        only; in a wrapped ``nn.Embedding`` subclass (a norm after the lookup), through its
        vocabulary rows only. Parameters of boundaries nested inside are theirs to list.
        """
        for boundary in self.boundaries.values():
            for name, _ in boundary.module.named_parameters():
                fqn = f"{boundary.fqn}.{name}"
                if self._enclosing(fqn.rpartition(".")[0]) is boundary and name not in boundary.params:
                    boundary.grad_reduce.add(name)
