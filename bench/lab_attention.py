"""Lab (kept in history only; H100, 2026-12-06, docs/benchmarks.md): the text decoder's attention over packed records, flash varlen in chunks of 128 queries (served) against
cuDNN's fused attention given the records whole (aten._cudnn_attention_forward with cumulative lengths). Random q, k, v
as the full-size decoder has them (32 query heads, 4 key heads of 128), 24 calls on 4 sets of buffers in one CUDA
graph; each variant's output against fp32 SDPA per record."""
import sys

import numpy as np
import torch
import triton

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402

HQ, HKV, D = 32, 4, 128
SCALE = D ** -0.5
rng = np.random.default_rng(7)
GRAPH_FAILED = [False]


def bucket_for(total):
    return next(b for b in serve_clef.DECODER_BUCKETS if b >= total)


def graph_us(calls):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=200, return_mode="median") * 1000 / len(calls)


def reference(q, k, v, boundaries):
    out = torch.zeros_like(q, dtype=torch.float32)
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        qq, kk, vv = (x[start:end].transpose(0, 1)[None].float() for x in (q, k, v))
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, is_causal=True, scale=SCALE, enable_gqa=True)[0].transpose(0, 1)
    return out


def run_case(name, lengths):
    total = sum(lengths)
    bucket = bucket_for(total)
    boundaries = [0, *np.cumsum(lengths).tolist()]
    torch.cuda.synchronize()
    sets = []
    for _ in range(4):
        q = torch.randn(bucket, HQ, D).to("cuda", torch.bfloat16)
        k = torch.randn(bucket, HKV, D).to("cuda", torch.bfloat16)
        v = torch.randn(bucket, HKV, D).to("cuda", torch.bfloat16)
        sets.append((q, k, v))
    chunks = torch.from_numpy(serve_clef.query_chunks(boundaries, serve_clef.MAX_QUERY_CHUNKS)).cuda()

    def flash(q, k, v):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, chunks[0], chunks[1], serve_clef.QUERY_CHUNK, bucket, 0.0, True, False, scale=SCALE,
            seqused_k=chunks[2][:-1])[0]

    # records, then the padding as one more record, then empty records up to a fixed count
    padded = boundaries + ([bucket] if bucket > total else [])
    fixed = padded + [bucket] * (serve_clef.MAX_RECORDS_PER_FORWARD + 2 - len(padded))
    variants = {"flash chunks (served)": flash}
    for label, cum, max_len in (
        ("cudnn, records + padding, max = longest", padded, max(np.diff(padded))),
        ("cudnn, 33 records (empties), max = bucket", fixed, bucket),
        ("cudnn, 33 records (empties), max = longest", fixed, max(np.diff(padded))),
    ):
        cum_t = torch.tensor(cum, dtype=torch.int32, device="cuda")

        def cudnn(q, k, v, cum_t=cum_t, max_len=int(max_len)):
            return torch.ops.aten._cudnn_attention_forward(
                q, k, v, None, cum_t, cum_t, max_len, max_len, False, 0.0, True, False, scale=SCALE)[0]
        variants[label] = cudnn
    if len(lengths) == 1:
        def one(q, k, v):
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, False, 0.0, True,
                False, scale=SCALE)[0][0].transpose(0, 1)
        variants["cudnn one record (served alone)"] = one
    q, k, v = sets[0]
    ref = reference(q, k, v, boundaries)
    print(f"\n{name}: records {lengths}, tokens {total}, bucket {bucket}", flush=True)
    for label, fn in variants.items():
        try:
            out = fn(q, k, v)
            torch.cuda.synchronize()
            err = (out[:total].float() - ref[:total]).abs().max().item()
            finite = bool(torch.isfinite(out[:total].float()).all())
            print(f"  {label:48s} max err {err:.4f}  finite {finite}", flush=True)
            torch.cuda.set_sync_debug_mode("warn")
            fn(q, k, v)
            torch.cuda.set_sync_debug_mode(0)
            eager = triton.testing.do_bench(lambda: fn(q, k, v), warmup=10, rep=100, return_mode="median") * 1000
            print(f"  {label:48s} eager {eager:8.1f} us", flush=True)
            if "cudnn," in label and GRAPH_FAILED[0]:
                continue
            us = graph_us([lambda q=q, k=k, v=v: fn(q, k, v) for q, k, v in sets for _ in range(6)])
            print(f"  {label:48s} {us:8.1f} us in a graph", flush=True)
        except Exception as error:  # noqa: BLE001 - a lab: report and go on
            GRAPH_FAILED[0] = GRAPH_FAILED[0] or "cudnn," in label
            print(f"  {label:48s} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)


print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
run_case("one record", [517])
run_case("one record", [2030])
run_case("two records", [300, 700])
for n in (4, 8, 16):
    run_case(f"{n} records", rng.integers(440, 560, n).tolist())
run_case("8 records, one long", [1500, *rng.integers(300, 500, 7).tolist()])
