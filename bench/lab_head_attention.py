"""Lab: the joint head's attention kernels (synthetic:full on the GPU). The batched head's option_logits for 1, 8 and
16 new ~500-token records (random packed rows, the records' real index in its HEAD_GRAPH_SLOTS row), captured in a
CUDA graph under each SDPA backend that runs it (torch's default, memory-efficient, cuDNN, math in fp32, math with
BF16 reductions), 20 replays each (median ms), and each variant's largest logit difference from the default's.

Usage: python3 lab_head_attention.py
"""
import contextlib
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_clef  # noqa: E402
from bench_serve import text_request  # noqa: E402

VARIANTS = {
    "default": None,
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math fp32": [SDPBackend.MATH],
    "math bf16 reductions": [SDPBackend.MATH],
}


@torch.inference_mode()
def main():
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: None)
    tokenizer, head = loaded.processor.tokenizer, loaded.model.head
    weight = loaded.model.output_embeddings.weight
    records = [serve_clef.prepare(loaded, text_request(tokenizer, 480 + 7 * i, seed=9100 + i), 4096).encoded
               for i in range(16)]
    for count in (1, 8, 16):
        batch = records[:count]
        tokens = sum(len(record.input_ids) for record in batch)
        bucket = next(b for b in serve_clef.DECODER_BUCKETS if b >= tokens)
        needed = serve_clef.head_slots_needed(batch)
        slots = next(slots for slots in serve_clef.HEAD_GRAPH_SLOTS if slots.holds(needed))
        host_index = serve_clef.head_index(batch, slots)
        index = host_index.to(torch.device("cuda"))
        packed = torch.randn(bucket, head.head.hidden_norm.normalized_shape[0], device="cuda", dtype=torch.bfloat16)
        print(f"\n{count} records, {tokens} tokens (bucket {bucket}), slots {tuple(slots)}", flush=True)
        reference = None
        for name, backends in VARIANTS.items():
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(name == "math bf16 reductions")
            context = sdpa_kernel(backends) if backends else contextlib.nullcontext()
            try:
                with context:
                    logits = head.option_logits(packed, index, weight, host_index.option_token_ids)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        static = head.option_logits(packed, index, weight, host_index.option_token_ids)
            except RuntimeError as error:
                print(f"  {name:22s} does not run: {str(error)[:120]}", flush=True)
                continue
            times = []
            for _ in range(20):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            real = static[:needed.options].float()
            if reference is None:
                reference = real.clone()
            print(f"  {name:22s} {statistics.median(times):7.3f} ms, largest logit difference from the default "
                  f"{(real - reference).abs().max().item():.4f} (logits up to {reference.abs().max().item():.2f}); "
                  f"eager equals replay: {torch.equal(logits[:needed.options], static[:needed.options])}", flush=True)
            del graph


if __name__ == "__main__":
    main()
