"""Lab: a lone ~512-token text decision's timeline without a profiler (synthetic:full on the GPU).

Twenty new requests (distinct lengths 500-576 tokens) through `decide()`. At each stage's start and end (prepare,
collate, batch_to_device, the thinker, the decoder, its graph's replay, the joint head, the logits' copy, the wait,
the answers) the host's clock is read and a CUDA event recorded. Event times are measured from an event recorded as
the decision starts (the device idle then), so each mark gives when the host reached it and when the device did: where
the device's time is the host's (plus a launch), the device had caught up and was waiting for the host. Printed: each
mark's median host and device times over the last eighteen decisions.

Usage: python3 lab_timeline.py [ANSWERS.json]   (the decisions' answers written there, to compare two trees)
"""
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_clef  # noqa: E402
from bench_serve import text_request  # noqa: E402

MARKS = []


def mark(label):
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    MARKS.append((label, time.perf_counter(), event))


def marked(function, name):
    def run(*args, **kwargs):
        mark(name + " <")
        try:
            return function(*args, **kwargs)
        finally:
            mark(name + " >")
    return run


def main():
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: print(line) if "head" in line else None)
    tokenizer = loaded.processor.tokenizer
    requests = [text_request(tokenizer, 500 + 4 * i, seed=8000 + i) for i in range(20)]
    schema, thinker, head = loaded.schema, loaded.model.thinker, loaded.model.head
    serve_clef.prepare = marked(serve_clef.prepare, "prepare")
    serve_clef.answer = marked(serve_clef.answer, "answer")
    serve_clef.logits_to_host = marked(serve_clef.logits_to_host, "logits_to_host")
    serve_clef.ForwardInFlight.wait = marked(serve_clef.ForwardInFlight.wait, "wait")
    schema.collate_records = marked(schema.collate_records, "collate")
    thinker.forward = marked(thinker.forward, "thinker")
    head.forward = marked(head.forward, "head")
    serve_clef.PackedTextDecoder.forward = marked(serve_clef.PackedTextDecoder.forward, "decoder")
    torch.cuda.CUDAGraph.replay = marked(torch.cuda.CUDAGraph.replay, "replay")
    to_device = serve_clef.batch_to_device
    depth = [0]

    def outer_batch_to_device(value, device):
        depth[0] += 1
        try:
            if depth[0] == 1:
                return marked(to_device, "batch_to_device")(value, device)
            return to_device(value, device)
        finally:
            depth[0] -= 1
    serve_clef.batch_to_device = outer_batch_to_device

    rows = defaultdict(lambda: ([], []))
    walls, answers = [], []
    for index, request in enumerate(requests):
        torch.cuda.synchronize()
        MARKS.clear()
        mark("start")
        answers.append(serve_clef.decide(loaded, request)["answers"])
        mark("end")
        torch.cuda.synchronize()
        label0, host0, event0 = MARKS[0]
        walls.append((MARKS[-1][1] - host0) * 1000)
        if index < 2:
            continue
        seen = defaultdict(int)
        for label, host, event in MARKS:
            seen[label] += 1
            key = label if seen[label] == 1 else f"{label} #{seen[label]}"
            rows[key][0].append((host - host0) * 1000)
            rows[key][1].append(event0.elapsed_time(event))
    print(f"decisions (ms): {', '.join(f'{w:.2f}' for w in walls)}; median of the last 18 "
          f"{statistics.median(walls[2:]):.2f}")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(answers))
    print(f"{'mark':28s} {'host ms':>8s} {'device ms':>10s}  (medians)")
    for key, (hosts, devices) in sorted(rows.items(), key=lambda item: statistics.median(item[1][0])):
        print(f"{key:28s} {statistics.median(hosts):8.3f} {statistics.median(devices):10.3f}")


if __name__ == "__main__":
    main()
