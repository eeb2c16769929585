"""The packed-expert Triton kernels, run on CPU by Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py).

References, none of them the kernels: the step-by-step NVFP4 formulas of test_nvfp4.py, the unpack + grouped_mm path
(itself checked against transformers' eager experts there), transformers' eager experts module, and a plain Python
routing. The weights' decode that only the GPU runs (PTX, which the interpreter cannot) is checked by carrying out its
instructions on Python integers, as PTX specifies them, against E2M1's table. The Gluon kernels for Hopper cannot run
here at all (Gluon has no interpreter): their decode PTX and the fragment order of their codes are checked the same
way, against the register layout of Hopper's tensor-core operand; bench/check_expert_kernels.py runs them on the GPU.
Dimension letters: E experts, H hidden, I expert width, T tokens, K experts per token, S pairs, P slots.
"""

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from test_nvfp4 import random_packed_experts, reference_dequantize, reference_fake_quant, tiny_text_config
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts

import serve_clef


def test_kernel_rounding_equals_the_formula_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    # 96 columns: not a power of two, so the kernel rounds each row in column blocks (of 32)
    x = torch.randn(6, 96, generator=generator) * torch.tensor([1e-9, 3e-4, 0.01, 1.0, 30.0, 1e6])[:, None]
    x[2, :16] = 0  # an all-zero block
    # values on every E2M1 midpoint once the block scale is exactly 2**-2 (input scale 2**-4, amax 1.5)
    midpoints = torch.tensor([1.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2) * 0.25
    x[3, :16] = midpoints * torch.tensor([1.0, -1.0]).repeat_interleave(8)
    x = x.to(torch.bfloat16)
    for input_scale in (2.0**-4, 0.02):
        rounded = serve_clef.round_activations_to_nvfp4(x, torch.tensor(input_scale))
        expected = reference_fake_quant(x, input_scale).to(torch.bfloat16)
        assert torch.equal(rounded.view(torch.int16), expected.view(torch.int16))


E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # by code


def bf16_pair(register: int) -> tuple[float, float]:
    """A 32-bit register read as two BF16 values: (low half, high half)."""
    halves = torch.tensor([register & 0xFFFF, register >> 16], dtype=torch.int32).to(torch.int16)
    return tuple(halves.view(torch.bfloat16).double().tolist())


def bf16_pair_register(low: float, high: float) -> int:
    halves = torch.tensor([low, high], dtype=torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(halves[0] | halves[1] << 16)


def run_ptx(ptx: str, registers: dict[str, int]) -> dict[str, int]:
    """A decode PTX run on 32-bit integers, by what each PTX instruction it uses is specified to do (the GPU runs the
    real thing; Triton's interpreter cannot): `registers` in, every register after the last instruction out."""
    registers = dict(registers)
    value = lambda operand: registers[operand] if operand in registers else int(operand, 0)  # noqa: E731
    for statement in ptx.strip("{}\n").split(";"):
        if not statement.strip() or statement.strip().startswith(".reg"):
            continue
        opcode, operands = statement.split(None, 1)
        target, *sources = [operand.strip() for operand in operands.split(",")]
        if opcode == "mov.b32":
            result = value(sources[0])
        elif opcode == "prmt.b32":  # each result byte i: byte (selector nibble i) of the 8 bytes (a, then b)
            a, b, selector = (value(source) for source in sources)
            pool = (a | b << 32).to_bytes(8, "little")
            result = int.from_bytes(bytes(pool[(selector >> 4 * i) & 7] for i in range(4)), "little")
            assert all((selector >> 4 * i) & 8 == 0 for i in range(4))  # no sign replication used
        elif opcode in ("shl.b32", "shr.b32", "and.b32", "or.b32"):
            a, b = (value(source) for source in sources)
            operation = {"shl.b32": int.__lshift__, "shr.b32": int.__rshift__, "and.b32": int.__and__,
                         "or.b32": int.__or__}[opcode]
            result = operation(a, b) & 0xFFFFFFFF
        elif opcode == "mad.lo.u32":  # the low 32 bits of a * b + c
            a, b, c = (value(source) for source in sources)
            result = (a * b + c) & 0xFFFFFFFF
        elif opcode == "fma.rn.bf16x2":  # per half, a * b + c rounded to BF16 (the products here are exact)
            a, b, c = (bf16_pair(value(source)) for source in sources)
            products = torch.tensor([x * y + z for x, y, z in zip(a, b, c)], dtype=torch.float64)
            halves = products.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
            result = int(halves[0] | halves[1] << 16)
        else:
            raise AssertionError(f"an instruction this test does not know: {statement}")
        registers[target] = result
    return registers


def run_decode_ptx(codes: int, scales: tuple[float, float, float, float]) -> list[int]:
    """DECODE_E2M1_PTX: $0-$3 out, $4 the four code bytes, $5 $6 two BF16 scale pairs."""
    registers = run_ptx(serve_clef.DECODE_E2M1_PTX.value, {"$4": codes, "$5": bf16_pair_register(*scales[:2]),
                                                             "$6": bf16_pair_register(*scales[2:])})
    return [registers[f"${k}"] for k in range(4)]


def test_the_gpu_decode_gives_every_code_times_its_block_scale():
    """Every byte value, with e4m3 block scales from the subnormal 2**-9 to 448: the low nibble (even column) and the
    high nibble (odd column) each come out as e2m1 * block_scale * 2**-8, read off E2M1's table."""
    block_scales = [2.0**-9, 0.0234375, 1.0, 1.125, 3.5, 100.0, 240.0, 448.0]  # e4m3 values
    for first_byte in range(0, 256, 4):
        code_bytes = [first_byte, first_byte + 1, first_byte + 2, first_byte + 3]
        scales = [block_scales[(first_byte // 4 + k) % len(block_scales)] for k in range(4)]
        even_01, even_23, odd_01, odd_23 = run_decode_ptx(
            int.from_bytes(bytes(code_bytes), "little"), tuple(scale * 2.0**118 for scale in scales))
        even = bf16_pair(even_01) + bf16_pair(even_23)
        odd = bf16_pair(odd_01) + bf16_pair(odd_23)
        for k, byte in enumerate(code_bytes):
            assert even[k] == E2M1_VALUES[byte & 0xF] * scales[k] * 2.0**-8, (byte, scales[k])
            assert odd[k] == E2M1_VALUES[byte >> 4] * scales[k] * 2.0**-8, (byte, scales[k])

E4M3_POSITIVE = torch.arange(1, 0x7F, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)  # 2**-9 to 448


def run_fragment_scales_ptx(scale_word: int) -> list[float]:
    """FRAGMENT_SCALES_PTX on one word of four scale bytes ($2; $3-$5 its unused copies) -> its four BF16 scales."""
    out = run_ptx(serve_clef.FRAGMENT_SCALES_PTX.value, {"$2": scale_word, "$3": 0, "$4": 0, "$5": 0})
    return [*bf16_pair(out["$0"]), *bf16_pair(out["$1"])]


def test_every_positive_e4m3_scale_comes_back_from_its_byte_times_2_to_the_118():
    """fragment_scales on every positive e4m3 value, subnormals included, then the kernels' two instructions a pair
    of scales: torch's own e4m3 value times 2**118, exactly; and block_scales_from_fragment_scales undoes it."""
    scale_bytes = serve_clef.fragment_scales(E4M3_POSITIVE)
    assert scale_bytes.dtype == torch.uint8
    for first in range(0, len(E4M3_POSITIVE) - 3, 4):
        word = int.from_bytes(bytes(scale_bytes[first:first + 4].tolist()), "little")
        expected = [value * 2.0**118 for value in E4M3_POSITIVE[first:first + 4].double().tolist()]
        assert run_fragment_scales_ptx(word) == expected
    back = serve_clef.block_scales_from_fragment_scales(scale_bytes)
    assert torch.equal(back.view(torch.uint8), E4M3_POSITIVE.view(torch.uint8))


def test_zero_and_negative_block_scales_become_positive_ones_with_the_same_weights():
    """with_positive_block_scales: the dequantized weights (test_nvfp4's formula) are unchanged, bit for bit, and
    every scale is positive, so that fragment_scales can keep it."""
    generator = torch.Generator().manual_seed(11)
    packed_codes = torch.randint(0, 256, (2, 4, 32), generator=generator, dtype=torch.int16).to(torch.uint8)
    scale_bytes = torch.randint(1, 0x7F, (2, 4, 4), generator=generator, dtype=torch.int16).to(torch.uint8)
    scale_bytes[0, 0, :2] = torch.tensor([0x00, 0x80], dtype=torch.uint8)  # +0 and -0
    scale_bytes[1, 2] |= 0x80  # a row of negative scales
    scale_bytes[1, 3, 1] |= 0x80  # and one beside positive ones
    block_scales = scale_bytes.view(torch.float8_e4m3fn)
    global_scale = torch.tensor([0.5, 3.0])
    codes, scales = serve_clef.with_positive_block_scales(packed_codes, block_scales)
    assert (scales.float() > 0).all()
    assert torch.equal(reference_dequantize(codes, scales, global_scale).view(torch.int16),
                       reference_dequantize(packed_codes, block_scales, global_scale).view(torch.int16))


def fragment_operand_weights(words: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """What the Gluon kernels hand the tensor cores, worked out on CPU: each fragment word (int32 [E, O/64, C/64, 512])
    decoded by FRAGMENT_WORD_PTX with the scales FRAGMENT_SCALES_PTX makes of its rows' scale bytes (uint8
    [E, O, C/16]), and its 8 weights put at the rows and columns the wgmma operand layout gives thread (w, rl, q),
    slice s and element j = p + 2 e + 4 h -> float64 [E, O, C] (each weight times 2**-8)."""
    num_experts, slabs, steps, _ = words.shape
    weights = torch.zeros(num_experts, 64 * slabs, 64 * steps, dtype=torch.float64)
    for expert, slab, step, w, rl, q, s in itertools.product(range(num_experts), range(slabs), range(steps), range(4),
                                                              range(8), range(4), range(4)):
        rows = (64 * slab + 16 * w + rl, 64 * slab + 16 * w + rl + 8)  # e = 0, 1
        scales = [run_fragment_scales_ptx(int.from_bytes(bytes(scale_bytes[expert, row, 4 * step:4 * step + 4]
                                                                .tolist()), "little"))[s] for row in rows]
        registers = {"$4": int(words[expert, slab, step, ((w * 8 + rl) * 4 + q) * 4 + s]) & 0xFFFFFFFF}
        registers.update({f"${5 + k}": 0 for k in range(7)})  # the word's other copies, unused
        # pair k = e + 2 h: both its weights lie in row e
        registers.update({f"${12 + k}": bf16_pair_register(scales[k & 1], scales[k & 1]) for k in range(4)})
        out = run_ptx(serve_clef.FRAGMENT_WORD_PTX.value, registers)
        for j, value in enumerate(value for k in range(4) for value in bf16_pair(out[f"${k}"])):
            p, e, h = j & 1, (j >> 1) & 1, j >> 2
            weights[expert, rows[e], 64 * step + 16 * s + 8 * h + 2 * q + p] = value
    return weights


def test_fragment_words_decode_to_the_weights_where_the_operand_layout_reads_them():
    """fragment_words, fragment_scales and the two decode PTX together, against the layout of Hopper's BF16
    tensor-core operand and E2M1's table: every weight of random codes and scales (subnormal to 448) comes out, at its
    row and column, as e2m1(code) * block_scale * 2**-8; packed_codes_from_fragment_words undoes fragment_words."""
    generator = torch.Generator().manual_seed(5)
    packed_codes = torch.randint(0, 256, (2, 64, 64), generator=generator, dtype=torch.int16).to(torch.uint8)
    block_scales = E4M3_POSITIVE[torch.randint(0, len(E4M3_POSITIVE), (2, 64, 8), generator=generator)]
    words = serve_clef.fragment_words(packed_codes)
    assert words.dtype == torch.int32 and tuple(words.shape) == (2, 1, 2, 512)
    weights = fragment_operand_weights(words, serve_clef.fragment_scales(block_scales))
    expected = reference_dequantize(packed_codes, block_scales, torch.ones(2)).double()  # e2m1 * scale, exact in BF16
    assert torch.equal(weights, expected * 2.0**-8)
    assert torch.equal(serve_clef.packed_codes_from_fragment_words(words), packed_codes)


class RecordedLaunches:
    """Stands in for a Gluon kernel (which cannot run on CPU): records each launch's grid and constexprs, and its
    positional arguments apart."""

    def __init__(self):
        self.launches, self.arguments = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            self.arguments.append(args)
        return launch


@pytest.mark.parametrize("hidden", [192, 256, 320, 384])
def test_the_gluon_down_programs_cover_every_output_column_once(monkeypatch, hidden):
    """With many tokens per expert a down program multiplies a pair of adjacent 64-column slabs (128 columns); a
    hidden size with an odd number of slabs must still be covered, once, by one slab a program."""
    config = tiny_text_config()
    config.hidden_size, config.moe_intermediate_size = hidden, 64
    experts = random_packed_experts(config, has_input_scales=False)
    experts.to_fragment_order()
    gate_up, down = RecordedLaunches(), RecordedLaunches()
    monkeypatch.setattr(serve_clef, "nvfp4_gate_up_fragment_kernel", gate_up)
    monkeypatch.setattr(serve_clef, "nvfp4_down_fragment_kernel", down)
    generator = torch.Generator().manual_seed(5)
    num_tokens = 1200  # 300 pairs per expert: a row of 128-row tiles
    hidden_states = torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16)
    top_k_weights, top_k_index = torch.randn(num_tokens, 8, generator=generator).softmax(-1).topk(2, dim=-1)
    experts.forward_fragments(hidden_states, top_k_index, top_k_weights.to(torch.bfloat16))
    (gate_up_grid, gate_up_constexprs), = gate_up.launches
    (down_grid, down_constexprs), = down.launches
    # gate_up: a program per 64 columns of the width, the columns first; every program one warp group
    assert gate_up_grid[0] * 64 == config.moe_intermediate_size
    assert gate_up_constexprs["num_warps"] == down_constexprs["num_warps"] == 4
    assert down_grid[1] == gate_up_grid[1]  # the same routed tiles, down's slab groups first (side by side)
    # down reads exactly the slots gate_up wrote: both count a tile's pairs against the same rows and smallest rows
    assert all(down_constexprs[name] == gate_up_constexprs[name] for name in ("BLOCK_R", "SMALLEST_ROWS"))
    slab_pairs = down_constexprs["SLAB_PAIRS"]
    assert slab_pairs == (hidden % 128 == 0)
    assert down_grid[0] * (2 if slab_pairs else 1) * 64 == hidden


@pytest.mark.parametrize("simulate_fp4_activations", [False, True], ids=["W4A16", "W4A4"])
def test_the_gluon_down_kernel_starts_right_behind_gate_up(monkeypatch, simulate_fp4_activations):
    """down is launched while gate_up may still run (programmatic stream serialization) and waits in each tile for
    gate_up's columns, counted in the routing's zeroed tile_columns_done; under W4A4 too, since gate_up's epilogue
    rounds the down input (nothing is launched between the two)."""
    config = tiny_text_config()
    config.hidden_size, config.moe_intermediate_size = 128, 64
    experts = random_packed_experts(config, has_input_scales=True)
    experts.to_fragment_order()
    experts.simulate_fp4_activations = simulate_fp4_activations
    gate_up, down = RecordedLaunches(), RecordedLaunches()
    monkeypatch.setattr(serve_clef, "nvfp4_gate_up_fragment_kernel", gate_up)
    monkeypatch.setattr(serve_clef, "nvfp4_down_fragment_kernel", down)
    rounding = RecordedLaunches()
    monkeypatch.setattr(serve_clef, "nvfp4_round_activations_kernel", rounding)
    generator = torch.Generator().manual_seed(6)
    hidden_states = torch.randn(40, 128, generator=generator).to(torch.bfloat16)
    top_k_weights, top_k_index = torch.randn(40, 8, generator=generator).softmax(-1).topk(2, dim=-1)
    experts.forward_fragments(hidden_states, top_k_index, top_k_weights.to(torch.bfloat16))
    (_, gate_up_constexprs), = gate_up.launches
    (_, down_constexprs), = down.launches
    down_input_scale = gate_up.arguments[0][6]  # W4A4: the down input rounded in gate_up's epilogue, with these
    assert down_input_scale is (experts.down_input_scale if simulate_fp4_activations else None)
    assert down_constexprs["launch_pdl"] is True
    assert len(rounding.launches) == (1 if simulate_fp4_activations else 0)  # the gate_up input's, before gate_up


def test_fragment_order_replaces_codes_and_scales_in_the_same_memory():
    """to_fragment_order swaps each projection's codes and block scales for their fragment-order words and scale
    bytes (no more memory), leaves the global and input scales as they were, and the layer's weights (unpacked(), what
    the calibration checks read) stay the same, a zero and a negative block scale included."""
    config = tiny_text_config()
    config.hidden_size, config.moe_intermediate_size = 128, 64
    experts = random_packed_experts(config, has_input_scales=True)
    experts.down_block_scales.view(torch.uint8)[3, 5, :2] = torch.tensor([0x00, 0xB8], dtype=torch.uint8)  # 0, -1
    weights = experts.unpacked()
    before = {name: buffer.clone() for name, buffer in experts.named_buffers()}
    experts.to_fragment_order()
    after = dict(experts.named_buffers())
    for group in ("gate_up", "down"):
        assert f"{group}_packed_codes" not in after and f"{group}_block_scales" not in after
        assert after[f"{group}_fragment_words"].nbytes == before[f"{group}_packed_codes"].nbytes
        assert after[f"{group}_fragment_scales"].nbytes == before[f"{group}_block_scales"].nbytes
    for name in ("gate_up_global_scale", "down_global_scale", "gate_up_input_scale", "down_input_scale"):
        assert torch.equal(after[name], before[name])
    for unpacked, expected in zip(experts.unpacked(), weights):
        assert torch.equal(unpacked.view(torch.int16), expected.view(torch.int16))


def test_routing_pads_each_expert_to_whole_tiles():
    top_k_index = torch.tensor([[3, 3], [1, 0], [3, 7], [0, 1], [7, 3]])  # a repeated expert; experts 2, 4-6 get none
    slot_pairs, tile_experts, _ = serve_clef.route_to_row_tiles(top_k_index, num_experts=8, block_rows=2)
    assert slot_pairs.dtype == tile_experts.dtype == torch.int32
    tiles = slot_pairs.view(-1, 2).tolist()
    expected_tiles = {0: [[3, 6]], 1: [[2, 7]], 3: [[0, 1], [4, 9]], 7: [[5, 8]]}  # pairs (token * 2 + k) in order
    got = {}
    for tile, expert in zip(tiles, tile_experts.tolist()):
        if expert < 8:
            got.setdefault(expert, []).append(tile)
        else:
            assert tile == [-1, -1]  # tiles past the last do nothing
    assert got == expected_tiles
    assert sorted(p for p in slot_pairs.tolist() if p >= 0) == list(range(10))  # every pair exactly once


def reference_top_k_sum(pair_outputs: torch.Tensor, top_k: int, real_tokens: int) -> torch.Tensor:
    """The formula: each token's K pair outputs added one after another in fp32 (pair order), rounded once to BF16;
    zeros for the tokens from real_tokens on."""
    pairs = pair_outputs.float().numpy().reshape(-1, top_k, pair_outputs.shape[1])  # [T, K, H]
    total = np.zeros((pairs.shape[0], pairs.shape[2]), dtype=np.float32)
    for k in range(top_k):
        total = (total + pairs[:, k]).astype(np.float32)
    total[real_tokens:] = 0
    return torch.from_numpy(total).to(torch.bfloat16)


@pytest.mark.parametrize(("num_tokens", "top_k", "hidden", "real_tokens"),
                         [(1, 1, 8, None), (19, 3, 300, None), (576, 8, 64, 517), (40, 8, 2048, 0), (13, 2, 5, 20)],
                         ids=["one pair", "odd sizes", "a bucket's padding", "no real token", "real past the end"])
def test_top_k_sum_equals_the_formula_bit_for_bit(num_tokens, top_k, hidden, real_tokens):
    """sum_top_k against the formula, over wide-ranging values (so the order of the fp32 adds shows in BF16). The
    padding's pair outputs are NaN, as the down kernel leaves them unwritten: they must never be read."""
    generator = torch.Generator().manual_seed(num_tokens * hidden)
    pair_outputs = (torch.randn(num_tokens * top_k, hidden, generator=generator)
                    * 10.0 ** torch.randint(-3, 4, (num_tokens * top_k, 1), generator=generator)).to(torch.bfloat16)
    real = num_tokens if real_tokens is None else min(real_tokens, num_tokens)
    pair_outputs[real * top_k:] = torch.nan
    real_tokens = None if real_tokens is None else torch.tensor([real_tokens], dtype=torch.int32)
    summed = serve_clef.sum_top_k(pair_outputs, top_k, real_tokens)
    expected = reference_top_k_sum(pair_outputs, top_k, real)
    assert summed.shape == (num_tokens, hidden) and summed.dtype == torch.bfloat16
    assert torch.equal(summed.view(torch.int16), expected.view(torch.int16))
    # with the decoder layer's residual added (ResidualInTopKSumLayer): torch's BF16 add of the two, padding included
    residual = (torch.randn(num_tokens, hidden, generator=generator) * 10.0).to(torch.bfloat16)
    with_residual = serve_clef.sum_top_k(pair_outputs, top_k, real_tokens, residual)
    assert torch.equal(with_residual.view(torch.int16), (residual + expected).view(torch.int16))


def tiny_packed_experts(power_of_two_global_scales: bool, seed: int = 0) -> serve_clef.PackedNVFP4Experts:
    return random_packed_experts(tiny_text_config(), True, power_of_two_global_scales, seed)


def routed(num_tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(num_tokens, 64, generator=generator).to(torch.bfloat16)  # [T, H]
    top_k_index = torch.randint(0, 5, (num_tokens, 2), generator=generator)  # [T, K]: experts 5-7 get no tokens
    top_k_index[0] = 4  # the same expert twice for one token
    top_k_weights = torch.rand(num_tokens, 2, generator=generator).softmax(-1).to(torch.bfloat16)  # [T, K]
    return hidden_states, top_k_index, top_k_weights


@pytest.mark.parametrize("simulate_fp4_activations", [False, True], ids=["W4A16", "W4A4"])
@pytest.mark.parametrize("num_tokens", [1, 5, 19])
@torch.no_grad()
def test_kernels_equal_the_unpack_path_bit_for_bit_when_weights_are_exact(num_tokens, simulate_fp4_activations):
    """With power-of-two global scales both paths multiply the same BF16 weights and round at the same places, so
    on CPU (fp32 sums in either order of a few terms) the outputs match to the bit, the W4A4 rounding included."""
    experts = tiny_packed_experts(power_of_two_global_scales=True)
    experts.simulate_fp4_activations = simulate_fp4_activations
    inputs = routed(num_tokens, seed=num_tokens)
    reference = experts.forward_unpacked(*inputs)
    assert reference.abs().mean() > 1e-4  # not a comparison of zeros
    assert torch.equal(experts.forward_packed(*inputs), reference)


@pytest.mark.parametrize("simulate_fp4_activations", [False, True], ids=["W4A16", "W4A4"])
@torch.no_grad()
def test_the_padding_skips_the_experts_and_the_real_tokens_keep_the_unpack_paths_bits(simulate_fp4_activations):
    """While the engine's decoder runs a padded bucket (PackedNVFP4Experts.real_tokens), the tokens past the real
    ones skip the experts: their outputs are zeros, and every real token's is the unpack path's to the bit."""
    experts = tiny_packed_experts(power_of_two_global_scales=True)
    experts.simulate_fp4_activations = simulate_fp4_activations
    inputs = routed(19, seed=11)
    reference = experts.forward_unpacked(*inputs)
    assert reference[:15].abs().mean() > 1e-4 and reference[15:].abs().mean() > 1e-4  # not comparisons of zeros
    experts.real_tokens = torch.tensor([15], dtype=torch.int32)
    output = experts.forward_packed(*inputs)
    assert torch.equal(output[:15], reference[:15])
    assert torch.equal(output[15:], torch.zeros_like(output[15:]))


@pytest.mark.parametrize("tiles", [tiles for _, tiles in serve_clef.EXPERT_TILES], ids=str)
@torch.no_grad()
def test_every_served_tile_shape_gives_the_unpack_paths_bits(tiles, monkeypatch):
    """Each row of EXPERT_TILES, served for every token count, on a routing where one expert gets more pairs than a
    tile has rows: its pairs span several routed tiles, and where the down kernel's tiles are smaller than the routed
    ones, each routed tile is split between several of them."""
    monkeypatch.setattr(serve_clef, "EXPERT_TILES", ((None, tiles),))
    routed_rows, route = [], serve_clef.route_to_row_tiles
    monkeypatch.setattr(serve_clef, "route_to_row_tiles", lambda index, num_experts, rows, real_tokens:
                        routed_rows.append(rows) or route(index, num_experts, rows, real_tokens))
    experts = tiny_packed_experts(power_of_two_global_scales=True)
    hidden_states, top_k_index, top_k_weights = routed(150, seed=7)
    top_k_index[:, 0] = 4  # expert 4: at least 150 pairs
    reference = experts.forward_unpacked(hidden_states, top_k_index, top_k_weights)
    assert reference.abs().mean() > 1e-4  # not a comparison of zeros
    assert torch.equal(experts.forward_packed(hidden_states, top_k_index, top_k_weights), reference)
    assert routed_rows == [tiles.rows]  # the kernels ran the forced row, not the one the table would serve


@torch.no_grad()
def test_kernels_match_transformers_eager_experts_on_any_global_scale():
    experts = tiny_packed_experts(power_of_two_global_scales=False, seed=1)
    config = tiny_text_config()
    config._experts_implementation = "eager"
    stock = Qwen3OmniMoeThinkerTextExperts(config).to(torch.bfloat16)
    stock.gate_up_proj.copy_(reference_dequantize(experts.gate_up_packed_codes, experts.gate_up_block_scales,
                                                  experts.gate_up_global_scale))
    stock.down_proj.copy_(reference_dequantize(experts.down_packed_codes, experts.down_block_scales,
                                               experts.down_global_scale))
    inputs = routed(23, seed=7)
    expected = stock(*inputs).float()
    got = experts.forward_packed(*inputs).float()
    scale = expected.abs().mean().item()
    assert scale > 1e-4  # not a comparison of zeros
    # BF16 noise: the stock module rounds each weight to BF16 and sums the top-k in BF16; the kernels do neither
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()
    assert (got - expected).abs().mean() < 0.01 * scale


def test_the_module_dispatches_by_its_kernels_choice(monkeypatch):
    experts = tiny_packed_experts(power_of_two_global_scales=True)
    calls = []
    monkeypatch.setattr(serve_clef, "nvfp4_gate_up_kernel", None)  # the unpack path must not touch the kernels
    experts.forward(*routed(3, seed=1))
    monkeypatch.undo()
    monkeypatch.setattr(experts, "forward_unpacked", lambda *inputs: calls.append("unpack"))
    experts.kernels = "triton"
    experts.forward(*routed(3, seed=1))
    assert calls == []  # on CPU the triton choice always runs the kernels


@pytest.mark.parametrize("kernels, layout_buffers", [
    ("unpack", {"gate_up_block_scales", "down_block_scales"}),
    ("triton", {"gate_up_block_scales", "down_block_scales"}),
    ("gluon", {"gate_up_fragment_words", "gate_up_fragment_scales", "down_fragment_words", "down_fragment_scales"}),
    ("native", {"gate_up_blocked_scales", "down_blocked_scales"}),
])
def test_each_kernels_choice_lays_the_weights_out_once_as_its_kernels_read_them(kernels, layout_buffers, monkeypatch):
    """use_kernels: the gluon kernels read the codes in their fragment order, the native ones the block scales in
    the tensor cores' tiles, the others the checkpoint's layout; each layout holds the same weights. Only the Triton
    and gluon kernels are compiled at load."""
    config = tiny_text_config()
    config.hidden_size, config.moe_intermediate_size = 128, 64  # whole fragments for the gluon layout
    experts = random_packed_experts(config, has_input_scales=True)
    weights = experts.unpacked()
    experts.use_kernels(kernels)
    names = {name for name, _ in experts.named_buffers()}
    assert experts.kernels == kernels and layout_buffers <= names
    other_layouts = {"gate_up_block_scales", "gate_up_fragment_words", "gate_up_blocked_scales"} - layout_buffers
    assert not other_layouts & names
    assert all(torch.equal(got, want) for got, want in zip(experts.unpacked(), weights, strict=True))
    calls = []  # what compile_kernels runs, recorded instead of run
    for forward in ("forward_packed", "forward_fragments", "forward_native", "forward_unpacked"):
        monkeypatch.setattr(experts, forward, lambda *inputs, forward=forward: calls.append(forward))
    experts.compile_kernels()
    assert set(calls) == {"triton": {"forward_packed"}, "gluon": {"forward_fragments"}}.get(kernels, set())


def test_expert_kernels_choice_is_checked_at_load(monkeypatch):
    def kernels(choice, device="cpu"):
        return serve_clef.resolve_expert_kernels(choice, torch.device(device))

    assert kernels("auto") == "unpack"
    assert kernels("unpack") == "unpack"
    assert kernels("triton") == "triton"  # TRITON_INTERPRET=1 in the tests
    with pytest.raises(serve_clef.CheckpointError, match="FP4 tensor cores"):
        kernels("native")
    with pytest.raises(serve_clef.CheckpointError, match="needs a Hopper GPU"):
        kernels("gluon")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(serve_clef.CheckpointError, match="TRITON_INTERPRET=1"):
        kernels("triton")


def test_auto_takes_the_gluon_kernels_on_hopper_when_the_sizes_fit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    fitting, odd = tiny_text_config(), tiny_text_config()
    fitting.hidden_size, fitting.moe_intermediate_size = 2048, 768
    odd.hidden_size, odd.moe_intermediate_size = 2048, 96
    assert serve_clef.resolve_expert_kernels("auto", cuda, fitting) == "gluon"
    assert serve_clef.resolve_expert_kernels("auto", cuda, odd) == "triton"
    assert serve_clef.resolve_expert_kernels("gluon", cuda, fitting) == "gluon"
    with pytest.raises(serve_clef.CheckpointError, match="multiples of 64"):
        serve_clef.resolve_expert_kernels("gluon", cuda, odd)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert serve_clef.resolve_expert_kernels("auto", cuda, fitting) == "triton"


def load_tiny(flags):
    args = serve_clef.parse_args(["--model", "synthetic", "--device", "cpu", *flags])
    return serve_clef.load_from_args(args, progress=lambda line: None)


@torch.no_grad()
def test_the_engine_s_padding_skips_the_kernels(monkeypatch):
    """A decision runs its record padded to a bucket: every layer's routing is told the record's length, so the
    padding's pairs take no slot, and the experts are told nothing once the decoder has run."""
    loaded = load_tiny(["--expert-kernels", "triton"])
    routings, route = [], serve_clef.route_to_row_tiles

    def recorded_route(top_k_index, num_experts, block_rows, real_tokens):
        routings.append((top_k_index.shape[0], None if real_tokens is None else int(real_tokens)))
        return route(top_k_index, num_experts, block_rows, real_tokens)

    monkeypatch.setattr(serve_clef, "route_to_row_tiles", recorded_route)
    request = {"model": "clef-omni", "state": "The parcel came late.", "questions": {"late": {"type": "noul"}}}
    tokens = serve_clef.decide(loaded, request, 4096)["usage"]["input_tokens"]
    bucket = min(bucket for bucket in serve_clef.DECODER_BUCKETS if bucket >= tokens)
    assert bucket > tokens  # padding to skip
    layers = loaded.model.thinker.config.text_config.num_hidden_layers
    assert routings == [(bucket, tokens)] * layers
    assert all(module.real_tokens is None for module in loaded.model.modules()
               if isinstance(module, serve_clef.PackedNVFP4Experts))


@torch.no_grad()
def test_tiny_model_answers_the_same_with_the_kernels():
    request = {
        "model": "clef-omni",
        "state": {"ticket": "The parcel came late and the box was crushed.", "orders": 3},
        "questions": {
            "team": {"type": "choice", "criteria": {"billing": None, "shipping": None, "support": None}},
            "late": {"type": "noul"},
            "anger": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
        },
    }
    answers = {}
    for choice in ("unpack", "triton"):
        for flags in ([], ["--simulate-fp4-activations"]):
            loaded = load_tiny(["--expert-kernels", choice, *flags])
            assert loaded.expert_kernels == choice
            answers[choice, bool(flags)] = serve_clef.decide(loaded, request, 4096)["answers"]
    # The unpack path rounds every weight times its global scale to BF16, the kernels keep e2m1 * block scale exact
    # and scale the sum: BF16-level differences, which a random two-layer model carries through to the answers as
    # up to ~0.006 (bit equality, where both paths see the same weights, is checked layer by layer above).
    for w4a4 in (False, True):
        unpack, triton_answers = answers["unpack", w4a4], answers["triton", w4a4]
        for question in ("team", "anger"):
            for option, probability in unpack[question]["probabilities"].items():
                assert abs(triton_answers[question]["probabilities"][option] - probability) < 0.01
        assert abs(triton_answers["late"]["noul"] - unpack["late"]["noul"]) < 0.01


def _sass_loop(*instructions: str) -> str:
    """A loop as nvdisasm prints one: each instruction with its address comment, under a label its branch returns to."""
    lines = [".L_x_1:"] + [f"        /*{16 * i:04x}*/   {text} ;   /* 0x000fe20000000000 */"
                           for i, text in enumerate(instructions + ("@P0 BRA `(.L_x_1)",))]
    return "\n".join(lines)


def inspect_gluon_kernels():
    """bench/inspect_gluon_kernels.py as a module (its SASS helpers need no GPU and no triton 3.6)."""
    script = Path(__file__).parents[1] / "bench" / "inspect_gluon_kernels.py"
    spec = importlib.util.spec_from_file_location("inspect_gluon_kernels", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sass_check_finds_writes_into_operands_of_products_in_flight():
    """bench/inspect_gluon_kernels.py's check, against the rule it enforces: an asynchronous HGMMA reads its A operand
    (four registers) until a WARPGROUP.DEPBAR.LE gsb0, N leaves at most N groups in flight, so a write into those
    registers before that, in this iteration or the next, is a race."""
    inspect = inspect_gluon_kernels()
    products = ("WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR20], R24",
                "HGMMA.64x64x16.F32.BF16 R24, R60, gdesc[UR24], R24, gsb0")
    # the next step's weights moved into the registers the products read, with one group left in flight: a race
    racing = _sass_loop("IMAD.MOV.U32 R57, RZ, RZ, R90", *products, "WARPGROUP.DEPBAR.LE gsb0, 0x1")
    assert inspect.in_flight_operand_writes(racing) == ["IMAD.MOV.U32 R57, RZ, RZ, R90"]
    # the same after waiting for every group, or into registers no product reads: none
    assert inspect.in_flight_operand_writes(racing.replace("gsb0, 0x1", "gsb0, 0x0")) == []
    assert inspect.in_flight_operand_writes(racing.replace("R57, RZ", "R80, RZ")) == []
    # a 16-byte load covers four registers: R61-R64 overlaps the second product's R60-R63
    wide = _sass_loop(*products, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "LDG.E.128 R61, desc[UR16][R16.64]")
    assert inspect.in_flight_operand_writes(wide) == ["LDG.E.128 R61, desc[UR16][R16.64]"]
    # a write after the products are issued but before the wait, in the same iteration, races too
    before_wait = _sass_loop(*products, "LOP3.LUT R56, R1, 0xf, RZ, 0xc0, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert inspect.in_flight_operand_writes(before_wait) == ["LOP3.LUT R56, R1, 0xf, RZ, 0xc0, !PT"]


def test_the_sass_count_takes_the_loop_of_products_not_a_wait_on_an_mbarrier():
    """bench/inspect_gluon_kernels.py counts the instructions of a step in the last loop that issues tensor-core
    products; a wait on an mbarrier (a try-wait and a branch back to it) is a loop too, and may come after it."""
    inspect = inspect_gluon_kernels()
    step = _sass_loop("LDS.128 R60, [R12+0x8000]", "WARPGROUP.ARRIVE",
                      "HGMMA.64x64x16.F32.BF16 R24, R60, gdesc[UR24], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    wait = "\n".join([".L_x_2:", "        /*0100*/   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R13+URZ+0xa000], R14 ;",
                      "        /*0110*/   @!P0 BRA `(.L_x_2) ;"])
    assert inspect.loop_instructions(step + "\n" + wait) == 5  # four instructions and the branch back
