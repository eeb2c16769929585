"""Lab: where a lone ~512-token text decision's wall time goes beside its GPU work (synthetic:full on the GPU).

Eight new requests (distinct lengths 500-530 tokens) through `decide()`, timed; then three more under torch.profiler,
with each serve_clef stage marked (prepare, collate, the thinker's forward, the decoder, the head, the logits' copy,
the answers). For each profiled decision: its wall time, the GPU's busy time (union of kernel and copy intervals),
the idle time before the first kernel, after the last, and every gap of 20 us or more between kernels, with the
stages the host was in when the gap began and ended, and the kernels on either side.

Usage: python3 lab_gaps.py   (writes $OUT/lab_gaps_trace.json: the last decision's chrome trace)
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_clef  # noqa: E402
from bench_serve import text_request  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def marked(function, name):
    def run(*args, **kwargs):
        with torch.profiler.record_function("lab:" + name):
            return function(*args, **kwargs)
    return run


def main():
    args = serve_clef.parse_args(["--model", os.environ.get("LAB_MODEL", "synthetic:full"),
                                  "--device", os.environ.get("LAB_DEVICE", "cuda")])
    loaded = serve_clef.load_from_args(args, progress=lambda line: None)
    tokenizer = loaded.processor.tokenizer
    requests = [text_request(tokenizer, 500 + 3 * i, seed=7000 + i) for i in range(11)]
    serve_clef.decide(loaded, text_request(tokenizer, 480, seed=6999))  # any first-call work
    times = []
    for request in requests[:8]:
        timings = {}
        sync()
        start = time.perf_counter()
        serve_clef.decide(loaded, request, timings=timings)
        times.append((time.perf_counter() - start) * 1000)
        print(f"decision {times[-1]:.2f} ms, stages " +
              ", ".join(f"{k} {v * 1000:.2f}" for k, v in timings.items()), flush=True)
    print(f"median of 8 new decisions: {statistics.median(times):.2f} ms", flush=True)

    schema, thinker, head = loaded.schema, loaded.model.thinker, loaded.model.head
    serve_clef.prepare = marked(serve_clef.prepare, "prepare")
    serve_clef.answer = marked(serve_clef.answer, "answer")
    serve_clef.logits_to_host = marked(serve_clef.logits_to_host, "logits_to_host")
    serve_clef.batch_to_device = marked(serve_clef.batch_to_device, "batch_to_device")
    schema.collate_records = marked(schema.collate_records, "collate")
    thinker.forward = marked(thinker.forward, "thinker")
    head.forward = marked(head.forward, "head")
    decoder_forward = serve_clef.PackedTextDecoder.forward
    serve_clef.PackedTextDecoder.forward = marked(decoder_forward, "decoder")
    out = Path(os.environ.get("OUT", "."))
    for index, request in enumerate(requests[8:]):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profiler:
            with torch.profiler.record_function("lab:decide"):
                serve_clef.decide(loaded, request)
            sync()
        trace = out / "lab_gaps_trace.json"
        profiler.export_chrome_trace(str(trace))
        report(json.loads(trace.read_text()), index)


def report(trace, index):
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    decide = next(e for e in events if e["name"] == "lab:decide")
    start, end = decide["ts"], decide["ts"] + decide["dur"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                     and start <= e["ts"] <= end), key=lambda e: e["ts"])
    stages = [e for e in events if e["name"].startswith("lab:") and e.get("cat") == "user_annotation"]

    def stages_at(ts):
        return "/".join(e["name"][4:] for e in sorted(stages, key=lambda e: e["ts"])
                        if e["ts"] <= ts <= e["ts"] + e["dur"] and e["name"] != "lab:decide") or "-"

    busy, gaps, cursor = 0.0, [], device[0]["ts"]
    previous = None
    for event in device:
        if event["ts"] > cursor and previous is not None and event["ts"] - cursor >= 20:
            gaps.append((cursor - start, event["ts"] - cursor, previous["name"][:50], event["name"][:50]))
        busy += max(0.0, event["ts"] + event["dur"] - max(cursor, event["ts"]))
        if event["ts"] + event["dur"] > cursor:
            cursor, previous = event["ts"] + event["dur"], event
    print(f"\nprofiled decision {index}: wall {(end - start) / 1000:.2f} ms, device busy {busy / 1000:.2f} ms in "
          f"{len(device)} kernels/copies; idle before the first {(device[0]['ts'] - start) / 1000:.2f} ms "
          f"(host in {stages_at(device[0]['ts'])}), after the last {(end - cursor) / 1000:.2f} ms; gaps >= 20 us: "
          f"{sum(g[1] for g in gaps) / 1000:.2f} ms in {len(gaps)}", flush=True)
    for at, length, before, after in gaps:
        print(f"  at {at / 1000:6.2f} ms: {length:7.1f} us  host {stages_at(start + at)} -> "
              f"{stages_at(start + at + length)}  | {before} -> {after}", flush=True)
    for stage in sorted({e["name"] for e in stages}):
        spans = [e for e in stages if e["name"] == stage and start <= e["ts"] <= end]
        print(f"  {stage}: host {sum(e['dur'] for e in spans) / 1000:.2f} ms in {len(spans)}, first at "
              f"{(spans[0]['ts'] - start) / 1000:.2f} ms" if spans else f"  {stage}: -", flush=True)


if __name__ == "__main__":
    main()
