"""How many tokens/s serve_clef's host side can feed a device: the HTTP server, the scheduler, request preparation
and answering, run for real, with the device replaced by a model of one (any CPU machine), or with the real model
and each of its forwards timed from inside the server (`--real`, on the GPU machine).

The server runs in its own process (`--serve`). Modeled: it serves the tiny synthetic checkpoint on CPU, with
`queue_forward` (the engine's one call into the model) replaced: it holds Python's lock for --host-ms (the host work
a real forward does before its graph, which the model leaves out), then the modeled device runs the batch for
--base-ms plus --per-token-us a token, one batch at a time, and the answers' logits are zeros of the right shapes.
The defaults are an H200's forwards with the Hopper kernels (2026-12-04, docs/benchmarks.md): 18.9 ms of GPU work for
one 516-token record and 139.7 ms for 16 records of 7,957 tokens, a straight line through both.

Real (`--real synthetic:full`, or `--real synthetic` to try it on CPU): the server runs the model, and each forward
is timed on the host and, on a GPU, by CUDA events on the device's clock (aligned with the host's at the first
forward): when the host entered `queue_forward`, reached the text decoder and returned; when the device reached the
forward (after the forward before it), started and ended the decoder, and ended the forward. So a level reports where
the device's time went: its forwards' decoders and joint heads, the gaps inside a forward while the host still queued
its work before the decoder, and the gaps between forwards, when nothing was queued. On CPU the model runs on the
host and the device times are the host's. Real forwards also tell when each of their records was ready (prepared),
from the end of the answers before the forward: the records ready after them are the answered clients' next
requests that joined it, and the last of them how long those took to come back (the rejoin wait's catch).

The clients are bench/load_http.py's plain levels (1, 8, 16 and 64 clients, distinct ~512-token requests). Reported
per level: tokens/s, records per forward, p50 latency, and the share of the time the (modeled or real) device was
busy; real forwards add the medians of their stages and of the records ready after the answers, and the JSON each
forward's.

Usage: python3 bench/host_capacity.py [--host-ms 0,10] [--base-ms 10.5] [--per-token-us 16.2]
       python3 bench/host_capacity.py --real synthetic:full   (writes $OUT/host_capacity.json when OUT is set)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import joint_schema_model  # noqa: E402
import load_http  # noqa: E402
import serve_clef  # noqa: E402
import synthetic_release  # noqa: E402

LEVELS = [(1, 16), (8, 64), (16, 128), (64, 256)]  # (clients, requests in all), load_http's plain levels


class ModeledEnd:
    """A modeled forward's end, as the CUDA event a real forward's logits pass: waiting for it sleeps until then."""

    def __init__(self, at: float):
        self.at = at  # perf_counter

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))


def serve_modeled(args: argparse.Namespace, forwards: list) -> int:
    """The server, its device modeled; each forward's records, tokens and times go into `forwards`."""
    device_free_at = [0.0]

    def modeled_queue_forward(loaded, encoded_records):
        entered = time.perf_counter()
        tokens = sum(len(record.input_ids) for record in encoded_records)
        busy_until = entered + args.host_ms / 1000
        while time.perf_counter() < busy_until:  # the forward's host work, holding Python's lock as Python code does
            pass
        started = max(time.perf_counter(), device_free_at[0])  # one device: after the forward before this one
        finished = device_free_at[0] = started + (args.base_ms + args.per_token_us * tokens / 1000) / 1000
        forwards.append({"records": len(encoded_records), "tokens": tokens, "entered": entered,
                         "device_busy_from": started, "device_ended": finished})
        logits = [[torch.zeros(len(question.option_ids)) for question in record.questions]
                  for record in encoded_records]
        return serve_clef.ForwardInFlight(logits, ModeledEnd(finished))

    serve_clef.queue_forward = modeled_queue_forward
    return serve_clef.main(["--model", "synthetic", "--device", "cpu", "--port", str(args.serve)])


class DeviceClock:
    """Marks on the device's timeline, read back as host perf_counter seconds: CUDA events on a GPU, aligned with the
    host's clock by one event waited for at the first mark; on CPU, where the model runs on the host, the host's
    clock when marked."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.reference = None  # (an event, the host's clock once it had passed)

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        if self.reference is None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            self.reference = (event, time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:  # once the device has passed the mark
        if not self.cuda:
            return mark
        event, host_seconds = self.reference
        return host_seconds + event.elapsed_time(mark) / 1000


def serve_real(args: argparse.Namespace, forwards: list) -> int:
    """The server, its model real; each forward's records, tokens and times (host and device, DeviceClock) go into
    `forwards` once the server stops."""
    clock, marked, in_progress = DeviceClock(), [], []
    real_queue_forward, real_decoder_forward = serve_clef.queue_forward, serve_clef.PackedTextDecoder.forward
    real_prepare, real_answer = serve_clef.prepare, serve_clef.answer
    prepared_at = {}  # id of a live encoded record: when its preparation ended
    answered_at = [None]  # when the last answer ended

    def timed_prepare(*args, **kwargs):
        prepared = real_prepare(*args, **kwargs)
        key = id(prepared.encoded)
        prepared_at[key] = time.perf_counter()
        # a record never forwarded (refused, its client gone) leaves no time behind for a later record at its address
        weakref.finalize(prepared.encoded, prepared_at.pop, key, None)
        return prepared

    def timed_answer(*args, **kwargs):
        try:
            return real_answer(*args, **kwargs)
        finally:
            answered_at[0] = time.perf_counter()

    def timed_queue_forward(loaded, encoded_records):
        entered = time.perf_counter()
        # when each record was ready, from the end of the answers before this forward (negative: it was waiting)
        ready = sorted(prepared_at.pop(id(record), entered) - (answered_at[0] or entered) for record in encoded_records)
        marks = {"records": len(encoded_records), "tokens": sum(len(record.input_ids) for record in encoded_records),
                 "entered": entered, "device_reached": clock.mark(), "ready_after_answers": ready}
        in_progress.append(marks)  # a stack: a batch out of memory is scored again record by record, inside
        try:
            flight = real_queue_forward(loaded, encoded_records)
        finally:
            in_progress.pop()
        marks.update(queued=time.perf_counter(), device_ended=clock.mark())
        marked.append(marks)
        return flight

    def timed_decoder_forward(self, **kwargs):
        marks = in_progress[-1] if in_progress else {}
        marks.update(host_at_decoder=time.perf_counter(), device_decoder_started=clock.mark())
        output = real_decoder_forward(self, **kwargs)
        marks["device_decoder_ended"] = clock.mark()
        return output

    serve_clef.queue_forward = timed_queue_forward
    serve_clef.PackedTextDecoder.forward = timed_decoder_forward
    serve_clef.prepare, serve_clef.answer = timed_prepare, timed_answer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return serve_clef.main(["--model", args.real, "--device", device, "--port", str(args.serve)])
    finally:
        if clock.cuda:
            torch.cuda.synchronize()
        for marks in marked:
            if "device_decoder_started" not in marks:  # a batch scored record by record: its records are listed
                continue
            forwards.append({key: clock.seconds(value) if key.startswith("device") else value
                             for key, value in marks.items()}
                            | {"device_busy_from": clock.seconds(marks["device_decoder_started"])})


def serve(args: argparse.Namespace) -> int:
    """The server process; once stopped (SIGTERM), it writes its forwards to --stats."""
    forwards = []
    try:
        return (serve_real if args.real else serve_modeled)(args, forwards)
    finally:
        Path(args.stats).write_text(json.dumps(forwards))


def forward_stages_ms(forward: dict, before: dict | None) -> dict:
    """A real forward's stages in ms (`before`: the forward the device ran before it, or None)."""
    seconds = {
        "host: entered to the decoder": forward["host_at_decoder"] - forward["entered"],
        "host: entered to queued": forward["queued"] - forward["entered"],
        "device: reached to the decoder": forward["device_decoder_started"] - forward["device_reached"],
        "device: decoder": forward["device_decoder_ended"] - forward["device_decoder_started"],
        "device: after the decoder": forward["device_ended"] - forward["device_decoder_ended"],
        "device: idle since the forward before": None if before is None
        else forward["device_reached"] - before["device_ended"],
    }
    return {stage: None if value is None else round(value * 1000, 2) for stage, value in seconds.items()}


def level_forwards(forwards: list, since: float, until: float) -> dict:
    """Records per forward and the share of [since, until] the device was busy, of the forwards the host entered in
    it; for real forwards also the medians of their stages and, for the JSON, each forward's (ms; `at`: when the
    host entered it, from the level's start)."""
    inside = [forward for forward in forwards if since <= forward["entered"] < until]
    busy = sum(max(0.0, min(forward["device_ended"], until) - forward["device_busy_from"]) for forward in inside)
    summary = {"records_per_forward": round(sum(forward["records"] for forward in inside) / max(1, len(inside)), 2),
               "device_busy": round(busy / (until - since), 3)}
    real = [forward for forward in inside if "queued" in forward]
    if real:
        stages = [forward_stages_ms(forward, before) for before, forward in zip([None, *real], real)]
        summary["forward_stages_median_ms"] = {}
        for stage in stages[0]:
            values = [row[stage] for row in stages if row[stage] is not None]  # the first has no forward before
            summary["forward_stages_median_ms"][stage] = round(statistics.median(values), 2) if values else None
        # the answered clients' next requests: how many joined each forward, and when the last of them was ready
        late = [[ready for ready in forward["ready_after_answers"] if ready > 0] for forward in real]
        summary["after_the_answers_median"] = {
            "records ready": statistics.median(len(ready) for ready in late),
            "the last ready, ms": round(statistics.median(max(ready, default=0.0) for ready in late) * 1000, 2)}
        summary["forwards"] = [{"records": forward["records"], "tokens": forward["tokens"],
                                "at": round((forward["entered"] - since) * 1000, 1), **row,
                                "ready after the answers, ms": [round(ready * 1000, 2)
                                                                for ready in forward["ready_after_answers"]]}
                               for forward, row in zip(real, stages)]
    return summary


def measure(server_flags: list[str], bodies: list[tuple[bytes, int]]) -> list[dict]:
    port = load_http.free_port()
    stats = Path(tempfile.mkdtemp()) / "forwards.json"
    with open(Path(os.environ.get("OUT", tempfile.gettempdir()), "host_capacity_server.log"), "a") as log:
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--stats", str(stats),
                                   *server_flags], stdout=subprocess.DEVNULL, stderr=log)
    try:
        load_http.wait_until_ready(server, port, 900)
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
        rows.append({"clients": level["clients"], "tokens_per_s": level["tokens_per_s"], "p50_ms": level["p50_ms"],
                     "lost": level["lost"], **level_forwards(forwards, since, until)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-ms", default="0,10", help="host work per forward, ms, comma-separated variants")
    parser.add_argument("--base-ms", type=float, default=10.5, help="the modeled device's time per forward, ms")
    parser.add_argument("--per-token-us", type=float, default=16.2, help="and per token, microseconds")
    parser.add_argument("--real", metavar="MODEL", help="serve this model (synthetic:full on a GPU, synthetic on "
                        "CPU) and time its forwards, instead of modeling the device")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process: its port
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        args.host_ms = 0.0 if args.real else float(args.host_ms)
        return serve(args)
    release = "full" if args.real == "synthetic:full" else "tiny"  # the tokenizer the server builds
    release_dir = synthetic_release.write_release(Path(tempfile.mkdtemp()) / release, release, weights=False)
    tokenizer = joint_schema_model.load_processor(release_dir).tokenizer
    bodies = []
    for seed in range(1, 1 + sum(count for _, count in LEVELS)):
        request = load_http.text_request(tokenizer, 500 + seed % 40, 10_000 + seed)
        tokens = len(joint_schema_model.encode_record(tokenizer, request).input_ids)
        bodies.append((json.dumps(request).encode(), tokens))
    if args.real:
        print(f"real forwards of {args.real}; {os.cpu_count()} CPUs")
        variants = [("real", ["--real", args.real])]
    else:
        print(f"modeled device: {args.base_ms} ms + {args.per_token_us} us a token per forward; {os.cpu_count()} CPUs")
        variants = [(f"host {host_ms} ms", ["--host-ms", host_ms, "--base-ms", str(args.base_ms),
                                            "--per-token-us", str(args.per_token_us)])
                    for host_ms in args.host_ms.split(",")]
    results, failures = {}, 0
    for name, server_flags in variants:
        results[name] = measure(server_flags, bodies)
        for row in results[name]:
            failures += row["lost"] > 0
            print(json.dumps({"variant": name, **{key: value for key, value in row.items() if key != "forwards"}}),
                  flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "host_capacity.json").write_text(json.dumps(results, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
