"""Tiny configs of model families transformers ships no tensor-parallel plan for (or whose plan hpgen
re-derives with ``--from-source``), for the derived planner's tests: hidden 64, 4 heads of 16, 2 layers,
vocabulary 127 (uneven over 2 ranks)."""

from __future__ import annotations

from typing import Any

_TINY = dict(vocab_size=127, max_position_embeddings=64)

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", dict(n_embd=64, n_head=4, n_layer=2, n_inner=90, vocab_size=127, n_positions=64)),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        # the default MLP width, 4 x hidden: the attention (multi-query, replicated) is the smaller part
        dict(n_embd=64, n_head=4, n_layer=2, vocab_size=127, n_positions=64, multi_query=True),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=89, **_TINY),
    ),
    "opt": (
        "OPTConfig",
        dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=90, word_embed_proj_dim=64, **_TINY),
    ),
    "bert": (
        "BertConfig",
        dict(
            hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=89, is_decoder=True, **_TINY
        ),
    ),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_head=4, n_layer=2, vocab_size=127)),
    # ALiBi as a per-head input made outside the attention: [heads, 1, max_seq_len]
    "mpt": ("MptConfig", dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, vocab_size=127)),
    # the feed-forward of the layer runs through apply_chunking_to_forward
    "xmod": (
        "XmodConfig",
        dict(
            hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=89, is_decoder=True,
            **_TINY,
        ),
    ),
    # the layers are classes under a module-level ``if is_xlstm_available(): ... else:``
    "xlstm": ("xLSTMConfig", dict(hidden_size=64, num_heads=8, num_blocks=2, vocab_size=127, use_cache=False)),
    # the language model is Persimmon's, from another modeling file than FuyuForCausalLM's
    "fuyu": (
        "FuyuConfig",
        dict(
            text_config=dict(
                model_type="persimmon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=89, vocab_size=127, max_position_embeddings=64,
            ),
        ),
    ),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=127)),
    # Falcon's attention sharded by heads: the grouped layout of new_decoder_architecture (two norms), and
    # multi_query=False (per-head [q, k, v], one norm); the ALiBi branch is dead for these rotary configs
    "falcon_nda": (
        "FalconConfig",
        dict(
            hidden_size=64, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, num_hidden_layers=2,
            vocab_size=127,
        ),
    ),
    "falcon_mha": (
        "FalconConfig",
        dict(hidden_size=64, num_attention_heads=4, multi_query=False, num_hidden_layers=2, vocab_size=127),
    ),
    # parallel-residual blocks (attention and MLP read one input, their outputs summed): one reduction a layer
    "gptj": ("GPTJConfig", dict(n_embd=64, n_head=4, n_layer=2, n_inner=90, rotary_dim=8, vocab_size=127, n_positions=64)),
    "phi": (
        "PhiConfig",
        dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=90, **_TINY),
    ),
    "cohere": (
        "CohereConfig",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=90,
            **_TINY,
        ),
    ),
    # CodeGen's fused qkv_proj holds mp_num=4 groups of [q | v | k] rows; 8 heads so that each rank's 4 fill them
    "codegen": (
        "CodeGenConfig",
        dict(n_embd=64, n_head=8, n_layer=2, n_inner=90, rotary_dim=4, vocab_size=127, n_positions=64, n_ctx=64),
    ),
    # Cohere's parallel block with sliding-window layers (the window shorter than the generated sequence)
    "cohere2": (
        "Cohere2Config",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=90,
            sliding_window=4, **_TINY,
        ),
    ),
    "stablelm": (
        "StableLmConfig",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=90,
            use_parallel_residual=True, **_TINY,
        ),
    ),
    "bitnet": (
        "BitNetConfig",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=89,
            **_TINY,
        ),
    ),
    # transformers' plan shards the MLP and the experts, not the attention
    "flint": (
        "FlintConfig",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
            intermediate_size=89, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, **_TINY,
        ),
    ),
    # multi-head latent attention (low-rank q and kv, one rotary key shared by the heads); dense MLPs only
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=89,
            q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
            first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            n_group=1, topk_group=1, **_TINY,
        ),
    ),
    # a linear-attention (KDA) mixer with a depthwise conv over cat(q, k, v) and per-head A_log, then MLA;
    # dense MLPs only
    "kimi_linear": (
        "KimiLinearConfig",
        dict(
            hidden_size=64, num_hidden_layers=2, intermediate_size=89, linear_num_heads=4, linear_head_dim=16,
            layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
            num_attention_heads=4, num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=4, moe_intermediate_size=24,
            pad_token_id=0, bos_token_id=0, eos_token_id=0, **_TINY,
        ),
    ),
    # Doge's dynamic-mask attention: dt_proj reads every value head and writes one value per key/value
    # head (gathered on entry); with biases, and a keep window shorter than the test's sequences so that
    # prepare_dynamic_mask's top-k over the keys runs on each rank's heads
    "doge": (
        "DogeConfig",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
            intermediate_size=89, attention_bias=True, keep_window_size=4, **_TINY,
        ),
    ),
    # differential attention: heads i and i + H/2 work together, value heads in halves; one key/value head per
    # half (every rank holds both: RS), and, 128 wide, two per half under grouped queries (a strided cut: SS)
    "diffllama": (
        "DiffLlamaConfig",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=89,
            **_TINY,
        ),
    ),
    "diffllama_grouped": (
        "DiffLlamaConfig",
        dict(
            hidden_size=128, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=89,
            **_TINY,
        ),
    ),
    # state-space mixers: 89 channels (uneven over 2 ranks) of Mamba1; Mamba2's packed z|x|B|C|dt in_proj
    "mamba": (
        "MambaConfig",
        dict(hidden_size=64, intermediate_size=89, state_size=16, num_hidden_layers=2, **_TINY),
    ),
    "zamba": (
        "ZambaConfig",
        # two Mamba heads per mixer (per-head x_proj, dt_proj, A_log), in two hybrid layers sharing one attention block
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=4, attention_head_dim=32,
            intermediate_size=89, num_hidden_layers=2, layers_block_type=["hybrid", "hybrid"], n_mamba_heads=2,
            mamba_d_state=16, mamba_dt_rank=4, use_cache=False, **_TINY,
        ),
    ),
    # Griffin: two recurrent blocks (linear_x/linear_y -> depthwise conv_1d -> RG-LRU with per-head gates ->
    # linear_out) and one sliding-window attention layer
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        dict(
            hidden_size=64, lru_width=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=89, num_hidden_layers=3, attention_window_size=16, vocab_size=127,
        ),
    ),
    "mamba2": (
        "Mamba2Config",
        dict(
            hidden_size=64, num_heads=8, head_dim=16, expand=2, n_groups=1, state_size=16, chunk_size=16,
            num_hidden_layers=2, **_TINY,
        ),
    ),
    # transformers' plan shards only the experts; the derivation completes the attention: per-head L2-clip
    # scales, dynamic convolutions whose taps (4, as many as the heads) come per head from weight_proj;
    # d_rel 4: the relative projection's 16 rows hold 4 heads of 4 (its module's num_heads), not one of 16
    "inkling2": (
        "Inkling2TextConfig",
        dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, d_rel=4,
            rel_extent=16, sconv_kernel_size=4, layer_types=["hybrid_sliding", "hybrid"], n_routed_experts=4,
            num_experts_per_tok=2, intermediate_size=32, unpadded_vocab_size=127, **_TINY,
        ),
    ),
}


def tiny(family: str) -> Any:
    """The tiny config of ``family`` (a key of :data:`CONFIGS`)."""
    import transformers

    name, kwargs = CONFIGS[family]
    return getattr(transformers, name)(**kwargs)
