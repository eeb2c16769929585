"""Lab (GPU): the decoder's attention projections under torch's BLAS back-ends, to see whether the one torch picks by
default leaves the output projection's tiles short of the GPU at a one-record decision's lengths.

At 516 tokens (the 576-token bucket) the 48 output projections ([T, 4096] x [4096, 2048]) took 1.20 ms of a
decision's 16.3 ms of GPU work on an H100, about 390 TFLOP/s, where the fused q, k, v projection ([T, 2048] x
[2048, 5120]) ran at about 620 (docs/benchmarks.md): 576 x 2048 outputs are 72 tiles of 128 x 128 for 132
multiprocessors. Timed here, 48 layers' weights in a CUDA graph as served, at the buckets of one record to 16: the
default back-end, cuBLASLt (`torch.backends.cuda.preferred_blas_library`), and each with BF16 reductions in reduced
precision refused (which steers cuBLAS's split-K choice); outputs compared with the default's (bit-equal share, max
difference in BF16 steps of the largest output).

Usage (GPU): python3 bench/lab_projections.py   (writes $OUT/lab_projections.json when OUT is set)
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_expert_kernels as check  # noqa: E402  (bench/: CUDA-graph timing)

TOKENS = (576, 1024, 2176, 8192)
LAYERS = 48
PROJECTIONS = {"o_proj": (4096, 2048), "qkv_proj": (2048, 5120)}  # (in, out) features at full size


def main() -> int:
    generator = torch.Generator("cuda").manual_seed(0)
    report = {"gpu": torch.cuda.get_device_name(), "rows": []}
    default_library = torch.backends.cuda.preferred_blas_library()
    settings = {
        "default": (default_library, True),
        "cublaslt": (torch._C._BlasBackend.Cublaslt, True),
        "default, no reduced-precision reductions": (default_library, False),
        "cublaslt, no reduced-precision reductions": (torch._C._BlasBackend.Cublaslt, False),
    }
    for name, (features_in, features_out) in PROJECTIONS.items():
        weights = [(torch.randn(features_out, features_in, device="cuda", generator=generator) * 0.02).to(
            torch.bfloat16) for _ in range(LAYERS)]
        for tokens in TOKENS:
            inputs = torch.randn(tokens, features_in, device="cuda", generator=generator).to(torch.bfloat16)
            reference = None
            row = {"projection": name, "tokens": tokens}
            for setting, (library, reduced) in settings.items():
                torch.backends.cuda.preferred_blas_library(library)
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
                outputs = torch.nn.functional.linear(inputs, weights[0])
                milliseconds = check.graph_ms(lambda: [torch.nn.functional.linear(inputs, w) for w in weights])
                if reference is None:
                    reference = outputs
                # the largest difference in BF16 steps (2**-7) of the largest output
                steps = ((outputs.float() - reference.float()).abs().max() / (reference.float().abs().max() * 2**-7)
                         ).item()
                flops = 2 * tokens * features_in * features_out * LAYERS
                row[setting] = {"ms": milliseconds, "tflops": flops / milliseconds / 1e9,
                                "bit_equal_share": (outputs == reference).float().mean().item(),
                                "max_difference_bf16_steps": steps}
                print(f"{name} at {tokens:5} tokens, 48 layers, {setting}: {milliseconds:.3f} ms "
                      f"({row[setting]['tflops']:.0f} TFLOP/s), {row[setting]['bit_equal_share']:.3f} bit-equal to "
                      f"the default, up to {steps:.2f} BF16 steps of the largest output apart", flush=True)
            report["rows"].append(row)
    torch.backends.cuda.preferred_blas_library(default_library)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    if out_dir := os.environ.get("OUT"):
        Path(out_dir, "lab_projections.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
