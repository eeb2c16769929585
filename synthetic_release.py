"""Synthetic Clef-Omni releases: random, meaningless weights in the exact layout of Cloudflare/clef-omni.

No real weights exist where serve_clef is built and tested, so every test and benchmark runs on a directory this
module writes offline and deterministically from a seed: `config.json` (`Qwen3OmniMoeConfig`, audio output off),
sharded BF16 thinker weights under the hub tensor names that transformers' `save_pretrained` writes (per expert:
`thinker.model.layers.L.mlp.experts.E.gate_proj.weight`), a couple of `talker.*` / `code2wav.*` tensors that loaders
must skip, the joint schema head, a byte-level BPE tokenizer trained in about a second that carries the Qwen special
tokens, the processor configuration and the remaining release files. It also makes the small PNG/WAV/MP4 media the tests and
processor checks feed through `encode_record`.

Sizes: `tiny` (every tower present, a few MB, seconds on CPU) and `full` (the Qwen3-Omni-30B-A3B thinker's published
dimensions; its ~31 B parameters are streamed tensor by tensor with `release_tensors`, never written to disk).

    python synthetic_release.py OUT_DIR --size tiny --seed 0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

# ---- sizes ------------------------------------------------------------------------------------------------------------

# Every expert matrix dimension is a multiple of 32 so NVFP4 packing (16-element blocks, two codes a byte) works.
SIZES = {
    "tiny": {
        "text": {
            "vocab_size": 2048,
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "mrope_section": [4, 2, 2],  # sums to head_dim / 2
            "max_position_embeddings": 65536,
        },
        "vision": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1],
        },
        "audio": {
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": 64,
            "n_window": 50,
            "n_window_infer": 800,
            "conv_chunksize": 500,
            "downsample_hidden_size": 32,
            "max_source_positions": 1500,
        },
        "head": {"hidden_size": 64, "width": 32, "routing_layers": 2, "layers": 2, "heads": 4, "feedforward": 64},
        "shard_bytes": 256 * 1024,
    },
    # Qwen3-Omni-30B-A3B-Instruct's published thinker (config.json of the Qwen release); the head's dimensions are the
    # ones Cloudflare's dense Clef releases use (the omni head's are not published).
    "full": {
        "text": {
            "vocab_size": 152064,
            "hidden_size": 2048,
            "intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "mrope_section": [24, 20, 20],
            "max_position_embeddings": 65536,
        },
        "vision": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 2048,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
        "audio": {
            "num_mel_bins": 128,
            "encoder_layers": 32,
            "encoder_attention_heads": 20,
            "encoder_ffn_dim": 5120,
            "d_model": 1280,
            "output_dim": 2048,
            "n_window": 50,
            "n_window_infer": 800,
            "conv_chunksize": 500,
            "downsample_hidden_size": 480,
            "max_source_positions": 1500,
        },
        "head": {"hidden_size": 2048, "width": 1024, "routing_layers": 2, "layers": 4, "heads": 16, "feedforward": 4096},
        "shard_bytes": 5 * 1000**3,
    },
}

# The Qwen special tokens, in the order Qwen's tokenizer appends them after its BPE vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Added tokens that Qwen does not mark special (they are decoded like text).
ADDED_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
AUDIO_SPECIAL_TOKENS = [
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
]
# The attribute names Qwen3OmniMoeProcessor reads from the tokenizer.
MULTIMODAL_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
BPE_VOCAB_SIZE = 1024  # learned tokens before the special ones; every size's vocab_size is larger

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A small corpus in the style of Clef prompts (English instructions, JSON state and option semantics), written for
# this module; the tokenizer only needs to be deterministic and to cover these words compactly.
CORPUS = [
    "Read the complete state and schema. Decide every field jointly.",
    "Each answer must be exactly one of that field's allowed options.",
    "<|im_start|>system\n",
    "<|im_start|>user\n",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "STATE:\n",
    "\n\nSCHEMA FIELDS:\n",
    "\nFIELD 1\nID: is_urgent\nTYPE: noul\nINSTRUCTION: ",
    "\nFIELD 2\nID: category\nTYPE: choice\nINSTRUCTION: ",
    "\nFIELD 3\nID: severity\nTYPE: score\nINSTRUCTION: ",
    "\nALLOWED OPTIONS:\nOPTION 1: OPTION 2: OPTION 3: OPTION 4: \nEND FIELD\n",
    "JOINT SCHEMA DECISIONS:",
    '{"description":"The proposition is true or the answer is yes.","option_id":"true"}',
    '{"description":"The proposition is false or the answer is no.","option_id":"false"}',
    '{"option_id":"0"}{"option_id":"1"}{"option_id":"2"}{"option_id":"3"}',
    '{"customer":{"name":"Ada","plan":"pro","tickets":[3,14,15]},"message":"My invoice is wrong again."}',
    '{"order":{"id":"A-1042","items":2,"total":59.90,"currency":"EUR"},"status":"delayed","days_late":4}',
    '{"sensor":"temperature","reading":71.5,"unit":"C","threshold":65,"alarm":true,"site":"north hall"}',
    '{"user":{"age":34,"country":"DE","verified":false},"text":"Can I get a refund for last month?"}',
    "Is the customer asking for a refund? Does the message need a reply today?",
    "Which department should handle this request: billing, shipping, technical support or sales?",
    "How severe is the problem, from no impact to a complete outage of the service?",
    "The image shows a chart of monthly revenue with a sharp drop in the last quarter.",
    "The audio clip contains a person speaking quickly about a missing parcel and a late delivery.",
    "The video shows a machine on a factory floor; a red warning light turns on after a few seconds.",
    "Answer yes when the evidence supports the proposition and no otherwise.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 100 128 256 512 1024 2048 4096.",
    "Punctuation and symbols: ( ) [ ] { } < > : ; , . ! ? ' \" - _ / \\ | @ # $ % ^ & * + = ~ `",
]

# ---- config -----------------------------------------------------------------------------------------------------------


def _train_tokenizer():
    """A byte-level BPE in Qwen2's style, trained on CORPUS, with the Qwen special and added tokens appended."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in ADDED_TOKENS])
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in AUDIO_SPECIAL_TOKENS])
    return tokenizer


def _single_token_id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) != 1:
        raise ValueError(f"{text!r} must be one token of the synthetic tokenizer, got {ids}: add it to CORPUS")
    return ids[0]


def make_config(size: str = "tiny", tokenizer=None):
    """The release's `Qwen3OmniMoeConfig` (audio output off) for a named size, token ids from the given tokenizer."""
    from transformers import Qwen3OmniMoeConfig

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    dims = SIZES[size]
    tokenizer = tokenizer or _train_tokenizer()
    token_id = tokenizer.token_to_id
    text = {key: value for key, value in dims["text"].items() if key != "mrope_section"}
    if tokenizer.get_vocab_size() > text["vocab_size"]:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than {size}'s vocab_size")
    text_config = {
        **text,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": dims["text"]["mrope_section"],
            "interleaved": True,
            "mrope_interleaved": True,
        },
    }
    vision_config = {**dims["vision"], "hidden_act": "gelu_pytorch_tanh", "in_channels": 3}
    audio_config = {**dims["audio"], "activation_function": "gelu", "scale_embedding": False}
    media_token_ids = {
        "image_token_id": token_id("<|image_pad|>"),
        "video_token_id": token_id("<|video_pad|>"),
        "audio_token_id": token_id("<|audio_pad|>"),
        "vision_start_token_id": token_id("<|vision_start|>"),
        "audio_start_token_id": token_id("<|audio_start|>"),
    }
    thinker_config = {
        "text_config": text_config,
        "vision_config": vision_config,
        "audio_config": audio_config,
        **media_token_ids,
        "vision_end_token_id": token_id("<|vision_end|>"),
        "audio_end_token_id": token_id("<|audio_end|>"),
        "user_token_id": _single_token_id(tokenizer, "user"),
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
    }
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker_config,
        talker_config={**media_token_ids, "thinker_hidden_size": dims["text"]["hidden_size"]},
        enable_audio_output=False,
        im_start_token_id=token_id("<|im_start|>"),
        im_end_token_id=token_id("<|im_end|>"),
        tts_pad_token_id=token_id("<tts_pad>"),
        tts_bos_token_id=token_id("<tts_text_bos>"),
        tts_eos_token_id=token_id("<tts_text_eod>"),
        system_token_id=_single_token_id(tokenizer, "system"),
        user_token_id=_single_token_id(tokenizer, "user"),
        assistant_token_id=_single_token_id(tokenizer, "assistant"),
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    config.dtype = torch.bfloat16
    return config


# ---- thinker weights --------------------------------------------------------------------------------------------------

# Kinds of tensor: "matrix" ~ normal(0, initializer_range), "expert" the same times a per-16-block scale, "norm" ones,
# "bias" zeros.


def _thinker_tensor_specs(config) -> list[tuple[str, tuple[int, ...], str]]:
    """(hub name, shape, kind) of every thinker tensor, in the order they are generated and written."""
    text = config.thinker_config.text_config
    vision = config.thinker_config.vision_config
    audio = config.thinker_config.audio_config
    if text.mlp_only_layers or text.decoder_sparse_step != 1:
        raise ValueError("synthetic releases have a mixture of experts in every layer (mlp_only_layers=[], step 1)")
    specs = []

    def linear(name, out_features, in_features, bias):
        specs.append((f"{name}.weight", (out_features, in_features), "matrix"))
        if bias:
            specs.append((f"{name}.bias", (out_features,), "bias"))

    def layer_norm(name, width, bias=True):
        specs.append((f"{name}.weight", (width,), "norm"))
        if bias:
            specs.append((f"{name}.bias", (width,), "bias"))

    # Text decoder. H hidden, I expert width, E experts, D head dim.
    H, I, E, D = text.hidden_size, text.moe_intermediate_size, text.num_experts, text.head_dim
    specs.append(("thinker.model.embed_tokens.weight", (text.vocab_size, H), "matrix"))
    for layer in range(text.num_hidden_layers):
        prefix = f"thinker.model.layers.{layer}"
        layer_norm(f"{prefix}.input_layernorm", H, bias=False)
        linear(f"{prefix}.self_attn.q_proj", text.num_attention_heads * D, H, text.attention_bias)
        linear(f"{prefix}.self_attn.k_proj", text.num_key_value_heads * D, H, text.attention_bias)
        linear(f"{prefix}.self_attn.v_proj", text.num_key_value_heads * D, H, text.attention_bias)
        linear(f"{prefix}.self_attn.o_proj", H, text.num_attention_heads * D, text.attention_bias)
        layer_norm(f"{prefix}.self_attn.q_norm", D, bias=False)
        layer_norm(f"{prefix}.self_attn.k_norm", D, bias=False)
        layer_norm(f"{prefix}.post_attention_layernorm", H, bias=False)
        linear(f"{prefix}.mlp.gate", E, H, bias=False)
        for expert in range(E):
            specs.append((f"{prefix}.mlp.experts.{expert}.gate_proj.weight", (I, H), "expert"))
            specs.append((f"{prefix}.mlp.experts.{expert}.up_proj.weight", (I, H), "expert"))
            specs.append((f"{prefix}.mlp.experts.{expert}.down_proj.weight", (H, I), "expert"))
    layer_norm("thinker.model.norm", H, bias=False)
    linear("thinker.lm_head", text.vocab_size, H, bias=False)

    # Vision tower. V vision hidden, M = V * merge^2 merged patch width.
    V, M = vision.hidden_size, vision.hidden_size * vision.spatial_merge_size**2
    patch_shape = (V, vision.in_channels, vision.temporal_patch_size, vision.patch_size, vision.patch_size)
    specs.append(("thinker.visual.patch_embed.proj.weight", patch_shape, "matrix"))
    specs.append(("thinker.visual.patch_embed.proj.bias", (V,), "bias"))
    specs.append(("thinker.visual.pos_embed.weight", (vision.num_position_embeddings, V), "matrix"))
    for block in range(vision.depth):
        prefix = f"thinker.visual.blocks.{block}"
        layer_norm(f"{prefix}.norm1", V)
        layer_norm(f"{prefix}.norm2", V)
        linear(f"{prefix}.attn.qkv", 3 * V, V, bias=True)
        linear(f"{prefix}.attn.proj", V, V, bias=True)
        linear(f"{prefix}.mlp.linear_fc1", vision.intermediate_size, V, bias=True)
        linear(f"{prefix}.mlp.linear_fc2", V, vision.intermediate_size, bias=True)
    # The final merger normalises before the 2x2 shuffle (width V), the deepstack mergers after it (width M).
    for prefix, norm_width in [("thinker.visual.merger", V)] + [
        (f"thinker.visual.merger_list.{i}", M) for i in range(len(vision.deepstack_visual_indexes))
    ]:
        layer_norm(f"{prefix}.ln_q", norm_width)
        linear(f"{prefix}.mlp.0", M, M, bias=True)
        linear(f"{prefix}.mlp.2", vision.out_hidden_size, M, bias=True)

    # Audio tower. A audio hidden, C conv channels; three stride-2 convs shrink the mel bins to F.
    A, C = audio.d_model, audio.downsample_hidden_size
    F = audio.num_mel_bins
    for _ in range(3):
        F = (F - 1) // 2 + 1
    specs.append(("thinker.audio_tower.conv2d1.weight", (C, 1, 3, 3), "matrix"))
    specs.append(("thinker.audio_tower.conv2d1.bias", (C,), "bias"))
    for conv in ("conv2d2", "conv2d3"):
        specs.append((f"thinker.audio_tower.{conv}.weight", (C, C, 3, 3), "matrix"))
        specs.append((f"thinker.audio_tower.{conv}.bias", (C,), "bias"))
    linear("thinker.audio_tower.conv_out", A, C * F, bias=False)
    for layer in range(audio.encoder_layers):
        prefix = f"thinker.audio_tower.layers.{layer}"
        for projection in ("k_proj", "v_proj", "q_proj", "out_proj"):
            linear(f"{prefix}.self_attn.{projection}", A, A, bias=True)
        layer_norm(f"{prefix}.self_attn_layer_norm", A)
        linear(f"{prefix}.fc1", audio.encoder_ffn_dim, A, bias=True)
        linear(f"{prefix}.fc2", A, audio.encoder_ffn_dim, bias=True)
        layer_norm(f"{prefix}.final_layer_norm", A)
    layer_norm("thinker.audio_tower.ln_post", A)
    linear("thinker.audio_tower.proj1", A, A, bias=True)
    linear("thinker.audio_tower.proj2", audio.output_dim, A, bias=True)
    return specs


def _tensor_seed(seed: int, name: str) -> int:
    """Seed mixed with a stable hash of the name: each tensor is reproducible on its own, in any order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _make_tensor(name, shape, kind, std, seed, device) -> torch.Tensor:
    device = torch.device(device)
    if device.type == "meta" or kind in ("norm", "bias"):
        fill = {"norm": 1.0, "bias": 0.0}.get(kind, 0.0)
        return torch.full(shape, fill, dtype=torch.bfloat16, device=device)
    generator = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * std
    if kind == "expert":
        # Per-16-block magnitudes spread over e^-2..e^2 (R rows, C/16 blocks) so NVFP4's block scales all differ.
        rows, columns = shape
        block_log_scale = torch.rand((rows, columns // 16, 1), generator=generator, device=device) * 4 - 2
        values = (values.view(rows, columns // 16, 16) * block_log_scale.exp()).view(shape)
    return values.to(torch.bfloat16)


def release_tensors(config, seed: int = 0, device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """The thinker's BF16 weights in hub layout, one tensor at a time, generated on `device`.

    Each tensor depends only on (seed, name), so the stream is reproducible for a seed and device and the full model
    can be generated straight into GPU memory without materialising it elsewhere. On the meta device only the shapes
    are produced.
    """
    std = config.thinker_config.initializer_range
    for name, shape, kind in _thinker_tensor_specs(config):
        yield name, _make_tensor(name, shape, kind, std, seed, device)


def _audio_output_tensors(config) -> dict[str, torch.Tensor]:
    """Stand-ins for the real release's talker and code2wav weights, which every Clef loader must skip."""
    width = config.thinker_config.text_config.hidden_size
    return {
        "talker.model.norm.weight": torch.ones(width, dtype=torch.bfloat16),
        "code2wav.code_embedding.weight": torch.zeros((4, width), dtype=torch.bfloat16),
    }


# ---- release files ----------------------------------------------------------------------------------------------------


def _write_weights(out: Path, config, seed: int, shard_bytes: int) -> None:
    """Sharded safetensors plus model.safetensors.index.json, shards cut in generation order at `shard_bytes`."""
    from safetensors.torch import save_file

    specs = _thinker_tensor_specs(config)
    extras = _audio_output_tensors(config)
    sizes = [(name, math.prod(shape) * 2) for name, shape, _ in specs]
    sizes += [(name, tensor.numel() * 2) for name, tensor in extras.items()]
    shard_of, shard, filled = {}, 0, 0
    for name, nbytes in sizes:
        if filled and filled + nbytes > shard_bytes:
            shard, filled = shard + 1, 0
        shard_of[name] = shard
        filled += nbytes
    count = shard + 1
    file_names = [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]

    def flush(tensors, k):
        save_file(tensors, str(out / file_names[k]), metadata={"format": "pt"})

    tensors, current = {}, 0
    for name, tensor in [*release_tensors(config, seed), *extras.items()]:
        if shard_of[name] != current:
            flush(tensors, current)
            tensors, current = {}, shard_of[name]
        tensors[name] = tensor
    flush(tensors, current)
    index = {
        "metadata": {"total_parameters": sum(n for _, n in sizes) // 2, "total_size": sum(n for _, n in sizes)},
        "weight_map": {name: file_names[shard_of[name]] for name, _ in sizes},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_head(out: Path, head_config: dict, seed: int) -> None:
    """joint_head.safetensors (BF16) and joint_head_config.json; the three learned scalars made non-trivial."""
    from safetensors.torch import save_file

    from joint_schema_model import JointSchemaHead

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = JointSchemaHead(**head_config)
    with torch.no_grad():
        # prior scale e^0.5, joint scale e^1, gate sigmoid(0.25): every term of the logit contributes.
        head.prior_logit_scale.fill_(0.5)
        head.joint_logit_scale.fill_(1.0)
        head.residual_gate.fill_(0.25)
    state = {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in head.state_dict().items()}
    save_file(state, str(out / "joint_head.safetensors"), metadata={"format": "pt"})
    (out / "joint_head_config.json").write_text(json.dumps(head_config, indent=2) + "\n")


def _write_tokenizer(out: Path, tokenizer) -> None:
    """tokenizer.json plus a tokenizer_config.json that names the Qwen2 tokenizer and the multimodal tokens."""
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token not in ADDED_TOKENS,
        }
        for token in SPECIAL_TOKENS + ADDED_TOKENS + AUDIO_SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 65536,
        "extra_special_tokens": MULTIMODAL_TOKENS,
        "processor_class": "Qwen3OmniMoeProcessor",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _processor_config(config) -> dict:
    """processor_config.json as transformers 5 writes it: one file holding every non-tokenizer sub-processor.

    Values are Qwen3-Omni's preprocessor_config.json (Qwen2-VL image/video processing with mean/std 0.5 and 16 px
    patches, 128-bin Whisper features at 16 kHz); patch/merge/temporal sizes follow the vision tower's config.
    """
    vision = config.thinker_config.vision_config
    pixels = {
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "size": {"shortest_edge": 3136, "longest_edge": 12845056},
        "do_resize": True,
        "resample": 3,  # bicubic
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
    }
    return {
        "processor_class": "Qwen3OmniMoeProcessor",
        "image_processor": {"image_processor_type": "Qwen2VLImageProcessor", **pixels},
        "video_processor": {
            "video_processor_type": "Qwen2VLVideoProcessor",
            **pixels,
            "do_sample_frames": False,
            "min_frames": 4,
            "max_frames": 768,
        },
        "feature_extractor": {
            "feature_extractor_type": "WhisperFeatureExtractor",
            "feature_size": config.thinker_config.audio_config.num_mel_bins,
            "sampling_rate": 16000,
            "hop_length": 160,
            "n_fft": 400,
            "chunk_length": 300,
            "n_samples": 4800000,
            "nb_max_frames": 30000,
            "padding_side": "right",
            "padding_value": 0.0,
            "dither": 0.0,
            "return_attention_mask": True,
        },
    }


CHAT_TEMPLATE = """{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{% if message['content'] is string -%}
{{ message['content'] }}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>
{%- elif part['type'] == 'audio' -%}<|audio_start|><|audio_pad|><|audio_end|>
{%- elif part['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>
{%- else -%}{{ part['text'] }}
{%- endif -%}
{%- endfor -%}
{%- endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

README = """# Synthetic Clef-Omni release ({size}, seed {seed})

Written by serve_clef's `synthetic_release.py`. The weights are RANDOM and MEANINGLESS: this directory only has the
file layout, tensor names, shapes and dtypes of Cloudflare/clef-omni (a Qwen3-Omni-30B-A3B thinker plus a joint schema
head) so that loading, quantization and serving can be tested without the real model. Its tokenizer is a small BPE
trained on a few sentences; only the Qwen special tokens match the real vocabulary's roles, not its ids.
"""

LICENSE = """Synthetic test data generated by serve_clef's synthetic_release.py. It contains no trained weights and no
third-party material; it may be used, copied and modified without restriction.
"""


# ---- media ------------------------------------------------------------------------------------------------------------

# Small media for tests and processor checks: tiny, so CPU forwards of the tiny towers stay fast.
AUDIO_RATE = 16_000
VIDEO_SIZE = (64, 48)  # width, height (even, as the codecs need)
VIDEO_FPS = 8
VIDEO_SECONDS = 2


def synthetic_png(width: int = 96, height: int = 64, shift: int = 0) -> bytes:
    """An RGB PNG of colour gradients, so resizing and normalisation see varied pixels; `shift` rolls the gradients
    by that many pixels, for distinct images of one size."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    red, green = (x + shift) % width * 255 // max(width - 1, 1), (y + shift) % height * 255 // max(height - 1, 1)
    pixels = np.stack([red, green, (red + green) // 2], axis=-1).astype(np.uint8)  # [h,w,3]
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _sine(seconds: float, frequency: float):
    import numpy as np

    t = np.arange(int(seconds * AUDIO_RATE)) / AUDIO_RATE
    return (0.3 * np.sin(2 * math.pi * frequency * t)).astype(np.float32)


def synthetic_wav(seconds: float = 1.5, frequency: float = 440.0) -> bytes:
    """A sine (440 Hz unless told) as 16 kHz mono 16-bit WAV (standard library writer: no audio package needed)."""
    import io
    import wave


    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(AUDIO_RATE)
        wav.writeframes((_sine(seconds, frequency) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def synthetic_mp4(with_audio: bool, seconds: int = VIDEO_SECONDS, size: tuple[int, int] = VIDEO_SIZE,
                  shift: int = 0) -> bytes:
    """`seconds` of moving-gradient frames of `size` (width, height) at VIDEO_FPS (mpeg4), optionally with a 16 kHz
    mono AAC sine track; `shift` starts the gradients that many pixels on, for distinct videos of one size."""
    import io
    from fractions import Fraction

    import av
    import numpy as np

    width, height = size
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=VIDEO_FPS)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = container.add_stream("aac", rate=AUDIO_RATE, layout="mono") if with_audio else None
        y, x = np.mgrid[0:height, 0:width]
        for index in range(VIDEO_FPS * seconds):
            # [h, w, 3]
            pixels = np.stack([(x + shift + 8 * index) % 256, (y * 4) % 256, np.full_like(x, 16 * index)], axis=-1)
            container.mux(video.encode(av.VideoFrame.from_ndarray(pixels.astype(np.uint8), format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            samples = _sine(seconds, 330.0)
            chunk = 1024  # one AAC frame
            for start in range(0, len(samples), chunk):
                frame = av.AudioFrame.from_ndarray(samples[None, start : start + chunk], format="flt", layout="mono")
                frame.sample_rate, frame.pts, frame.time_base = AUDIO_RATE, start, Fraction(1, AUDIO_RATE)
                container.mux(audio.encode(frame))
            container.mux(audio.encode())
    return buffer.getvalue()


def write_release(out_dir, size: str = "tiny", seed: int = 0, weights: bool = True) -> Path:
    """Write a synthetic Clef-Omni release to `out_dir`; without `weights`, everything but the thinker shards/index."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    config = make_config(size, tokenizer)
    config.save_pretrained(out)
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    generation_config = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    _write_tokenizer(out, tokenizer)
    (out / "processor_config.json").write_text(json.dumps(_processor_config(config), indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "README.md").write_text(README.format(size=size, seed=seed))
    (out / "LICENSE").write_text(LICENSE)
    # serve_clef (SYNTHETIC_MARKER) and calib/parity.py read it to say that the answers of this release mean nothing.
    marker = {"size": size, "seed": seed, "weights": "random"}
    (out / "synthetic_release.json").write_text(json.dumps(marker) + "\n")
    _write_head(out, SIZES[size]["head"], seed)
    if weights:
        _write_weights(out, config, seed, SIZES[size]["shard_bytes"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-weights", dest="weights", action="store_false", help="skip the thinker shards")
    args = parser.parse_args()
    print(write_release(args.out_dir, args.size, args.seed, args.weights))


if __name__ == "__main__":
    main()
