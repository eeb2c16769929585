"""Lab (branch lab/packed-attention, 2026-12-06): the decoder's attention over several records, flash attention's
varlen kernel (served) against serve_clef's Triton kernel (packed_causal_attention) in several tile settings, on
random full-size heads (32 query heads, 4 key-value heads, 128 dims) of 1, 4, 8 and 16 records of 480-560 tokens
packed into their bucket, the padding as one more record, chunks as the decoder makes them. Each output is compared
with fp32 attention computed record by record (the largest absolute difference, both kernels), each timed in a CUDA
graph (median us a layer); a lone record's cuDNN attention (as served for one record) for scale.

Usage: python3 bench/lab_packed_attention.py [first|second]   (exit status 1 if a Triton output is further from fp32 than 2x flash's)
"""
import bisect
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402
from check_expert_kernels import graph_ms  # noqa: E402

HEADS, KEY_HEADS, HEAD_DIM, SCALING = 32, 4, 128, 128 ** -0.5
A = serve_clef.AttentionTiles
# (queries, heads together, keys, warps, stages)
SETTINGS = {
    "first": [*((queries, heads, keys, 4, 2) for queries, heads in ((64, 1), (32, 2), (16, 4)) for keys in (32, 64)),
              *((queries, heads, keys, 8, 2) for queries, heads in ((128, 1), (64, 2), (32, 4), (16, 8))
                for keys in (32, 64)),
              (16, 8, 32, 8, 3), (64, 2, 32, 8, 3)],
    "second": [(16, 8, 32, 8, 3), (16, 8, 32, 8, 4), (16, 8, 16, 8, 3), (16, 8, 16, 8, 4), (32, 4, 32, 8, 3),
               (32, 4, 32, 8, 4), (16, 4, 32, 4, 3), (32, 2, 32, 4, 3), (16, 8, 64, 8, 3), (8, 8, 32, 4, 3)],
}


def flash(query, key, value, chunks, total):
    query_starts, first_keys, key_counts = chunks
    return torch.ops.aten._flash_attention_forward(
        query, key, value, query_starts, first_keys, serve_clef.QUERY_CHUNK, total, 0.0, True, False,
        scale=SCALING, seqused_k=key_counts[:-1])[0]


def fp32_reference(query, key, value, boundaries):
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        q, k, v = (x[start:end].float().transpose(0, 1)[None] for x in (query, key, value))
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=SCALING, enable_gqa=True)[0].transpose(0, 1)
    return out


def main() -> int:
    print(torch.cuda.get_device_name(), flush=True)
    generator = torch.Generator().manual_seed(0)
    settings = [A(*setting) for setting in SETTINGS[sys.argv[1] if len(sys.argv) > 1 else "first"]]
    served, failures = serve_clef.PACKED_ATTENTION_TILES, 0
    busy = {tiles: 0.0 for tiles in settings}  # us at 8 and 16 records
    for records in ((1, 4, 8, 16) if len(sys.argv) < 2 or sys.argv[1] == 'first' else (8, 16)):
        lengths = torch.randint(480, 561 if records < 16 else 512, (records,), generator=generator).tolist()
        real = sum(lengths)
        total = serve_clef.DECODER_BUCKETS[bisect.bisect_left(serve_clef.DECODER_BUCKETS, real)]
        boundaries = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        chunks = torch.from_numpy(serve_clef.query_chunks(boundaries + [total], serve_clef.MAX_QUERY_CHUNKS)).cuda()
        # q, k and v as the decoder's projections leave them: token-major
        query = torch.randn(total, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
        key = torch.randn(total, KEY_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
        value = torch.randn(total, KEY_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
        reference = fp32_reference(query, key, value, boundaries)
        flash_error = float((flash(query, key, value, chunks, total)[:real].float() - reference[:real]).abs().max())
        line = [f"flash {graph_ms(lambda: flash(query, key, value, chunks, total)) * 1000:.1f} us (err {flash_error:.4f})"]
        if records == 1:
            cudnn = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(  # noqa: E731
                query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], None, False,
                0.0, True, False, scale=SCALING)[0]
            line.append(f"cudnn (one record) {graph_ms(cudnn) * 1000:.1f} us")
        for tiles in settings:
            serve_clef.PACKED_ATTENTION_TILES = tiles
            try:
                ours = serve_clef.packed_causal_attention(query, key, value, chunks, SCALING)
                error = float((ours[:real].float() - reference[:real]).abs().max())
                microseconds = graph_ms(lambda: serve_clef.packed_causal_attention(
                    query, key, value, chunks, SCALING)) * 1000
            finally:
                serve_clef.PACKED_ATTENTION_TILES = served
            if records >= 8:
                busy[tiles] += microseconds
            bad = error > 2 * flash_error
            failures += bad
            line.append(f"Q{tiles.queries}xG{tiles.heads}/K{tiles.keys}/w{tiles.num_warps}/s{tiles.num_stages} {microseconds:.1f} us "
                        f"(err {error:.4f}{' TOO FAR' if bad else ''})")
        print(f"{records} records, {real} tokens (bucket {total}):\n  " + "\n  ".join(line), flush=True)
    fastest = min(settings, key=busy.get)
    print(f"fastest at 8 and 16 records: {fastest}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention_tiles.json").write_text(json.dumps(fastest.__dict__))
    print("ok" if not failures else f"FAILED ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
