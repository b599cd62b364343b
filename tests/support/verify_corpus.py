"""The plans ``tests/verify/test_verify.py`` proves with ``hpgen verify``: wrong ones, each a mistake a user
makes, and the plans ``hpgen plan`` writes for a dozen architectures.

A wrong plan is a correct ``hpgen plan`` plan (of the full default config, as a user has it)
with one mistake, and the module ``hpgen verify`` must name: its FQN (a prefix where the
first departing layer may be either) and the side (forward output, backward gradient, the
module that raised, or parallelize's refusal).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any


@cache
def written_plan(model_type: str, attn_dp: bool = False, **flags: Any) -> dict[str, Any]:
    """What ``hpgen plan MODEL_TYPE --tp 2 [--sp] [--ep 2] [--cp 2] [--attn-dp]`` writes (the full default
    config); ``tp=None``: no ``--tp``."""
    from hpgen.planner.entry.make import make_plan

    flags = {"tp": 2, **flags}
    if not attn_dp:
        return make_plan(model_type, **flags)
    from hpgen.planner.model.load import load_config, meta_model
    from hpgen.planner.passes.data_parallel_attention import data_parallel_attention

    return data_parallel_attention(meta_model(load_config(model_type)), make_plan(model_type, **flags), model_type)


@cache
def tiny_written_plan(model_type: str, **flags: Any) -> dict[str, Any]:
    """What ``hpgen plan`` writes for the tiny config ``hpgen verify`` shrinks to (``tiny_config``)."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model, model_and_config
    from hpgen.verify.shrink import tiny_config

    _, config = model_and_config(tiny_config(model_type))
    return plan_model(meta_model(config), tp=2, name=model_type, **flags)


@dataclass(frozen=True)
class Wrong:
    """One mistake: the base plan, the edit, and where ``hpgen verify`` must locate it."""

    model_type: str
    edit: Callable[[dict[str, Any]], None]
    fqn: str  # the located module's FQN starts with this
    side: str  # "forward", "backward", "raised" (the forward raised there), "parallelize" (refused, naming it)
    flags: tuple[tuple[str, Any], ...] = ()
    entry: str | None = None  # the plan key the report must name
    planner: bool = True  # the report says what hpgen plan would declare at the located entry (False: it is alike)

    def plan(self) -> dict[str, Any]:
        plan = copy.deepcopy(written_plan(self.model_type, **dict(self.flags)))
        self.edit(plan["param_plan"])
        return plan


def _set(key: str, field: str, name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(entries: dict[str, Any]) -> None:
        entries[key][field][name] = value

    return edit


def _drop_grad_reduce(prefix: str, keep_norm: bool = True) -> Callable[[dict[str, Any]], None]:
    def edit(entries: dict[str, Any]) -> None:
        for key, entry in entries.items():
            if key.startswith(prefix):
                entry.pop("grad_reduce_params", None)

    return edit


def _gpt2_fused(placement_weight: str, placement_bias: str) -> Callable[[dict[str, Any]], None]:
    def edit(entries: dict[str, Any]) -> None:
        params = entries["transformer.h.*.attn"]["params"]
        params["c_attn.weight"] = {"tp": placement_weight}
        params["c_attn.bias"] = {"tp": placement_bias}

    return edit


def _reversed_out_names(entries: dict[str, Any]) -> None:
    entry = entries["model.layers.*.self_attn"]
    entry["out_names"] = list(reversed(entry["out_names"]))


def _bias_deferred_and_reduced(entries: dict[str, Any]) -> None:
    entries["transformer.h.*.mlp"]["grad_reduce_params"] = ["c_proj.bias"]


def _bias_not_deferred(entries: dict[str, Any]) -> None:
    del entries["transformer.h.*.mlp"]["deferred_bias_params"]


def _no_divide(entries: dict[str, Any]) -> None:
    del entries["transformer.h.*.attn"]["tp_divide_attrs"]


SP = (("sp", True),)
CP = (("cp", 2), ("tp", None))  # hpgen plan --cp 2
CP_TP_SP = (("cp", 2), ("sp", True))  # hpgen plan --cp 2 --tp 2 --sp: 4 ranks
ATTN_DP = (("ep", 2), ("tp", None), ("attn_dp", True))  # hpgen plan --ep 2 --attn-dp


def _rotary_not_cut(entries: dict[str, Any]) -> None:
    entries["model.rotary_emb"]["out_dst"] = {name: {"cp": "R"} for name in entries["model.rotary_emb"]["out_dst"]}

WRONG: dict[str, Wrong] = {
    # the attention's row-parallel o_proj leaves a partial sum; R says there is nothing to reduce
    "attention_out_R_for_P": Wrong("llama", _set("model.layers.*.self_attn", "out_src", "attn_output", {"tp": "R"}),
                                   "model.layers.0.self_attn", "forward", entry="model.layers.*.self_attn"),
    "mlp_out_R_for_P": Wrong("llama", _set("model.layers.*.mlp", "out_src", "output", {"tp": "R"}),
                             "model.layers.0.mlp", "forward", entry="model.layers.*.mlp"),
    # gate cut by columns, up left whole: act(gate) * up of a half and a whole
    "gate_up_other_columns": Wrong("llama", _set("model.layers.*.mlp", "params", "up_proj.weight", {"tp": "R"}),
                                   "model.layers.0.mlp", "raised", entry="model.layers.*.mlp"),
    # the query projection cut on its input features: a matmul of the wrong shapes
    "shard_dim_crashes": Wrong("llama", _set("model.layers.*.self_attn", "params", "q_proj.weight", {"tp": "S(1)"}),
                               "model.layers.0.self_attn.q_proj", "raised", entry="model.layers.*.self_attn"),
    # out_names in the wrong order: the reduction lands on the attention weights
    "out_names_order": Wrong("llama", _reversed_out_names, "model.layers.0.self_attn", "forward",
                             entry="model.layers.*.self_attn"),
    # the embedding's vocabulary-parallel lookup is a partial sum (parallelize refuses: it wraps the embedding)
    "embedding_out_R_for_P": Wrong("llama", _set("model.embed_tokens", "out_src", "output", {"tp": "R"}),
                                   "model.embed_tokens", "parallelize"),
    # a column-parallel lm_head whose output is declared whole: never gathered (parallelize refuses)
    "lm_head_not_gathered": Wrong("llama", _set("lm_head", "out_src", "output", {"tp": "R"}),
                                  "lm_head", "parallelize"),
    # lm_head's output gather left out (out_dst S(-1)): right by its own entry, but the model returns a shard
    "lm_head_gather_removed": Wrong("llama", _set("lm_head", "out_dst", "output", {"tp": "S(-1)"}),
                                    "lm_head", "forward", entry="lm_head"),
    # sequence parallelism: the norms of a sequence-sharded stream see half the tokens each
    "sp_missing_grad_reduce": Wrong("llama", _drop_grad_reduce("model.layers."), "model.layers.", "backward", SP),
    # sequence parallelism: the attention's input declared whole while the stream is cut by tokens
    "sp_input_declared_R": Wrong("llama", _set("model.layers.*.self_attn", "in_src", "hidden_states", {"tp": "R"}),
                                 "model.layers.0.self_attn", "raised", SP, entry="model.layers.*.self_attn"),
    # per-head q/k norms on head-sharded activations: partial weight gradients
    "qk_norm_missing_grad_reduce": Wrong("qwen3", _drop_grad_reduce("model.layers.*.self_attn"),
                                         "model.layers.", "backward", entry="model.layers.*.self_attn"),
    # GPT-2's fused c_attn (q, k, v side by side) cut as one matrix: rank 0 gets q and half of k
    "fused_qkv_without_blocks": Wrong("gpt2", _gpt2_fused("S(1)", "S(0)"), "transformer.h.0.attn", "forward",
                                      entry="transformer.h.*.attn"),
    # an SS block count that is off: 2 blocks of a 3-block layout
    "ss_block_count_off": Wrong("gpt2", _gpt2_fused("SS(1,2)", "SS(0,2)"), "transformer.h.0.attn", "forward",
                                entry="transformer.h.*.attn"),
    # a deferred bias (added once, after the reduction) whose gradient is all-reduced too: twice its gradient
    "bias_deferred_and_reduced": Wrong("gpt2", _bias_deferred_and_reduced, "transformer.h.", "backward",
                                       entry="transformer.h.*.mlp"),
    # the row-parallel bias added by every rank before the reduction: twice the bias
    "row_bias_not_deferred": Wrong("gpt2", _bias_not_deferred, "transformer.h.0.mlp", "forward",
                                   entry="transformer.h.*.mlp"),
    # split_size not divided: the local fused projection split at the full width
    "missing_tp_divide_attrs": Wrong("gpt2", _no_divide, "transformer.h.0.attn", "raised",
                                     entry="transformer.h.*.attn"),
    # context parallelism: the rotary (cos, sin) left whole while the tokens are cut: the first attention
    # (the located entry is as hpgen plan writes it: the mistake is the rotary's, upstream)
    "cp_rotary_not_cut": Wrong("llama", _rotary_not_cut, "model.layers.0.self_attn", "raised", CP,
                               entry="model.layers.*.self_attn", planner=False),
    # context parallelism: each rank's weight gradients come from its tokens only, never summed over cp
    "cp_missing_grad_reduce": Wrong("llama", _drop_grad_reduce("model.layers."), "model.layers.", "backward", CP),
    # the same at cp 2 x tp 2 with --sp: the stream cut on both axes, gathered over tp, then cp, to be compared
    "cp_tp_sp_missing_grad_reduce": Wrong("llama", _drop_grad_reduce("model.layers."), "model.layers.", "backward",
                                          CP_TP_SP, planner=False),
}

# what `hpgen plan` writes, verified exact: (model type, flags)
CORRECT: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "llama": ("llama", ()),
    "llama_sp": ("llama", SP),
    "qwen2": ("qwen2", ()),
    "qwen3": ("qwen3", ()),
    "qwen3_sp": ("qwen3", SP),
    "gpt2": ("gpt2", ()),
    "starcoder2_sp": ("starcoder2", SP),
    "olmo2": ("olmo2", ()),
    "phi3": ("phi3", ()),
    "gpt_neox": ("gpt_neox", ()),
    "qwen3_moe_ep": ("qwen3_moe", (("ep", 2),)),
    "mixtral": ("mixtral", ()),
    "qwen3_moe_attn_dp": ("qwen3_moe", ATTN_DP),
    "llama_cp": ("llama", CP),
    "qwen3_cp_tp": ("qwen3", (("cp", 2),)),  # cp 2 x tp 2: 4 ranks
    "llama_cp_tp_sp": ("llama", CP_TP_SP),
}

# every planner mode's plan, verified exact again with eager attention (the corpus runs sdpa, the default)
EAGER = ("llama", "llama_sp", "qwen3_moe_ep", "qwen3_moe_attn_dp", "llama_cp", "qwen3_cp_tp")

# the same, planned for the tiny config (as benchmarks/coverage.py plans): where planning the full default
# config costs half a minute (cpmant's 48 layers)
CORRECT_TINY: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    # the sequence-sharded decoder layer hands position_bias (requiring grad) to its attention, which declares
    # it R -> S(1): copied in the layer as well, its gradient came back twice
    "cpmant_sp": ("cpmant", SP),
    # every decoder layer multiplies its sequence shard by per_layer_input (requiring grad), which the model
    # computes for the whole sequence: split R -> S(1) at each layer, its gradient gathered back
    "gemma4_text_sp": ("gemma4_text", SP),
    # Inkling's shared experts, stacked weights of their own beside the routed experts: transformers 5.25's plan
    # leaves them out and hpgen reads their rules from the weights' shapes (planner/translate/expert_tp.py);
    # 5.24's plan shards them itself. Both attentions run (EAGER_TINY)
    "inkling_text": ("inkling_text", ()),
}

# the same again with eager attention
EAGER_TINY = ("inkling_text",)


def in_this_release(model_type: str) -> bool:
    """Whether the installed transformers has ``model_type`` (a corpus case of a type it lacks is skipped)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


# Falcon's attention in each of its forms (transformers 5.25 moved it to the attention interface, whose eager
# path repeats key/value heads by num_key_value_groups and whose sdpa path may not: eager and sdpa both run), as
# `hpgen plan CONFIG --tp 2` writes it for a small config.json: name -> (FalconConfig arguments, attention)
FALCON_SHAPES: dict[str, dict[str, Any]] = {
    "multi_query_8x8": {"hidden_size": 64, "num_attention_heads": 8},  # heads divide; head_dim = the head count
    "multi_query_7": {"hidden_size": 56, "num_attention_heads": 7},  # Falcon-7B's uneven heads (71 at --tp 2)
    "grouped_8_kv2": {"hidden_size": 64, "num_attention_heads": 8, "new_decoder_architecture": True, "num_kv_heads": 2},
    "grouped_6_kv3": {"hidden_size": 96, "num_attention_heads": 6, "new_decoder_architecture": True, "num_kv_heads": 3},
    "per_head_3": {"hidden_size": 48, "num_attention_heads": 3, "multi_query": False},  # q, k, v interleaved per head
    # heads that divide: the tiny copy has 4 heads, and num_kv_heads (8 in this config) must follow them
    "per_head_8x8": {"hidden_size": 64, "num_attention_heads": 8, "multi_query": False},
}
FALCON: dict[str, tuple[dict[str, Any], str]] = {
    f"falcon_{shape}_{attention}": (config, attention)
    for shape, config in FALCON_SHAPES.items()
    for attention in ("sdpa", "eager")
}


def falcon_config(arguments: dict[str, Any]) -> Any:
    """A small Falcon config (2 layers) of the given shape."""
    from transformers import FalconConfig

    return FalconConfig(num_hidden_layers=2, vocab_size=127, **arguments)


def config_plan(config: Any) -> dict[str, Any]:
    """What ``hpgen plan config.json --tp 2`` writes for ``config`` (built on the meta device)."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    return plan_model(meta_model(config), tp=2, name=config.model_type)
