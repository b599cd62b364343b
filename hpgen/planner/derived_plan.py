"""A derived layout (:mod:`hpgen.planner.derive`) written as a frozen plan.

It reuses the translator of transformers' plans (:mod:`hpgen.planner.translator`) for
everything after the choice of boundaries: the inputs and outputs read from each
class's ``forward``, the replicated parameters of a sharded body in
``grad_reduce_params``, grouping of the layers into ``*`` keys, ``boundary_classes``
where static resolution needs them, and the check that the document loads. What differs is where the boundaries
come from (the derivation, not the styles) and the kinds a derivation has that
transformers' plans never produce:

- ``col_block``: a module holding only column-parallel projections, whose output stays
  sharded (``S(-1) -> S(-1)``) for the row-parallel ``nn.Linear`` after it;
- ``col_leaf`` / ``row_leaf``: one ``nn.Linear`` that ``parallelize`` wraps, column-parallel
  with its output left sharded, or row-parallel taking a sharded input and reducing;
- ``reduce_leaf``: a row-parallel ``nn.Linear`` inside a block (Mamba's ``x_proj``) whose reduced
  output the block's channel-sharded code consumes: its gradient arrives partial and is
  reduced too (``out_grad_partial``);
- ``gather_leaf``: a column-parallel ``nn.Linear`` inside a block that reads another column's
  sharded output whole (Doge's ``dt_proj``, one output per head, :mod:`hpgen.planner.gathered`):
  its input is gathered (``S(-1) -> R``, reduce-scattered in backward) and its output stays
  sharded with the heads (``S(-1) -> S(-1)``);
- ``col_gather`` / ``split_row``: a column-parallel ``nn.Linear`` whose output is gathered
  (``S(-1) -> R``) and a row-parallel one that splits its replicated input (``R -> S(-1)``),
  around a body that runs replicated (a state-space mixer whose packed projection no
  placement cuts);
- ``split_row_leaf``: the same split row on its own, where no group shards a projection into the
  stream (:mod:`hpgen.planner.split_rows`); ``--sp`` leaves it replicated;
- ``attrs`` / ``alias``: entries that are not boundaries, holding only ``tp_divide_attrs``
  or the layout of a parameter registered under a second name.
"""

from __future__ import annotations

from typing import Any

from hpgen.errors import HpgenError
from hpgen.placement import Placement
from hpgen.planner.boundary import Boundary
from hpgen.planner.modules import generic
from hpgen.planner.derive import Derivation, Placed
from hpgen.planner.entries import BATCH_MAJOR
from hpgen.planner.translator import Translator

__all__ = ["derived_plan"]

BATCH_MAJOR_HEADS = "hpgen.runtime.local_heads.batch_major_heads"

_KINDS = {
    "block": "block",
    "col_block": "block",
    "col_leaf": "linear",
    "row_leaf": "linear",
    "reduce_leaf": "linear",
    "gather_leaf": "linear",
    "col_gather": "linear",
    "split_row": "linear",
    "split_row_leaf": "linear",
    "lm_head": "linear",
    "embedding": "embedding",
    "attrs": "attrs",
    "alias": "attrs",
    "heads": "block",
}


def derived_plan(model: Any, derivation: Derivation, *, tp: int | None, sp: bool = False, name: str) -> dict[str, Any]:
    """The frozen plan document of ``derivation`` for ``model``."""
    if sp and any(p.kind == "split_row_leaf" for p in derivation.placed.values()):
        # a split row reduces to the replicated stream, which --sp keeps sequence-sharded: left replicated
        kept = {fqn: p for fqn, p in derivation.placed.items() if p.kind != "split_row_leaf"}
        derivation = type(derivation)(placed=kept, notes=list(derivation.notes))
    if sp:
        leaf_kinds = ("col_block", "col_leaf", "row_leaf", "col_gather", "split_row")
        leaves = sorted(p.fqn for p in derivation.placed.values() if p.kind in leaf_kinds)
        if leaves:
            raise HpgenError(
                f"{name}: --sp needs every sharded group in a block of its own; the derived plan shards "
                f"{generic(leaves[0])} on its own (the module around it adds a residual or a norm)"
            )
    return _DerivedTranslator(model, derivation, tp=tp, sp=sp, name=name).plan()


class _DerivedTranslator(Translator):
    def __init__(self, model: Any, derivation: Derivation, *, tp: int | None, sp: bool, name: str) -> None:
        self.derivation = derivation
        self.placed: dict[str, Placed] = {}
        super().__init__(model, tp=tp, ep=None, sp=sp, ep_axis=None, name=name)

    def _rules(self, tp: int | None, ep: int | None, ep_axis: str | None = None) -> tuple[dict, tuple[str, ...]]:
        self.sizes = {"tp": tp} if tp is not None else {}
        return {}, ("tp",)

    def _find_boundaries(self) -> None:
        for fqn, placed in sorted(self.derivation.placed.items()):
            boundary = self._boundary(fqn, _KINDS[placed.kind])
            boundary.axes.add("tp")
            self.placed[fqn] = placed

    def _place_params(self) -> None:
        for fqn, placed in self.placed.items():
            boundary = self.boundaries[fqn]
            boundary.params = {name: {"tp": str(placement)} for name, placement in placed.params.items()}
            boundary.deferred = set(placed.deferred)

    def _implicit_grad_reduce(self) -> None:
        """The derivation says which replicated parameters the sharded body runs through (the norms
        before the columns, per-head norms, scales read between the projections); only their
        gradients are partial. A parameter a block merely returns (GPT-NeoX-Japanese's
        ``dense_bias``, added by the caller) keeps its full gradient."""
        for fqn, boundary in self.boundaries.items():
            placed = self.placed.get(fqn)
            if placed is not None and placed.kind in ("block", "col_block"):
                boundary.grad_reduce.update(placed.grad_reduce)

    def _check_sizes(self) -> None:
        """The derivation checked heads and vocabulary against ``--tp`` already."""

    def _set_io(self, boundary: Boundary) -> None:
        placed = self.placed.get(boundary.fqn)
        kind = placed.kind if placed is not None else None
        replicated = {"tp": "R"}
        if kind in ("attrs", "alias"):
            return
        if kind == "lm_head":
            boundary.wrapped_as = "nn.Linear"
            boundary.inputs["input"] = (dict(replicated), dict(replicated))
            boundary.outputs["output"] = ({"tp": "S(-1)"}, dict(replicated))
            return
        if kind == "col_gather":
            boundary.wrapped_as = "nn.Linear"
            boundary.inputs["input"] = (dict(replicated), dict(replicated))
            boundary.outputs["output"] = ({"tp": "S(-1)"}, dict(replicated))
            return
        if kind == "gather_leaf":  # a sharded column's output, gathered whole; one output per local head
            boundary.wrapped_as = "nn.Linear"
            boundary.inputs["input"] = ({"tp": "S(-1)"}, dict(replicated))
            boundary.outputs["output"] = ({"tp": "S(-1)"}, {"tp": "S(-1)"})
            return
        if kind == "split_row":
            boundary.wrapped_as = "nn.Linear"
            boundary.inputs["input"] = (dict(replicated), {"tp": "S(-1)"})
            boundary.outputs["output"] = ({"tp": "P(sum)"}, dict(replicated))
            return
        if kind == "embedding":
            boundary.wrapped_as = "nn.Embedding"
            boundary.outputs["output"] = ({"tp": "P(sum)"}, dict(replicated))
            return
        if kind == "col_leaf":
            boundary.wrapped_as = "nn.Linear"
            boundary.inputs["input"] = (dict(replicated), dict(replicated))
            boundary.outputs["output"] = ({"tp": "S(-1)"}, {"tp": "S(-1)"})
            return
        if kind == "split_row_leaf":  # a replicated input, split on entry (no communication)
            boundary.wrapped_as = "nn.Linear"
            boundary.inputs["input"] = (dict(replicated), {"tp": "S(-1)"})
            boundary.outputs["output"] = ({"tp": "P(sum)"}, dict(replicated))
            return
        if kind in ("row_leaf", "reduce_leaf"):
            boundary.wrapped_as = "nn.Linear"
            boundary.inputs["input"] = ({"tp": "S(-1)"}, {"tp": "S(-1)"})
            boundary.outputs["output"] = ({"tp": "P(sum)"}, dict(replicated))
            return
        if kind == "heads":  # only the per-head inputs move; the leaves inside do the rest
            for name, placement in sorted(placed.head_inputs.items()):
                dst = {"tp": str(placement)} if isinstance(placement, Placement) else dict(replicated)
                boundary.inputs[name] = (dict(replicated), dst)
            return
        if placed is None:  # a decoder layer or the final norm of --sp: the translator's own
            super()._set_io(boundary)
            return
        # a block: every input that feeds the columns is R -> R (its gradient comes back partial);
        # entered from the sequence-sharded stream (--sp) it gathers S(1) first and reduce-scatters after
        parameters = self._parameters(boundary.module, boundary.fqn)
        for name in placed.inputs:
            if name not in parameters and name not in self._keyword_names(boundary):
                raise HpgenError(f"{self.name}: {boundary.fqn}: {name} is not a parameter of its forward")
            src = {"tp": "S(1)"} if boundary.sp_input and name == parameters[0] else dict(replicated)
            boundary.inputs[name] = (src, dict(replicated))
        for name, placement in sorted(placed.head_inputs.items()):
            # a per-head tensor made outside the block (MPT's position_bias): each rank keeps its heads' slice
            if name not in parameters and name not in self._keyword_names(boundary):
                raise HpgenError(f"{self.name}: {boundary.fqn}: {name} is not a parameter of its forward")
            if isinstance(placement, Placement):  # cut on its head dim; a batch-major one by the region
                boundary.inputs[name] = (dict(replicated), {"tp": str(placement)})
        names = self._outputs(boundary.module, boundary.fqn)
        boundary.out_names = names if len(names) > 1 else None
        if kind == "col_block":
            boundary.outputs[names[0]] = ({"tp": "S(-1)"}, {"tp": "S(-1)"})
        else:
            dst = {"tp": "S(1)"} if boundary.sp_input else dict(replicated)
            if boundary.sp_input:
                boundary.grad_reduce.update(boundary.deferred)  # added to a sequence shard
            boundary.outputs[names[0]] = ({"tp": "P(sum)"}, dst)

    def _document(self) -> dict[str, Any]:
        """The translator's document, plus the region injections of blocks whose per-head input fuses
        the heads into the batch dim (BLOOM's ``alibi``): see :mod:`hpgen.runtime.local_heads`."""
        document = super()._document()
        injections = list(document.get("injections", []))
        for key, (boundary, _) in sorted(self._grouped().items()):
            placed = self.placed.get(boundary.fqn)
            names = sorted(n for n, p in placed.head_inputs.items() if p == BATCH_MAJOR) if placed else []
            if names:
                target = {"_target_": BATCH_MAJOR_HEADS, "head_inputs": names, "global_heads": placed.global_heads}
                injections.append({"match": key, "local_compute_fn": {**target, "axis": "tp"}})
        if injections:
            document["injections"] = injections
        return document

    def _keyword_names(self, boundary: Boundary) -> set[str]:
        forward = self._forward_owner(boundary.module, boundary.fqn).forward
        return {p.name for p in forward.parameters} if forward is not None else set()

    def _entry(self, boundary: Boundary) -> dict[str, Any]:
        entry = boundary.entry()
        placed = self.placed.get(boundary.fqn)
        if placed is not None and placed.divide:
            entry["tp_divide_attrs"] = sorted(placed.divide)
        if placed is not None and placed.kind == "reduce_leaf":
            entry["out_grad_partial"] = ["output"]
        return entry

    def _boundary_classes(self, groups: dict[str, tuple[Boundary, dict[str, Any]]]) -> dict[str, str]:
        lowered = {key: value for key, value in groups.items() if value[0].kind != "attrs"}
        return super()._boundary_classes(lowered)
