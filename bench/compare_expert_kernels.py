"""Time this tree's packed-expert kernels against another version of serve_clef.py, side by side in one run (H200).

Both run the same random full-size weights (128 experts, hidden 2048, width 768, top-8), each version in a layer of
its own class (as it keeps them), on the same routed inputs, each as served (its own tile tables) and captured in a
CUDA graph, as the engine runs a layer: the Triton kernels, and on a Hopper GPU the gluon kernels (the layer's codes
then in fragment order); and whether the two versions' outputs agree bit for bit on each timed input. First, each
version's output is compared with the unpack path on a layer with power-of-two global scales, where every weight is
exact in BF16 on both paths: a mean error above 1e-4 of the mean output counts as a failure (the exit status).

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

TOKEN_COUNTS = (1, 64, 512, 1024, 2048, 3072, 4096, 6144, 8192)
EXACT_MEAN_ERROR = 1e-4  # of the mean output, with power-of-two global scales
# kernel set -> (the layer's method that runs it, whether it reads the codes in fragment order)
KERNEL_SETS = {"triton": ("forward_packed", False), "gluon": ("forward_fragments", True)}


def main() -> int:
    other_path = Path(sys.argv[1])
    other = check_expert_kernels.other_version(other_path)
    kernel_sets = KERNEL_SETS if torch.cuda.get_device_capability() == (9, 0) else {"triton": KERNEL_SETS["triton"]}
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "other": str(other_path),
              "exact": {}, "milliseconds": {}, "bit_identical": {}}
    failures = 0

    for kernels, (method, fragment_order) in kernel_sets.items():
        # each version runs on a layer of its own class (the two may keep the weights differently), the same weights
        versions = {f"this tree, {kernels}": serve_clef, f"{other_path.name}, {kernels}": other}
        unpacked = check_expert_kernels.random_layer(True, seed=2)
        references = {num_tokens: unpacked.forward_unpacked(*check_expert_kernels.routed_inputs(
            num_tokens, seed=num_tokens)).float() for num_tokens in (7, 512)}
        del unpacked
        layers = {}
        for name, version in versions.items():
            exact_layer = check_expert_kernels.random_layer(True, seed=2, version=version)
            layers[name] = check_expert_kernels.random_layer(False, seed=3, version=version)
            if fragment_order:
                exact_layer.to_fragment_order()
                layers[name].to_fragment_order()
            for num_tokens, reference in references.items():
                inputs = check_expert_kernels.routed_inputs(num_tokens, seed=num_tokens)
                error = ((getattr(exact_layer, method)(*inputs).float() - reference).abs().mean()
                         / reference.abs().mean()).item()
                failures += not error <= EXACT_MEAN_ERROR
                report["exact"][f"{name}, {num_tokens} tokens"] = error
                print(f"{name}: {num_tokens} tokens, mean |err| against unpack {error:.2e} of mean |out| "
                      f"(gate {EXACT_MEAN_ERROR})", flush=True)
            del exact_layer

        for num_tokens in TOKEN_COUNTS:
            inputs = check_expert_kernels.routed_inputs(num_tokens, seed=10 + num_tokens)
            row = {name: check_expert_kernels.graph_ms(lambda layer=layer: getattr(layer, method)(*inputs))
                   for name, layer in layers.items()}
            report["milliseconds"].setdefault(num_tokens, {}).update(row)
            # a change that only reorganises the launches (not the sums) should leave every bit as it was
            outputs = [getattr(layer, method)(*inputs) for layer in layers.values()]
            identical = torch.equal(*outputs)
            report["bit_identical"].setdefault(num_tokens, {})[kernels] = identical
            print(f"{num_tokens:5} tokens: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in row.items())
                  + f"; outputs {'identical' if identical else 'differ'} bit for bit", flush=True)
        del layers

    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "compare_expert_kernels.json").write_text(json.dumps(report, indent=2))
    print("FAILED" if failures else "both versions exact against unpack")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
