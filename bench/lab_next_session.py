"""Lab, written 2026-12-06 without a GPU to run it on (branch lab/next-session): measurements for the next session.

A. The top-k sum's launch shape: `sum_top_k_kernel` as served (8 tokens by 256 columns a program, 4 warps) against
   other token and column blocks and warps, at 517, 4,057 and 7,957 tokens (K = 8, H = 2,048, the bucket's padding
   past the real tokens), 20 launches in a CUDA graph, median ms a launch; every variant's output compared with the
   served launch's bit for bit. No model is loaded.
B. Rows of HEAD_GRAPH_SLOTS nearer what batches fill: the batched head's option_logits for 1, 6 and 8 new ~500-token
   records (random packed rows, the records' real index), captured in a CUDA graph in the served row that holds them
   and in a smaller candidate ((32, 8, 32, 512, 512) for a lone record, (32, 32, 128, 2,048, 2,048) for 6 and 8,
   which the second row holds today), 20 replays, median ms, and the largest difference of the real options' logits
   between the two.

C. The head's maths compiled: option_logits as served against torch.compile(option_logits, dynamic=True,
   fullgraph=True) for 1 and 8 records, each captured in a CUDA graph, 20 replays, median ms; the compile's seconds
   for each slots row (on the 2-core CPU machine: 28-30 s a row); the largest logit difference.

Usage: python3 bench/lab_next_session.py [A|B|C]   (all when none is named)
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402

TOP_K, HIDDEN = 8, 2048


def graph_milliseconds(run, launches: int = 20, replays: int = 5) -> float:
    """Median ms of one `run()` over `replays` replays of a graph of `launches` calls."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            run()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def top_k_sum_shapes() -> None:
    for tokens, bucket in ((517, 576), (4057, 4096), (7957, 8192)):
        pair_outputs = torch.randn(bucket * TOP_K, HIDDEN, device="cuda").to(torch.bfloat16)  # [S, H]
        real_tokens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
        served = serve_clef.sum_top_k(pair_outputs, TOP_K, real_tokens)

        def served_launch(pair_outputs=pair_outputs, real_tokens=real_tokens):
            serve_clef.sum_top_k(pair_outputs, TOP_K, real_tokens)
        print(f"\n{tokens} real tokens of {bucket}: served {graph_milliseconds(served_launch) * 1000:.1f} us",
              flush=True)
        for block_t in (4, 8, 16, 32):
            for block_h in (128, 256, 512, 1024):
                for warps in (4, 8):
                    out = torch.empty(bucket, HIDDEN, dtype=torch.bfloat16, device="cuda")

                    def launch(block_t=block_t, block_h=block_h, warps=warps, out=out, bucket=bucket,
                               pair_outputs=pair_outputs, real_tokens=real_tokens):
                        serve_clef.sum_top_k_kernel[(triton_cdiv(bucket, block_t), triton_cdiv(HIDDEN, block_h))](
                            pair_outputs, real_tokens, out, bucket, HIDDEN, TOP_K=TOP_K, PADDED=True,
                            BLOCK_T=block_t, BLOCK_H=block_h, num_warps=warps)
                    microseconds = graph_milliseconds(launch) * 1000
                    print(f"  {block_t:2d} tokens x {block_h:4d} columns, {warps} warps: {microseconds:6.1f} us, "
                          f"same bits: {torch.equal(out, served)}", flush=True)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@torch.inference_mode()
def head_slots(loaded) -> None:
    from bench_serve import text_request
    tokenizer, head = loaded.processor.tokenizer, loaded.model.head
    weight = loaded.model.output_embeddings.weight
    records = [serve_clef.prepare(loaded, text_request(tokenizer, 480 + 5 * i, seed=9300 + i), 4096).encoded
               for i in range(8)]
    for count in (1, 6, 8):
        candidate = (serve_clef.HeadSlots(serve_clef.MAX_RECORDS_PER_FORWARD, 8, 32, 512, 512) if count == 1 else
                     serve_clef.HeadSlots(serve_clef.MAX_RECORDS_PER_FORWARD, 32, 128, 2048, 2048))
        batch = records[:count]
        tokens = sum(len(record.input_ids) for record in batch)
        bucket = next(b for b in serve_clef.DECODER_BUCKETS if b >= tokens)
        needed = serve_clef.head_slots_needed(batch)
        packed = torch.randn(bucket, weight.shape[1], device="cuda", dtype=torch.bfloat16)
        logits = {}
        served = next(slots for slots in serve_clef.HEAD_GRAPH_SLOTS if slots.holds(needed))
        for name, slots in (("served row", served), ("candidate", candidate)):
            if not slots.holds(needed):
                print(f"{count} records: {name} {tuple(slots)} does not hold {tuple(needed)}", flush=True)
                continue
            host_index = serve_clef.head_index(batch, slots)
            index = host_index.to(torch.device("cuda"))

            def run(index=index, host_index=host_index, name=name, logits=logits, packed=packed):
                logits[name] = head.option_logits(packed, index, weight, host_index.option_token_ids)
            milliseconds = graph_milliseconds(run, launches=1, replays=20)
            print(f"{count} records ({tokens} tokens, bucket {bucket}), {name} {tuple(slots)}: {milliseconds:.3f} ms",
                  flush=True)
        if len(logits) == 2:
            difference = (logits["candidate"][:needed.options].float()
                          - logits["served row"][:needed.options].float()).abs().max().item()
            print(f"  largest difference of the real options' logits: {difference:.4f}", flush=True)


@torch.inference_mode()
def head_compiled(loaded) -> None:
    import contextlib
    import time

    from bench_serve import text_request
    tokenizer, head = loaded.processor.tokenizer, loaded.model.head
    weight = loaded.model.output_embeddings.weight
    # dynamo cannot trace torch's kernel-order calls: the compiled maths runs inside the served kernel choice instead,
    # taken around the whole call (and around the trace, where SDPA picks its kernel)
    # and the option rows' gather from the host table (a Triton kernel on a host pointer, which Inductor would
    # compile for the CPU) stays eager, between two compiled graphs
    served_kernels, served_gather = serve_clef.head_attention_kernels, serve_clef.host_rows_to_device
    maths = torch.compile(head.option_logits, dynamic=True)

    def compiled(*args):
        serve_clef.head_attention_kernels = lambda device: contextlib.nullcontext()
        serve_clef.host_rows_to_device = torch.compiler.disable(served_gather)
        try:
            with served_kernels(args[0].device):
                return maths(*args)
        finally:
            serve_clef.head_attention_kernels, serve_clef.host_rows_to_device = served_kernels, served_gather
    records = [serve_clef.prepare(loaded, text_request(tokenizer, 480 + 5 * i, seed=9500 + i), 4096).encoded
               for i in range(8)]
    for count in (1, 8):
        batch = records[:count]
        tokens = sum(len(record.input_ids) for record in batch)
        bucket = next(b for b in serve_clef.DECODER_BUCKETS if b >= tokens)
        needed = serve_clef.head_slots_needed(batch)
        slots = next(slots for slots in serve_clef.HEAD_GRAPH_SLOTS if slots.holds(needed))
        host_index = serve_clef.head_index(batch, slots)
        index = host_index.to(torch.device("cuda"))
        packed = torch.randn(bucket, weight.shape[1], device="cuda", dtype=torch.bfloat16)
        start = time.perf_counter()
        compiled(packed, index, weight, host_index.option_token_ids)
        torch.cuda.synchronize()
        print(f"{count} records ({tokens} tokens, bucket {bucket}, slots {tuple(slots)}): first compiled call "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        logits = {}
        for name, function in (("as served", head.option_logits), ("compiled", compiled)):
            def run(function=function, name=name, index=index, host_index=host_index, packed=packed, logits=logits):
                logits[name] = function(packed, index, weight, host_index.option_token_ids)
            print(f"  {name}: {graph_milliseconds(run, launches=1, replays=20):.3f} ms", flush=True)
        difference = (logits["compiled"][:needed.options].float()
                      - logits["as served"][:needed.options].float()).abs().max().item()
        print(f"  largest difference of the real options' logits: {difference:.4f}", flush=True)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["A", "B", "C"]
    if "A" in parts:
        top_k_sum_shapes()
    if "B" in parts or "C" in parts:
        loaded = serve_clef.load_from_args(serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"]),
                                           progress=lambda line: None)
        if "B" in parts:
            head_slots(loaded)
        if "C" in parts:
            head_compiled(loaded)
