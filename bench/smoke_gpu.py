"""A one-minute GPU check of the paths that run only on CUDA, for when there is no time for the full checks.

1. The Triton routing (`route_to_row_tiles`) equals the plain reference of tests/test_routing_kernel.py bit for bit
   at full size (128 experts, top-8, 516 and 8,192 tokens, every row tile).
2. On a random full-size layer with power-of-two global scales (every weight exact in BF16), the packed kernels,
   routed by it, give the unpack path's output to summation-order noise, at 516 and 8,192 tokens.
3. The tiny synthetic model loads on CUDA as served (the text decoder's graphs captured, the batched joint head
   checked at load and serving, both embedding tables on the host unless tied), answers text, image and video
   requests, and scores each twice to the same bits (its raw option logits).

Usage: python3 bench/smoke_gpu.py   (exit status 1 when a check fails)
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
import serve_clef  # noqa: E402
import synthetic_release  # noqa: E402
from bench_serve import QUESTIONS  # noqa: E402
from check_expert_kernels import random_layer, routed_inputs  # noqa: E402
from test_routing_kernel import reference_row_tiles  # noqa: E402


def main() -> int:
    checks = {}
    for num_tokens in (516, 8192):
        top_k_index = routed_inputs(num_tokens, seed=num_tokens)[1]
        for block_rows in (16, 32, 64, 128):
            routed = serve_clef.route_to_row_tiles(top_k_index, 128, block_rows)
            expected = reference_row_tiles(top_k_index.cpu(), 128, block_rows)
            checks[f"routing, {num_tokens} tokens, tiles of {block_rows}"] = all(
                torch.equal(got.cpu(), want) for got, want in zip(routed, expected))

    layer = random_layer(power_of_two_global_scales=True, seed=1)
    for num_tokens in (516, 8192):
        inputs = routed_inputs(num_tokens, seed=100 + num_tokens)
        packed, unpacked = layer.forward_packed(*inputs).float(), layer.forward_unpacked(*inputs).float()
        relative = ((packed - unpacked).abs().mean() / unpacked.abs().mean()).item()
        print(f"kernels vs unpack, {num_tokens} tokens: mean error {relative:.2e} of the mean output")
        checks[f"kernels vs unpack, {num_tokens} tokens"] = relative <= 1e-4
    del layer

    lines = []
    loaded = serve_clef.load_clef("synthetic", device="cuda", progress=lines.append)
    print("\n".join(f"    {line}" for line in lines))
    checks["batched joint head serves"] = isinstance(loaded.model.head, serve_clef.BatchedJointSchemaHead)
    decoder = next(module for module in loaded.model.modules() if isinstance(module, serve_clef.PackedTextDecoder))
    checks["the text decoder's graphs captured"] = len(decoder.graphs) > 0
    input_embeddings = decoder.decoder.embed_tokens
    tied = not isinstance(input_embeddings, serve_clef.HostEmbedding) and (
        input_embeddings.weight is loaded.model.output_embeddings.weight)
    checks["embedding tables on the host (unless tied)"] = tied or (
        isinstance(input_embeddings, serve_clef.HostEmbedding)
        and isinstance(loaded.model.output_embeddings, serve_clef.HostEmbedding))

    def data_url(content_type: str, data: bytes) -> str:
        import base64
        return f"data:{content_type};base64,{base64.b64encode(data).decode()}"

    base = {"model": "clef-omni", "state": "The parcel came late. " * 40, "questions": QUESTIONS}
    requests = [base, {**base, "images": [data_url("image/png", synthetic_release.synthetic_png(320, 240))]},
                {**base, "videos": [data_url("video/mp4", synthetic_release.synthetic_mp4(True, seconds=2))]}]
    checks["tiny model: text, image, video answered"] = all(
        serve_clef.decide(loaded, request)["answers"].keys() == QUESTIONS.keys() for request in requests)
    encoded = [serve_clef.prepare(loaded, request, 4096).encoded for request in requests]
    first, second = ([serve_clef.score_records(loaded, [record])[0] for record in encoded] for _ in range(2))
    checks["tiny model: text, image, video bit-identical twice (raw option logits)"] = all(
        torch.equal(a, b) for record_a, record_b in zip(first, second) for a, b in zip(record_a, record_b))
    for name, passed in checks.items():
        print(f"{name}: {'ok' if passed else 'FAILED'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
