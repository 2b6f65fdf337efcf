"""Breadth of `tpuexport convert DIR --task auto` over every model type transformers ships.

For each model type in transformers' auto mappings of the tasks tpuexport supports, a tiny random
config is derived from its config class (widths, layers, heads, vocabulary, positions, experts,
image and audio sizes shrunk generically; per-type overrides only where the generic shrink cannot
build, in OVERRIDES), the model of its main head is written with save_pretrained and converted with

    tpuexport convert DIR --task auto --target v5e --no-saved-model

in its own process with a time limit, as a user would. One row per model type: the task --task auto
chose, the outcome, seconds, the first line of any failure; the last line

    architectures: N passed, R refused, F failed, C crashed of M

Outcomes: passed (exit 0); refused (exit 2 with one line `error: ...`); failed (exit 1 with one line
`verification failed: ...`); crashed (anything else: a traceback, a multi-line failure, a signal, the
time limit); not built (no tiny config of the type builds, or it stays above MAX_PARAMETERS).

The head built for a type is the first mapping in HEADS that lists it (a seq2seq LM before its
decoder-only causal LM, a masked LM before an encoder's causal LM head), AutoModel otherwise.

    pip install -c constraints.txt -e ".[bench]"
    nice -n 10 python benchmarks/architectures.py --shard 1/8 --jobs 1 --json shard1.json
    python benchmarks/architectures.py --only roberta,llama,vit
    python benchmarks/architectures.py --bf16-checkpoint      # the text-generation types, written in bfloat16
    python benchmarks/architectures.py --language-models      # multimodal types' language models (--task text-generation)
    python benchmarks/architectures.py --table a.json b.json  # one table from the shards' JSON

Each row's build runs in a child (`--build TYPE DIR DTYPE`), which tries the shrink levels in
order (LEVELS) and keeps the first whose model builds and runs one eager forward on tpuexport's own
example inputs; when none runs eagerly, the first that builds is converted anyway (tpuexport must
then refuse it in one line or convert it).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = pathlib.Path(__file__).resolve().parent
# The repository root (this file is in benchmarks/ or benchmarks/<group>/): the tpuexport package beside it.
ROOT = next(parent for parent in HERE.parents if (parent / "tpuexport").is_dir())

# (task as tpuexport names it, transformers' mapping) in the order a type's head is chosen.
HEADS = (
    ("text2text-generation", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("automatic-speech-recognition", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    ("fill-mask", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("text-generation", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("automatic-speech-recognition", "MODEL_FOR_CTC_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
    ("text-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    ("question-answering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
    ("semantic-segmentation", "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES"),
    ("object-detection", "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES"),
    ("depth-estimation", "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES"),
    ("audio-frame-classification", "MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES"),
    ("feature-extraction", "MODEL_MAPPING_NAMES"),
)
OUTCOMES = ("passed", "refused", "failed", "crashed", "not built")
CHILD_TIMEOUT_SECONDS = 900
BUILD_TIMEOUT_SECONDS = 300
MAX_PARAMETERS = 40_000_000

# The generic shrink: config keys by what they size, and the size they shrink to (never grown).
LAYERS, ATTENTION_HEADS, POSITIONS, WIDTH = 2, 4, 64, 64
SIZES = {  # group: (size, keys)
    "width": (WIDTH, (
        "hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "hidden_dim", "embedding_size", "encoder_hidden_size",
        "decoder_hidden_size", "text_hidden_size", "projection_dim", "word_embed_proj_dim", "out_hidden_size", "output_hidden_size",
        "projector_hidden_size", "audio_hidden_size", "cross_hidden_size", "attention_hidden_size", "pooler_output_size",
        "pooler_hidden_size", "fusion_hidden_size", "backbone_hidden_size", "classifier_proj_size", "vision_output_dim",
        "encoder_hidden_dim", "hidden_size_global", "mask_feature_size", "fpn_hidden_size", "conv_output_size", "output_dim",
        "latent_dim", "xvector_output_dim", "codevector_dim", "proj_codevector_dim", "vision_feature_dim", "text_embed_dim",
        "reassemble_hidden_size", "bottleneck_features", "d_latents",
        "upsample_groups")),  # Mimi's depthwise upsampling: as many groups as channels, the hidden size (kept equal to it)
    "ffn": (128, (
        "intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size",
        "shared_expert_intermediate_size", "mlp_dim", "dim_feedforward", "decoder_intermediate_size", "ffn_hidden_size",
        "dense_intermediate_size", "moe_hidden_size", "shared_intermediate_size", "moe_shared_expert_intermediate_size",
        "intermediate_size_mlp", "encoder_feedforward_dim", "d_inner", "linear_units", "projection_intermediate_size",
        "shared_experts_intermediate_size", "dim_ff", "dff", "encoder_linear_units", "decoder_linear_units", "expert_intermediate_size",
        "expert_ffn_hidden_size")),
    "layers": (LAYERS, (
        "num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "n_layers", "num_decoder_layers",
        "num_encoder_layers", "speech_encoder_layers", "text_encoder_layers", "num_text_layers", "max_window_layers",
        "num_self_attends_per_block")),
    "heads": (ATTENTION_HEADS, (
        "num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads", "attention_heads",
        "cross_num_attention_heads", "decoder_cross_attention_heads", "index_n_heads", "swa_num_attention_heads", "num_heads")),
    "head_dim": (16, (
        "head_dim", "d_kv", "attention_head_dim", "dim_head", "kv_channels", "d_head", "swa_head_dim", "cross_head_dim", "index_head_dim",
        "qk_nope_head_dim", "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "state_size",
        "ssm_state_size", "mamba_d_state")),
    "vocab": (512, (
        "vocab_size", "text_vocab_size", "input_vocab_size", "output_vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size",
        "vision_vocab_size", "codebook_size")),
    "positions": (POSITIONS, (
        "max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "max_source_positions", "max_seq_len",
        "max_2d_position_embeddings")),
    "frames": (4, ("num_frames", "frames_per_clip")),  # a video clip's (a multiple of the usual tubelets, 1 and 2)
    "experts": (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num")),
    "top_k": (2, ("num_experts_per_tok", "moe_topk", "n_group", "moe_k", "moe_top_k", "num_experts_per_token", "experts_per_token",
                  "top_k_experts")),
    "window": (32, ("sliding_window", "attention_chunk_size", "sliding_window_size", "kv_lora_rank", "q_lora_rank", "o_lora_rank")),
    "small": (8, ("qk_rope_head_dim", "rotary_dim", "time_step_rank", "block_size", "attention_window", "num_conv_pos_embeddings", "mamba_chunk_size")),
    "one": (1, ("n_shared_experts", "topk_group", "first_k_dense_replace", "num_shared_experts", "moe_num_shared_experts",
                "moe_layer_start_index", "moe_layer_end_index")),
}
SHRUNK = {key: size for size, keys in SIZES.values() for key in keys}
# What the last shrink level still shrinks (widths stay).
COUNTS = SIZES["layers"][1] + SIZES["vocab"][1] + SIZES["experts"][1] + SIZES["top_k"][1] + SIZES["positions"][1]
# Counts an MoE config's defaults may leave unset (None) beside the ones it sets: the tiny model gets them.
MOE_UNSET = SIZES["experts"][1] + ("num_experts_per_tok", "n_shared_experts")
# Counts of layers of one kind (Gemma 3n's and Gemma 4's layers reusing another layer's KV cache), cut with the layers.
LAYER_COUNTS = ("num_kv_shared_layers",)
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "cross_num_key_value_heads",
            "swa_num_key_value_heads", "linear_num_key_heads")
# Per-layer lists of key/value heads (Sapiens2's), cut with the layers and shrunk as KV_HEADS.
KV_HEADS_PER_LAYER = ("num_key_value_heads_per_layer",)
# Per-stage lists of vision backbones: widths scaled down together, heads divided by the first stage's.
STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "embed_dim_per_stage", "neck_hidden_sizes", "stage_out_channels", "stage_in_channels",
                "stage_mid_channels", "encoder_hidden_sizes", "conv_dim", "tdnn_dim", "stem_channels", "backbone_channel_list")
STAGE_HEADS = ("num_heads", "num_attention_heads", "num_attention_heads_per_stage", "attention_heads")
STAGE_DEPTHS = ("depths", "stage_num_blocks", "blocks_per_stage", "num_block_repeats", "stage_numb_of_layers")
# Compound-scaling multipliers of EfficientNet-style backbones (ALIGN's and EfficientNet's defaults are B7's, 2.0 wide and
# 3.1 deep: 45M parameters at every shrink level), brought down to the base network's 1.0.
COEFFICIENTS = ("width_coefficient", "depth_coefficient")
LEVELS = ("everything", "image size kept", "layers and vocabulary only", "everything, unset sizes given")
# The last level shrinks as the first and gives the sizes of these groups that the config leaves None their shrunk
# values: defaults that record no vocabulary (ESM's) or no experts (DiffusionGemma's MoE, always built), which no model
# builds with, or no padding id (ESM's, which numbers its positions from it). Only when no other level builds: elsewhere
# None may mean "none" (a dense model's experts, a decoder's padding).
UNSET_GIVEN = ("width", "ffn", "layers", "heads", "vocab", "experts", "top_k")
UNSET_TOKEN_IDS = {"pad_token_id": 1}  # RoBERTa's and ESM's
# Key/value heads left None (Nemotron's) are as many as the query heads, as Llama's config reads None.

GLM_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
# Per-type overrides, applied after the generic shrink (only where it cannot build): {type: {key: value}}.
# A multimodal model's placeholder token fields, and the positions its text keeps for them.
PLACEHOLDER_TOKEN = re.compile(r"(image|video|audio|vision)_token_(id|index)")
MEDIA_POSITIONS = 1024
OVERRIDES: dict[str, dict] = {
    # Their configs leave the image token unset (None), which their checkpoints set (BLIP-2 OPT's 50265).
    **{name: {"image_token_index": 500} for name in ("blip-2", "instructblip", "instructblipvideo")},
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": WIDTH // 4}},  # the text width / 4, checked by its config
    # Its config leaves the vision layers feeding the language model's layers unset (None); its tiny layers are 0 and 1.
    "granite4_vision": {"deepstack_layer_map": [[-2, 0], [-1, 1]], "spatial_target_layers": [0, 1, 0, 1], "downsample_rate": "1/2"},
    "chameleon": {"vocabulary_map": {"<image>": 500}},  # the image token's id in its (absent) tokenizer
    # Its attention reads rope_theta, which DbrxAttentionConfig has no default for, and clamps by clip_qkv, failing when it is
    # None (its default): DBRX's checkpoint's values.
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # Its text model's rotary embedding takes one row of positions per mrope_section axis, which its config leaves unset:
    # HunYuan-VL's four axes (xdrope_section), summing to half the tiny head dim.
    "hunyuan_vl_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2, 2]}},
    "efficientnet": {"hidden_dim": 1280},  # its top conv is 1280 x width_coefficient wide, its batch norm hidden_dim
    "align": {"projection_dim": 320},  # its image embeddings are the vision tower's last stage, unprojected: 320 wide at width 1.0
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},  # no default
    # Their configs' defaults have no short-convolution layer (LFM2's: all attention; LFM2-MoE's: none given), which every released
    # checkpoint has: one of each, as the checkpoints begin (LFM2-MoE's first layer dense).
    **{name: {"layer_types": ["conv", "full_attention"]} for name in ("lfm2", "lfm2_moe")},
    "lfm3": {"num_hidden_layers": 3, "layer_types": ["conv", "sliding_attention", "full_attention"]},  # its default's first three
    # Hybrid state-space decoders keep attention layers among their Mamba layers (their defaults place the first at layer 4 or
    # later, or none); shrunk to 2 layers they kept none, and transformers' generate() then fails on its own cache.
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # Its segmentation head's channels have no default (its head reads upsample_out_channels[:-1] of None): a small head.
    "sapiens2": {"head_config": {"upsample_out_channels": [32, 32], "conv_out_channels": [32]}},
    # GLM-4V's rotary sections default to [8, 12, 12] in its code, not its config: they sum to half the tiny head dim.
    **{name: {"rope_parameters": GLM_ROPE} for name in ("glm4v_text", "glm_image_text", "glm_ocr_text")},
    **{name: {"text_config": {"rope_parameters": GLM_ROPE}} for name in ("glm4v", "glm_image", "glm_ocr", "glm46v", "glmga")},
    # GLM-4.5V's rotate half of each head ([8, 12, 12] of 128): a quarter of the tiny head dim.
    "glm4v_moe_text": {"rope_parameters": {**GLM_ROPE, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}},
    "glm4v_moe": {"text_config": {"rope_parameters": {**GLM_ROPE, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}}},
    # Their encoders' positions bound the subsampled frames (tpuexport's 3000 mel frames / subsampling_factor 8: 376), which 64 broke
    # ("Sequence Length: 376 has to be less or equal than config.max_position_embeddings 64", given time-major features).
    "nemotron_asr_streaming_encoder": {"max_position_embeddings": 512},
    **{name: {"encoder_config": {"max_position_embeddings": 512}} for name in ("nemotron_asr_streaming", "nemotron3_5_asr")},
    # Qwen2-VL's text models too: their mrope_section defaults to [16, 24, 24] in their code when the config leaves it unset.
    **{name: {"rope_parameters": GLM_ROPE} for name in ("qwen2_vl_text", "qwen2_5_vl_text")},
    **{name: {"text_config": {"rope_parameters": GLM_ROPE}} for name in ("qwen2_vl", "qwen2_5_vl")},
    # Sizes their configs' validators tie together, which the generic shrink left apart: each layer reads its own keys
    # (the shrunk per-layer list kept later layers' indexes); sliding layers' head_dim is qk_nope + qk_rope (16 + 8);
    # a codebook as wide as the model; the adapter reading the tower's 2 layers.
    # Its projector's norm is as wide as the tower (projection_hidden_size defaults to the full tower's 1152).
    "kimi_k25": {"projection_hidden_size": WIDTH},
    "mistral_large4_text": {"kv_source_layers": [0, 1]},
    "mistral_large4": {"text_config": {"kv_source_layers": [0, 1]}},
    "dots3_note_text": {"head_dim": 24},
    "wavtokenizer": {"codebook_dim": WIDTH},
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2]}},
    # Hybrid decoders whose shrunk mixers no longer fit: as many value heads as key heads; one expert group for the 4 experts;
    # Zamba2's Mamba heads as wide as 2 x width over its 8 heads, its shared attention over the width twice (embeddings
    # concatenated), its hybrid layer the second (the ids its full config recorded).
    "zamba2": {"mamba_headdim": 2 * WIDTH // 8, "attention_hidden_size": 2 * WIDTH, "attention_head_dim": 2 * WIDTH // ATTENTION_HEADS,
               "hybrid_layer_ids": [1]},
    "olmo_hybrid": {"linear_num_value_heads": 4},
    # Its adapters need a language for rows that name none (a checkpoint's processor names one; its config defaults none).
    "xmod": {"default_language": "en_XX"},
    "bailing_hybrid": {"num_expert_group": 1, "topk_group": 1},
    # Its default config's backbone gives only its last stage, where its head reads all six (checkpoints list them).
    "uvdoc": {"backbone_config": {"out_features": [f"stage{index}" for index in range(1, 7)], "out_indices": list(range(1, 7))}},
    # Its config counts num_hidden_layers as num_layers_per_stack x H_cycles x (L_cycles + 1): kept consistent when shrunk.
    "hrm_text": {"num_layers_per_stack": 2, "num_hidden_layers": 16},
    # Its config leaves the audio token unset (None), which its checkpoints set; the tiny vocabulary has room at 500.
    "voxtral": {"audio_token_id": 500},
    # Its two-stage top-k takes num_queries (300) of the encoder's proposals, one per patch: 256 at 224 x 224 (real
    # checkpoints run at 560: --dim height=560:560 --dim width=560:560).
    "rf_detr": {"num_queries": 16},
    # Its hooks index the patch encoder's 12 layers (the tiny one has 2); its images are 1536 x 1536 (patch_size /
    # min(scaled_images_ratios)), which its config does not record: --dim height=1536:1536 --dim width=1536:1536.
    "depth_pro": {"intermediate_hook_ids": [1, 0]},
}


def model_types() -> dict[str, tuple[str, str]]:
    """{model type: (task, model class name)} over the HEADS mappings."""
    from transformers.models.auto import modeling_auto

    chosen: dict[str, tuple[str, str]] = {}
    for task, table in HEADS:
        for model_type, names in getattr(modeling_auto, table).items():
            name = names if isinstance(names, str) else names[0]
            chosen.setdefault(model_type, (task, name))
    return dict(sorted(chosen.items()))


def language_model_types() -> dict[str, tuple[str, str]]:
    """{multimodal model type: ("text-generation", its image-text-to-text class name)} for the types whose
    language model `--task text-generation` converts alone (export/language_model.py: a text config
    a causal LM builds), leaving out the types a causal LM table lists themselves (Gemma 3's)."""
    import transformers
    from transformers.models.auto import modeling_auto

    from tpuexport.export.language_model import language_model_config

    chosen: dict[str, tuple[str, str]] = {}
    for model_type, names in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items():
        if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        try:
            config = transformers.AutoConfig.for_model(model_type)
        except Exception:  # a config class that needs arguments to build: not listed
            continue
        if language_model_config(config) is not None:
            chosen[model_type] = ("text-generation", names if isinstance(names, str) else names[0])
    return dict(sorted(chosen.items()))


def _is_config(value) -> bool:
    return isinstance(value, dict) and "model_type" in value


def _token_ids(config: dict, vocab: int) -> None:
    """Special token ids past the shrunk vocabulary become distinct ids at its end."""
    spare = iter(range(vocab - 1, vocab // 2, -1))
    remap: dict[int, int] = {}

    def clamp(value):
        if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            return remap.setdefault(value, next(spare))
        return value

    for key, value in config.items():
        if key.endswith(("_token_id", "_token_index", "token_id", "_token_ids")) or key in ("image_token_id", "boi_token_id"):
            config[key] = [clamp(item) for item in value] if isinstance(value, list) else clamp(value)


def _per_layer(values: list, layers: int) -> list:
    """A per-layer list cut to `layers`, keeping one layer of each kind it has (sliding and full
    attention, linear and full, ...) where it can."""
    cut = list(values[:layers])
    missing = [value for value in dict.fromkeys(map(json.dumps, values)) if value not in map(json.dumps, cut)]
    for position, value in zip(range(layers - 1, -1, -1), missing):
        cut[position] = json.loads(value)
    return cut


def shrink(config: dict, level: int) -> dict:
    """One config dict (and its sub-configs) shrunk in place at `level` (an index of LEVELS)."""
    # A backbone's num_layers counts its stages, as does a layer count equal to its stages' (MuseSpark's audio num_hidden_layers).
    stages = next((len(config[key]) for key in STAGE_DEPTHS if isinstance(config.get(key), list)), None)
    staged = stages is not None
    layers_before = None if staged else next((config[key] for key in SIZES["layers"][1] if isinstance(config.get(key), int)), None)
    heads_before = next((config[key] for key in SIZES["heads"][1] if isinstance(config.get(key), int)), None)
    before = dict(config)
    for key, value in list(config.items()):
        if staged and (key == "num_layers" or (key in SIZES["layers"][1] and value == stages)):
            continue
        if key in ("out_features", "out_indices") and layers_before and not staged and "out_features" in config:
            config[key] = None  # a transformer backbone's stages are its layers: the default (the last) after the cut
            continue
        if key == "out_indices" and layers_before and isinstance(value, list):  # the layers a model's own neck taps (BEiT-style)
            config[key] = [min(index * LAYERS // layers_before, LAYERS - 1) for index in value]
            continue
        if _is_config(value) and value["model_type"] == "timm_backbone":
            config[key] = _tiny_resnet(value)
        elif _is_config(value):
            shrink(value, level)
        elif isinstance(value, dict) and value and all(str(index).isdigit() for index in value) and layers_before:
            config[key] = {str(int(index) * LAYERS // layers_before): shrink(dict(item), level) if isinstance(item, dict) else item
                           for index, item in value.items()}  # per-layer settings, their sizes shrunk as the model's
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, float) and key in COEFFICIENTS:
            config[key] = min(value, 1.0)
        elif isinstance(value, int) and key in SHRUNK and (level < 2 or key in COUNTS):
            config[key] = min(value, SHRUNK[key])
        elif isinstance(value, int) and ("vocab_size" in key or key.endswith("_vocab")):
            config[key] = min(value, SIZES["vocab"][0])
        elif isinstance(value, int) and key in LAYER_COUNTS and layers_before:
            config[key] = value * LAYERS // layers_before  # all layers stay all; a few of many, none of the cut ones
        elif isinstance(value, int) and key in KV_HEADS and heads_before:
            config[key] = _kv_heads(value, heads_before, level)
        elif isinstance(value, list) and key in KV_HEADS_PER_LAYER and heads_before:
            cut = _per_layer(value, LAYERS) if layers_before and len(value) == layers_before > LAYERS else value
            config[key] = [_kv_heads(item, heads_before, level) for item in cut]
        elif isinstance(value, list) and layers_before and len(value) == layers_before and layers_before > LAYERS:
            config[key] = _per_layer(value, LAYERS)
        elif level < 2 and isinstance(value, list) and value and all(isinstance(item, int) for item in value):
            _shrink_stages(config, key, value)
        elif level == 0 and key in ("image_size", "crop_size") and isinstance(value, int):
            patch = config.get("patch_size") if isinstance(config.get("patch_size"), int) else 8
            config[key] = min(value, max(64, 4 * patch))
    _keep_equal_sizes(before, config)
    _keep_tapped_layers(before, config, layers_before)
    if any(isinstance(config.get(key), int) for key in SIZES["experts"][1] + SIZES["top_k"][1]):
        for key in MOE_UNSET:
            if key in config and config[key] is None:
                config[key] = SHRUNK[key]
    for key, value in config.items():  # after the head dims they follow
        if isinstance(value, dict) and key.startswith("rope"):
            _shrink_rope(value, config)
    _state_space_heads(config)
    if "head_dim" in config and config["head_dim"] is None and isinstance(config.get("hidden_size"), int) and heads_before:
        # Ministral's and HunYuan's defaults leave it None, which their attention reads as is (None ** -0.5)
        config["head_dim"] = config["hidden_size"] // next(config[key] for key in SIZES["heads"][1] if isinstance(config.get(key), int))
    if "qk_head_dim" in config and "qk_nope_head_dim" in config:
        config["qk_head_dim"] = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else SIZES["vocab"][0]
    _token_ids(config, vocab)
    return config


def _kv_heads(value: int, heads_before: int, level: int) -> int:
    """A layer's key/value heads after the shrink: all the query heads where it had all, one where it had one, else 2."""
    heads = min(heads_before, ATTENTION_HEADS) if level < 2 else heads_before
    return heads if value >= heads_before else 1 if value == 1 else min(2, heads)


def _keep_tapped_layers(before: dict, after: dict, layers_before: int | None) -> None:
    """A neck that takes one feature map per tapped layer (DPT, Depth Anything, ZoeDepth: 4) needs
    that many layers: a transformer keeps as many as it taps, each tapped (a backbone's stage
    indices count from its stem, 1; DPT's own backbone_out_indices from 0)."""
    for key, first in (("out_indices", 1), ("backbone_out_indices", 0)):
        taps = before.get(key)
        if not (isinstance(taps, list) and LAYERS < len(taps) <= (layers_before or 0)) or (key == "out_indices" and "out_features" not in after):
            continue
        layer_key = next(name for name in SIZES["layers"][1] if isinstance(after.get(name), int))
        after[layer_key], after[key] = len(taps), list(range(first, first + len(taps)))
        if key == "out_indices":
            after["out_features"] = None


def _keep_equal_sizes(before: dict, after: dict) -> None:
    """Sizes of one kind (widths, head dims, ...) that were equal stay equal, at the smaller shrunk
    value: MLA's rotary head_dim is its qk_rope_head_dim, a projection width is the hidden size."""
    dimensions = {key for group in ("width", "ffn", "head_dim", "window", "small") for key in SIZES[group][1]}
    shrunk = [key for key in dimensions if isinstance(before.get(key), int) and not isinstance(before[key], bool) and key in after]
    for key in shrunk:
        equal = [other for other in shrunk if before[other] == before[key]]
        smallest = min(after[other] for other in equal)
        for other in equal:
            after[other] = smallest


def _tiny_resnet(timm: dict) -> dict:
    """A transformers ResNet in place of a timm backbone (timm needs torchvision, which does not load
    with the CPU torch here), its stages the ones the timm config takes features from."""
    stages = [f"stage{index}" for index in timm.get("out_indices") or (1, 2, 3, 4)]
    return {"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1],
            "layer_type": "basic", "out_features": stages, "num_channels": timm.get("num_channels", 3)}


def _state_space_heads(config: dict) -> None:
    """A Mamba-2 mixer's heads times head dim is its inner width (expand x hidden size; Falcon-H1's
    explicit mamba_d_ssm, unshrunk, would stay the original model's, so it goes back to that default)."""
    if isinstance(config.get("mamba_d_ssm"), int):
        config["mamba_d_ssm"] = None
    for expand, heads, head_dim in (("expand", "num_heads", "head_dim"), ("mamba_expand", "mamba_n_heads", "mamba_d_head"),
                                    ("mamba_expand", "mamba_num_heads", "mamba_head_dim")):
        values = [config.get(key) for key in (expand, heads, head_dim, "hidden_size")]
        if all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
            config[heads] = int(values[0] * values[3]) // values[2]


def _shrink_rope(rope: dict, config: dict) -> None:
    """Rotary parameters follow the shrunk positions and head dims: the original context of a scaled
    rotary (YaRN, LongRoPE, Llama-3) becomes half the shrunk one; per-frequency factor lists keep
    head_dim / 2 entries; multimodal sections are cut to fit."""
    for key, value in list(rope.items()):
        if isinstance(value, dict):
            _shrink_rope(value, config)
        elif key == "original_max_position_embeddings" and isinstance(value, int):
            rope[key] = min(value, POSITIONS // 2)
        elif key in ("short_factor", "long_factor") and isinstance(value, list):
            rotary = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0
            rope[key] = value[: max(1, int(config.get("head_dim", WIDTH // ATTENTION_HEADS) * rotary) // 2)]
        elif key == "mrope_section" and isinstance(value, list):
            rotary = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0
            half = int(config.get("head_dim", WIDTH // ATTENTION_HEADS) * rotary) // 2
            rope[key] = [half - 2 * (half // 4), half // 4, half // 4][: len(value)]


def _shrink_stages(config: dict, key: str, value: list) -> None:
    if key in STAGE_WIDTHS:
        factor = max(1, value[0] // 16)
        config[key] = [max(8, item // factor) for item in value]
    elif key in STAGE_HEADS and len(value) > 1:
        config[key] = [max(1, item // value[0]) for item in value]
    elif key in STAGE_DEPTHS:
        config[key] = [min(item, 2) for item in value]


def tiny_config(model_type: str, level: int):
    """The model type's default config shrunk at `level`, with its OVERRIDES."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    values = config_class().to_dict()
    if LEVELS[level] == "everything, unset sizes given":
        _give_unset_sizes(values)
        level = 0
    original = copy.deepcopy(values)
    values = shrink(values, level)
    _keep_sums(original, values)
    _scale_pinpoints(original, values)
    if any(PLACEHOLDER_TOKEN.fullmatch(key) for key in values):
        _room_for_media_tokens(original, values)
    for key, value in OVERRIDES.get(model_type, {}).items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key].update(value)
        else:
            values[key] = value
    return config_class.from_dict(values)


def _keep_sums(before: dict, after: dict) -> None:
    """A size the shrink left that was the sum of two widths (the config's own and its sub-configs') stays
    their sum: a codec's latent width is its acoustic and semantic encoders' widths concatenated (XCodec's
    codebook_dim, 256 + 768; NeuCodec's and XCodec2's quantization_dim, 1024 + 1024), which the shrunk
    widths broke ("mat1 and mat2 shapes cannot be multiplied (100x128 and 1024x512)")."""
    widths = {}  # (sub-config key or "", width key): (before, after)
    for prefix, old, new in [("", before, after)] + [(key, before[key], after[key]) for key in after
                                                       if _is_config(after[key]) and _is_config(before.get(key))]:
        for key in SIZES["width"][1]:
            if isinstance(old.get(key), int) and isinstance(new.get(key), int) and old[key] != new[key]:
                widths[prefix, key] = (old[key], new[key])
    pairs = [(a, b) for index, a in enumerate(widths) for b in list(widths)[index:]]
    for key, value in after.items():
        if not (key.endswith("_dim") and isinstance(value, int) and not isinstance(value, bool) and value == before.get(key)):
            continue
        summed = next((widths[a][1] + widths[b][1] for a, b in pairs if a != b and widths[a][0] + widths[b][0] == value), None)
        if summed is not None and summed < value:
            after[key] = summed


def _scale_pinpoints(before: dict, after: dict) -> None:
    """Any-resolution tiling's pinpoints (LLaVA-NeXT's image_grid_pinpoints, multiples of a tile: 336)
    made the same multiples of the shrunk tower's image size, whose tiles must cut them evenly (a default
    config's tower need not match its pinpoints: Granite 4 Vision's CLIP defaults to 224)."""
    pinpoints, new = after.get("image_grid_pinpoints"), (after.get("vision_config") or {}).get("image_size")
    if isinstance(pinpoints, list) and pinpoints and isinstance(new, int):
        tile = math.gcd(*(side for pinpoint in pinpoints for side in pinpoint))
        after["image_grid_pinpoints"] = [[height // tile * new, width // tile * new] for height, width in pinpoints]


def _room_for_media_tokens(before: dict, after: dict) -> None:
    """A multimodal config's positions shrunk no further than MEDIA_POSITIONS: its text holds an
    image's (clip's, audio's) placeholder tokens, one per feature, often more than POSITIONS."""
    for key, value in after.items():
        if _is_config(value) and _is_config(before.get(key)):
            _room_for_media_tokens(before[key], value)
        elif key in SIZES["positions"][1] and isinstance(value, int) and isinstance(before.get(key), int):
            after[key] = max(value, min(before[key], MEDIA_POSITIONS))


def _give_unset_sizes(config: dict) -> None:
    """Sizes of the UNSET_GIVEN groups a config (and its sub-configs) leaves None get their shrunk values,
    UNSET_TOKEN_IDS theirs and key/value heads the query heads'."""
    heads = next((config[key] for key in SIZES["heads"][1] if isinstance(config.get(key), int)), None)
    sizes = {**{key: SIZES[group][0] for group in UNSET_GIVEN for key in SIZES[group][1]}, **UNSET_TOKEN_IDS,
             **dict.fromkeys(KV_HEADS if heads else (), heads)}
    for key, value in config.items():
        if _is_config(value):
            _give_unset_sizes(value)
        elif value is None and key in sizes:
            config[key] = sizes[key]


def _eager_check(model, task: str) -> None:
    """One eager forward on the inputs tpuexport gives the model (a causal LM: a short prompt), whose
    float outputs must be finite: a random tiny model can overflow or underflow where a trained one
    does not (ALIGN's image tower scales its activations by ~1e-4 a block to 1e-24, and the L2 norm of
    its embeddings underflows to 0: every embedding +-inf), and verification cannot check such outputs."""
    import torch

    from tpuexport.export.huggingface import forward_program

    with torch.no_grad():
        if task == "text-generation":
            vocab = model.config.get_text_config().vocab_size
            outputs = model(input_ids=torch.randint(1, vocab, (1, 8)), use_cache=False)
        else:
            wrapped, args, _ = forward_program(model)
            outputs = wrapped(*args)
    pytree = torch.utils._pytree
    leaves, _ = pytree.tree_flatten_with_path(dict(outputs) if isinstance(outputs, dict) else outputs)
    not_finite = [pytree.keystr(path) for path, leaf in leaves
                  if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not torch.isfinite(leaf).all()]
    if not_finite:
        raise FloatingPointError(f"eager outputs {', '.join(not_finite)} hold inf or NaN at the tiny config")


def tiny_model(model_type: str, language_models: bool = False):
    """The tiny model of a type (`language_models`: its image-text-to-text model, language_model_types),
    at the first shrink level that builds and runs eagerly.

    Returns:
      (model, {"task", "class", "level", "parameters", "eager"}): the shrink level kept and, when no
      level ran eagerly, the first line of the eager error at the first level that built.
    Raises:
      RuntimeError: no level builds under MAX_PARAMETERS (the message says why).
    """
    import torch
    import transformers

    task, class_name = (language_model_types() if language_models else model_types())[model_type]
    model_class = getattr(transformers, class_name)
    first, reasons = None, []
    for level in range(len(LEVELS)):
        if LEVELS[level] == "everything, unset sizes given" and first is not None:
            break  # a level built: its sizes were set, only its eager forward failed
        torch.manual_seed(0)
        try:
            config = tiny_config(model_type, level)
            if not isinstance(config, model_class.config_class) and isinstance(config.get_text_config(), model_class.config_class):
                config = config.get_text_config()  # a causal LM the mapping lists under its multimodal type (Qwen3.5)
            with torch.device("meta"):  # counted before any memory is taken
                parameters = sum(parameter.numel() for parameter in model_class(config).parameters())
            if parameters > MAX_PARAMETERS:
                reasons.append(f"{LEVELS[level]}: {parameters / 1e6:.0f}M parameters")
                continue
            model = model_class(config).eval()
        except Exception as error:  # a config the class cannot build: try the next level
            reasons.append(f"{LEVELS[level]}: {type(error).__name__}: {_first_line(error)}")
            continue
        _untie_zero_weights(model)
        try:
            _eager_check(model, task)
            eager = "ok"
        except Exception as error:
            eager = f"{type(error).__name__}: {_first_line(error)}"
        candidate = (model, {"task": task, "class": class_name, "level": LEVELS[level], "parameters": parameters, "eager": eager})
        if eager == "ok":
            first = candidate
            break
        first = first or candidate
    if first is None:
        raise RuntimeError("; ".join(reasons)[:300])
    return first


def _untie_zero_weights(model) -> None:
    """Weight matrices transformers initializes to zeros (MoE routers' gates, some projections) get
    small random values: a router of zeros ties every expert on every token, which no trained
    checkpoint does, and which top-k then breaks one way in PyTorch and another in XLA."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2 and parameter.is_floating_point() and not parameter.any():
                parameter.normal_(0.0, 0.02)


def build(model_type: str, directory: pathlib.Path, dtype_name: str, language_models: bool = False) -> dict:
    """Writes the tiny model of a type with save_pretrained in `dtype_name` (run in a child process);
    returns tiny_model's record."""
    import torch

    model, record = tiny_model(model_type, language_models)
    model.to(getattr(torch, dtype_name)).save_pretrained(directory)
    return record


def _first_line(error) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else ""


def _noise(line: str) -> bool:
    """Lines third-party libraries print on import that are no part of tpuexport's output."""
    return line.startswith(("Failed to load", "W1", "I1", "E1", "WARNING: All log messages")) or "torch/utils/_pytree.py" in line


def outcome(returncode: int, stderr: str) -> tuple[str, str]:
    """(outcome, first line of any failure) of one `tpuexport convert`."""
    lines = [line for line in stderr.strip().splitlines() if line.strip() and not _noise(line)]
    if returncode == 0:
        return "passed", ""
    message = next((line for line in lines if line.startswith(("error:", "verification failed:"))), None)
    one_line = message is not None and lines[-1] == message and "Traceback" not in stderr
    if returncode == 2 and one_line and message.startswith("error:"):
        return "refused", message
    if returncode == 1 and one_line and message.startswith("verification failed:"):
        return "failed", message
    first = next((line for line in lines if line.startswith(("Traceback", "error:", "verification failed:"))), None)
    tail = lines[-1] if lines else f"exit code {returncode}"
    signal = f"killed by signal {-returncode}; " if returncode < 0 else ""
    return "crashed", f"{signal}{tail}" + (f" (first: {first})" if first and first != tail and not first.startswith("Traceback") else "")


def run_row(model_type: str, options) -> dict:
    """Builds one type's tiny directory and converts it; returns its row."""
    task, class_name = (language_model_types() if options.language_models else model_types())[model_type]
    row = {"type": model_type, "class": class_name, "task": task, "seconds": 0.0, "message": ""}
    environment = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    dtype = "bfloat16" if options.bf16_checkpoint else "float32"
    with tempfile.TemporaryDirectory(prefix="tpuexport-architectures-") as scratch:
        scratch = pathlib.Path(scratch)
        directory = scratch / f"{model_type}-tiny"  # not an importable name: the cwd must not shadow a package (xlstm)
        try:
            built = subprocess.run([sys.executable, __file__, "--build", model_type, str(directory), dtype,
                                    *(["--language-models"] if options.language_models else [])], capture_output=True,
                                   text=True, timeout=BUILD_TIMEOUT_SECONDS, env=environment, cwd=scratch)
        except subprocess.TimeoutExpired:
            return {**row, "outcome": "not built", "message": f"building took over {BUILD_TIMEOUT_SECONDS} s"}
        if built.returncode != 0:
            lines = [line for line in built.stderr.strip().splitlines() if not _noise(line)]
            return {**row, "outcome": "not built", "message": (lines or ["?"])[-1][:300]}
        row.update(json.loads(built.stdout.strip().splitlines()[-1]))
        command = [sys.executable, "-m", "tpuexport.cli", "convert", str(directory), "--task", task if options.language_models else "auto",
                   "--target", "v5e",
                   "--no-saved-model", "-o", str(scratch / "out.tpu")]
        start = time.perf_counter()
        try:
            completed = subprocess.run(command, capture_output=True, text=True, timeout=options.timeout, env=environment, cwd=scratch)
        except subprocess.TimeoutExpired:
            return {**row, "outcome": "crashed", "seconds": round(time.perf_counter() - start, 1),
                    "message": f"timed out after {options.timeout} s"}
        row["seconds"] = round(time.perf_counter() - start, 1)
        row["outcome"], row["message"] = outcome(completed.returncode, completed.stderr)
        if row["outcome"] == "crashed":  # kept in the JSON for diagnosis
            row["stderr_tail"] = [line for line in completed.stderr.splitlines() if not _noise(line)][-40:]
        if row["outcome"] == "passed":
            manifest = json.loads((scratch / "out.tpu" / "manifest.json").read_text())
            row["task"] = manifest.get("huggingface", {}).get("task", row["task"])
        return row


def format_row(row: dict) -> str:
    """One table line; `eager` says whether the tiny model ran one eager forward on tpuexport's inputs
    (no: the inputs or the tiny config do not suit it, whatever tpuexport does)."""
    eager = {"ok": "yes", None: "-"}.get(row.get("eager"), "no")
    return f"{row['type']:<34} {row['task']:<28} {row['outcome']:<9} {eager:<5} {row['seconds']:>7.1f}  {row['message']}"


def print_table(rows: list[dict], title: str) -> None:
    print(f"# {title}")
    print(f"{'type':<34} {'task':<28} {'outcome':<9} {'eager':<5} {'seconds':>7}  first line of any failure")
    for row in sorted(rows, key=lambda row: row["type"]):
        print(format_row(row), flush=True)
    counts = {name: sum(row["outcome"] == name for row in rows) for name in OUTCOMES}
    print(f"architectures: {counts['passed']} passed, {counts['refused']} refused, {counts['failed']} failed, {counts['crashed']} crashed "
          f"of {len(rows)} ({counts['not built']} not built tiny)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (default: every one)")
    parser.add_argument("--shard", default="1/1", help="i/n: the i-th of n interleaved shards of the types")
    parser.add_argument("--jobs", type=int, default=1, help="conversions at once")
    parser.add_argument("--timeout", type=int, default=CHILD_TIMEOUT_SECONDS, help="seconds per conversion")
    parser.add_argument("--bf16-checkpoint", action="store_true", help="the text-generation types only, written in bfloat16")
    parser.add_argument("--language-models", action="store_true",
                        help="multimodal types' language models alone: their image-text-to-text model, --task text-generation")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    parser.add_argument("--table", nargs="+", type=pathlib.Path,
                        help="print one table from rows written with --json (a later file's row of a type replaces an earlier one)")
    parser.add_argument("--build", nargs=3, metavar=("TYPE", "DIR", "DTYPE"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if options.build:
        try:
            record = build(options.build[0], pathlib.Path(options.build[1]), options.build[2], options.language_models)
        except Exception as error:
            print(f"could not be built tiny: {type(error).__name__}: {_first_line(error)}", file=sys.stderr)
            sys.exit(3)
        print(json.dumps(record))
        return
    if options.table:  # a type's row in a later file replaces its row in an earlier one (a re-run after a fix)
        runs = [json.loads(path.read_text()) for path in options.table]
        rows = {row["type"]: row for run in runs for row in run["rows"]}
        print_table(list(rows.values()), "; ".join(f"{run['started']} {run['mode']} shard {run['shard']} at {run.get('commit', '?')}"
                                                  for run in runs))
        return
    types = language_model_types() if options.language_models else model_types()
    names = [name.strip() for name in options.only.split(",")] if options.only else list(types)
    unknown = [name for name in names if name not in types]
    if unknown:
        sys.exit(f"not a model type of the supported tasks' mappings: {', '.join(unknown)}")
    if options.bf16_checkpoint:
        names = [name for name in names if types[name][0] == "text-generation"]
    index, count = map(int, options.shard.split("/"))
    names = names[index - 1::count]
    started = time.strftime("%Y-%m-%d %H:%M")
    commit = _commit()
    with ThreadPoolExecutor(options.jobs) as pool:
        rows = []
        for row in pool.map(lambda name: run_row(name, options), names):
            rows.append(row)
            print(format_row(row), flush=True)
    mode = ("bf16 checkpoint" if options.bf16_checkpoint else "f32") + (", language models" if options.language_models else "")
    print_table(rows, f"{started}, {mode}, shard {options.shard}, jobs {options.jobs}, tpuexport {commit}, transformers {_transformers_version()}")
    if options.json:
        options.json.write_text(json.dumps({"started": started, "mode": mode, "shard": options.shard, "commit": commit, "rows": rows},
                                           indent=1))


def _commit() -> str:
    """The tpuexport commit converted with ("+" when the work tree has changes)."""
    def git(*arguments):
        return subprocess.run(["git", "-C", str(ROOT), *arguments], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


if __name__ == "__main__":
    main()
