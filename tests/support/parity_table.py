"""Every multi-process parity case of the runtime tests, one row each.

A row names a transformers family (``tests/support/models.FAMILIES``), the plan (a file
of ``tests/plans`` or a function that writes one, as ``hpgen plan`` does), config
overrides, the lowering mode and the mesh. :func:`lowered_cases` lowers the rows of a
table. ``tests/runtime/forward/conftest.py`` runs every row of :data:`PARITY` in one spawn of 2
gloo ranks; ``tests/runtime/forward/test_parity.py`` checks logits, every gradient, greedy
generation and state-dict keys of each row against the unsharded transformers model.
:data:`PARITY_2D` are the rows on 4 ranks (two axes, or ``tp`` 4), run with the
compositions of ``tests/runtime/forward/test_parity_2d.py``, which checks logits, gradients and
greedy generation. A new family or plan is one line here (and the family's line in
``FAMILIES``); assertions particular to a case live beside the family's other tests.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.models import Case, load_plan_dict, lower_family, make_config


@dataclass(frozen=True)
class Row:
    """One parity case. ``plan`` is a plan name of tests/plans or a function returning a plan;
    ``file_of`` reuses another row's generated file (a plan change that keeps the contract)."""

    family: str
    plan: str | Callable[[], dict[str, Any]]
    config: Mapping[str, Any] = field(default_factory=dict)
    mode: str = "default"
    file_of: str | None = None
    mesh: tuple[tuple[str, int], ...] = ()  # (axis, size) in mesh order; () = the plan's first axis, all ranks
    parallel: bool = True  # False: the generated model as built, without parallelize

    def plan_dict(self) -> dict[str, Any]:
        return load_plan_dict(self.plan) if isinstance(self.plan, str) else self.plan()


def lowered_cases(rows: Mapping[str, Row], directory: Path) -> list[Case]:
    """Each row's :class:`~tests.support.models.Case`, its file lowered into ``directory`` as ``<name>.py``."""
    files: dict[str, str] = {}
    cases = []
    for name, row in rows.items():
        plan = row.plan_dict()
        if row.file_of is None:
            path = lower_family(row.family, plan, directory, mode=row.mode)
            files[name] = str(path.rename(directory / f"{name}.py"))
        generated = files[row.file_of or name]
        cases.append(Case(name, row.family, generated, plan, row.config, mesh=row.mesh, parallel=row.parallel))
    return cases


def hpgen_plan(family: str, **options: Any) -> Callable[[], dict[str, Any]]:
    """What ``hpgen plan`` writes for the family's tiny config (``tp=2``, ``sp=True``, ...)."""

    def make() -> dict[str, Any]:
        from hpgen.planner.model.load import meta_model
        from hpgen.planner.translate.translator import translated_plan

        return translated_plan(meta_model(make_config(family)), **options)

    make.__name__ = f"hpgen_plan_{family}"
    return make


def hpgen_plan_completed(family: str, **options: Any) -> Callable[[], dict[str, Any]]:
    """What ``hpgen plan`` writes: transformers' plan, completed from the source where it leaves blocks replicated."""

    def make() -> dict[str, Any]:
        from hpgen.planner.model.load import meta_model
        from hpgen.planner.entry.make import plan_model

        return plan_model(meta_model(make_config(family)), name=family, **options)

    make.__name__ = f"hpgen_plan_completed_{family}"
    return make


def moe_with_inner_wrapper() -> dict[str, Any]:
    """The MoE plan with an ``inner_wrapper`` around the experts' local compute function."""
    plan = load_plan_dict("qwen3_moe_tp_ep")
    plan["injections"][0]["inner_wrapper"] = {"_target_": "tests.support.models.recording", "label": "experts"}
    return plan


def moe_experts_undeclared() -> dict[str, Any]:
    """The MoE plan with the experts entry's inputs left undeclared: a tensor requiring grad that enters
    their sharded body (``hidden_states``, ``top_k_weights``) is ``R`` there, copied in with its gradient
    all-reduced (without it every gradient upstream of the experts is partial)."""
    plan = load_plan_dict("qwen3_moe_tp_ep")
    experts = plan["param_plan"]["model.layers.*.mlp.experts"]
    del experts["in_src"], experts["in_dst"]
    return plan


STARCODER2_NORMS = ("input_layernorm", "post_attention_layernorm")


def starcoder2_norm_entries() -> dict[str, Any]:
    """``hpgen plan starcoder2 --tp 2 --sp``, with the norms' gradient reductions declared on the
    ``nn.LayerNorm`` modules themselves (a class outside the file) instead of the decoder layers."""
    plan = copy.deepcopy(hpgen_plan("starcoder2", tp=2, sp=True)())
    for key, entry in plan["param_plan"].items():
        if key.startswith("model.layers.") and key.count(".") == 2:
            expected = {f"{norm}.{param}" for norm in STARCODER2_NORMS for param in ("weight", "bias")}
            assert set(entry.pop("grad_reduce_params")) == expected
    for norm in STARCODER2_NORMS:
        plan["param_plan"][f"model.layers.*.{norm}"] = {
            "in_src": {"input": {"tp": "S(1)"}},
            "in_dst": {"input": {"tp": "S(1)"}},
            "params": {"weight": {"tp": "R"}, "bias": {"tp": "R"}},
            "grad_reduce_params": ["weight", "bias"],
        }
    return plan


def starcoder2_final_norm_gathered() -> dict[str, Any]:
    """The sequence-parallel plan as Megatron writes it: the last decoder layer hands on its tokens
    sharded, the final ``nn.LayerNorm`` (a class outside the file) normalizes them there, and its
    output is gathered (``S(1) -> R``) for ``lm_head``."""
    plan = starcoder2_norm_entries()
    last = plan["param_plan"]["model.layers.1"]
    last["out_dst"] = {"output": {"tp": "S(1)"}}
    plan["param_plan"]["model.norm"] = {
        "in_src": {"input": {"tp": "S(1)"}},
        "in_dst": {"input": {"tp": "S(1)"}},
        "out_src": {"output": {"tp": "S(1)"}},
        "out_dst": {"output": {"tp": "R"}},
        "params": {"weight": {"tp": "R"}, "bias": {"tp": "R"}},
        "grad_reduce_params": ["weight", "bias"],
    }
    return plan


PARITY: dict[str, Row] = {
    # the contract's own example plan, as written there (no o_proj bias: Llama has none):
    # lm_head and embed_tokens declare no input; the wrapper copies lm_head's in itself
    "llama_spec_example": Row("llama", "llama_spec"),
    # attention heads and MLP columns/rows sharded, one all-reduce each
    "llama_tp": Row("llama", "llama_tp"),
    # + vocab-parallel embed_tokens and column-parallel lm_head, sharing one tied weight
    "llama_tp_vocab_tied": Row("llama", "llama_tp_vocab", {"tie_word_embeddings": True}),
    # the same from a file lowered in toggle mode (``if self.tp_enable:`` blocks)
    "llama_tp_vocab_toggle": Row("llama", "llama_tp_vocab", mode="toggle"),
    # + sequence parallel residual stream: 2 all-gathers and 2 reduce-scatters per layer
    "llama_tp_sp": Row("llama", "llama_tp_sp"),
    # the gather in the last decoder layer: it gets the subclass LlamaDecoderLayer_hp1
    "llama_tp_sp_layers": Row("llama", "llama_tp_sp_layers"),
    # q/k/v and gate/up biases sharded, o_proj and down_proj biases deferred
    "llama_bias": Row("llama", "llama_bias", {"attention_bias": True, "mlp_bias": True}),
    # attention in the generic form (an input in **kwargs), lm_head through DTensor R -> P
    "llama_generic": Row("llama", "llama_generic"),
    # q/k/v projections with biases, sharded with their heads
    "qwen2_tp": Row("qwen2", "qwen2_tp"),
    # per-head q_norm/k_norm (grad_reduce_params), vocab-parallel embedding and lm_head
    "qwen3_tp": Row("qwen3", "qwen3_tp"),
    # attention TP and experts EP on the same two ranks (region form, experts_parallel)
    "qwen3_moe_tp_ep": Row("qwen3_moe", "qwen3_moe_tp_ep"),
    # the same with an inner_wrapper: the contract is unchanged, so is the generated file
    "qwen3_moe_wrapped": Row("qwen3_moe", moe_with_inner_wrapper, file_of="qwen3_moe_tp_ep"),
    # the same with no in_src: the undeclared differentiable inputs get their copy all the same
    "qwen3_moe_ep_undeclared": Row("qwen3_moe", moe_experts_undeclared),
    # hpgen plan: transformers' moe_tp_experts (each expert's intermediate dim sharded)
    "qwen3_moe_hpgen_tp": Row("qwen3_moe", hpgen_plan("qwen3_moe", tp=2)),
    # the same where the whole experts suit grouped_mm (36 floats a row) but a rank's shard does not
    # (18 floats, 72 bytes): parallelize runs those experts' eager loop and says so
    "qwen3_moe_hpgen_tp_unaligned": Row("qwen3_moe", hpgen_plan("qwen3_moe", tp=2), {"moe_intermediate_size": 36}),
    # hpgen plan --ep 2: whole experts per rank
    "qwen3_moe_hpgen_ep": Row("qwen3_moe", hpgen_plan("qwen3_moe", tp=2, ep=2)),
    # transformers' plan shards the experts; the attention is completed from the source: short convolutions
    # on k/v sharded with their channels (and their cached conv states local), the relative-logits matrix
    # replicated with its gradient reduced
    "inkling_completed": Row("inkling", hpgen_plan_completed("inkling", tp=2)),
    # the same for Inkling2: dynamic convolutions' static taps S(1) and per-head taps, per-head L2-clip scales S(0)
    "inkling2_completed": Row("inkling2", hpgen_plan_completed("inkling2", tp=2)),
    # sequence-parallel nn.LayerNorm entries on a class outside the file
    "starcoder2_sp_norms": Row("starcoder2", starcoder2_norm_entries),
    # + the final nn.LayerNorm on the sharded tokens, its output gathered by the generic outside wrapper
    "starcoder2_sp_final_norm": Row("starcoder2", starcoder2_final_norm_gathered),
}


EP_TP = (("ep", 2), ("tp", 2))
TP4 = (("tp", 4),)
# The experts' intermediate dim on tp 4 is 8 floats: grouped_mm (the default experts kernel)
# needs rows of a multiple of 16 bytes, and 24 / 4 = 6 floats crashes inside torch._grouped_mm.
MOE = {"moe_intermediate_size": 32}
QWEN3_MOE_EP_TP = hpgen_plan("qwen3_moe", tp=2, ep=2, ep_axis="ep")

PARITY_2D: dict[str, Row] = {
    # experts on their own axis (hpgen plan --tp 2 --ep 2 --ep-axis ep), transformers' default expert kernels
    "qwen3_moe_ep_tp": Row("qwen3_moe", QWEN3_MOE_EP_TP, MOE, mesh=EP_TP),
    "mixtral_ep_tp": Row("mixtral", hpgen_plan("mixtral", tp=2, ep=2, ep_axis="ep"), mesh=EP_TP),
    # key/value heads replicated (hpgen plan --tp 4 of 2 KV heads): RS(0,2), with biases (qwen2), k_norm (qwen3)
    **{f"{family}_rs": Row(family, hpgen_plan(family, tp=4), mesh=TP4) for family in ("llama", "qwen2", "qwen3")},
    # one toggle-mode file: unparallelized, on tp alone (its ep axis off; the same contracts), and on ep x tp
    "toggle_none": Row("qwen3_moe", QWEN3_MOE_EP_TP, MOE, mode="toggle", parallel=False),
    "toggle_tp": Row(
        "qwen3_moe", hpgen_plan("qwen3_moe", tp=4, ep=2, ep_axis="ep"), MOE, file_of="toggle_none", mesh=TP4
    ),
    "toggle_ep_tp": Row("qwen3_moe", QWEN3_MOE_EP_TP, MOE, file_of="toggle_none", mesh=EP_TP),
}
