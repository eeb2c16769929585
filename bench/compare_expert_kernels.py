"""Time this tree's packed-expert kernels against another version of serve_clef.py, side by side in one run (H200).

Both run on the same random full-size layer (128 experts, hidden 2048, width 768, top-8) and the same routed inputs,
each as served (its own EXPERT_TILES) and captured in a CUDA graph, as the engine runs a layer. First, each version's
output is compared with the unpack path on a layer with power-of-two global scales, where every weight is exact in
BF16 on both paths: a mean error above 1e-4 of the mean output counts as a failure (the exit status).

Usage: git show REV:serve_clef.py > bench/other_serve_clef.py
       python3 bench/compare_expert_kernels.py bench/other_serve_clef.py   (writes $OUT/compare_expert_kernels.json)
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_expert_kernels  # noqa: E402
import serve_clef  # noqa: E402  (check_expert_kernels put the repository on the path)

TOKEN_COUNTS = (1, 64, 512, 2048, 8192)
EXACT_MEAN_ERROR = 1e-4  # of the mean output, with power-of-two global scales


def main() -> int:
    other_path = Path(sys.argv[1])
    other = check_expert_kernels.other_version(other_path)
    versions = {"this tree": serve_clef.PackedNVFP4Experts.forward_packed,
                other_path.name: other.PackedNVFP4Experts.forward_packed}
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "other": str(other_path),
              "exact": {}, "milliseconds": {}}
    failures = 0

    exact_layer = check_expert_kernels.random_layer(True, seed=2)
    for name, forward_packed in versions.items():
        for num_tokens in (7, 512):
            inputs = check_expert_kernels.routed_inputs(num_tokens, seed=num_tokens)
            reference = exact_layer.forward_unpacked(*inputs).float()
            error = ((forward_packed(exact_layer, *inputs).float() - reference).abs().mean()
                     / reference.abs().mean()).item()
            failures += not error <= EXACT_MEAN_ERROR
            report["exact"][f"{name}, {num_tokens} tokens"] = error
            print(f"{name}: {num_tokens} tokens, mean |err| against unpack {error:.2e} of mean |out| "
                  f"(gate {EXACT_MEAN_ERROR})", flush=True)
    del exact_layer

    layer = check_expert_kernels.random_layer(False, seed=3)
    for num_tokens in TOKEN_COUNTS:
        inputs = check_expert_kernels.routed_inputs(num_tokens, seed=10 + num_tokens)
        row = {name: check_expert_kernels.graph_ms(lambda: forward_packed(layer, *inputs))
               for name, forward_packed in versions.items()}
        report["milliseconds"][num_tokens] = row
        print(f"{num_tokens:5} tokens: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in row.items()), flush=True)

    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "compare_expert_kernels.json").write_text(json.dumps(report, indent=2))
    print("FAILED" if failures else "both versions exact against unpack")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
