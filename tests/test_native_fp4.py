"""The native FP4 path (--expert-kernels native): operand layouts, activation quantization and whole layers.

No GPU here runs FP4 tensor cores, so torch's grouped scaled matmul is replaced by `grouped_mm_as_documented`, which
does what its contract says (torch.nn.functional.scaled_grouped_mm with NVFP4 operands, 2-D activations against 3-D
weights): it checks the arguments the way torch does, reads every block scale at the place the tensor cores' tiled
layout puts it, decodes the codes and multiplies per expert. Everything serve_clef does around that call runs as it
would on the GPU, and is compared with the unpack path's W4A4 replay.
"""

import pytest
import torch
from test_expert_kernels import load_tiny, routed
from test_nvfp4 import random_packed_experts, tiny_text_config

import serve_clef

functional = torch.nn.functional
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])  # by code: bit 3 sign


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2], element 2i in the low nibble -> fp32 [..., K]."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    return E2M1_VALUES[codes.long()]


def tiled_scale_offset(row: torch.Tensor, column: torch.Tensor, padded_columns: int) -> torch.Tensor:
    """Where block scale (row, column) sits in the tensor cores' tiled layout: tiles of 128 rows by 4 columns, 512
    bytes each, one row of tiles after another; in a tile, 32 rows of 16 bytes, each holding rows r, r + 32, r + 64
    and r + 96 with their 4 columns."""
    tile = (row // 128) * (padded_columns // 4) + column // 4
    return tile * 512 + (row % 32) * 16 + (row % 128 // 32) * 4 + column % 4


def grouped_mm_as_documented(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                             swizzle_b=None, bias=None, offs=None, output_dtype=torch.bfloat16, contraction_dim=(),
                             use_fast_accum=False):
    nvfp4 = [functional.ScalingType.BlockWise1x16, functional.ScalingType.TensorWise]
    tiled = [functional.SwizzleType.SWIZZLE_32_4_4, functional.SwizzleType.NO_SWIZZLE]
    assert scale_recipe_a == nvfp4 and scale_recipe_b == nvfp4 and swizzle_a == tiled and swizzle_b == tiled
    assert mat_a.dtype == mat_b.dtype == torch.float4_e2m1fn_x2
    assert mat_a.dim() == 2 and mat_a.is_contiguous()  # activations [S, K/2]
    assert mat_b.dim() == 3 and mat_b.stride(-2) == 1  # weights [E, K/2, O], a transposed view of [E, O, K/2]
    assert bias is None and output_dtype == torch.bfloat16 and not contraction_dim
    num_experts, half_k, out_features = mat_b.shape
    assert offs.dtype == torch.int32 and offs.shape == (num_experts,)
    (a_scales, a_global), (b_scales, b_global) = scale_a, scale_b
    assert a_scales.dtype == b_scales.dtype == torch.float8_e4m3fn
    assert a_global.dtype == b_global.dtype == torch.float32
    columns = 2 * half_k // 16
    padded_columns = -(-columns // 4) * 4
    assert a_scales.dim() == 2 and a_scales.shape[0] >= mat_a.shape[0]
    assert b_scales.shape == (num_experts, -(-out_features // 128) * 128 * padded_columns)
    alpha = a_global * b_global  # torch multiplies the two; its kernel reads one per expert
    assert alpha.shape == (num_experts,)
    a_values = decode_e2m1(mat_a.view(torch.uint8))  # [S, K]
    b_values = decode_e2m1(mat_b.transpose(-2, -1).contiguous().view(torch.uint8))  # [E, O, K]
    a_bytes, b_bytes = a_scales.view(torch.uint8).flatten(), b_scales.view(torch.uint8)
    out = torch.zeros(mat_a.shape[0], out_features)
    start = scale_start = 0
    column = torch.arange(columns)[None, :]
    for expert, end in enumerate(offs.tolist()):
        rows = torch.arange(end - start)[:, None]
        a_block_scales = a_bytes[scale_start * padded_columns + tiled_scale_offset(rows, column, padded_columns)]
        weight_rows = torch.arange(out_features)[:, None]
        b_block_scales = b_bytes[expert][tiled_scale_offset(weight_rows, column, padded_columns)]
        a = a_values[start:end] * a_block_scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
        b = b_values[expert] * b_block_scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
        out[start:end] = (a @ b.T) * alpha[expert]
        scale_start += -(-(end - start) // 128) * 128  # each expert's scales start on a whole tile
        start = end
    return out.to(torch.bfloat16)


@pytest.fixture
def fp4_tensor_cores(monkeypatch):
    monkeypatch.setattr(functional, "scaled_grouped_mm", grouped_mm_as_documented)


def test_blocked_scales_put_every_scale_where_the_tensor_cores_read_it():
    generator = torch.Generator().manual_seed(0)
    block_scales = (torch.rand(3, 130, 6, generator=generator) * 400 + 1).to(torch.float8_e4m3fn)  # pads both ways
    blocked = serve_clef.blocked_scales(block_scales)
    assert blocked.dtype == torch.float8_e4m3fn and blocked.shape == (3, 256 * 8)
    rows, columns = torch.arange(130)[:, None], torch.arange(6)[None, :]
    offsets = tiled_scale_offset(rows, columns, 8)  # [130, 6]
    placed = blocked.view(torch.uint8)[:, offsets.flatten()].view(3, 130, 6)
    assert torch.equal(placed, block_scales.view(torch.uint8))
    padding = torch.ones(256 * 8, dtype=torch.bool)
    padding[offsets.flatten()] = False
    assert not blocked.view(torch.uint8)[:, padding].any()  # zero bytes
    assert torch.equal(serve_clef.block_scales_from_blocked(blocked, 130, 6).view(torch.uint8),
                       block_scales.view(torch.uint8))


@pytest.mark.parametrize("per_row_scales", [False, True], ids=["one input scale", "one per row"])
def test_activation_operands_decode_to_the_w4a4_replay_bit_for_bit(per_row_scales):
    generator = torch.Generator().manual_seed(1)
    activations = torch.randn(6, 64, generator=generator) * torch.logspace(-3, 2, 6)[:, None]
    activations[0, :16] *= 1e-9  # the block scale underflows e4m3 to 0: the replay's scale 1, zeros here
    activations[1, 16:32] = 0
    activations[2] *= 1e5  # scales clamped at 448: the largest codes saturate
    activations = activations.to(torch.bfloat16)
    input_scale = torch.rand(6, 1, 1, generator=generator) * 0.05 if per_row_scales else torch.tensor(0.01)
    packed_codes, block_scales = serve_clef.quantize_nvfp4_activations(activations, input_scale)
    assert packed_codes.dtype == torch.uint8 and packed_codes.shape == (6, 32)
    assert block_scales.dtype == torch.float8_e4m3fn and block_scales.shape == (6, 4)
    # what the tensor cores compute with: code * (block scale * input scale), the replay's order of products
    scale_per_value = (block_scales.float() * input_scale.view(-1, 1)).repeat_interleave(16, dim=1)
    decoded = (decode_e2m1(packed_codes).abs() * scale_per_value).copysign(decode_e2m1(packed_codes))
    replay = serve_clef.fake_quant_nvfp4_activations(activations, input_scale)
    assert replay.abs().amax(dim=1).gt(0).all() and replay[0, :16].eq(0).all()  # not a comparison of zeros only
    assert torch.equal(decoded.to(torch.bfloat16), replay)


@pytest.mark.parametrize("num_tokens", [1, 5, 19])
@torch.no_grad()
def test_native_layer_equals_the_w4a4_replay_bit_for_bit_when_weights_are_exact(num_tokens, fp4_tensor_cores):
    """Power-of-two global and input scales make every weight, every rounded input and every product exact on both
    paths (the replay multiplies by the scales before its matmul, the tensor cores after theirs): the same values
    reach the same BF16 roundings, with experts that get no token and a token routed twice to one expert."""
    experts = random_packed_experts(tiny_text_config(), True, power_of_two_global_scales=True)
    experts.gate_up_input_scale.fill_(2.0**-10)
    experts.down_input_scale.fill_(2.0**-16)
    experts.simulate_fp4_activations = True
    inputs = routed(num_tokens, seed=num_tokens)
    reference = experts.forward_unpacked(*inputs)
    assert reference.abs().mean() > 1e-4  # not a comparison of zeros
    experts.to_native_order()
    experts.kernels = "native"
    assert torch.equal(experts(*inputs), reference)


@torch.no_grad()
def test_native_layer_with_scales_per_expert_and_unequal_gate_and_up(fp4_tensor_cores):
    """Older exports: an input scale per expert (each pair's input quantized with its expert's) and gate and up global
    scales that differ (the product takes gate's, up's rows are rescaled after). Powers of two keep it exact."""
    experts = random_packed_experts(tiny_text_config(), True, power_of_two_global_scales=True, seed=3)
    generator = torch.Generator().manual_seed(3)
    experts.gate_up_global_scale[:, 1] *= 2.0 ** torch.randint(-2, 3, (8,), generator=generator)
    for name, exponent in (("gate_up", -10), ("down", -16)):
        scales = getattr(experts, f"{name}_input_scale")
        scales.copy_(2.0 ** (exponent + torch.randint(-1, 2, (8,), generator=generator)))
        experts.input_scale_values[name] = set(scales.tolist())  # what store() records while loading
    assert not experts.gate_up_input_scales_shared and not experts.down_input_scales_shared
    experts.simulate_fp4_activations = True
    inputs = routed(37, seed=3)
    reference = experts.forward_unpacked(*inputs)
    assert reference.abs().mean() > 1e-4
    experts.to_native_order()
    assert experts.up_over_gate_scale is not None
    assert torch.equal(experts.forward_native(*inputs), reference)


def test_native_order_keeps_the_checkpoints_weights(fp4_tensor_cores):
    experts = random_packed_experts(tiny_text_config(), True, seed=5)
    experts.down_block_scales[0, :3] = torch.tensor([0.0, -2.0, 3.0]).to(torch.float8_e4m3fn)[:, None]
    weights = experts.unpacked()
    experts.to_native_order()
    assert not hasattr(experts, "gate_up_block_scales") and experts.gate_up_blocked_scales.shape == (8, 128 * 4)
    for before, after in zip(weights, experts.unpacked()):
        assert torch.equal(before, after)


def test_native_kernels_are_chosen_where_the_gpu_has_fp4_tensor_cores(monkeypatch):
    cuda, config = torch.device("cuda"), tiny_text_config()
    for capability in ((10, 0), (10, 3), (12, 0)):  # torch refuses 12.x today: the check at load then says so
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        assert serve_clef.resolve_expert_kernels("auto", cuda, config) == "native"
        assert serve_clef.resolve_expert_kernels("native", cuda, config) == "native"
        assert serve_clef.resolve_expert_kernels("auto", cuda, config, experts_w4a4=False) == "triton"
        with pytest.raises(serve_clef.CheckpointError, match="this one is W4A16"):
            serve_clef.resolve_expert_kernels("native", cuda, config, experts_w4a4=False)
    odd = tiny_text_config()
    odd.moe_intermediate_size = 48
    assert serve_clef.resolve_expert_kernels("auto", cuda, odd) == "triton"
    with pytest.raises(serve_clef.CheckpointError, match="multiples of 32, this model has 64 and 48"):
        serve_clef.resolve_expert_kernels("native", cuda, odd)
    for capability, auto in (((9, 0), "gluon"), ((8, 0), "triton")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        config.hidden_size, config.moe_intermediate_size = 2048, 768
        assert serve_clef.resolve_expert_kernels("auto", cuda, config) == auto
        with pytest.raises(serve_clef.CheckpointError, match=r"FP4 tensor cores .* is compute capability"):
            serve_clef.resolve_expert_kernels("native", cuda, config)
    with pytest.raises(serve_clef.CheckpointError, match="is a CPU"):
        serve_clef.resolve_expert_kernels("native", torch.device("cpu"), config)


def test_the_load_time_check_passes_the_documented_matmul_and_refuses_others(monkeypatch, fp4_tensor_cores):
    config, cpu = tiny_text_config(), torch.device("cpu")
    assert 0 < serve_clef.check_native_fp4({}, config, cpu) < 0.05  # W4A4 rounding flips, no misread layout
    monkeypatch.setattr(functional, "scaled_grouped_mm", lambda *args, **kwargs: grouped_mm_as_documented(
        *args, **kwargs).flip(0))  # rows in the wrong order: what a misread layout would give
    with pytest.raises(serve_clef.CheckpointError, match="differs from the unpack path"):
        serve_clef.check_native_fp4({}, config, cpu)

    def refuse(*args, **kwargs):
        raise NotImplementedError("nvfp4 grouped gemm is not supported without USE_FBGEMM_GENAI")

    monkeypatch.setattr(functional, "scaled_grouped_mm", refuse)
    with pytest.raises(serve_clef.CheckpointError, match="failed on cpu: nvfp4 grouped gemm is not supported"):
        serve_clef.check_native_fp4({}, config, cpu)
    store = random_packed_experts(config, True)
    store.unequal_gate_up_input_scale = "model.layers.0.mlp.experts.3.up_proj.input_scale"
    with pytest.raises(serve_clef.CheckpointError, match="experts.3.up_proj.input_scale differs"):
        serve_clef.check_native_fp4({"experts": store}, config, cpu)


@torch.no_grad()
def test_tiny_model_answers_with_native_kernels_as_with_the_w4a4_replay(monkeypatch, fp4_tensor_cores):
    """The whole load path (the check at load, the layers put in native order) and the answers, on CPU, with the
    kernels chosen as a GPU with FP4 tensor cores would choose them."""
    resolve = serve_clef.resolve_expert_kernels
    monkeypatch.setattr(serve_clef, "resolve_expert_kernels", lambda choice, *args: (
        "native" if choice == "native" else resolve(choice, *args)))
    request = {
        "model": "clef-omni",
        "state": {"ticket": "The parcel came late and the box was crushed.", "orders": 3},
        "questions": {
            "team": {"type": "choice", "criteria": {"billing": None, "shipping": None, "support": None}},
            "anger": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
        },
    }
    lines = []
    native = serve_clef.load_from_args(
        serve_clef.parse_args(["--model", "synthetic", "--device", "cpu", "--expert-kernels", "native"]), lines.append)
    assert native.expert_kernels == "native"
    assert any("native kernels" in line for line in lines)  # the loading line names them
    assert any("agree with the unpack path" in line and "have not run them" in line for line in lines)
    layers = [m for m in native.model.modules() if isinstance(m, serve_clef.PackedNVFP4Experts)]
    assert layers and all(layer.kernels == "native" and hasattr(layer, "down_blocked_scales") for layer in layers)
    replay = load_tiny(["--expert-kernels", "unpack", "--simulate-fp4-activations"])
    native_answers = serve_clef.decide(native, request, 4096)["answers"]
    replay_answers = serve_clef.decide(replay, request, 4096)["answers"]
    for question in ("team", "anger"):
        for option, probability in replay_answers[question]["probabilities"].items():
            assert abs(native_answers[question]["probabilities"][option] - probability) < 0.01
