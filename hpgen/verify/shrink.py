"""A tiny copy of a model's config: the same architecture and layer structure, sizes shrunk.

``hpgen verify`` proves a plan on such a copy, and ``benchmarks/coverage.py`` runs every
architecture on one. The shrunk sizes keep what a plan shards dividing over its axes: 4
query and 2 key/value heads of 16 features, 4 experts, and odd sizes where a shard may be
uneven (vocabulary rows, MLP intermediate) so that tensor_split's uneven chunks run too.
:func:`shape_for` scales the heads and experts for larger axes; :func:`kept_heads` keeps head
counts that do not divide the axis (and a whole-head plan's), shrinking ``head_dim`` instead,
and :func:`scaled_units` the plan's units with it, so the copy has the heads the job runs.
transformers is imported inside the functions that build a config.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpgen.core.model_config import config_value

__all__ = [
    "CONFIG_FIXES",
    "TINY",
    "all_configs",
    "axis_sizes",
    "fold_layers",
    "kept_heads",
    "more_layers",
    "scaled_units",
    "shape_for",
    "stages_for_layers",
    "tiny_config",
]

# The tiny shape, applied to the keys a config has: head_dim 16 with 4 query and 2 KV heads
# (GQA), 4 experts of which 2 are routed per token, and odd sizes where a shard may be
# uneven (vocabulary rows, MLP intermediate), so the uneven tensor_split chunks run too.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_attention_heads_per_layer": 4,
    "head_dim": 16,
    "intermediate_size": 89,
    "vocab_size": 127,
    "max_position_embeddings": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k_experts": 2,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 24,
    "v_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_d_state": 16,
    "mamba_d_ssm": 128,
    "ssm_state_size": 16,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "sliding_window": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 127,
    "num_kv_shared_layers": 0,
    "num_nextn_predict_layers": 0,
    "intermediate_size_mlp": 89,
    "dense_intermediate_size": 89,
    "moe_hidden_size": 24,
    "embedding_rank": 32,
    "rotary_dim": 8,
    "unpadded_vocab_size": 127,
    # the feed-forward width and heads of the encoder-decoder and CTRL-style configs (even: some require it);
    # GPT-2-style configs keep n_inner None: 4 x hidden, their own default
    "ffn_dim": 90,
    "decoder_ffn_dim": 90,
    "encoder_ffn_dim": 90,
    "dff": 90,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
}
# Model types whose default config, made tiny, needs one more change to be a valid config at all. Each
# fixes only what the config's own validator or transformers' model code demands, as the comment says.
CONFIG_FIXES: dict[str, dict[str, Any]] = {
    # 7 tokens are too few for block-sparse attention; transformers itself falls back to full attention
    # then, swapping the attention modules at run time
    "big_bird": {"attention_type": "original_full"},
    # hidden 64 * expand 2 must equal num_heads * head_dim 16
    "mamba2": {"num_heads": 8},
    # "ZAYA currently supports num_experts_per_tok=1 only"
    "zaya": {"num_experts_per_tok": 1},
    # the default lists attention and MLP blocks separately (halved at load) and splits the layers into
    # input, recurrent and output groups, which must add up
    "dory": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
    },
    # the shared transformer is tied across hybrid layers: at least two of them
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid", "hybrid"]},
    # a causal LM only as a decoder; axial position embeddings add up to the hidden size and the positions
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 16]},
    # the default attention config lacks rope_theta and clip_qkv (transformers' own default does not build)
    "dbrx": {
        "attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 89, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # the default has no layer_types (transformers' own default does not build)
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # the causal LM takes one row of ids per codebook: two codebooks for the batch of two sequences
    "musicgen_decoder": {"num_codebooks": 2},
    "musicgen_melody_decoder": {"num_codebooks": 2},
    # BLT's nested configs: the byte-group hash embeddings have 500002 rows per group size (192M
    # parameters, a vocabulary TINY does not reach); the global transformer's hidden size must be the
    # local encoder's times cross_attn_k (default 1024 x 2 = 2048), and BltConfig computes the global
    # input size from the encoder config it is given (before the sub-configs are made tiny): every
    # hidden size 64, one cross-attention repeat, the local decoder reading the global size 64
    "blt": {
        "encoder_hash_byte_group_vocab": 127,
        "cross_attn_k": 1,
        "encoder_config": {"hidden_size": 64, "hidden_size_global": 64, "cross_attn_k": 1},
        "decoder_config": {"hidden_size_global": 64, "cross_attn_k": 1},
    },
    # rope parameters are per layer type (transformers' own default has none)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
}

LAYERS = 2
MAX_LAYERS = 4
# Layer counts under other names (encoder-decoder halves, GPT-2 style configs without an attribute_map entry).
LAYER_KEYS = ("decoder_layers", "num_decoder_layers", "n_layer", "n_layers", "num_layers")


def _per_layer_lists(defaults: dict[str, Any], count: int) -> list[str]:
    """Config keys holding one value per layer (a list as long as the layer count)."""
    return sorted(
        key for key, value in defaults.items() if isinstance(value, (list, tuple)) and len(value) == count and count > 1
    )


def _layer_choice(defaults: dict[str, Any], keys: list[str], count: int) -> list[int]:
    """Layer indices covering each distinct per-layer combination once (at least two layers)."""
    seen, chosen = set(), []
    for index in range(count):
        combination = tuple(json.dumps(defaults[key][index], sort_keys=True, default=str) for key in keys)
        if combination not in seen:
            seen.add(combination)
            chosen.append(index)
    chosen = chosen[:MAX_LAYERS]
    while len(chosen) < LAYERS:
        chosen.append(next(i for i in range(count) if i not in chosen))
    return sorted(chosen)


def _overrides(defaults: dict[str, Any], aliases: dict[str, str], shape: dict[str, Any] | None) -> dict[str, Any]:
    """The tiny shape as keyword arguments for a config whose defaults are ``defaults``."""
    overrides: dict[str, Any] = {}
    for key, value in {**TINY, **(shape or {})}.items():
        key = aliases.get(key, key)
        if key in defaults:
            overrides[key] = _fit(value, defaults[key])
    _follow_key_value_heads(overrides, defaults, aliases, shape)
    mla = "kv_lora_rank" in defaults
    if mla and "num_key_value_heads" in defaults:  # MLA: as many key/value heads as query heads
        overrides["num_key_value_heads"] = TINY["num_attention_heads"]
    if mla and defaults.get("head_dim"):  # rotary on the qk_rope_head_dim part of each head
        overrides["head_dim"] = overrides.get("qk_rope_head_dim", TINY["qk_rope_head_dim"])
    if "qk_head_dim" in defaults and {"qk_nope_head_dim", "qk_rope_head_dim"} <= set(overrides):
        overrides["qk_head_dim"] = overrides["qk_nope_head_dim"] + overrides["qk_rope_head_dim"]
    layers_key = aliases.get("num_hidden_layers", "num_hidden_layers")
    if layers_key not in defaults:  # encoder-decoder halves and older configs name it otherwise
        layers_key = next((k for k in LAYER_KEYS if isinstance(defaults.get(k), int)), layers_key)
    for key in ("encoder_layers", "num_encoder_layers", *LAYER_KEYS):  # the other half's (or stack's) count
        if key != layers_key and isinstance(defaults.get(key), int) and defaults[key] > LAYERS:
            overrides[key] = LAYERS
    count = defaults.get(layers_key)
    if isinstance(count, int):
        keys = _per_layer_lists(defaults, count)
        chosen = _layer_choice(defaults, keys, count) if keys else list(range(LAYERS))
        overrides[layers_key] = len(chosen)
        for key in keys:
            values = overrides.get(key, defaults[key])
            overrides[key] = [values[index] for index in chosen]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in defaults and defaults[key] is not None:
            overrides[key] = 0
    rope = defaults.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        rotary = overrides.get("qk_rope_head_dim") if mla else overrides.get("head_dim", TINY["head_dim"])
        overrides["rope_parameters"] = {**rope, "mrope_section": _rescaled(rope["mrope_section"], rotary // 2)}
    return overrides


# Key/value head counts a config sets under another name than ``num_key_value_heads``, which the modeling code
# reads in its place (Falcon's ``num_kv_heads``; transformers 5.25's FalconConfig derives num_key_value_heads from it).
KEY_VALUE_HEAD_KEYS = ("num_kv_heads",)


def _follow_key_value_heads(
    overrides: dict[str, Any], defaults: dict[str, Any], aliases: dict[str, str], shape: dict[str, Any] | None
) -> None:
    """Shrink the key/value head counts of :data:`KEY_VALUE_HEAD_KEYS` with the query heads, into ``overrides``.

    Left as the given config has them, they no longer fit the tiny query heads: Falcon's per-head attention (one
    key/value head a query head) with 8 heads shrunk to 4 kept ``num_kv_heads`` 8, a config transformers' own model
    fails on. A count equal to the query heads stays equal to the tiny ones; any other is the tiny
    ``num_key_value_heads`` (2, or the count :func:`kept_heads` keeps).
    """
    heads_key = aliases.get("num_attention_heads", "num_attention_heads")
    heads, tiny_heads = defaults.get(heads_key), overrides.get(heads_key)
    for key in KEY_VALUE_HEAD_KEYS:
        given = defaults.get(key)
        if not isinstance(given, int) or not isinstance(tiny_heads, int):
            continue
        overrides[key] = tiny_heads if given == heads else {**TINY, **(shape or {})}["num_key_value_heads"]


def _key_value_heads(config: Any) -> Any:
    """The config's key/value head count: ``num_key_value_heads``, or its other name (:data:`KEY_VALUE_HEAD_KEYS`)."""
    found = config_value(config, "num_key_value_heads")
    for key in KEY_VALUE_HEAD_KEYS:
        if not isinstance(found, int):
            found = config_value(config, key)
    return found


def tiny_config(model: str | Any, shape: dict[str, Any] | None = None) -> Any:
    """A small config of ``model`` (a model type, or a config): the tiny shape (``TINY`` updated
    with ``shape``) on the keys it has.

    A model type starts from transformers' default config; a given config keeps every value
    it sets otherwise than that default (a rope scaling, biases, the layer pattern), with its
    sizes shrunk. Per-layer lists (``layer_types``, ``mlp_layer_types``, ...) keep one layer
    of each distinct combination, so a hybrid or partly-MoE model keeps every kind of layer. A
    key whose default is 0 stays 0 (it turns a feature off, e.g. no rotary part in an MLA head);
    a per-layer list of sizes gets the tiny size on every layer; multimodal rotary sections
    are rescaled to the tiny head. A config that rejects grouped-query attention is retried
    with as many key/value heads as query heads.
    """
    from transformers import AutoConfig

    from hpgen.planner.model.load import model_and_config

    model_type = model if isinstance(model, str) else model.model_type
    default = AutoConfig.for_model(model_type)
    given = default if isinstance(model, str) else model
    overrides = _overrides(given.to_dict(), getattr(given, "attribute_map", {}) or {}, shape)
    overrides.update(CONFIG_FIXES.get(model_type, {}))
    overrides = {**_changed(given, default), **overrides}
    try:
        config = AutoConfig.for_model(model_type, **overrides)
    except Exception:  # e.g. an architecture without grouped-query attention
        if "num_key_value_heads" not in overrides:
            raise
        config = AutoConfig.for_model(model_type, **{**overrides, "num_key_value_heads": TINY["num_attention_heads"]})
    built = model_and_config(config)[1]
    if built is not config:  # the causal LM is built from a sub-config (llama4 -> llama4_text): shrink that
        return tiny_config(built if not isinstance(model, str) else built.model_type, shape)
    for sub in list(all_configs(config))[1:]:  # vision, audio, text parts of a multimodal config: tiny too
        for key, value in _overrides(sub.to_dict(), getattr(sub, "attribute_map", {}) or {}, shape).items():
            try:
                setattr(sub, key, value)
            except Exception:  # a validated field that refuses the tiny value keeps its default
                continue
    config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    if _reads_is_decoder(model_and_config(config)[0]):  # BERT-style models are causal LMs only as decoders
        config.is_decoder = True
    # Attention and experts implementations stay transformers' defaults (sdpa, grouped_mm):
    # what users get.
    for sub in all_configs(config):
        if hasattr(sub, "use_cache"):
            sub.use_cache = False
    return config


# bookkeeping keys of a config's dict that are no constructor arguments
_NOT_ARGUMENTS = ("model_type", "transformers_version", "architectures", "_name_or_path", "auto_map")


def _changed(config: Any, default: Any) -> dict[str, Any]:
    """What ``config`` sets otherwise than its type's default (nothing for the default itself)."""
    if config is default:
        return {}
    mine, base = config.to_dict(), default.to_dict()
    return {
        key: value
        for key, value in mine.items()
        if key not in _NOT_ARGUMENTS and not isinstance(value, dict) and base.get(key, object()) != value
    }


def _reads_is_decoder(cls: type) -> bool:
    """Whether the model's modeling file reads ``config.is_decoder`` (a BERT-style encoder used as a decoder)."""
    try:
        return "config.is_decoder" in Path(inspect.getsourcefile(cls) or "").read_text(encoding="utf-8")
    except (OSError, TypeError):
        return False


def _fit(value: Any, default: Any) -> Any:
    """The tiny value in the default's form: 0 stays 0, a per-layer list of ints stays a list."""
    if isinstance(default, bool) or not isinstance(value, int):
        return value
    if isinstance(default, int) and default == 0:
        return 0
    if isinstance(default, list) and default and all(isinstance(item, int) for item in default):
        return [value] * len(default)
    return value


def _rescaled(sections: list[int], total: int) -> list[int]:
    """Integer sections proportional to ``sections`` that add up to ``total`` (each at least 1)."""
    scale = total / sum(sections)
    found = [max(1, int(section * scale)) for section in sections]
    found[0] += total - sum(found)
    return found


def all_configs(config: Any) -> Iterable[Any]:
    """The config and its sub-configs (text, vision...), each once."""
    seen, pending = set(), [config]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for value in vars(current).values():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                pending.append(value)


def axis_sizes(plan: Any, ranks: int | None = None) -> dict[str, int]:
    """The mesh to verify ``plan`` on: axis -> size, in the plan's mesh order.

    A plan does not say how large its axes are; 2 ranks an axis shard every planned dim. An
    axis holding key/value heads replicated ``RS(d, r)`` takes ``2 r`` ranks (2 chunks of
    ``r`` replicas, as the plan was written for), or ``g r`` with query heads in ``g`` groups
    (``S(d,u,g)``: a set of ``r`` ranks a group). ``ranks`` sets the total: the last axis
    (``tp`` in ``ep x tp``) takes what the others leave; a total they do not divide is a
    ``ValueError``.
    """
    sizes = {axis: max(2, _groups(plan, axis)) * _replicas(plan, axis) for axis in plan.mesh_dim_names}
    if ranks is None:
        return sizes
    *others, last = plan.mesh_dim_names
    rest = 1
    for axis in others:
        rest *= sizes[axis]
    if ranks % rest or ranks // rest < 1:
        raise ValueError(f"--ranks {ranks} does not divide over the axes {', '.join(plan.mesh_dim_names)} ({rest} ranks on the others)")
    sizes[last] = ranks // rest
    if sizes[last] % _replicas(plan, last):
        raise ValueError(f"--ranks {ranks}: {sizes[last]} ranks on {last} do not hold replicas of {_replicas(plan, last)}")
    return sizes


def _replicas(plan: Any, axis: str) -> int:
    """The largest replica count ``r`` of an ``RS(d, r)`` placement on ``axis`` (1 when none)."""
    found = 1
    for entry in plan.entries.values():
        for layout in entry.params.values():
            placement = layout.on(axis)
            if placement.kind == "RS" and placement.replicas:
                found = max(found, placement.replicas)
    return found


def _groups(plan: Any, axis: str) -> int:
    """The largest group count ``g`` of an ``S(d,u,g)`` placement on ``axis``, blocks included (1 when none)."""
    found = 1
    for entry in plan.entries.values():
        for layout in entry.params.values():
            placement = layout.on(axis)
            for inner in [placement, *(p for _, p in placement.parts)]:
                if inner.kind == "S":
                    found = max(found, inner.groups)
    return found


def _whole_units(plan: Any) -> bool:
    return any(p.whole_units for entry in plan.entries.values() for layout in entry.params.values() for _, p in layout.placements)


def _head_dim(config: Any) -> int | None:
    heads = config_value(config, "num_attention_heads")
    head_dim = config_value(config, "head_dim")
    if not isinstance(head_dim, int) and isinstance(heads, int) and heads > 0:
        hidden = config_value(config, "hidden_size")
        head_dim = hidden // heads if isinstance(hidden, int) and hidden % heads == 0 else None
    return head_dim if isinstance(head_dim, int) and head_dim > 0 else None


def kept_heads(config: Any, plan: Any, sizes: dict[str, int]) -> tuple[dict[str, Any], int]:
    """The shape that keeps ``config``'s head counts where the tiny ones would prove another model, and the
    factor by which ``head_dim`` shrinks instead (1: the usual tiny shape, nothing kept).

    Kept when the plan cuts whole heads or blocks (``hpgen.plan/2``), or when the query heads (or
    the key/value heads, which may also be replicated) do not divide over the largest axis: 6 heads
    at 4 ranks are proven on 6 heads, each of a head_dim small enough for a quick run, the hidden
    size that many heads of it.
    """
    heads, kv = config_value(config, "num_attention_heads"), _key_value_heads(config)
    head_dim = _head_dim(config)
    largest = max(sizes.values(), default=1)
    if not isinstance(heads, int) or head_dim is None or largest < 2:
        return {}, 1
    kv_uneven = isinstance(kv, int) and kv > 0 and kv % largest != 0 and largest % kv != 0
    if not (_whole_units(plan) or heads % largest or kv_uneven):
        return {}, 1
    small = next(d for d in (16, 8, 4, 2, 1) if head_dim % d == 0 and (heads * d <= 256 or d <= 2))
    shape: dict[str, Any] = {"num_attention_heads": heads, "head_dim": small, "hidden_size": heads * small}
    if isinstance(kv, int):
        shape["num_key_value_heads"] = kv
    return shape, head_dim // small


def scaled_units(document: dict[str, Any], factor: int) -> dict[str, Any]:
    """The plan document with every whole-unit size (``S(d,u,g)``'s ``u``, ``B``'s block sizes,
    ``local_attrs``' units) divided by ``factor``: the plan of the copy whose head_dim shrank so.

    ``ValueError`` where a size is not a multiple of ``factor`` (a unit that is not whole heads).
    """
    from hpgen.core.placement import Placement

    if factor == 1:
        return document

    def scaled(size: int) -> int:
        if size % factor:
            raise ValueError(f"{size} is not a multiple of {factor}: the plan cuts a unit that is not whole heads")
        return size // factor

    def placement(p: Placement) -> Placement:
        import dataclasses

        if p.kind == "B":
            return dataclasses.replace(p, parts=tuple((scaled(n), placement(inner)) for n, inner in p.parts))
        if p.kind == "S" and p.unit > 1:
            return dataclasses.replace(p, unit=scaled(p.unit))
        return p

    def count(spec: dict[str, Any]) -> dict[str, Any]:
        out = dict(spec)
        if "unit" in out:
            out["unit"] = scaled(out["unit"])
        if "per" in out:
            out["per"] = count(out["per"])
        return out

    entries = {}
    for key, entry in document.get("param_plan", {}).items():
        entry = dict(entry)
        if "params" in entry:
            entry["params"] = {
                name: {axis: str(placement(Placement.parse(text))) for axis, text in layout.items()}
                for name, layout in entry["params"].items()
            }
        if "local_attrs" in entry:
            entry["local_attrs"] = {attr: count(spec) for attr, spec in entry["local_attrs"].items()}
        entries[key] = entry
    return {**document, "param_plan": entries}


# shape keys of heads and experts: scaled together so they divide over a larger axis
_HEADS = ("num_attention_heads", "num_attention_heads_per_layer", "swa_num_attention_heads", "decoder_attention_heads",
          "encoder_attention_heads", "linear_num_heads", "linear_num_value_heads")
_KV_HEADS = ("num_key_value_heads", "swa_num_key_value_heads", "linear_num_key_heads", "index_n_heads")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def shape_for(plan: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """The changes to :data:`TINY` that keep every sharded dim dividing over axes of ``sizes``.

    The tiny shape has 4 query heads, 2 key/value heads and 4 experts: enough for axes of 2.
    On a larger axis of ``n`` ranks there are ``2 n`` query heads, ``n`` key/value heads (``n / r``
    where the plan replicates them ``RS(d, r)``) and ``2 n`` experts.
    """
    largest = max(sizes.values(), default=1)
    if largest <= 2:
        return {}
    replicas = max((_replicas(plan, axis) for axis in sizes), default=1)
    shape: dict[str, Any] = {key: 2 * largest for key in (*_HEADS, *_EXPERTS)}
    shape.update({key: largest // replicas for key in _KV_HEADS})
    return shape


def stages_for_layers(document: dict[str, Any], layers: int) -> tuple[dict[str, Any], int]:
    """The plan's pipeline stages rewritten for a copy of ``layers`` decoder layers, and that count.

    A ``--pp`` plan names the full model's layers (``model.layers.16-31``); the tiny copy has a
    few. Each stage keeps its other modules (embedding, norm, ``lm_head``) and gets a contiguous
    run of the copy's layers in proportion to the layers it named, at least one: the copy has
    at least as many layers as the plan has stages (more than ``layers`` where it has more
    stages). A plan without stages is returned as it is.
    """
    from hpgen.core.plan_entries import expand_stage_item

    pipeline = document.get("pipeline")
    if not isinstance(pipeline, dict) or not isinstance(pipeline.get("stages"), list):
        return document, layers
    stages = [[name for item in stage for name in (expand_stage_item(item) or (item,))] for stage in pipeline["stages"]]
    prefixes = {name.rpartition(".")[0] for stage in stages for name in stage if name.rpartition(".")[2].isdigit()}
    if len(prefixes) != 1:  # no numbered layers named, or several lists: left for parallelize to judge
        return document, layers
    (prefix,) = prefixes
    named = [sum(1 for name in stage if name.rpartition(".")[0] == prefix) for stage in stages]
    count = max(layers, len(stages))
    shares = [1] * len(stages)
    total = sum(named) or 1
    for _ in range(count - len(stages)):  # each further layer to the stage furthest below its share
        best = max(range(len(stages)), key=lambda index: named[index] / total - shares[index] / count)
        shares[best] += 1
    rewritten, start = [], 0
    for stage, share in zip(stages, shares):
        run = f"{prefix}.{start}" + (f"-{start + share - 1}" if share > 1 else "")
        kept = [name for name in stage if name.rpartition(".")[0] != prefix]
        at = next((index for index, name in enumerate(stage) if name.rpartition(".")[0] == prefix), len(stage))
        at = sum(1 for name in stage[:at] if name.rpartition(".")[0] != prefix)  # where the layers were
        rewritten.append([*kept[:at], run, *kept[at:]])
        start += share
    return {**document, "pipeline": {**pipeline, "stages": rewritten}}, count


def fold_layers(config: Any, given: Any, firsts: list[int]) -> None:
    """Give the tiny ``config`` one decoder layer for each folded run of the ``given`` config's layers (``firsts``:
    each run's first layer, :func:`hpgen.verify.prepare.fewer_layers`).

    A per-layer list of kinds (``layer_types``: which layer is sliding, hybrid, ...) takes the given config's value
    at each run's first layer, so that tiny layer ``i`` is of the kind it stands for (a list left at the tiny
    count made transformers' model index past its end: Inkling's 66 layers folded to 22); a list of sizes, which
    the shrink made tiny, keeps its tiny value, continued with its last one.
    """
    before, total = config.num_hidden_layers, config_value(given, "num_hidden_layers")
    for key, value in list(vars(config).items()):
        if not (isinstance(value, list) and len(value) == before and before > 0):
            continue
        original = getattr(given, key, None)
        sizes = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        if isinstance(original, list) and len(original) == total and not sizes:
            setattr(config, key, [original[index] for index in firsts])
        else:
            setattr(config, key, [value[min(index, before - 1)] for index in range(len(firsts))])
    config.num_hidden_layers = len(firsts)


def more_layers(config: Any, count: int) -> None:
    """Grow the tiny ``config`` to ``count`` decoder layers (one a pipeline stage at least), its per-layer lists
    (``layer_types``, ...) continued with their last value."""
    before = config.num_hidden_layers
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == before and before > 0:
            setattr(config, key, value + [value[-1]] * (count - before))
    config.num_hidden_layers = count
