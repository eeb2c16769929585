"""Synthetic releases against transformers' own save/load, and the CPU processor against the processing formulas."""

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

import joint_schema_model as jsm
import synthetic_release


def _shard_tensors(release) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor in a directory's safetensors files."""
    tensors = {}
    for file in sorted(release.glob("*.safetensors")):
        if file.name == "joint_head.safetensors":
            continue
        with safe_open(str(file), "pt") as shard:
            for name in shard.keys():
                view = shard.get_slice(name)
                tensors[name] = (tuple(view.get_shape()), view.get_dtype())
    return tensors


def _load_tensor(release, name) -> torch.Tensor:
    index = json.loads((release / "model.safetensors.index.json").read_text())
    with safe_open(str(release / index["weight_map"][name]), "pt") as shard:
        return shard.get_tensor(name)


# ---- layout and determinism ---------------------------------------------------------------------------------------


def test_release_has_the_clef_omni_files(tiny_release):
    names = {path.name for path in tiny_release.iterdir()}
    expected = {
        "config.json", "model.safetensors.index.json", "joint_head.safetensors", "joint_head_config.json",
        "tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja",
        "generation_config.json", "LICENSE", "README.md",
    }
    assert expected <= names
    shards = sorted(name for name in names if name.startswith("model-"))
    assert len(shards) > 1 and shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    config = json.loads((tiny_release / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert config["enable_audio_output"] is False
    index = json.loads((tiny_release / "model.safetensors.index.json").read_text())
    on_disk = _shard_tensors(tiny_release)
    assert set(index["weight_map"]) == set(on_disk)
    assert index["metadata"]["total_size"] == sum(math.prod(shape) * 2 for shape, _ in on_disk.values())
    assert {dtype for _, dtype in on_disk.values()} == {"BF16"}
    assert any(name.startswith("talker.") for name in on_disk) and any(name.startswith("code2wav.") for name in on_disk)


def test_same_seed_same_bytes_other_seed_other_weights(tiny_release, tmp_path):
    again = synthetic_release.write_release(tmp_path / "again", size="tiny", seed=0)
    other = synthetic_release.write_release(tmp_path / "other", size="tiny", seed=1)
    weight_files = sorted(path.name for path in tiny_release.glob("*.safetensors"))
    for name in weight_files + ["tokenizer.json", "config.json", "model.safetensors.index.json"]:
        assert (again / name).read_bytes() == (tiny_release / name).read_bytes(), name
    for name in weight_files:
        assert (other / name).read_bytes() != (tiny_release / name).read_bytes(), name


def test_tensor_names_and_shapes_equal_transformers_save_pretrained(tiny_release, tmp_path):
    from transformers import AutoConfig, Qwen3OmniMoeForConditionalGeneration

    config = AutoConfig.from_pretrained(tiny_release)
    model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "reference")
    reference = _shard_tensors(tmp_path / "reference")
    ours = {name: spec for name, spec in _shard_tensors(tiny_release).items()
            if not name.startswith(("talker.", "code2wav."))}
    assert sorted(ours) == sorted(reference)
    assert ours == reference  # shapes and BF16 dtype, name by name


def test_from_pretrained_loads_cleanly_and_puts_each_tensor_in_place(tiny_release):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_release, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(key.startswith(("talker.", "code2wav.")) for key in info["unexpected_keys"])
    # Per-expert files are fused on load: gate rows first, then up rows, of gate_up_proj [E, 2I, H].
    modules = dict(model.thinker.named_modules())
    experts = next(module for name, module in modules.items() if name.endswith("layers.1.mlp.experts"))
    audio_tower = next(module for name, module in modules.items() if name.endswith("audio_tower"))
    intermediate = model.config.thinker_config.text_config.moe_intermediate_size
    gate = _load_tensor(tiny_release, "thinker.model.layers.1.mlp.experts.3.gate_proj.weight")
    up = _load_tensor(tiny_release, "thinker.model.layers.1.mlp.experts.3.up_proj.weight")
    down = _load_tensor(tiny_release, "thinker.model.layers.1.mlp.experts.3.down_proj.weight")
    assert torch.equal(experts.gate_up_proj[3, :intermediate], gate)
    assert torch.equal(experts.gate_up_proj[3, intermediate:], up)
    assert torch.equal(experts.down_proj[3], down)
    assert torch.equal(model.thinker.lm_head.weight, _load_tensor(tiny_release, "thinker.lm_head.weight"))
    assert torch.equal(audio_tower.proj2.weight, _load_tensor(tiny_release, "thinker.audio_tower.proj2.weight"))


def test_tensor_values_follow_their_kind(tiny_release):
    norm = _load_tensor(tiny_release, "thinker.model.layers.0.input_layernorm.weight")
    bias = _load_tensor(tiny_release, "thinker.visual.blocks.0.attn.qkv.bias")
    matrix = _load_tensor(tiny_release, "thinker.model.layers.0.self_attn.q_proj.weight").float()
    expert = _load_tensor(tiny_release, "thinker.model.layers.0.mlp.experts.0.down_proj.weight").float()
    assert torch.equal(norm, torch.ones_like(norm)) and torch.equal(bias, torch.zeros_like(bias))
    assert abs(matrix.std().item() - 0.02) < 0.004 and abs(matrix.mean().item()) < 0.004
    # NVFP4 scales each 16-element block by its own amax: the synthetic experts' block amaxes must spread widely.
    block_amax = expert.view(expert.shape[0], -1, 16).abs().amax(-1)
    assert block_amax.max() / block_amax.min() > 8


def test_joint_head_loads_strictly_with_every_term_active(tiny_release):
    from safetensors.torch import load_file

    head_config = json.loads((tiny_release / "joint_head_config.json").read_text())
    config = json.loads((tiny_release / "config.json").read_text())
    assert head_config["hidden_size"] == config["thinker_config"]["text_config"]["hidden_size"]
    state = load_file(tiny_release / "joint_head.safetensors")
    assert {tensor.dtype for tensor in state.values()} == {torch.bfloat16}
    head = jsm.JointSchemaHead(**head_config)
    head.load_state_dict(state, strict=True)
    scalars = [head.prior_logit_scale.item(), head.joint_logit_scale.item(), head.residual_gate.item()]
    assert all(value != 0 for value in scalars)


def test_tokenizer_carries_the_qwen_special_tokens(tiny_release):
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_release)
    thinker = AutoConfig.from_pretrained(tiny_release).thinker_config
    text = "<|im_start|>user\nSTATE:\n<|vision_start|><|image_pad|><|vision_end|><think>\n\n</think>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    specials = ["<|im_start|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<think>", "</think>"]
    added_ids = set(tokenizer.get_added_vocab().values())
    assert [tokenizer.convert_ids_to_tokens(i) for i in ids if i in added_ids] == specials
    assert tokenizer.image_token_id == thinker.image_token_id == ids[ids.index(thinker.vision_start_token_id) + 1]
    assert tokenizer.convert_tokens_to_ids("<|video_pad|>") == thinker.video_token_id
    assert tokenizer.convert_tokens_to_ids("<|audio_pad|>") == thinker.audio_token_id
    assert tokenizer.convert_tokens_to_ids("<|audio_start|>") == thinker.audio_start_token_id
    assert tokenizer.decode(ids[1:2]) == "user" and ids[1] == thinker.user_token_id


# ---- full size ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_config():
    return synthetic_release.make_config("full")


def test_full_config_has_the_published_qwen3_omni_30b_a3b_thinker(full_config):
    text = full_config.thinker_config.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_experts, text.num_experts_per_tok) == (48, 2048, 128, 8)
    assert (text.moe_intermediate_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (768, 32, 4, 128)
    assert text.vocab_size == 152064 and text.rope_parameters["mrope_section"] == [24, 20, 20]
    vision = full_config.thinker_config.vision_config
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads) == (27, 1152, 4304, 16)
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size, vision.out_hidden_size) == (16, 2, 2, 2048)
    assert list(vision.deepstack_visual_indexes) == [8, 16, 24] and vision.num_position_embeddings == 2304
    audio = full_config.thinker_config.audio_config
    assert (audio.encoder_layers, audio.d_model, audio.encoder_attention_heads, audio.encoder_ffn_dim) == (32, 1280, 20, 5120)
    assert (audio.num_mel_bins, audio.output_dim, audio.downsample_hidden_size, audio.n_window) == (128, 2048, 480, 50)
    assert synthetic_release.SIZES["full"]["head"] == {
        "hidden_size": 2048, "width": 1024, "routing_layers": 2, "layers": 4, "heads": 16, "feedforward": 4096,
    }


def test_full_release_tensors_match_the_transformers_model(full_config):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    shapes = {name: tuple(tensor.shape) for name, tensor in synthetic_release.release_tensors(full_config, device="meta")}
    assert shapes["thinker.model.layers.47.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert shapes["thinker.model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert shapes["thinker.model.layers.0.self_attn.q_proj.weight"] == (4096, 2048)
    assert shapes["thinker.lm_head.weight"] == (152064, 2048)
    assert sum(name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")) for name in shapes) == 48 * 128 * 3
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(full_config)
    thinker_parameters = sum(p.numel() for name, p in model.state_dict().items() if name.startswith("thinker."))
    assert sum(math.prod(shape) for shape in shapes.values()) == thinker_parameters


# ---- processor on CPU ---------------------------------------------------------------------------------------------


def _qwen2vl_grid(height, width, factor, min_pixels, max_pixels, patch):
    """Qwen2-VL's resize rule (multiples of factor, area within bounds, aspect kept) as patch-grid height/width."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h // patch, w // patch


def _audio_tokens(samples, n_window=50, hop=160):
    """Qwen3-Omni audio encoder output length: 13 tokens per 2*n_window mel frames, three stride-2 convs on the rest."""
    frames = samples // hop
    rest = frames % (2 * n_window)
    for _ in range(3):
        rest = (rest - 1) // 2 + 1
    return rest + frames // (2 * n_window) * 13


@pytest.fixture(scope="module")
def processor(tiny_release):
    return jsm.load_processor(tiny_release)


def test_the_processor_comes_from_transformers_where_torchvision_is_installed(tiny_release, monkeypatch):
    """AutoProcessor where torchvision can be imported (the GPU image); the frame processor where it cannot."""
    import importlib.util

    import transformers

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda path: ("AutoProcessor", path))
    find_spec = importlib.util.find_spec

    def torchvision_installed(installed: bool) -> None:
        torchvision_spec = object() if installed else None
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: (
            torchvision_spec if name == "torchvision" else find_spec(name, *rest)))

    torchvision_installed(True)
    assert jsm.load_processor(tiny_release) == ("AutoProcessor", tiny_release)
    torchvision_installed(False)
    assert type(jsm.load_processor(tiny_release).video_processor).__name__ == "FrameVideoProcessor"


def _count(ids, token_id):
    return sum(1 for i in ids if i == token_id)


def test_processor_expands_an_image(processor, png_bytes):
    encoded = processor(text=jsm.IMAGE_PLACEHOLDER, images=[jsm.load_image(png_bytes)], size=jsm.IMAGE_SIZE,
                        add_special_tokens=False, return_tensors="pt")
    grid_h, grid_w = _qwen2vl_grid(64, 96, 32, jsm.IMAGE_SIZE["shortest_edge"], jsm.IMAGE_SIZE["longest_edge"], 16)
    assert encoded["image_grid_thw"].tolist() == [[1, grid_h, grid_w]]
    assert encoded["pixel_values"].shape == (grid_h * grid_w, 3 * 2 * 16 * 16)
    assert _count(encoded["input_ids"][0].tolist(), processor.image_token_id) == grid_h * grid_w // 4


def test_processor_expands_audio(processor, wav_bytes):
    samples = jsm.load_audio(wav_bytes)
    encoded = processor(text=jsm.AUDIO_PLACEHOLDER, audio=[samples], add_special_tokens=False, return_tensors="pt")
    assert len(samples) == 24_000
    assert encoded["feature_attention_mask"].sum().item() == len(samples) // 160
    assert encoded["input_features"].shape[:2] == (1, 128)
    assert _count(encoded["input_ids"][0].tolist(), processor.audio_token_id) == _audio_tokens(len(samples)) == 20


@pytest.mark.parametrize("with_audio", [False, True])
def test_processor_expands_a_video_through_encode_record(processor, mp4_silent_bytes, mp4_with_audio_bytes, with_audio):
    video = mp4_with_audio_bytes if with_audio else mp4_silent_bytes
    frames, soundtrack = jsm.load_video(video)
    record = {"state": {"a": 1}, "questions": {"q": {"type": "noul"}}, "videos": [video]}
    encoded = jsm.encode_record(processor.tokenizer, record, processor=processor)
    ids = list(encoded.input_ids)
    grid_h, grid_w = _qwen2vl_grid(frames.shape[1], frames.shape[2], 32, 128 * 32 * 32, 768 * 32 * 32, 16)
    grid_t = math.ceil(len(frames) / 2)
    assert encoded.media["video_grid_thw"].tolist() == [[grid_t, grid_h, grid_w]]
    assert encoded.media["video_grid_thw"].dtype == torch.int64
    assert encoded.media["pixel_values_videos"].dtype == torch.float32
    assert encoded.media["pixel_values_videos"].shape == (grid_t * grid_h * grid_w, 3 * 2 * 16 * 16)
    assert encoded.media["video_second_per_grid"].tolist() == [2 / jsm.VIDEO_FPS]
    assert _count(ids, processor.video_token_id) == grid_t * grid_h * grid_w // 4
    assert encoded.media["use_audio_in_video"] is with_audio
    if with_audio:
        assert _count(ids, processor.audio_token_id) == _audio_tokens(len(soundtrack))
        start = ids.index(processor.tokenizer.convert_tokens_to_ids("<|vision_start|>"))
        assert processor.tokenizer.convert_ids_to_tokens(ids[start:start + 2]) == ["<|vision_start|>", "<|audio_start|>"]
    else:
        assert _count(ids, processor.audio_token_id) == 0


def _image_and_video_patches(processor, frame: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The image processor's patches of `frame` and the frame processor's of a video of two copies of it (an image is
    processed as `temporal_patch_size` copies of itself), both at the 64x96 pixel area."""
    size = {"shortest_edge": 64 * 96, "longest_edge": 64 * 96}
    image = processor.image_processor(images=[frame], size=size, return_tensors="pt")
    video = processor.video_processor(np.stack([frame, frame]), size=size, return_tensors="pt")
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist() == [[1, 4, 6]]
    return image["pixel_values"], video["pixel_values_videos"]


def test_frame_video_processor_lays_out_patches_like_the_image_processor(processor):
    # A frame already on the 32-pixel grid makes both resizes the identity: the patches must be the same.
    frame = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    image, video = _image_and_video_patches(processor, frame)
    torch.testing.assert_close(video, image, rtol=0, atol=1e-6)


def test_frame_video_processor_resizes_frames_as_pil_does_within_one_level(processor):
    # Frames are resized as uint8 (torchvision's path for uint8 frames), which stays within one level of PIL's bicubic
    # resize in the image processor; resizing in float, as before, differed by up to 13 levels on these sizes.
    frame = np.random.default_rng(1).integers(0, 256, (100, 150, 3), dtype=np.uint8)  # -> 64x96: a real downscale
    image, video = _image_and_video_patches(processor, frame)
    difference = (video - image).abs()
    assert difference.max() <= 1 / 255 / min(processor.image_processor.image_std) + 1e-5
    assert (difference > 1e-5).float().mean() < 0.02
