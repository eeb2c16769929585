"""How many tokens/s serve_clef's host side can feed a device: the HTTP server, the scheduler, request preparation
and answering, run for real, with the device replaced by a model of one. Runs on a CPU machine.

The server runs in its own process (`--serve`), serving the tiny synthetic checkpoint on CPU, with `queue_forward` (the
engine's one call into the model) replaced: it holds Python's lock for --host-ms (the host work a real forward does
before its graph, which the model leaves out), then the modeled device runs the batch for --base-ms plus
--per-token-us a token, one batch at a time, and the answers' logits are zeros of the right shapes. The defaults are
an H200's forwards with the Hopper kernels (2026-12-04, docs/benchmarks.md): 18.9 ms of GPU work for one 516-token
record and 139.7 ms for 16 records of 7,957 tokens, a straight line through both. The clients are bench/load_http.py's
plain levels (1, 8, 16 and 64 clients, distinct ~512-token requests). Reported per level: tokens/s, records per
forward, p50 latency, and the share of the time the modeled device was busy.

Usage: python3 bench/host_capacity.py [--host-ms 0,10] [--base-ms 10.5] [--per-token-us 16.2]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import joint_schema_model  # noqa: E402
import load_http  # noqa: E402
import serve_clef  # noqa: E402
import synthetic_release  # noqa: E402

LEVELS = [(1, 16), (8, 64), (16, 128), (64, 256)]  # (clients, requests in all), load_http's plain levels


def serve(args: argparse.Namespace) -> int:
    """The server, its device modeled; once stopped, it writes each forward's (records, tokens, start, end) to
    --stats."""
    forwards = []
    device_free_at = [0.0]

    def modeled_queue_forward(loaded, encoded_records):
        tokens = sum(len(record.input_ids) for record in encoded_records)
        busy_until = time.perf_counter() + args.host_ms / 1000
        while time.perf_counter() < busy_until:  # the forward's host work, holding Python's lock as Python code does
            pass
        started = max(time.perf_counter(), device_free_at[0])  # one device: after the forward before this one
        finished = device_free_at[0] = started + (args.base_ms + args.per_token_us * tokens / 1000) / 1000
        forwards.append((len(encoded_records), tokens, started, finished))

        def wait():
            time.sleep(max(0.0, finished - time.perf_counter()))
            return [[torch.zeros(len(question.option_ids)) for question in record.questions]
                    for record in encoded_records]

        return wait

    serve_clef.queue_forward = modeled_queue_forward
    try:
        return serve_clef.main(["--model", "synthetic", "--device", "cpu", "--port", str(args.serve)])
    finally:  # stopped (SIGTERM): the forwards, for the share of the time the device was busy
        Path(args.stats).write_text(json.dumps(forwards))


def device_busy(forwards: list, since: float, until: float) -> tuple[float, float]:
    """(records per forward, share of [since, until] the device was busy) of the forwards that started in it."""
    inside = [forward for forward in forwards if since <= forward[2] < until]
    busy = sum(min(end, until) - start for _, _, start, end in inside)
    return sum(records for records, *_ in inside) / max(1, len(inside)), busy / (until - since)


def measure(host_ms: float, args: argparse.Namespace, bodies: list[tuple[bytes, int]]) -> list[dict]:
    port = load_http.free_port()
    stats = Path(tempfile.mkdtemp()) / "forwards.json"
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--stats", str(stats), "--host-ms", str(host_ms),
         "--base-ms", str(args.base_ms), "--per-token-us", str(args.per_token_us)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        load_http.wait_until_ready(server, port, 300)
        results, spans, sent = [], [], 0
        for clients, count in LEVELS:
            start = time.perf_counter()
            level = load_http.run_level(port, clients, bodies[sent:sent + count], mixed=False)
            spans.append((start, time.perf_counter()))
            sent += count
            results.append(level)
    finally:
        server.terminate()
        server.wait(timeout=60)
    forwards = json.loads(stats.read_text())
    rows = []
    for level, (since, until) in zip(results, spans):  # perf_counter is one clock for both processes on Linux
        records, busy = device_busy(forwards, since, until)
        rows.append({"host_ms": host_ms, "clients": level["clients"], "tokens_per_s": level["tokens_per_s"],
                     "records_per_forward": round(records, 2), "p50_ms": level["p50_ms"], "lost": level["lost"],
                     "device_busy": round(busy, 3)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-ms", default="0,10", help="host work per forward, ms, comma-separated variants")
    parser.add_argument("--base-ms", type=float, default=10.5, help="the modeled device's time per forward, ms")
    parser.add_argument("--per-token-us", type=float, default=16.2, help="and per token, microseconds")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process: its port
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        args.host_ms = float(args.host_ms)
        return serve(args)
    release_dir = synthetic_release.write_release(Path(tempfile.mkdtemp()) / "tiny", "tiny", weights=False)
    tokenizer = joint_schema_model.load_processor(release_dir).tokenizer
    bodies = []
    for seed in range(1, 1 + sum(count for _, count in LEVELS)):
        request = load_http.text_request(tokenizer, 500 + seed % 40, 10_000 + seed)
        tokens = len(joint_schema_model.encode_record(tokenizer, request).input_ids)
        bodies.append((json.dumps(request).encode(), tokens))
    print(f"modeled device: {args.base_ms} ms + {args.per_token_us} us a token per forward; {os.cpu_count()} CPUs")
    failures = 0
    for host_ms in map(float, args.host_ms.split(",")):
        for row in measure(host_ms, args, bodies):
            failures += row["lost"] > 0
            print(json.dumps(row), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
