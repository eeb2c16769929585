"""NVFP4 numerics of serve_clef: unpack, quantizer, activation replay and the packed experts forward.

Every reference is independent of serve_clef: the formulas of docs/nvfp4-format.md §2 written out here,
ModelOpt's own NVFP4 quantizer, and transformers' own eager experts module.
Dimension letters: E experts, O output rows, K input columns, T tokens, H hidden, I expert width.
"""

import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts

import serve_clef

E2M1_TABLE = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]  # docs/nvfp4-format.md §2, codes 0..15


def e4m3_scale_bytes(shape, generator) -> torch.Tensor:
    """Random finite float8_e4m3fn block scales: every byte but the NaNs 0x7F / 0xFF, positive only."""
    scale_bytes = torch.randint(0, 0x7F, shape, generator=generator, dtype=torch.int16).to(torch.uint8)
    return scale_bytes.view(torch.float8_e4m3fn)


def reference_dequantize(packed_codes, block_scales, global_scale) -> torch.Tensor:
    """docs/nvfp4-format.md §2.1 as written: low nibble = element 2i, table lookup, per_block = scale * scale_2 in
    fp32, then BF16. global_scale [E], or [E, G]: G equal groups of rows with their own scale (gate, up)."""
    num_experts, rows, half_columns = packed_codes.shape
    codes = torch.empty(num_experts, rows, 2 * half_columns, dtype=torch.long)
    codes[..., 0::2] = (packed_codes & 0x0F).long()
    codes[..., 1::2] = (packed_codes >> 4).long()
    e2m1 = torch.tensor(E2M1_TABLE, dtype=torch.float32)[codes]
    row_scales = global_scale.reshape(num_experts, -1, 1)  # [E, G, 1]
    per_block = block_scales.float() * row_scales.repeat_interleave(rows // row_scales.shape[1], dim=1)
    return (e2m1 * per_block.repeat_interleave(16, dim=-1)).to(torch.bfloat16)


def test_unpack_equals_the_dequantisation_formula_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    packed_codes = torch.randint(0, 256, (3, 8, 32), generator=generator, dtype=torch.int16).to(torch.uint8)
    packed_codes[0, 0] = torch.arange(32, dtype=torch.uint8) * 8  # both nibbles of every code value occur
    block_scales = e4m3_scale_bytes((3, 8, 4), generator)  # K = 64: 4 blocks
    global_scale = torch.tensor([1.0, 3.7e-4, 2.5e3])
    unpacked = serve_clef.unpack_nvfp4(packed_codes, block_scales, global_scale)
    expected = reference_dequantize(packed_codes, block_scales, global_scale)
    assert unpacked.dtype == torch.bfloat16 and unpacked.shape == (3, 8, 64)
    assert torch.equal(unpacked.view(torch.int16), expected.view(torch.int16))  # signs of zero included


def test_quantizer_equals_modelopt_codes_and_scale_bytes():
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    generator = torch.Generator().manual_seed(1)
    # [O=6, K=64]: rows of very different ranges, so block scales spread over the e4m3 range
    weight = torch.randn(6, 64, generator=generator) * torch.tensor([1e-3, 0.02, 0.5, 3.0, 40.0, 1.0])[:, None]
    weight[2, 16:32] = 0  # an all-zero block gets scale 1.0
    weight[3, :16] = 1e-7  # far below the others: its block scale clamps to 2**-9
    weight[5, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor(
        [1.0, -1.0]
    ).repeat_interleave(8)
    weight = weight.to(torch.bfloat16)
    global_scale = weight.abs().amax().float() / (6 * 448)
    modelopt_packed, modelopt_block_scales, _ = NVFP4QTensor.quantize(weight, 16, weights_scaling_factor_2=global_scale)
    packed_codes, block_scales = serve_clef.quantize_nvfp4(weight, global_scale)
    assert packed_codes.dtype == torch.uint8 and block_scales.dtype == torch.float8_e4m3fn
    assert torch.equal(packed_codes, modelopt_packed._quantized_data)
    assert torch.equal(block_scales.view(torch.uint8), modelopt_block_scales.view(torch.uint8))


def reference_fake_quant(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """docs/nvfp4-format.md §2.3 step by step, one fp32 scalar at a time, with the rounding table of §2.3 as
    thresholds."""

    def f32(value) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float32)

    blocks = x.float().view(-1, 16)
    out = torch.empty_like(blocks)
    for row, block in enumerate(blocks):
        ratio = torch.minimum(block.abs().max() / (f32(6.0) * f32(input_scale)), f32(448.0))
        scale = ratio.to(torch.float8_e4m3fn).float() * f32(input_scale)
        if scale < 1e-5:
            scale = f32(1.0)
        for column, value in enumerate(block):
            v = float(value.abs() / scale)
            rounded = (
                0
                if v <= 0.25
                else 0.5
                if v < 0.75
                else 1
                if v <= 1.25
                else 1.5
                if v < 1.75
                else 2
                if v <= 2.5
                else 3
                if v < 3.5
                else 4
                if v <= 5
                else 6
            )
            out[row, column] = (f32(rounded) * scale) * (1 if value >= 0 else -1)
    return out.view(x.shape)


def test_activation_rounding_at_the_e2m1_boundaries():
    # input_scale 2**-4 and block amax 6 * 2**-2 make the block scale exactly 2**-2 (ratio 4 is exact in e4m3)
    input_scale, block_scale = 2.0**-4, 2.0**-2
    boundaries = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rounded_at = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # ties to even (docs/nvfp4-format.md §2.3 table)
    below = torch.nextafter(boundaries * block_scale, torch.tensor(0.0))
    above = torch.nextafter(boundaries * block_scale, torch.tensor(torch.inf))
    rounded_below = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    rounded_above = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    for values, expected in ((boundaries * block_scale, rounded_at), (below, rounded_below), (above, rounded_above)):
        for sign in (1.0, -1.0):
            block = torch.zeros(16)
            block[0] = 6 * block_scale  # the block's amax
            block[1:8] = sign * values
            quantized = serve_clef.fake_quant_nvfp4_activations(block[None], torch.tensor(input_scale))[0]
            assert torch.equal(quantized[1:8], sign * expected * block_scale), (values, sign)
            assert quantized[0] == 6 * block_scale


def test_activation_rounding_at_the_scale_limits_and_on_zero_blocks():
    input_scale = torch.tensor(0.01)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 32, generator=generator)
    x[0] *= 1e-9  # block scale underflows e4m3 to 0 -> scale 1 -> everything rounds to 0
    x[1] *= 1e6  # amax / (6 * input_scale) beyond 448 saturates: values clip to 6 * 448 * input_scale
    x[2] = 0  # all-zero blocks stay zero
    x[3] *= 3e-4  # block scale in e4m3's subnormal range
    quantized = serve_clef.fake_quant_nvfp4_activations(x, input_scale)
    assert torch.equal(quantized[0], torch.zeros(32))
    assert torch.equal(quantized[2], torch.zeros(32))
    assert quantized[1].abs().max() == 6 * (448 * input_scale)  # fp32, in the order the block scale is built
    assert torch.equal(quantized, reference_fake_quant(x, float(input_scale)))


def test_activation_rounding_matches_the_formula_on_random_bf16():
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 64, generator=generator) * torch.logspace(-3, 2, 4)[:, None]).to(torch.bfloat16)
    quantized = serve_clef.fake_quant_nvfp4_activations(x, torch.tensor(0.02))
    assert quantized.dtype == torch.bfloat16
    assert torch.equal(quantized, reference_fake_quant(x, 0.02).to(torch.bfloat16))


def tiny_text_config():
    return Qwen3OmniMoeTextConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def random_packed_experts(
    text_config, has_input_scales: bool, power_of_two_global_scales: bool = False, seed: int = 4
) -> serve_clef.PackedNVFP4Experts:
    """Random packed experts; with power-of-two global scales every weight is exact in BF16 on the unpack path too."""
    generator = torch.Generator().manual_seed(seed)
    experts = serve_clef.PackedNVFP4Experts(text_config, F.silu, has_input_scales=has_input_scales)
    for name in ("gate_up", "down"):
        codes = getattr(experts, f"{name}_packed_codes")
        codes.copy_(torch.randint(0, 256, codes.shape, generator=generator, dtype=torch.int16).to(torch.uint8))
        # block scales of a weight of std ~0.02: codes up to 6 -> scale ~0.01 / global scale
        scales = getattr(experts, f"{name}_block_scales")
        scales.copy_((torch.rand(scales.shape, generator=generator) * 100 + 20).to(torch.float8_e4m3fn))
        global_scale = getattr(experts, f"{name}_global_scale").view(8, -1)  # gate_up: [E, 2], gate and up alike
        if power_of_two_global_scales:
            global_scale.copy_(2.0 ** torch.randint(-15, -12, (8, 1), generator=generator).float())
        else:
            global_scale.copy_(torch.rand(8, 1, generator=generator) * 1e-4 + 5e-5)
    experts.gate_up_input_scale.fill_(3.0 / (6 * 448))
    experts.down_input_scale.fill_(0.05 / (6 * 448))
    return experts


def routed_tokens(text_config):
    generator = torch.Generator().manual_seed(5)
    hidden_states = torch.randn(24, text_config.hidden_size, generator=generator).to(torch.bfloat16)  # [T, H]
    top_k_index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(24)])  # [T, k]
    top_k_weights = torch.rand(24, 2, generator=generator).softmax(-1).to(torch.bfloat16)  # [T, k]
    return hidden_states, top_k_index, top_k_weights


@torch.no_grad()
def test_packed_forward_equals_transformers_eager_experts_on_the_dequantised_weights():
    text_config = tiny_text_config()
    text_config._experts_implementation = "eager"
    packed = random_packed_experts(text_config, has_input_scales=False)
    stock = Qwen3OmniMoeThinkerTextExperts(text_config)
    stock.to(torch.bfloat16)
    stock.gate_up_proj.copy_(
        reference_dequantize(packed.gate_up_packed_codes, packed.gate_up_block_scales, packed.gate_up_global_scale)
    )
    stock.down_proj.copy_(
        reference_dequantize(packed.down_packed_codes, packed.down_block_scales, packed.down_global_scale)
    )
    hidden_states, top_k_index, top_k_weights = routed_tokens(text_config)
    expected = stock(hidden_states, top_k_index, top_k_weights)
    got = packed(hidden_states, top_k_index, top_k_weights)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert expected.abs().mean() > 1e-3  # the comparison is not between near-zeros
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().mean().item())


@torch.no_grad()
def test_simulated_fp4_activations_quantize_both_expert_inputs():
    text_config = tiny_text_config()
    packed = random_packed_experts(text_config, has_input_scales=True)
    packed.simulate_fp4_activations = True
    gate_up_proj = reference_dequantize(
        packed.gate_up_packed_codes, packed.gate_up_block_scales, packed.gate_up_global_scale
    ).float()
    down_proj = reference_dequantize(
        packed.down_packed_codes, packed.down_block_scales, packed.down_global_scale
    ).float()
    hidden_states, top_k_index, top_k_weights = routed_tokens(text_config)
    # W4A4 per docs/nvfp4-format.md §2.3, one token and one routed expert at a time, fp32 math on BF16-rounded
    # activations
    expected = torch.zeros(hidden_states.shape)
    quantized_hidden = reference_fake_quant(hidden_states, float(packed.gate_up_input_scale[0])).bfloat16().float()
    for token in range(hidden_states.shape[0]):
        for slot in range(2):
            expert = top_k_index[token, slot]
            gate, up = (gate_up_proj[expert] @ quantized_hidden[token]).bfloat16().chunk(2)  # BF16 like the kernel
            intermediate = (F.silu(gate) * up).float()
            intermediate = reference_fake_quant(intermediate, float(packed.down_input_scale[0])).bfloat16().float()
            expected[token] += top_k_weights[token, slot].float() * (down_proj[expert] @ intermediate)
    got = packed(hidden_states, top_k_index, top_k_weights).float()
    packed.simulate_fp4_activations = False
    w4a16 = packed(hidden_states, top_k_index, top_k_weights).float()
    scale = expected.abs().mean().item()
    # Accumulation order differs from the grouped kernel, so an intermediate value sitting on an E2M1 rounding
    # boundary may land on the other side: compare on average, far tighter than the effect of the replay itself.
    assert (w4a16 - expected).abs().mean() > 0.2 * scale
    assert (got - expected).abs().mean() < 0.02 * scale


def test_compiled_unpack_equals_the_formula_on_the_layer_buffers():
    """unpack_nvfp4_compiled, which PackedNVFP4Experts.unpacked runs on CUDA, called as it is there: on a layer's own
    buffers (gate_up with a global scale per gate and up half, [E, 2]; down with one, [E]). Inductor's C++ backend
    compiles it here (torch.compile works on CPU when a C++ compiler is present). Compared as numbers, which is what
    the matmuls rely on: compiled on CUDA, E2M1 code 8 (-0) may come out +0 (bench/check_nvfp4_gpu.py counts it)."""
    experts = random_packed_experts(tiny_text_config(), has_input_scales=False, seed=6)
    experts.gate_up_global_scale[:, 1] *= 1.7  # up's own global scale
    experts.gate_up_packed_codes[0, 0, :8] = torch.arange(8, dtype=torch.uint8) * 0x21  # every code in both nibbles
    for name in ("gate_up", "down"):
        packed = [getattr(experts, f"{name}_{field}") for field in ("packed_codes", "block_scales", "global_scale")]
        compiled = serve_clef.unpack_nvfp4_compiled(*packed)
        expected = reference_dequantize(*packed)
        assert compiled.dtype == torch.bfloat16 and expected.abs().max() > 0
        assert torch.equal(compiled, expected), name  # as numbers: -0 == +0, NaN never equal


def test_compiled_activation_replay_equals_the_formula_bit_for_bit():
    """fake_quant_nvfp4_activations_compiled, which the unpack path runs on CUDA (serve_clef.fake_quant), on the inputs
    it gets there: BF16 [T, H] with the shared 0-d input scale, and [S, H] with one scale per row ([S, 1, 1], an
    expert's own), at two token counts (compiled with dynamic shapes). On CPU inductor divides as IEEE does, so the
    compiled replay must equal §2.3's formula to the bit, E2M1 boundaries included. On CUDA the division is Triton's,
    and what production relies on there is equality with ModelOpt's own kernel: bench/check_nvfp4_gpu.py counts that."""
    generator = torch.Generator().manual_seed(7)
    for rows in (24, 5):
        x = (torch.randn(rows, 64, generator=generator) * torch.logspace(-2, 1, rows)[:, None]).to(torch.bfloat16)
        shared = torch.tensor(11.0 / (6 * 448))
        compiled = serve_clef.fake_quant_nvfp4_activations_compiled(x, shared)
        assert compiled.dtype == torch.bfloat16
        expected = reference_fake_quant(x, float(shared)).bfloat16()
        assert torch.equal(compiled.view(torch.int16), expected.view(torch.int16))
        per_row = torch.rand(rows, generator=generator) * 0.01 + 1e-3  # [S]
        compiled = serve_clef.fake_quant_nvfp4_activations_compiled(x, per_row[:, None, None])
        expected = torch.cat([reference_fake_quant(x[row:row + 1], float(per_row[row])) for row in range(rows)])
        assert torch.equal(compiled.view(torch.int16), expected.bfloat16().view(torch.int16))
    # the E2M1 rounding boundaries, exactly on, just below and just above (as in the eager test above)
    input_scale, block_scale = 2.0**-4, 2.0**-2
    boundaries = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * block_scale
    blocks = torch.zeros(6, 16)
    blocks[:, 0] = 6 * block_scale  # each block's amax
    for row, values in enumerate((boundaries, torch.nextafter(boundaries, torch.tensor(0.0)),
                                  torch.nextafter(boundaries, torch.tensor(torch.inf)))):
        blocks[2 * row, 1:8], blocks[2 * row + 1, 1:8] = values, -values
    compiled = serve_clef.fake_quant_nvfp4_activations_compiled(blocks, torch.tensor(input_scale))
    assert torch.equal(compiled.view(torch.int32), reference_fake_quant(blocks, input_scale).view(torch.int32))
