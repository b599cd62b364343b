"""Sequence-parallel rules (``--sp``): Megatron-style sequence parallelism on the ``tp`` axis.

Every decoder layer is listed by index (the first splits ``R -> S(1)`` at its input),
blocks gather ``S(1) -> R`` and reduce-scatter ``P(sum) -> S(1)``, a child of a layer
that mixes positions without being sharded (an MoE block around its experts, a recurrent
mixer) gathers and splits, norms on the shards get ``grad_reduce_params``, and the final
norm gathers at its output (when it is a class of the modeling file; otherwise the last
layer does), before the causal LM slices ``logits_to_keep`` and calls ``lm_head``.
"""

from __future__ import annotations

from typing import Any

from hpgen.errors import HpgenError
from hpgen.planner.boundary import Boundary
from hpgen.planner.load import defined_in
from hpgen.planner.signatures import self_calls

__all__ = ["SequenceParallel", "has_params", "is_norm", "is_per_token"]


class SequenceParallel:
    """The ``--sp`` step of a :class:`~hpgen.planner.translator.Translator`: decoder layers as ``sp`` boundaries."""

    modules: dict[str, Any]
    boundaries: dict[str, Boundary]
    name: str

    def _sequence_parallel(self) -> None:
        """Residual stream sharded on dim 1 between decoder layers (Megatron sequence parallel)."""
        layers_path, layers = self._decoder_layers()
        count = len(layers)
        final_norm = self._final_norm(layers_path)
        for index, (fqn, layer) in enumerate(layers):
            boundary = self._boundary(fqn, "sp")
            first = index == 0
            last_gathers = index == count - 1 and final_norm is None
            boundary.inputs[self._input(layer, fqn)] = ({"tp": "R" if first else "S(1)"}, {"tp": "S(1)"})
            names = self._outputs(layer, fqn)
            boundary.out_names = names if len(names) > 1 else None
            boundary.outputs[names[0]] = ({"tp": "S(1)"}, {"tp": "R" if last_gathers else "S(1)"})
            boundary.axes.add("tp")
            for child_name, child in layer.named_children():
                child_fqn = f"{fqn}.{child_name}"
                inner = [b for key, b in self.boundaries.items() if key == child_fqn or key.startswith(child_fqn + ".")]
                own = child_fqn in self.boundaries and self.boundaries[child_fqn].kind in ("block", "experts")
                if own:
                    self.boundaries[child_fqn].sp_input = True
                elif inner or (has_params(child) and not is_per_token(child)):
                    wrapper = self._boundary(child_fqn, "sp")
                    wrapper.inputs[self._input(child, child_fqn)] = ({"tp": "S(1)"}, {"tp": "R"})
                    child_names = self._outputs(child, child_fqn)
                    wrapper.out_names = child_names if len(child_names) > 1 else None
                    wrapper.outputs[child_names[0]] = ({"tp": "R"}, {"tp": "S(1)"})
                elif has_params(child):
                    for param_name, _ in child.named_parameters():
                        boundary.grad_reduce.add(f"{child_name}.{param_name}")
            for param_name, _ in layer.named_parameters(recurse=False):
                boundary.grad_reduce.add(param_name)
        if final_norm is not None:
            fqn, norm = final_norm
            boundary = self._boundary(fqn, "sp")
            boundary.inputs[self._input(norm, fqn)] = ({"tp": "S(1)"}, {"tp": "S(1)"})
            names = self._outputs(norm, fqn)
            boundary.out_names = names if len(names) > 1 else None
            boundary.outputs[names[0]] = ({"tp": "S(1)"}, {"tp": "R"})
            boundary.grad_reduce.update(name for name, _ in norm.named_parameters())
            boundary.axes.add("tp")

    def _decoder_layers(self) -> tuple[str, list[tuple[str, Any]]]:
        """The ``nn.ModuleList`` holding the most boundaries: the decoder layers."""
        import torch.nn as nn

        best: tuple[int, str] | None = None
        for fqn, module in self.modules.items():
            if not isinstance(module, nn.ModuleList):
                continue
            held = sum(1 for key in self.boundaries if key.startswith(fqn + "."))
            if held and (best is None or held > best[0]):
                best = (held, fqn)
        if best is None:
            raise HpgenError(
                f"{self.name}: --sp: no decoder layer holds a sharded block (the plan shards "
                f"{', '.join(sorted(self.boundaries)) or 'nothing'}), so there is no all-reduce to split"
            )
        path = best[1]
        outside = [
            key
            for key, b in self.boundaries.items()
            if b.kind in ("block", "experts") and not key.startswith(path + ".")
        ]
        if outside:
            raise HpgenError(
                f"{self.name}: --sp: the sharded blocks {', '.join(outside)} are outside the decoder layers {path}"
            )
        return path, [(f"{path}.{name}", layer) for name, layer in self.modules[path].named_children()]

    def _final_norm(self, layers_path: str) -> tuple[str, Any] | None:
        """The norm after the decoder layers, when it can gather the sequence at its output.

        It must be a class of the modeling file with a ``forward`` of its own, and the
        model's ``forward`` must call it once: a norm also applied before the layers
        (NanoChat) would gather a stream that is not sharded yet. Otherwise the last
        decoder layer gathers.
        """
        parent_path = layers_path.rpartition(".")[0]
        parent = self.modules[parent_path]
        after = False
        for name, child in parent.named_children():
            fqn = f"{parent_path}.{name}" if parent_path else name
            if fqn == layers_path:
                after = True
                continue
            if after and is_norm(child):
                info = self.index.class_named(type(child).__name__)
                if info is None or info.forward is None or not defined_in(type(child), self.source):
                    return None
                if self_calls(self.parsed, self._forward_owner(parent, parent_path).name, name) != 1:
                    return None
                return fqn, child
        return None


def is_norm(module: Any) -> bool:
    return "norm" in type(module).__name__.lower()


def is_per_token(module: Any) -> bool:
    """A layer that computes each position on its own (a norm, a linear map): it runs on sequence shards."""
    import torch.nn as nn

    return is_norm(module) or isinstance(module, nn.Linear)


def has_params(module: Any) -> bool:
    return any(True for _ in module.parameters())
