"""bench/expert_kernel_lab.py's variants on CPU (Triton's interpreter, set in conftest.py): each equals serve_clef's
current packed-expert kernels bit for bit when every weight is exact in BF16 (power-of-two global scales), and the
half-split layout and the PTX decoder's bit logic hold against plain indexing and the E2M1 table."""

import sys
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import expert_kernel_lab as lab  # noqa: E402


def test_half_split_layout_and_decoder_logic():
    assert lab.check_half_split_codes() == 0
    assert lab.check_decode_asm_logic() == 0


@pytest.mark.parametrize("variant", list(lab.VARIANTS))
@torch.no_grad()
def test_variant_equals_the_current_kernels_bit_for_bit(variant):
    config = Qwen3OmniMoeTextConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    layer = lab.random_layer(config, "cpu", power_of_two_global_scales=True, seed=1)
    inputs = lab.routed_inputs(config, 7, "cpu", seed=7)
    reference = layer.forward_packed(*inputs)
    assert reference.abs().mean() > 1e-4  # not a comparison of zeros
    tiles = lab.LabTiles(16, 16, 32, 4, 3, columns_first=True)
    output = lab.forward_variant(lab.HalfSplitLayer.of(layer), lab.VARIANTS[variant], tiles, *inputs)
    assert torch.equal(output.view(torch.int16), reference.view(torch.int16))
