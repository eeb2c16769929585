"""Every public NVFP4 layout of the thinker loads and answers exactly like the same weights in our own layout, or is
refused in one line saying what is unsupported.

Fixtures are written by the tools that write these layouts where they can (ModelOpt's exporter and quantizer,
compressed-tensors' compressor and its ModelOpt converter) and by hand from the published facts of
docs/nvfp4-format.md where no installed tool writes them any more (ModelOpt before 0.43, 0.45). The reference for
"the same weights" is always a BF16 checkpoint holding each NVFP4 linear dequantised by an independent
implementation: the §2.1 formula of test_nvfp4.py, or compressed-tensors' own decompressor.
"""

import copy
import json
import re
import shutil
import types
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from test_loader import RELEASE_FILES, load, nvfp4_export, raw_probabilities, w4a16_export
from test_nvfp4 import random_packed_experts, reference_dequantize, reference_fake_quant, tiny_text_config

import serve_clef

__all__ = ["nvfp4_export", "w4a16_export"]  # session fixtures shared with test_loader.py

EXPERT = "thinker.model.layers.{layer}.mlp.experts.{expert}.{projection}."
NUM_LAYERS, NUM_EXPERTS = 2, 8


def write_checkpoint(source: Path, destination: Path, tensors: dict, hf_quant_config: dict | None = None,
                     quantization_config: dict | None = None) -> Path:
    """A model directory with `source`'s release files, `tensors` in one shard, and the metadata given (none: BF16)."""
    destination.mkdir()
    for name in RELEASE_FILES:
        if (source / name).exists():
            shutil.copy(source / name, destination / name)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (destination / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if hf_quant_config is not None:
        (destination / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))
    safetensors.torch.save_file(tensors, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


def checkpoint_files(checkpoint: Path) -> tuple[dict, dict | None, dict | None]:
    """(tensors, hf_quant_config, config.json's quantization_config) of a checkpoint."""
    tensors = dict(serve_clef.checkpoint_tensors(checkpoint))
    hf_quant_config = None
    if (checkpoint / "hf_quant_config.json").exists():
        hf_quant_config = json.loads((checkpoint / "hf_quant_config.json").read_text())
    return tensors, hf_quant_config, json.loads((checkpoint / "config.json").read_text()).get("quantization_config")


def dequantised(tensors: dict) -> dict:
    """A ModelOpt-layout tensor dict with every NVFP4 linear turned into its BF16 weight by docs/nvfp4-format.md §2.1
    as written (test_nvfp4.reference_dequantize), all scales dropped: the same weights in a BF16 release."""
    out = {}
    for name, tensor in tensors.items():
        module, _, field = name.rpartition(".")
        if field in ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale"):
            continue
        if field == "weight" and tensor.dtype == torch.uint8:
            tensor = reference_dequantize(tensor[None], tensors[f"{module}.weight_scale"][None],
                                          tensors[f"{module}.weight_scale_2"].reshape(1))[0]
        out[name] = tensor
    return out


def assert_same_answers(checkpoint: Path, reference: Path, *flags: str) -> None:
    for got, expected in zip(raw_probabilities(load(checkpoint, *flags)), raw_probabilities(load(reference)),
                             strict=True):
        assert torch.equal(got, expected)


def console(checkpoint: Path, **options) -> list[str]:
    lines = []
    serve_clef.load_clef(str(checkpoint), device="cpu", progress=lines.append, **options)
    return lines


# ==== ModelOpt before 0.43: scales per expert =========================================================================

def per_expert_input_scales(down_only: bool):
    """ModelOpt 0.33-0.42 (down_only): each expert its own down input scale; before 0.33 its own gate/up one too."""

    def change(tensors):
        for layer in range(NUM_LAYERS):
            for expert in range(NUM_EXPERTS):
                for projection in ("down_proj",) if down_only else ("gate_proj", "up_proj", "down_proj"):
                    name = EXPERT.format(layer=layer, expert=expert, projection=projection) + "input_scale"
                    tensors[name] = tensors[name] * (1 + 0.375 * expert)
        return tensors

    return change


def gate_and_up_quantized_apart(release: Path):
    """ModelOpt before 0.43: gate and up of an expert quantized with their own weight_scale_2, each from its own amax;
    written by ModelOpt's own NVFP4 quantizer from the release's BF16 weights."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    bf16 = dict(serve_clef.checkpoint_tensors(release))

    def change(tensors):
        for layer in range(NUM_LAYERS):
            for expert in range(NUM_EXPERTS):
                for projection in ("gate_proj", "up_proj"):
                    prefix = EXPERT.format(layer=layer, expert=expert, projection=projection)
                    # the synthetic weights share one amax; halve gate's so that the two global scales differ
                    weight = bf16[prefix + "weight"] * (0.5 if projection == "gate_proj" else 1.0)
                    global_scale = weight.abs().amax().float() / (6 * 448)
                    packed, block_scales, _ = NVFP4QTensor.quantize(weight, 16, weights_scaling_factor_2=global_scale)
                    tensors[prefix + "weight"] = packed._quantized_data
                    tensors[prefix + "weight_scale"] = block_scales
                    tensors[prefix + "weight_scale_2"] = global_scale.reshape(1)  # [1], as some exports write it
        gate, up = (tensors[EXPERT.format(layer=0, expert=0, projection=p) + "weight_scale_2"] for p in ("gate_proj",
                                                                                                         "up_proj"))
        assert gate != up
        return tensors

    return change


@pytest.mark.parametrize("layout, version", [("down-inputs-per-expert", "0.40.0"),
                                             ("all-inputs-per-expert", "0.31.0"),
                                             ("gate-up-global-scales-apart", "0.42.0")])
def test_modelopt_layouts_before_0_43_answer_like_their_weights(nvfp4_export, tiny_release, tmp_path, layout,
                                                                version):
    tensors, hf_quant_config, _ = checkpoint_files(nvfp4_export)
    change = {"down-inputs-per-expert": per_expert_input_scales(down_only=True),
              "all-inputs-per-expert": per_expert_input_scales(down_only=False),
              "gate-up-global-scales-apart": gate_and_up_quantized_apart(tiny_release)}[layout]
    tensors = change(tensors)
    hf_quant_config["producer"]["version"] = version
    old = write_checkpoint(nvfp4_export, tmp_path / "old", tensors, hf_quant_config)
    reference = write_checkpoint(nvfp4_export, tmp_path / "bf16", dequantised(tensors))
    assert f"written by modelopt {version}" in "\n".join(console(old))
    assert_same_answers(old, reference)
    replayed = load(old, "--simulate-fp4-activations")
    w4a16, w4a4 = raw_probabilities(load(old)), raw_probabilities(replayed)
    assert any(not torch.equal(a, b) for a, b in zip(w4a16, w4a4, strict=True))
    # the replay rounds each expert's inputs with that expert's own scales, as the checkpoint holds them
    layers = [module for module in replayed.model.modules() if isinstance(module, serve_clef.PackedNVFP4Experts)]
    assert len(layers) == NUM_LAYERS
    for layer, experts in enumerate(layers):
        for buffer, projection in (("gate_up_input_scale", "gate_proj"), ("down_input_scale", "down_proj")):
            expected = torch.stack([tensors[EXPERT.format(layer=layer, expert=expert, projection=projection)
                                            + "input_scale"].float().reshape(()) for expert in range(NUM_EXPERTS)])
            assert torch.equal(getattr(experts, buffer), expected), (layer, buffer)


def test_per_expert_input_scales_replay_like_the_packed_kernels(nvfp4_export, tmp_path):
    """A whole model with every expert's own input scales: the W4A4 replay of the unpack path and of the kernels
    (docs/expert-kernels.md) agree to the noise the kernels' different weight rounding gives (see
    test_expert_kernels.py)."""
    tensors, hf_quant_config, _ = checkpoint_files(nvfp4_export)
    old = write_checkpoint(nvfp4_export, tmp_path / "old", per_expert_input_scales(down_only=False)(tensors),
                           hf_quant_config)
    unpack = raw_probabilities(load(old, "--simulate-fp4-activations", "--expert-kernels", "unpack"))
    kernels = raw_probabilities(load(old, "--simulate-fp4-activations", "--expert-kernels", "triton"))
    for a, b in zip(unpack, kernels, strict=True):
        assert (a - b).abs().max() < 0.01


def store_input_scales(experts: serve_clef.PackedNVFP4Experts, gate_up: list[float], down: list[float]) -> None:
    for expert, (gate_up_scale, down_scale) in enumerate(zip(gate_up, down, strict=True)):
        for projection, scale in (("gate_proj", gate_up_scale), ("up_proj", gate_up_scale), ("down_proj", down_scale)):
            experts.store(expert, projection, "input_scale", torch.tensor(scale), f"experts.{expert}.{projection}")


def routed(num_tokens: int):
    generator = torch.Generator().manual_seed(num_tokens)
    hidden_states = torch.randn(num_tokens, 64, generator=generator).to(torch.bfloat16)  # [T, H]
    top_k_index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(num_tokens)])  # [T, K]
    top_k_index[0] = 3  # one token routed twice to one expert
    top_k_weights = torch.rand(num_tokens, 2, generator=generator).softmax(-1).to(torch.bfloat16)  # [T, K]
    return hidden_states, top_k_index, top_k_weights


GATE_UP_SCALES = [(1 + expert) / (6 * 448) for expert in range(8)]  # amax 1 .. 8
DOWN_SCALES = [0.02 * (1 + 0.5 * expert) / (6 * 448) for expert in range(8)]


@torch.no_grad()
def test_each_expert_rounds_its_inputs_with_its_own_scales():
    """docs/nvfp4-format.md §2.3 one token and one routed expert at a time, with that expert's scales."""
    experts = random_packed_experts(tiny_text_config(), has_input_scales=True)
    experts.gate_up_global_scale[:, 1] *= 1.7  # up's own global scale
    store_input_scales(experts, GATE_UP_SCALES, DOWN_SCALES)
    assert not experts.gate_up_input_scales_shared and not experts.down_input_scales_shared
    gate_up_proj = reference_dequantize(experts.gate_up_packed_codes, experts.gate_up_block_scales,
                                        experts.gate_up_global_scale).float()
    down_proj = reference_dequantize(experts.down_packed_codes, experts.down_block_scales,
                                     experts.down_global_scale).float()
    hidden_states, top_k_index, top_k_weights = routed(24)
    expected = torch.zeros(hidden_states.shape)
    for token in range(hidden_states.shape[0]):
        for slot in range(2):
            expert = int(top_k_index[token, slot])
            rounded = reference_fake_quant(hidden_states[token:token + 1], GATE_UP_SCALES[expert]).bfloat16().float()
            gate, up = (gate_up_proj[expert] @ rounded[0]).bfloat16().chunk(2)
            intermediate = (F.silu(gate) * up).float()[None]
            intermediate = reference_fake_quant(intermediate, DOWN_SCALES[expert]).bfloat16().float()[0]
            expected[token] += top_k_weights[token, slot].float() * (down_proj[expert] @ intermediate)
    experts.simulate_fp4_activations = True
    scale = expected.abs().mean().item()
    for path in (experts.forward_unpacked, experts.forward_packed):
        got = path(hidden_states, top_k_index, top_k_weights).float()
        # accumulation order differs from the reference, as in test_nvfp4.py: compare on average
        assert (got - expected).abs().mean() < 0.02 * scale
    experts.simulate_fp4_activations = False
    assert (experts(hidden_states, top_k_index, top_k_weights).float() - expected).abs().mean() > 0.1 * scale


@pytest.mark.parametrize("num_tokens", [1, 7])
@torch.no_grad()
def test_per_expert_scales_in_the_kernels_equal_the_unpack_path_bit_for_bit(num_tokens):
    """Power-of-two global scales (gate and up apart) make every weight exact on both paths (as in
    test_expert_kernels.py), so the per-pair rounding of the kernels and of the unpack path agree to the bit."""
    experts = random_packed_experts(tiny_text_config(), True, power_of_two_global_scales=True)
    experts.gate_up_global_scale[:, 1] *= 4
    store_input_scales(experts, GATE_UP_SCALES, DOWN_SCALES)
    experts.simulate_fp4_activations = True
    inputs = routed(num_tokens)
    reference = experts.forward_unpacked(*inputs)
    assert reference.abs().mean() > 1e-4
    assert torch.equal(experts.forward_packed(*inputs), reference)


@torch.no_grad()
def test_equal_per_expert_scales_round_as_the_shared_one():
    """Rounding per pair with scales that happen to be equal gives the once-per-token rounding's bits exactly."""
    experts = random_packed_experts(tiny_text_config(), True, power_of_two_global_scales=True)
    store_input_scales(experts, [GATE_UP_SCALES[2]] * 8, [DOWN_SCALES[3]] * 8)
    assert experts.gate_up_input_scales_shared and experts.down_input_scales_shared
    experts.simulate_fp4_activations = True
    inputs = routed(5)
    shared = (experts.forward_unpacked(*inputs), experts.forward_packed(*inputs))
    experts.input_scale_values["gate_up"].add(-1.0)  # as if a scale differed: the per-pair paths
    experts.input_scale_values["down"].add(-1.0)
    for per_pair, once_per_token in zip((experts.forward_unpacked(*inputs), experts.forward_packed(*inputs)), shared,
                                        strict=True):
        assert torch.equal(per_pair, once_per_token)


def test_unequal_gate_and_up_input_scales_load_but_refuse_the_replay(nvfp4_export, tmp_path):
    tensors, hf_quant_config, _ = checkpoint_files(nvfp4_export)
    name = EXPERT.format(layer=1, expert=4, projection="up_proj") + "input_scale"
    tensors[name] = tensors[name] * 1.5
    odd = write_checkpoint(nvfp4_export, tmp_path / "odd", tensors, hf_quant_config)
    assert_same_answers(odd, nvfp4_export)  # W4A16 never uses input scales
    with pytest.raises(serve_clef.CheckpointError, match=name.replace(".", r"\.") + " differs from") as refusal:
        load(odd, "--simulate-fp4-activations")
    assert "\n" not in str(refusal.value)


def test_weight_only_export_with_input_scales_loads_and_says_so(w4a16_export, nvfp4_export, tmp_path):
    tensors, hf_quant_config, _ = checkpoint_files(w4a16_export)
    input_scales = {name: tensor for name, tensor in serve_clef.checkpoint_tensors(nvfp4_export)
                    if name.endswith("input_scale")}
    carrying = write_checkpoint(w4a16_export, tmp_path / "carrying", tensors | input_scales, hf_quant_config)
    lines = console(carrying)
    assert f"{len(input_scales)} input_scale tensors of weight-only (W4A16) layers ignored" in "\n".join(lines)
    assert_same_answers(carrying, w4a16_export)


# ==== quantization metadata ===========================================================================================

def lower_case_algo(hf_quant_config, config_quantization):
    hf_quant_config["quantization"]["quant_algo"] = "nvfp4"
    return hf_quant_config, config_quantization


def config_json_only(hf_quant_config, config_quantization):
    return None, config_quantization


def mixed_precision(hf_quant_config, config_quantization):
    """MIXED_PRECISION as ModelOpt's exporter writes it: no exclude list, every quantized module by name."""
    quantized_layers = {
        EXPERT.format(layer=layer, expert=expert, projection=projection).removesuffix("."): {"quant_algo": "NVFP4",
                                                                                           "group_size": 16}
        for layer in range(NUM_LAYERS) for expert in range(NUM_EXPERTS)
        for projection in ("gate_proj", "up_proj", "down_proj")
    }
    quantization = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": quantized_layers}
    return hf_quant_config | {"quantization": quantization}, config_quantization


def wildcard_kinds(hf_quant_config, config_quantization):
    """Exact names, `name*` and `name.*`, as ModelOpt compresses its exclude list."""
    hf_quant_config["quantization"]["exclude_modules"] = [
        "thinker.audio_tower.*", "thinker.lm_head", "thinker.model.embed_tokens", "thinker.model.layers.0.mlp.gate",
        "thinker.model.layers.0.self_attn", "thinker.model.layers.0.self_attn.*", "thinker.model.layers.1.mlp.gate",
        "thinker.model.layers.1.self_attn*", "thinker.visual*",
    ]
    return hf_quant_config, config_quantization


@pytest.mark.parametrize("change", [lower_case_algo, config_json_only, mixed_precision, wildcard_kinds],
                         ids=["lower-case-algo", "config-json-only", "mixed-precision", "wildcard-kinds"])
def test_quantization_metadata_variants_answer_like_the_export(nvfp4_export, tmp_path, change):
    tensors, hf_quant_config, config_quantization = checkpoint_files(nvfp4_export)
    hf_quant_config, config_quantization = change(hf_quant_config, config_quantization)
    variant = write_checkpoint(nvfp4_export, tmp_path / "variant", tensors, hf_quant_config, config_quantization)
    loaded = load(variant, "--simulate-fp4-activations")
    assert loaded.kind == ("modelopt:MIXED_PRECISION" if change is mixed_precision else "modelopt:NVFP4")
    for got, expected in zip(raw_probabilities(loaded), raw_probabilities(load(nvfp4_export,
                                                                                "--simulate-fp4-activations")),
                             strict=True):
        assert torch.equal(got, expected)


def test_synthetic_metadata_has_no_mid_name_wildcards():
    checkpoint_dir = load("synthetic").checkpoint_dir
    exclude_modules = json.loads((checkpoint_dir / "hf_quant_config.json").read_text())["quantization"][
        "exclude_modules"]
    assert "thinker.model.layers.1.mlp.gate" in exclude_modules
    assert all("*" not in pattern[:-2] for pattern in exclude_modules)  # `name*` or `name.*` only


def fp8_layer_in_mixed(hf_quant_config, config_quantization):
    hf_quant_config, _ = mixed_precision(hf_quant_config, config_quantization)
    hf_quant_config["quantization"]["quantized_layers"]["thinker.model.layers.0.self_attn.q_proj"] = {
        "quant_algo": "FP8"}
    return hf_quant_config, config_quantization


def mixed_expert_algos(hf_quant_config, config_quantization):
    hf_quant_config, _ = mixed_precision(hf_quant_config, config_quantization)
    hf_quant_config["quantization"]["quantized_layers"]["thinker.model.layers.1.mlp.experts.0.down_proj"] = {
        "quant_algo": "W4A16_NVFP4", "group_size": 16}
    return hf_quant_config, config_quantization


def group_size_32(hf_quant_config, config_quantization):
    hf_quant_config["quantization"]["group_size"] = 32
    return hf_quant_config, config_quantization


def experts_excluded(hf_quant_config, config_quantization):
    hf_quant_config["quantization"]["exclude_modules"].append("thinker.model.layers.1.mlp.experts*")
    return hf_quant_config, config_quantization


def other_quant_method(hf_quant_config, config_quantization):
    return None, {"quant_method": "gptq", "bits": 4}


def compressed_tensors_int4(hf_quant_config, config_quantization):
    return None, {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                                   "group_size": 128}}}}


def compressed_tensors_frozen(hf_quant_config, config_quantization):
    return None, {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                  "quantization_status": "frozen", "config_groups": {}}


@pytest.mark.parametrize("change, message", [
    (fp8_layer_in_mixed, r"thinker\.model\.layers\.0\.self_attn\.q_proj: quant_algo 'FP8' \(group size None\) is "
                         r"not served"),
    (mixed_expert_algos, "its experts mix NVFP4 and W4A16_NVFP4, which is not served"),
    (group_size_32, "quant_algo 'NVFP4' .group size 32. is not served"),
    (experts_excluded, r"experts\.0\.\w+_proj\.\w+ is part of an NVFP4 linear, but .*hf_quant_config\.json says "
                       r"thinker\.model\.layers\.1\.mlp\.experts\.0\.\w+_proj is not quantized"),
    (other_quant_method, "quant_method 'gptq' is not served"),
    (compressed_tensors_int4, "config group group_0 .format 'pack-quantized', weights 4-bit int.* is not served"),
    (compressed_tensors_frozen, "quantization_status 'frozen', the weights are not packed"),
], ids=["fp8-layer", "mixed-expert-algos", "group-size-32", "excluded-yet-packed", "gptq", "ct-int4", "ct-frozen"])
def test_unserved_metadata_is_refused_in_one_line(nvfp4_export, tmp_path, change, message):
    tensors, hf_quant_config, config_quantization = checkpoint_files(nvfp4_export)
    hf_quant_config, config_quantization = change(hf_quant_config, config_quantization)
    refused = write_checkpoint(nvfp4_export, tmp_path / "refused", tensors, hf_quant_config, config_quantization)
    with pytest.raises(serve_clef.CheckpointError, match=message) as refusal:
        load(refused)
    assert "\n" not in str(refusal.value)


# ==== NVFP4 outside the experts: attention, towers, KV-cache scales ===================================================

@pytest.fixture(scope="module")
def everything_export(tiny_release, tmp_path_factory) -> Path:
    """ModelOpt's default NVFP4 recipe (experts, attention and the audio tower's linears) with an FP8 KV cache,
    calibrated on text (so the audio tower's input quantizers never are) and written by ModelOpt's exporter."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    config = transformers.AutoConfig.from_pretrained(tiny_release)
    config.enable_audio_output = False
    backbone = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_release, config=config, dtype=torch.bfloat16, experts_implementation="eager")
    quant_config = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    quant_config["quant_cfg"] += [{"quantizer_name": pattern, "enable": False} for pattern in
                                  ("*visual*", "*talker*", "*code2wav*", "*lm_head*", "*mlp.gate.*", "*embed*")]
    quant_config["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])

    def calibrate(model):
        generator = torch.Generator().manual_seed(0)
        for _ in range(4):
            input_ids = torch.randint(0, config.thinker_config.text_config.vocab_size, (1, 96), generator=generator)
            model.thinker(input_ids=input_ids, use_cache=False)

    mtq.quantize(backbone, quant_config, calibrate)
    backbone.forward = types.MethodType(
        lambda self, input_ids=None, **kwargs: self.thinker(input_ids=input_ids, use_cache=False), backbone)
    out_dir = tmp_path_factory.mktemp("everything_export")
    export_hf_checkpoint(backbone, export_dir=out_dir)
    for name in RELEASE_FILES:
        if (tiny_release / name).exists():
            shutil.copy(tiny_release / name, out_dir / name)
    return out_dir


def test_quantized_attention_and_tower_linears_unpack_at_load(everything_export, tmp_path):
    tensors, _, _ = checkpoint_files(everything_export)
    assert tensors["thinker.model.layers.0.self_attn.o_proj.weight"].dtype == torch.uint8
    assert tensors["thinker.audio_tower.layers.0.fc1.weight"].dtype == torch.uint8
    kv_cache_scales = [name for name in tensors if name.endswith(("k_proj.k_scale", "v_proj.v_scale"))]
    assert len(kv_cache_scales) == 2 * NUM_LAYERS
    text = "\n".join(console(everything_export))
    assert f"{len(kv_cache_scales)} KV-cache scales (k_scale/v_scale) skipped: unused" in text
    assert "NVFP4 linears outside the experts unpacked to BF16" in text
    assert re.search(r"have no input_scale \(their input quantizer was never calibrated, e\.g\. \S*audio_tower\.", text)
    reference = write_checkpoint(everything_export, tmp_path / "bf16", dequantised(tensors))
    assert_same_answers(everything_export, reference)


def test_simulated_activations_round_the_inputs_of_quantized_attention(everything_export):
    """Under --simulate-fp4-activations each W4A4 linear's input is rounded with its own calibrated input_scale
    (docs/nvfp4-format.md §2.3, step by step in test_nvfp4.reference_fake_quant)."""
    tensors = dict(serve_clef.checkpoint_tensors(everything_export))
    loaded = load(everything_export, "--simulate-fp4-activations")
    seen = {}
    for projection in ("q_proj", "o_proj"):
        module = next(module for name, module in loaded.model.named_modules()
                      if name.endswith(f"layers.1.self_attn.{projection}"))
        # runs before the replay's own pre-hook: the raw input (append returns None, so nothing is replaced)
        module.register_forward_pre_hook(lambda m, args, p=projection: seen.setdefault(p, []).append(args[0]),
                                         prepend=True)
        module.register_forward_hook(lambda m, args, out, p=projection: seen[p].append(args[0]))
    raw_probabilities(loaded)
    assert set(seen) == {"q_proj", "o_proj"}  # both ran, once each (two inputs: raw, then rounded)
    for projection, (raw, rounded) in seen.items():
        input_scale = float(tensors[f"thinker.model.layers.1.self_attn.{projection}.input_scale"])
        assert not torch.equal(raw, rounded)
        assert torch.equal(rounded, reference_fake_quant(raw.reshape(-1, raw.shape[-1]), input_scale)
                           .to(raw.dtype).reshape(raw.shape))


# ==== NaN block scales (ModelOpt before 0.45) =========================================================================

def test_nan_block_scales_are_refused_or_repaired(nvfp4_export, everything_export, tmp_path):
    tensors, hf_quant_config, _ = checkpoint_files(everything_export)
    nan_at = {EXPERT.format(layer=0, expert=2, projection="gate_proj") + "weight_scale": [(1, 0), (5, 1)],
              "thinker.model.layers.1.self_attn.k_proj.weight_scale": [(0, 3)]}
    repaired = dict(tensors)
    for name, blocks in nan_at.items():
        nan_bytes, repaired_bytes = tensors[name].view(torch.uint8).clone(), tensors[name].view(torch.uint8).clone()
        for row, block in blocks:
            nan_bytes[row, block] = 0x7F if row else 0xFF  # both NaN encodings
            repaired_bytes[row, block] = 0x7E  # 448
        tensors[name], repaired[name] = nan_bytes.view(torch.float8_e4m3fn), repaired_bytes.view(torch.float8_e4m3fn)
    hf_quant_config["producer"]["version"] = "0.44.0"
    broken = write_checkpoint(everything_export, tmp_path / "broken", tensors, hf_quant_config)
    by_hand = write_checkpoint(everything_export, tmp_path / "by_hand", repaired, hf_quant_config)
    with pytest.raises(serve_clef.CheckpointError, match="ModelOpt before 0.45 .* pass --repair-nan-scales") as refusal:
        load(broken)
    assert "\n" not in str(refusal.value)
    assert "--repair-nan-scales: 3 NaN block scales (0x7F/0xFF) loaded as 448" in "\n".join(
        console(broken, repair_nan_scales=True))
    assert_same_answers(broken, by_hand, "--repair-nan-scales")


# ==== compressed-tensors nvfp4-pack-quantized =========================================================================

CT_IGNORE = ["thinker.lm_head", "re:.*mlp\\.gate$", "re:thinker\\.(audio_tower|visual)\\.", "re:.*embed_tokens$",
             "re:.*\\.self_attn\\.(k|v|o)_proj$"]


def compressed_tensors_export(release: Path, out_dir: Path, w4a4: bool) -> tuple[Path, Path]:
    """The release's experts and q_proj linears compressed by compressed-tensors' own NVFP4 compressor, with its
    config (`ignore` mixing exact names and re: regexes); and the same weights decompressed by compressed-tensors,
    as a BF16 release. Global scales are powers of two (a valid choice for any amax), so both tools' operation orders
    give the same numbers and the comparison can be exact."""
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4, NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = QuantizationScheme(targets=["Linear"], **(NVFP4 if w4a4 else NVFP4A16))
    quant_config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=CT_IGNORE,
                                      format="nvfp4-pack-quantized", quantization_status="compressed")
    compressed, decompressed = {}, {}
    for name, tensor in serve_clef.checkpoint_tensors(release):
        module = name.removesuffix(".weight")
        if not (name.endswith("_proj.weight") and module.startswith("thinker.model.")
                and not any(serve_clef.module_matches(pattern, module) for pattern in CT_IGNORE)):
            compressed[name] = decompressed[name] = tensor
            continue
        global_scale = 2.0 ** torch.floor(torch.log2(448 * 6 / tensor.abs().amax().float()))
        blocks = tensor.float().unflatten(-1, (-1, 16))
        block_scales, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=global_scale)
        parts = NVFP4PackedCompressor.compress(
            {"weight": tensor, "weight_scale": block_scales, "weight_global_scale": global_scale.reshape(1)}, scheme)
        if w4a4:  # calibrated per linear; gate and up see the same inputs, so they get the same one
            calibrated_amax = 2.0 + sum(map(ord, module.replace("up_proj", "gate_proj"))) % 7
            parts["input_global_scale"] = torch.tensor([448 * 6 / calibrated_amax])
        compressed |= {f"{module}.{field}": value for field, value in parts.items()}
        decompressed[name] = NVFP4PackedCompressor.decompress(parts, scheme)["weight"].to(torch.bfloat16)
    assert compressed[EXPERT.format(layer=1, expert=7, projection="down_proj") + "weight_packed"].dtype == torch.uint8
    assert "thinker.model.layers.0.self_attn.q_proj.weight_global_scale" in compressed
    assert compressed["thinker.model.layers.0.self_attn.k_proj.weight"].dtype == torch.bfloat16
    checkpoint = write_checkpoint(release, out_dir / "ct", compressed, quantization_config=quant_config.to_dict())
    return checkpoint, write_checkpoint(release, out_dir / "bf16", decompressed)


@pytest.mark.parametrize("w4a4", [True, False], ids=["NVFP4", "NVFP4A16"])
def test_compressed_tensors_export_answers_like_its_own_decompression(tiny_release, tmp_path, w4a4):
    checkpoint, reference = compressed_tensors_export(tiny_release, tmp_path, w4a4)
    loaded = load(checkpoint)
    assert loaded.kind == ("compressed-tensors:NVFP4" if w4a4 else "compressed-tensors:NVFP4A16")
    assert_same_answers(checkpoint, reference)
    if w4a4:
        simulated = raw_probabilities(load(checkpoint, "--simulate-fp4-activations"))
        assert any(not torch.equal(a, b) for a, b in zip(simulated, raw_probabilities(loaded), strict=True))
    else:
        with pytest.raises(serve_clef.CheckpointError, match="compressed-tensors:NVFP4A16: drop the flag"):
            load(checkpoint, "--simulate-fp4-activations")


def test_modelopt_export_converted_by_compressed_tensors_loads_with_inverted_scales(nvfp4_export, tmp_path):
    """compressed-tensors' own ModelOpt converter writes the reciprocal global and input scales; loaded, they are
    ModelOpt's again (to the last bit of a reciprocal of a reciprocal) and the answers are those of the export."""
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    tensors, _, _ = checkpoint_files(nvfp4_export)
    converter = ModelOptNvfp4Converter(ignore=CT_IGNORE, targets=["Linear"])
    converted = converter.validate(dict(tensors))
    assert EXPERT.format(layer=0, expert=0, projection="up_proj") + "input_global_scale" in converted
    quant_config = converter.update_config(None).to_dict()
    checkpoint = write_checkpoint(nvfp4_export, tmp_path / "ct", converted, quantization_config=quant_config)
    loaded = load(checkpoint, "--simulate-fp4-activations")
    assert loaded.kind == "compressed-tensors:NVFP4"
    layer = next(m for m in loaded.model.modules() if isinstance(m, serve_clef.PackedNVFP4Experts))
    original = torch.stack([tensors[EXPERT.format(layer=0, expert=expert, projection=projection) + "weight_scale_2"]
                            for expert in range(NUM_EXPERTS) for projection in ("gate_proj", "up_proj")]).view(-1, 2)
    torch.testing.assert_close(layer.gate_up_global_scale, original, rtol=2**-23, atol=0)
    for got, expected in zip(raw_probabilities(loaded), raw_probabilities(load(nvfp4_export,
                                                                                "--simulate-fp4-activations")),
                             strict=True):
        # The scales are the export's to one float32 rounding, which moves a few activations' FP4 roundings and so
        # the BF16 logits by a rounding step or two: up to ~0.005 of a probability through the batched joint head.
        torch.testing.assert_close(got, expected, rtol=0, atol=0.01)


def test_experts_an_export_left_in_bf16_are_refused_naming_the_layer(nvfp4_export, tiny_release, tmp_path):
    """An export that excludes one layer's experts from quantization writes them in BF16, one matrix per expert, as
    the release holds them: refused in one line that says so, not as a tensor of the wrong dtype."""
    tensors, hf_quant_config, _ = checkpoint_files(nvfp4_export)
    release = dict(serve_clef.checkpoint_tensors(tiny_release))
    prefix = "thinker.model.layers.1.mlp.experts."
    tensors = {name: tensor for name, tensor in tensors.items() if not name.startswith(prefix)}
    tensors |= {name: tensor for name, tensor in release.items() if name.startswith(prefix)}
    hf_quant_config["quantization"]["exclude_modules"].append("thinker.model.layers.1.mlp.experts*")
    checkpoint = write_checkpoint(nvfp4_export, tmp_path / "partly", tensors, hf_quant_config)
    refusal = (r"layers\.1\.mlp\.experts\.\d+\.\w+_proj\.weight: torch\.bfloat16 expert weights in a quantized "
               r"export, .* serves quantized exports whose experts are all NVFP4")
    with pytest.raises(serve_clef.CheckpointError, match=refusal):
        load(checkpoint)
