"""GPU check of serve_clef's packed NVFP4 experts at Clef-Omni size, on a CUDA machine (here: the H200).

1. `serve_clef.unpack_nvfp4_compiled` (torch.compile) equals the eager `unpack_nvfp4` as numbers on one full-size
   layer (128 experts, hidden 2048, width 768; bit patterns may differ only in the sign of zero, E2M1 code 8), and
   its time per layer (target: well under the 8.4 ms of the stock torch LUT unpack, near the ~0.4 ms bandwidth floor).
2. The compiled activation replay (`fake_quant_nvfp4_activations_compiled`, what CUDA runs) equals ModelOpt's Triton
   W4A4 fake-quant kernel (`fp4_fake_quant_block`) in every value when nvidia-modelopt is installed (carry its wheel;
   skipped otherwise). ModelOpt's kernel divides with Triton's `/`, eager torch with IEEE division, so the eager replay
   (used on CPU) may differ from it, and the compiled replay from the eager one, but only by one E2M1 step, in under
   1% of the values (values right at a rounding boundary): both counted so, the latter at two token counts and with
   one input scale per row (an expert's own).
3. Time of one packed layer forward on the unpack path (`PackedNVFP4Experts.forward_unpacked`) at 512 tokens, top-8;
   the Triton kernels are checked and timed by bench/check_expert_kernels.py.

Usage: python bench/check_nvfp4_gpu.py   (exit status 1 when any printed comparison fails; timings are not checked)
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef


def cuda_ms(function, repeats: int = 20) -> float:
    """Median CUDA time of function() in milliseconds, after warm-up."""
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def e2m1_positions(replayed: torch.Tensor, activations: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Signed index (-7..7) on the E2M1 grid of each replayed value [..., K], in units of its block's scale, the
    block scales rebuilt from the activations by docs/nvfp4-format.md §2.3."""
    blocks = activations.float().unflatten(-1, (-1, 16))  # [..., K/16, 16]
    block_scales = (blocks.abs().amax(-1, keepdim=True) / (6.0 * input_scale)).clamp(max=448.0)
    block_scales = block_scales.to(torch.float8_e4m3fn).float() * input_scale  # [..., K/16, 1]
    block_scales = torch.where(block_scales >= 1e-5, block_scales, 1.0)
    values = replayed.float().unflatten(-1, (-1, 16))
    grid = torch.tensor(serve_clef.E2M1_MAGNITUDES, device=replayed.device)
    index = ((values.abs() / block_scales)[..., None] - grid).abs().argmin(-1)  # [..., K/16, 16]
    return (values.sign() * index).flatten(-2)


def replays_agree(label: str, ours: torch.Tensor, theirs: torch.Tensor, activations: torch.Tensor,
                  input_scale: torch.Tensor, exact: bool) -> bool:
    """Print and judge one replay comparison: exact, or apart only by one E2M1 step in under 1% of the values."""
    differ = int((ours != theirs).sum())
    steps = int((e2m1_positions(ours, activations, input_scale)
                 - e2m1_positions(theirs, activations, input_scale)).abs().max())
    largest = (ours.float() - theirs.float()).abs().max().item()
    agree = differ == 0 if exact else (steps <= 1 and differ < 0.01 * ours.numel())
    print(f"{label}: {differ} of {ours.numel()} values differ, by at most {steps} E2M1 step(s) (largest difference "
          f"{largest:.4g}; allowed: {'none' if exact else 'one step in under 1%'}): {'OK' if agree else 'FAILED'}")
    return agree


def main() -> int:
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    text_config = Qwen3OmniMoeTextConfig(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8
    )
    with torch.device(device):
        experts = serve_clef.PackedNVFP4Experts(text_config, F.silu, has_input_scales=True)
    for name in ("gate_up", "down"):
        codes = getattr(experts, f"{name}_packed_codes")
        codes.copy_(
            torch.randint(0, 256, codes.shape, generator=generator, device=device, dtype=torch.int16).to(torch.uint8)
        )
        scales = getattr(experts, f"{name}_block_scales")
        scales.copy_((torch.rand(scales.shape, generator=generator, device=device) * 100 + 20).to(torch.float8_e4m3fn))
        getattr(experts, f"{name}_global_scale").view(128, -1).copy_(  # gate_up: [E, 2], gate and up alike
            torch.rand(128, 1, generator=generator, device=device) * 1e-4 + 5e-5
        )
    experts.gate_up_input_scale.fill_(3.0 / (6 * 448))
    experts.down_input_scale.fill_(0.05 / (6 * 448))
    failures, not_run = 0, []  # not_run: checks that could not run here, named in the last line

    packed = (experts.gate_up_packed_codes, experts.gate_up_block_scales, experts.gate_up_global_scale)
    packed_down = (experts.down_packed_codes, experts.down_block_scales, experts.down_global_scale)
    start = time.perf_counter()
    compiled = serve_clef.unpack_nvfp4_compiled(*packed)
    torch.cuda.synchronize()
    print(f"torch.compile of unpack_nvfp4: {time.perf_counter() - start:.1f} s")
    eager = serve_clef.unpack_nvfp4(*packed)
    # As numbers (-0 == +0): what a matmul sees. Bit for bit, code 8 (E2M1 -0) may come out as +0 once compiled.
    same = torch.equal(compiled, eager)
    bits_differ = compiled.view(torch.int16) != eager.view(torch.int16)
    signed_zeros = bits_differ & (compiled == 0) & (eager == 0)
    only_zero_signs = int(bits_differ.sum()) == int(signed_zeros.sum())
    failures += not (same and only_zero_signs)
    print(f"compiled unpack == eager unpack as numbers: {same}; bit patterns differ in {int(bits_differ.sum())} of "
          f"{compiled.numel()} values, {int(signed_zeros.sum())} of them only in the sign of zero: "
          f"{'OK' if same and only_zero_signs else 'FAILED'}")
    eager_ms = cuda_ms(lambda: (serve_clef.unpack_nvfp4(*packed), serve_clef.unpack_nvfp4(*packed_down)))
    compiled_ms = cuda_ms(
        lambda: (serve_clef.unpack_nvfp4_compiled(*packed), serve_clef.unpack_nvfp4_compiled(*packed_down))
    )
    packed_bytes = sum(tensor.nbytes for tensor in (*packed, *packed_down))
    bf16_bytes = compiled.nbytes + serve_clef.unpack_nvfp4(*packed_down).nbytes
    print(
        f"unpack one layer (gate_up + down): eager {eager_ms:.2f} ms, compiled {compiled_ms:.2f} ms "
        f"({packed_bytes / 2**20:.0f} MiB packed in, {bf16_bytes / 2**20:.0f} MiB BF16 out)"
    )

    activations = (torch.randn(512, 2048, generator=generator, device=device) * 3).to(torch.bfloat16)
    try:
        from modelopt.torch.kernels.quantization.gemm.fp4_kernel_hopper import fp4_fake_quant_block
    except ImportError as error:  # not run is not passed: the final line says so
        not_run.append(f"the activation replay vs ModelOpt's fp4_fake_quant_block ({error})")
        print(f"ModelOpt fake-quant comparison NOT RUN ({error})")
    else:
        global_amax = torch.tensor(11.0, device=device)  # calibrated activation amax
        input_scale = global_amax.float() / (6.0 * 448.0)  # what the exporter writes, as the kernel derives it
        theirs = fp4_fake_quant_block(activations, global_amax)
        for label, replay, exact in (("compiled", serve_clef.fake_quant_nvfp4_activations_compiled, True),
                                     ("eager", serve_clef.fake_quant_nvfp4_activations, False)):
            failures += not replays_agree(f"{label} activation replay vs ModelOpt fp4_fake_quant_block",
                                          replay(activations, input_scale), theirs, activations, input_scale, exact)
    input_scale = torch.tensor(11.0 / (6 * 448), device=device)
    for rows in (512, 77):  # compiled with dynamic shapes: token counts vary per request
        x = activations[:rows]
        per_row = torch.linspace(0.5, 2.0, rows, device=device)[:, None, None] * input_scale  # [S, 1, 1]
        for label, scale in (("shared input scale", input_scale), ("an input scale per row", per_row)):
            failures += not replays_agree(
                f"compiled activation replay vs eager, {rows} tokens, {label}",
                serve_clef.fake_quant_nvfp4_activations_compiled(x, scale),
                serve_clef.fake_quant_nvfp4_activations(x, scale), x, scale, exact=False)
    eager_ms = cuda_ms(lambda: serve_clef.fake_quant_nvfp4_activations(activations, input_scale))
    compiled_ms = cuda_ms(lambda: serve_clef.fake_quant_nvfp4_activations_compiled(activations, input_scale))
    print(f"activation replay of [512, 2048]: eager {eager_ms:.3f} ms, compiled {compiled_ms:.3f} ms")

    top_k_weights, top_k_index = torch.rand(512, 128, generator=generator, device=device).softmax(-1).topk(8, dim=-1)
    for simulate in (False, True):
        experts.simulate_fp4_activations = simulate
        routing = (activations, top_k_index, top_k_weights.to(torch.bfloat16))
        forward_ms = cuda_ms(lambda: experts.forward_unpacked(*routing))
        print(f"packed layer forward (unpack path), 512 tokens, top-8, simulate_fp4_activations={simulate}: "
              f"{forward_ms:.2f} ms")
    if failures:
        print("FAILED")
    elif not_run:
        print("OK for what ran; NOT RUN: " + "; ".join(not_run))
    else:
        print("OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
