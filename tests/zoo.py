"""Tiny random models for every architecture of the installed mlx_lm (no weights, no network).

``ARCHITECTURES`` lists every module of ``mlx_lm.models`` that defines ``ModelArgs`` and
``Model``; ``tiny_args(name)`` gives the keyword arguments of a tiny model of it (a generic
filler keyed by field name, then ``OVERRIDES``); ``tiny_model(name, seed)`` builds it in
float32. ``UNBUILDABLE`` names the architectures that cannot run a forward pass, with why.

Run ``python tests/zoo.py [name ...]`` to check every architecture against mlx_lm's own
caches, ``generate_step`` and ``BatchGenerator``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import io
import pkgutil
import types
from typing import Any

import knorm_gen  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import mlx_lm.models
from mlx.utils import tree_map

# Shapes every tiny model shares; an architecture's override changes them where it must.
HIDDEN = 64
INTERMEDIATE = 128
MOE_INTERMEDIATE = 32
LAYERS = 2
VOCAB = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
MAX_POSITIONS = 512
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
SLIDING_WINDOW = 8
KV_LORA_RANK = 16
Q_LORA_RANK = 32
ROPE_HEAD_DIM = 8
NOPE_HEAD_DIM = 16

# Fields set whatever their default: the sizes that make a model big.
_SHRINK: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "model_dim", "hidden_dim", "dim"), HIDDEN),
    **dict.fromkeys(
        ("intermediate_size", "ffn_hidden_size", "n_inner", "ff_intermediate_size",
         "intermediate_size_mlp", "block_ff_dim", "ffn_dim", "dense_intermediate_size"),
        INTERMEDIATE,
    ),
    **dict.fromkeys(
        ("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
         "moe_shared_expert_intermediate_size", "shared_intermediate_size", "share_expert_dim"),
        MOE_INTERMEDIATE,
    ),
    **dict.fromkeys(
        ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_transformer_layers"), LAYERS
    ),
    **dict.fromkeys(("vocab_size", "num_vocab", "vocab_size_per_layer_input"), VOCAB),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "num_query_heads"), HEADS
    ),
    **dict.fromkeys(
        ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "num_attention_groups"), KV_HEADS
    ),
    **dict.fromkeys(("head_dim", "kv_channels", "hidden_size_per_head"), HEAD_DIM),
    **dict.fromkeys(
        ("max_position_embeddings", "n_positions", "n_ctx", "block_size", "model_max_length"),
        MAX_POSITIONS,
    ),
    **dict.fromkeys(
        ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), EXPERTS
    ),
    **dict.fromkeys(
        ("num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k", "num_experts_per_token",
         "top_k_experts"),
        EXPERTS_PER_TOKEN,
    ),
    **dict.fromkeys(
        ("n_shared_experts", "num_shared_experts", "num_shared_expert", "moe_num_shared_experts"), 1
    ),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size"), SLIDING_WINDOW),
    "index_n_heads": HEADS,
    "index_head_dim": HEAD_DIM,
    # Below the prompt lengths, so the DSA indexers' top-k selection does run.
    "index_topk": 4,
    "rotary_dim": 8,
    "window_size": SLIDING_WINDOW,
    # Two expert groups of two, one picked: the grouped routing runs.
    "n_group": 2,
    "topk_group": 1,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM,
    "linear_conv_kernel_dim": 4,
    "kv_lora_rank": KV_LORA_RANK,
    "q_lora_rank": Q_LORA_RANK,
    "qk_rope_head_dim": ROPE_HEAD_DIM,
    "qk_nope_head_dim": NOPE_HEAD_DIM,
    "v_head_dim": HEAD_DIM,
}

# Fields set only where the dataclass has no default for them.
_REQUIRED: dict[str, Any] = {
    **dict.fromkeys(
        ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon",
         "layernorm_epsilon"),
        1e-5,
    ),
    **dict.fromkeys(("rope_theta", "rotary_emb_base", "rope_embedding_base"), 10000.0),
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "norm_topk_prob": True,
    "partial_rotary_factor": 1.0,
    "rope_scaling": None,
    "rope_parameters": None,
}

# Fields of _REQUIRED also set where their default is None (the model reads them as numbers).
_WHEN_NONE = {"rope_theta"}

# Layer-kind patterns of four layers: two of each kind, so two plain full-attention layers.
_SF = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_LF = ["linear_attention", "full_attention", "linear_attention", "full_attention"]

# Gemma 4's small checkpoints: the last layer reads the KV of an earlier sliding layer.
_GEMMA4_TEXT: dict[str, Any] = {
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
    "num_kv_shared_layers": 1,
    "global_head_dim": 32,
    "hidden_size_per_layer_input": 8,
}

# Qwen3.5's text model: gated-delta linear attention with full attention every other layer.
_QWEN3_5_TEXT: dict[str, Any] = {
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "rope_parameters": {"type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.5},
}

# Ministral 3's rope_parameters carry the llama-4 attention scaling next to the YaRN settings.
_MINISTRAL3: dict[str, Any] = {
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
        "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
    },
}

# Per-architecture keyword arguments applied after the generic filler (a text_config entry is
# merged into the filled text_config). Where an entry sets 4 layers and a layer pattern, it is for
# two layers of each kind: the default patterns put one global layer in 4 to 8 or more. The other
# values fill fields that have no default, with values in the style of the published configs.
OVERRIDES: dict[str, dict[str, Any]] = {
    # Three own-KV layers, then one layer that reuses the last layer's keys and values.
    "afm7": {"num_layers": 4, "num_kv_reuse_layers": 1},
    "afmoe": {"num_hidden_layers": 4, "layer_types": _SF, "num_dense_layers": 1},
    # Layer 1 is the sliding-window one; the convolution over keys needs a window of 2.
    "baichuan_m1": {"num_hidden_layers": 3, "sliding_window_layers": [1], "conv_window": 2},
    # Every second layer is MLA (global), the others linear attention.
    "bailing_hybrid": {"num_hidden_layers": 4, "layer_group_size": 2, "group_norm_size": 4},
    "bailing_moe_linear": {"num_hidden_layers": 4, "layer_group_size": 2, "group_norm_size": 4},
    "bailing_moe_v3": {"num_hidden_layers": 4, "layer_group_size": 2},
    "cohere2": {"num_hidden_layers": 4, "sliding_window_pattern": 2},
    # DBRX nests its attention and MoE settings in dicts.
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # DeepSeek-V2 always builds its YaRN rotary embedding from rope_scaling.
    "deepseek_v2": {
        "rope_scaling": {
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
        },
    },
    # Compressed-KV layers (ratio 2 and 1) sharing KV and index keys, after a window-only layer.
    "deepseek_v41": {
        "num_hidden_layers": 4, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 4,
        "compress_ratios": (0, 2, 2, 1), "kv_source_layer_ids": (1, 3),
        "index_source_layer_ids": (1, 2, 3), "index_topk": 3, "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 2, "candidate_block_size": 2, "hc_mult": 2, "hc_sinkhorn_iters": 3,
    },
    "exaone4": {"num_hidden_layers": 4, "sliding_window_pattern": "LG"},
    "exaone_moe": {"num_hidden_layers": 4, "layer_types": _SF, "is_moe_layer": [False, True, True, True]},
    # Falcon-H1 runs attention and a Mamba-2 mixer in parallel in every layer.
    "falcon_h1": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 16},
    "gear": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "conv_mixer", "full_attention"],
    },
    "gemma3": {"text_config": {"num_hidden_layers": 4, "sliding_window_pattern": 2}},
    "gemma3_text": {"num_hidden_layers": 4, "sliding_window_pattern": 2},
    # Gemma 3n: AltUp, LAuReL and per-layer inputs; the last layer shares the first's sliding KV.
    "gemma3n": {
        "text_config": {
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
            "num_kv_shared_layers": 1,
            "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
            "hidden_size_per_layer_input": 8,
            "altup_num_inputs": 4, "altup_coef_clip": 120.0, "altup_correct_scale": True,
            "altup_active_idx": 0, "laurel_rank": 8, "rope_local_base_freq": 10000.0,
            "final_logit_softcapping": 30.0,
        },
    },
    "gemma4": {"text_config": _GEMMA4_TEXT},
    "gemma4_text": _GEMMA4_TEXT,
    # GLM-5 (DSA) reads rope_theta from rope_parameters.
    "glm_moe_dsa": {
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "gpt_neox": {"rotary_pct": 0.25},
    "gpt_oss": {"num_hidden_layers": 4},
    # Granite's muP multipliers have no defaults.
    "granite": {"logits_scaling": 4.0, "attention_multiplier": 0.25, "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22},
    "granitemoe": {"logits_scaling": 4.0, "attention_multiplier": 0.25, "embedding_multiplier": 12.0,
                   "residual_multiplier": 0.22},
    "granitemoehybrid": {
        "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"],
        "logits_scaling": 4.0, "attention_multiplier": 0.25, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "shared_intermediate_size": 64, "mamba_n_heads": 4,
        "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_n_groups": 1, "mamba_conv_bias": True,
    },
    # Cross-layer attention: odd layers reuse the KV of the layer before.
    # Hunyuan's DynamicNTKAlphaRoPE reads rope_scaling["alpha"].
    "hunyuan": {
        "num_hidden_layers": 4, "use_cla": True, "cla_share_factor": 2, "use_mixed_mlp_moe": True,
        "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
    },
    # IQuest-Loop's second loop attends through a window of loop_window_size.
    "iquestloopcoder": {"loop_window_size": SLIDING_WINDOW},
    # Jamba: Mamba and attention layers alternate, as do dense and MoE feed-forwards.
    "jamba": {
        "num_hidden_layers": 4, "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
        "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_expand": 2,
    },
    # Kimi Delta Attention in layers 1 and 3 (1-based), MLA in layers 2 and 4.
    "kimi_k3": {
        "text_config": {
            "num_hidden_layers": 4, "attn_res_block_size": 2,
            "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                                   "head_dim": 16, "short_conv_kernel_size": 4},
        },
    },
    "kimi_linear": {
        "num_hidden_layers": 4,
        "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                               "head_dim": 16, "short_conv_kernel_size": 4},
    },
    # Laguna-XS: sliding and full layers with their own head counts and RoPE.
    "laguna": {
        "num_hidden_layers": 4, "layer_types": _SF, "num_attention_heads_per_layer": [8, 4, 8, 4],
        "rope_parameters": {
            "full_attention": {"rope_theta": 500000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_theta": 10000.0},
        },
    },
    # LFM2: short-convolution layers and attention layers.
    "lfm2": {
        "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "conv_L_cache": 3, "block_dim": HIDDEN, "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
    },
    "lfm2-vl": {
        "text_config": {
            "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "conv_L_cache": 3, "block_dim": HIDDEN, "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
        },
    },
    "lfm2_moe": {
        "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "conv_L_cache": 3, "num_dense_layers": 1,
    },
    # Llama 4: chunked attention in three layers of four, global (NoPE) in the fourth (so one global
    # layer only); its MoE routes each token to one expert.
    "llama4": {
        "text_config": {"num_hidden_layers": 4, "attention_chunk_size": 8, "interleave_moe_layer_step": 2,
                        "num_experts_per_tok": 1},
    },
    "llama4_text": {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]},
    # LongCat-Flash: two MLA sublayers per layer; "zero" experts pass the token through.
    "longcat_flash": {
        "attention_method": "MLA", "zero_expert_type": "identity", "zero_expert_num": 2,
        "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
    },
    "longcat_flash_ngram": {
        "zero_expert_num": 2, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
        "ngram_vocab_size_ratio": 2,
    },
    "mamba": {"state_size": 16, "conv_kernel": 4, "time_step_rank": 4},
    # Mamba-2 heads tile the inner width: 8 heads of 16 make the 128 of intermediate_size.
    "mamba2": {
        "num_heads": 8, "head_dim": 16, "state_size": 16, "conv_kernel": 4, "n_groups": 1,
        "time_step_limit": (0.0, float("inf")), "time_step_rank": "auto",
    },
    # Mellum keys its RoPE settings by layer type.
    "mellum": {
        "num_hidden_layers": 4, "layer_types": _SF,
        "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0},
                            "full_attention": {"rope_theta": 500000.0}},
    },
    # MiMo-V2-Flash: sliding layers with attention sinks; keys wider than values.
    "mimo_v2_flash": {
        "num_hidden_layers": 4, "hybrid_layer_pattern": [1, 0, 1, 0], "moe_layer_freq": [0, 1, 1, 1],
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": True,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": KV_HEADS,
        "head_dim": 24, "v_head_dim": 16, "swa_head_dim": 24, "swa_v_head_dim": 16,
        "partial_rotary_factor": 0.5,
    },
    # MiniCPM's muP scales have no defaults.
    "minicpm": {"dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 12.0},
    # MiniCPM3 always builds a LongRoPE (SuScaledRoPE) from rope_scaling.
    "minicpm3": {
        "dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 12.0,
        "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 256,
                         "short_factor": [1.0] * (ROPE_HEAD_DIM // 2),
                         "long_factor": [1.5] * (ROPE_HEAD_DIM // 2)},
    },
    # MiniMax-M3: block-sparse attention (an indexer picks key blocks) in layers 0 and 2.
    "minimax_m3_vl": {
        "text_config": {
            "num_hidden_layers": 4, "moe_layer_freq": [0, 1, 1, 1],
            "sparse_attention_config": {
                "sparse_num_index_heads": HEADS, "sparse_index_dim": HEAD_DIM, "sparse_block_size": 2,
                "sparse_topk_blocks": 2, "sparse_local_block": 1, "sparse_attention_freq": [1, 0, 1, 0],
            },
        },
    },
    "ministral3": _MINISTRAL3,
    # Mistral 4 (MLA) reads the same llama-4 scaling from rope_parameters.
    "mistral4": _MINISTRAL3,
    # Mistral 3 picks its text model by text_config's model_type (llama, ministral3 or mistral4).
    "mistral3": {"text_config": {"model_type": "ministral3", **_MINISTRAL3}},
    "muse_spark": {
        "text_config": {
            "num_hidden_layers": 4, "layer_types": _SF, "layer_rope_theta": [10000.0, 0.0, 10000.0, 0.0],
            "rope_parameters": {"rope_theta": 10000.0}, "post_norm_eps": 1e-8,
            "final_logit_softcapping": 30.0, "output_multiplier": 0.2, "moe_hidden_size": 32,
            # Every layer is sparse: Muse Spark rejects shared experts and dense layers.
            "num_shared_experts": 0,
        },
    },
    "muse_glimmer": {"num_hidden_layers": 4, "layer_types": _SF},
    "nemotron": {"hidden_act": "relu2", "partial_rotary_factor": 0.5},
    # Nemotron-NAS: a block can drop its attention (no cache) or replace it by a linear map.
    "nemotron-nas": {
        "num_hidden_layers": 4,
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"no_op": True}},
        ],
    },
    # Nemotron-H: Mamba-2 (M), attention (*) and MoE (E) blocks; only M and * hold a cache.
    "nemotron_h": {
        "hybrid_override_pattern": ["M", "*", "E", "*"], "mamba_num_heads": 4, "mamba_head_dim": 16,
        "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    },
    "olmo3": {"num_hidden_layers": 4, "layer_types": _SF},
    "olmo_hybrid": {
        "num_hidden_layers": 4, "layer_types": _LF, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": True,
    },
    # OpenELM: head counts and FFN widths vary per layer.
    "openelm": {
        "num_query_heads": [4, 8], "num_kv_heads": [2, 4], "ffn_multipliers": [0.5, 1.0],
        "ffn_dim_divisor": 16,
    },
    # Phi-3-small sets the logits of 91 fixed token ids from 100256 on to -inf: a smaller vocabulary
    # makes that write land out of bounds (heap corruption on CPU).
    "phi3small": {
        "vocab_size": 100352, "num_hidden_layers": 4, "dense_attention_every_n_layers": 2,
        "gegelu_limit": 20.0, "blocksparse_block_size": 32, "blocksparse_num_local_blocks": 1,
        "blocksparse_vert_stride": 2,
    },
    # PLaMo shares each KV head among n_shared_head query heads.
    "plamo": {"n_shared_head": 2},
    "plamo2": {"num_hidden_layers": 4, "mamba_num_heads": 4, "mamba_d_state": 16},
    "plamo3": {"num_hidden_layers": 4, "sliding_window_pattern": 2},
    # A Prism pack needs its schema, 2-bit quantization and a manifest of packed modules: here one
    # dense down_proj (input width 512, a multiple of 128, for a Hadamard block of 512).
    "prism_hadamard_qwen35": {
        "schema_version": 2, "tensor_namespace": "mlx-vlm-qwen3_5",
        "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
        "modules": [{"path": "model.layers.1.mlp.down_proj", "embedding": False, "dtype": "float16",
                     "block": 512}],
        "text_config": {**_QWEN3_5_TEXT, "intermediate_size": 512, "num_experts": 0},
    },
    # Qwen3.5 dense: with experts (the filler gives 4) it would be Qwen3.5-MoE.
    "qwen3_5": {"text_config": {**_QWEN3_5_TEXT, "num_experts": 0}},
    "qwen3_5_moe": {"text_config": _QWEN3_5_TEXT},
    "qwen3_next": {"num_hidden_layers": 4, "full_attention_interval": 2, "partial_rotary_factor": 0.5},
    "recurrent_gemma": {
        "num_hidden_layers": 4, "block_types": ["recurrent", "attention"], "conv1d_width": 4,
        "logits_soft_cap": 30.0,
    },
    # RWKV-7's low-rank projections have no defaults.
    "rwkv7": {"a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8, "decay_low_rank_dim": 8},
    "smollm3": {"num_hidden_layers": 4, "no_rope_layer_interval": 2},
    "spark2_5": {
        "num_hidden_layers": 4, "layer_types": _SF,
        "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0},
                            "full_attention": {"rope_theta": 1000000.0, "partial_rotary_factor": 0.5}},
    },
    # Step 3.5: sliding layers have their own head counts; layer 0 is dense.
    "step3p5": {
        "num_hidden_layers": 4, "moe_layers_enum": "1,2,3",
        "attention_other_setting": {"num_attention_heads": 8, "num_attention_groups": 4},
    },
}

# Wrapper architectures: the ``text_config`` dict is filled for this inner args class.
_TEXT_ARGS: dict[str, str] = {
    "gemma3": "gemma3_text:ModelArgs",
    "gemma4": "gemma4_text:ModelArgs",
    "mistral3": "ministral3:ModelArgs",
    "pixtral": "llama:ModelArgs",
    "qwen2_vl": "qwen2:ModelArgs",
    "qwen3_vl": "qwen3:ModelArgs",
    "qwen3_vl_moe": "qwen3_moe:ModelArgs",
    "qwen3_5_moe": "qwen3_5:TextModelArgs",
    "prism_hadamard_qwen35": "qwen3_5:TextModelArgs",
    "lfm2-vl": "lfm2:ModelArgs",
    "kimi_k25": "deepseek_v3:ModelArgs",
}
_TEXT_CLASS_NAMES = ("TextArgs", "TextModelArgs", "TextConfig")

# Architectures known not to build or run, with why; import failures are added below.
UNBUILDABLE: dict[str, str] = {}
if not mx.metal.is_available():
    UNBUILDABLE["bitnet"] = (
        "needs Metal: its BitLinear layers run only as an mx.fast.metal_kernel (no CPU or CUDA path)"
    )
    UNBUILDABLE["muse_spark"] = (
        "needs Metal: its attention, norms and expert routing are mlx_lm.kernels Metal kernels "
        "with no CPU or CUDA path"
    )


def _defines_model(name: str) -> bool:
    """Whether a module that cannot be imported still defines ModelArgs and Model (read, not run)."""
    spec = importlib.util.find_spec(f"mlx_lm.models.{name}")
    try:
        with open(spec.origin, encoding="utf-8") as f:
            source = f.read()
    except (AttributeError, OSError, TypeError):
        return False
    return "class ModelArgs" in source and "class Model(" in source


def _discover() -> tuple[list[str], dict[str, str]]:
    """Every module of mlx_lm.models with ModelArgs and Model, and why some fail to import."""
    names, failures = [], {}
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        said = io.StringIO()
        try:
            # olmo prints its install hint, then calls sys.exit(1), when ai2-olmo is missing.
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                mod = importlib.import_module(f"mlx_lm.models.{info.name}")
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001  (SystemExit included)
            if _defines_model(info.name):
                names.append(info.name)
                hint = said.getvalue().strip()
                failures[info.name] = f"import fails ({type(e).__name__}: {e})" + (f": {hint}" if hint else "")
            continue
        if hasattr(mod, "ModelArgs") and hasattr(mod, "Model"):
            names.append(info.name)
    return sorted(names), failures


ARCHITECTURES, IMPORT_ERRORS = _discover()
_IMPORT_HINTS = {"olmo": "needs the ai2-olmo package (importing mlx_lm.models.olmo calls sys.exit(1))"}
for _name, _why in IMPORT_ERRORS.items():
    UNBUILDABLE.setdefault(_name, _IMPORT_HINTS.get(_name, _why))


def module(model_type: str) -> types.ModuleType:
    """The mlx_lm.models module of an architecture."""
    return importlib.import_module(f"mlx_lm.models.{model_type}")


def _fill(cls: type, model_type: str) -> tuple[dict[str, Any], list[str]]:
    """Tiny values for the fields of dataclass ``cls``, and the required fields left without one."""
    values: dict[str, Any] = {}
    missing = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name == "model_type":
            values[f.name] = model_type
        elif f.name in _SHRINK:
            values[f.name] = copy.deepcopy(_SHRINK[f.name])
        elif f.name in _REQUIRED and (required or (f.default is None and f.name in _WHEN_NONE)):
            values[f.name] = copy.deepcopy(_REQUIRED[f.name])
        elif required and f.type in (bool, "bool"):
            values[f.name] = False
        elif required:
            missing.append(f.name)
    return values, missing


def _text_args_class(model_type: str) -> tuple[type, str]:
    """The args class a wrapper architecture builds from its ``text_config``, and its model_type."""
    if model_type in _TEXT_ARGS:
        name, cls = _TEXT_ARGS[model_type].split(":")
        return getattr(module(name), cls), name
    mod = module(model_type)
    for cls in _TEXT_CLASS_NAMES:
        if dataclasses.is_dataclass(getattr(mod, cls, None)):
            return getattr(mod, cls), model_type
    raise KeyError(f"{model_type}: no known args class for its text_config (add it to _TEXT_ARGS)")


def _apply(cls: type, values: dict[str, Any], missing: list[str], override: dict[str, Any],
           where: str) -> list[str]:
    """Put ``override`` into ``values``; return the required fields still missing."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(override) - fields)
    if unknown:
        raise KeyError(f"{where}: OVERRIDES names no field(s) {', '.join(unknown)} of {cls.__qualname__}")
    values.update(copy.deepcopy(override))
    return [k for k in missing if k not in values]


def tiny_args(model_type: str) -> dict[str, Any]:
    """Keyword arguments of ``ModelArgs`` (for ``ModelArgs.from_dict``) of a tiny ``model_type``."""
    args_cls = module(model_type).ModelArgs
    override = dict(OVERRIDES.get(model_type, {}))
    args, missing = _fill(args_cls, model_type)
    if "text_config" in {f.name for f in dataclasses.fields(args_cls)}:
        text_cls, text_type = _text_args_class(model_type)
        text, text_missing = _fill(text_cls, text_type)
        text_missing = _apply(text_cls, text, text_missing, override.pop("text_config", {}),
                              f"{model_type}.text_config")
        args["text_config"] = text
        missing += [f"text_config.{k}" for k in text_missing]
    missing = _apply(args_cls, args, missing, override, model_type)
    if missing:
        raise TypeError(f"{model_type}: no tiny value for required field(s) {', '.join(missing)}")
    return args


def tiny_model(model_type: str, seed: int = 0) -> Any:
    """A tiny random float32 ``Model`` of ``model_type``; the same seed gives the same weights."""
    mod = module(model_type)
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(tiny_args(model_type)))
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    mx.eval(model.parameters())
    return model


def status(model_type: str) -> str | None:
    """Why ``model_type`` cannot be built and run here, or None when it can."""
    return UNBUILDABLE.get(model_type)


def cache_kinds(model: Any) -> list[str]:
    """The class name of each entry of mlx_lm's ``make_prompt_cache(model)``."""
    from mlx_lm.models.cache import make_prompt_cache

    return [type(c).__name__ for c in make_prompt_cache(model)]


def _kind(cache: Any) -> str:
    """A cache's class name, with the classes a CacheList holds."""
    inner = getattr(cache, "caches", None)
    if inner is None:
        return type(cache).__name__
    return f"{type(cache).__name__}({'+'.join(_kind(c) for c in inner)})"


def _summary(caches: list[Any]) -> str:
    counts: dict[str, int] = {}
    for c in caches:
        counts[_kind(c)] = counts.get(_kind(c), 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in counts.items())


def _check(model_type: str) -> tuple[str, float, bool, bool, bool]:
    """One architecture's report line, its build time, and whether a forward, mlx_lm's
    generate_step and its BatchGenerator work."""
    import time

    from mlx_lm.generate import BatchGenerator, generate_step
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    try:
        model = tiny_model(model_type)
    except Exception as e:  # noqa: BLE001
        return f"BUILD FAIL {type(e).__name__}: {e}", 0.0, False, False, False
    build = time.perf_counter() - t0
    try:
        caches = make_prompt_cache(model)
        model(mx.array([[1, 2, 3, 4, 5]]), cache=caches)
        logits = model(mx.array([[6]]), cache=caches)
        mx.eval(logits)
        layers = getattr(model, "layers", None)
        layer_txt = f"layers={len(layers)}" if layers is not None else "no .layers"
        line = f"{_summary(caches)} | logits {tuple(logits.shape)} | {layer_txt}"
    except Exception as e:  # noqa: BLE001
        return f"FORWARD FAIL {type(e).__name__}: {e}", build, False, False, False
    gen_ok = batch_ok = True
    try:
        tokens = [int(t) for t, _ in generate_step(
            mx.array([1, 2, 3, 4, 5, 6, 7, 8]), model, max_tokens=5,
            sampler=lambda x: mx.argmax(x, axis=-1), prompt_cache=make_prompt_cache(model))]
        assert len(tokens) == 5, tokens
        line += " | generate_step ok"
    except Exception as e:  # noqa: BLE001
        gen_ok = False
        line += f" | generate_step FAIL {type(e).__name__}: {e}"
    try:
        gen = BatchGenerator(model, max_tokens=4, stop_tokens=[])
        uids = gen.insert([[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 2, 1]])
        got: dict[int, list[int]] = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                got[r.uid].append(r.token)
        gen.close()
        assert all(len(v) == 4 for v in got.values()), got
        line += " | BatchGenerator ok"
    except Exception as e:  # noqa: BLE001
        batch_ok = False
        line += f" | BatchGenerator FAIL {type(e).__name__}: {str(e)[:200]}"
    line += f" | build {build:.2f}s, all {time.perf_counter() - t0:.2f}s"
    return line, build, True, gen_ok, batch_ok


if __name__ == "__main__":
    import sys
    import time

    names = sys.argv[1:] or ARCHITECTURES
    todo = [n for n in names if n not in UNBUILDABLE]
    start = time.perf_counter()
    failed: dict[str, list[str]] = {"forward": [], "generate_step": [], "BatchGenerator": []}
    builds = {}
    for name in todo:
        line, builds[name], fwd, gen, batch = _check(name)
        for key, ok in zip(failed, (fwd, gen, batch)):
            if not ok:
                failed[key].append(name)
        print(f"{name}: {line}", flush=True)
    elapsed = time.perf_counter() - start
    for name in names:
        if name in UNBUILDABLE:
            print(f"{name}: UNBUILDABLE ({UNBUILDABLE[name]})")
    for key, bad in failed.items():
        print(f"{key} fails: {', '.join(bad) or 'none'}")
    slow = sorted(builds, key=builds.get, reverse=True)[:5]
    print("slowest builds: " + ", ".join(f"{n} {builds[n]:.2f}s" for n in slow))
    print(f"{len(ARCHITECTURES)} architectures, {len(UNBUILDABLE)} unbuildable here; of {len(todo)} checked "
          f"{len(todo) - len(failed['forward'])} run a forward, "
          f"{len(todo) - len(failed['generate_step'])} generate_step, "
          f"{len(todo) - len(failed['BatchGenerator'])} BatchGenerator; loop {elapsed:.1f}s")


# ---- a tokenizer that fits every tiny model's vocabulary ----------------------------------------

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A character tokenizer for ASCII text with a chat template: 99 tokens, so its ids fit the
    zoo's vocabulary of 128, wrapped for mlx_lm (``TokenizerWrapper``)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], ignore_merges=True))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=TINY_CHAT_TEMPLATE)
    return TokenizerWrapper(hf)
