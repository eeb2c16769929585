"""GPU check of the engine's CUDA-graphed text decoder on `synthetic:full`, with the noise floor it is judged by.

On new requests (text of 90 to 3,000 tokens, image, audio, video), the answers of one loaded model are compared
across four ways of running its text decoder:

- eager, with cuDNN attention (as before the engine);
- eager, without cuDNN attention (what the engine allows);
- padded to the request's bucket, eager;
- padded, replayed from the bucket's CUDA graph (as served).

The first pair differs only in the attention kernel: that difference is the BF16 noise floor on this random model,
and the graphs are gated against it (max |dp| of graphs vs eager at most twice the floor, plus 0.005). Then
first-sight latency and a profile of one new 516-token decision, served with the graphs.

Usage: python3 bench/check_engine_gpu.py   (exit status 1 when a gate fails)
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402
from bench_serve import media_requests, profile_decision, swap_text_decoder, text_request, timed_decision  # noqa: E402


def largest_difference(answers_a: list[dict], answers_b: list[dict]) -> float:
    largest = 0.0
    for first, second in zip(answers_a, answers_b):
        for question_id, answer in first.items():
            for option, probability in answer.get("probabilities", {"true": answer.get("noul")}).items():
                other = second[question_id].get("probabilities", {"true": second[question_id].get("noul")})
                largest = max(largest, abs(probability - other[option]))
    return largest


def main() -> int:
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: print("   ", line, flush=True))
    tokenizer = loaded.processor.tokenizer

    def answers(requests):
        return [serve_clef.decide(loaded, request, args.max_length)["answers"] for request in requests]

    requests = [text_request(tokenizer, target, 7000 + target) for target in (90, 515, 1500, 3000)]
    requests += list(media_requests().values())
    graphed = answers(requests)
    repeated = answers(requests)
    decoder = next(m for m in loaded.model.modules() if isinstance(m, serve_clef.GraphedTextDecoder))
    graphs, decoder.graphs = decoder.graphs, {}
    padded = answers(requests)  # the same padding, run eagerly
    decoder.graphs = graphs
    swap_text_decoder(loaded, graphed=False)
    eager_flash = answers(requests)
    torch.backends.cuda.enable_cudnn_sdp(True)
    eager_cudnn = answers(requests)
    torch.backends.cuda.enable_cudnn_sdp(False)
    swap_text_decoder(loaded, graphed=True)

    floor = largest_difference(eager_cudnn, eager_flash)
    differences = {
        "eager: cuDNN vs other attention (noise floor)": floor,
        "padded eager vs unpadded eager": largest_difference(padded, eager_flash),
        "graphs vs padded eager": largest_difference(graphed, padded),
        "graphs vs unpadded eager": largest_difference(graphed, eager_flash),
    }
    for name, value in differences.items():
        print(f"max |dp|, {name}: {value:.4f}")
    gate = 2 * floor + 0.005
    passed = differences["graphs vs unpadded eager"] <= gate and graphed == repeated
    print(f"graphs vs eager within {gate:.4f}: {differences['graphs vs unpadded eager'] <= gate}; repeats "
          f"bit-identical: {graphed == repeated}")

    decide = lambda request: serve_clef.decide(loaded, request, args.max_length)  # noqa: E731
    for target, seeds in ((512, range(20, 28)), (2048, range(30, 34))):
        times = [timed_decision(decide, text_request(tokenizer, target + 7 * i, seed))[0]
                 for i, seed in enumerate(seeds)]
        print(f"~{target} tokens, new lengths, graphs: median {statistics.median(times):.1f} ms "
              f"({', '.join(f'{t:.0f}' for t in times)})")
    profile = profile_decision(decide, text_request(tokenizer, 516, 4242))
    print(f"516 tokens: GPU busy {profile['profile_gpu_busy_ms']} ms, {profile['profile_kernel_launches']} launches; "
          f"top {profile['profile_top_kernels'][:4]}")
    print(f"serving peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (load included)")
    print("ok" if passed else "FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
