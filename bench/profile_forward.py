"""Where the time of one engine forward goes on the GPU machine (`synthetic:full`), stage by stage.

For one ~516-token record, for 16 records of ~500 tokens in one forward, and for one image, audio and video record
each, `score_records` is timed as a whole and split into its stages, each synchronised: collating the batch, the
thinker around its text decoder (embedding, the vision and audio towers, rotary indices, merging), the text decoder
(a CUDA graph replay), and the joint head. The whole forward is also timed as served (no stage synchronised: the host
queues the joint head while the device runs the decoder), and, as baselines in the same run, as it ran before three
changes: with the host waiting for the decoder before it queues the head (before the head's copies came from pinned
memory), with the towers' attention as transformers runs it under SDPA (a call per image, frame or audio window,
after a host read of their lengths), and with a one-record batch replaying the graph of batches of several records
(serve_clef's packed attention kernel; flash varlen before 2026-12-06) instead of its own (cuDNN's). torch.profiler
then gives the GPU's busy time, the kernels launched and the host's busiest operators, also for that last baseline,
and where the device idles between its first activity and its last (the idle stretches by length, the longest with
the activities on either side).

Usage: python3 bench/profile_forward.py   (writes $OUT/profile_forward.json when OUT is set)
"""

import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402
from bench_serve import media_requests, text_request  # noqa: E402

HOST_OPERATORS_REPORTED = 15
KERNELS_REPORTED = 15
GAPS_REPORTED = 10


def idle_gaps(device_events: list) -> dict | None:
    """Where the device idles between its first activity and its last: the span, the time no kernel, copy or memset
    ran, how many idle stretches there were by length, and the longest few with the activities on either side. Each
    event: (name, start us, end us). Activities may overlap (a dependent launch starts before its predecessor ends):
    an idle stretch is one that no activity covers. None where the profiler recorded no device activity (no CUPTI),
    so that the run's other figures are still reported."""
    if not device_events:
        return None
    events = sorted(device_events, key=lambda event: event[1])
    gaps, covered_until, before = [], events[0][2], events[0][0]
    for name, start, end in events[1:]:
        if start > covered_until:
            gaps.append((start - covered_until, before, name))
        if end >= covered_until:
            covered_until, before = end, name
    lengths = [gap for gap, _, _ in gaps]
    return {
        "span_ms": round((covered_until - events[0][1]) / 1000, 3),
        "idle_ms": round(sum(lengths) / 1000, 3),
        "idle_stretches_by_us": {label: sum(low <= gap < high for gap in lengths) for label, low, high in (
            ("under 1", 0, 1), ("1-2", 1, 2), ("2-5", 2, 5), ("5-20", 5, 20), ("20 or more", 20, float("inf")))},
        "longest": [(round(gap, 1), before[:50], after[:50])
                    for gap, before, after in sorted(gaps, reverse=True)[:GAPS_REPORTED]],
    }


def synchronised_timer(function, stage: str, seconds: dict):
    """`function`, with its wall time (the device synchronised before and after) added to seconds[stage]."""
    def timed(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = function(*args, **kwargs)
        torch.cuda.synchronize()
        seconds[stage] += time.perf_counter() - start
        return result
    return timed


def stage_milliseconds(loaded, encoded_records: list, repeats: int = 5) -> dict:
    """Median-free mean over `repeats` forwards of each stage's synchronised wall time, in ms."""
    seconds = defaultdict(float)
    schema, thinker, head = loaded.schema, loaded.model.thinker, loaded.model.head
    originals = (schema.collate_records, thinker.forward, head.forward, serve_clef.PackedTextDecoder.forward)
    schema.collate_records = synchronised_timer(originals[0], "collate", seconds)
    thinker.forward = synchronised_timer(originals[1], "thinker (with its decoder)", seconds)
    head.forward = synchronised_timer(originals[2], "joint head", seconds)
    serve_clef.PackedTextDecoder.forward = synchronised_timer(originals[3], "text decoder", seconds)
    try:
        for _ in range(repeats):
            synchronised_timer(serve_clef.score_records, "score_records", seconds)(loaded, encoded_records)
    finally:
        schema.collate_records, thinker.forward, head.forward = originals[:3]
        del thinker.forward, head.forward  # back to the class's methods
        serve_clef.PackedTextDecoder.forward = originals[3]
    stages = {stage: round(total / repeats * 1000, 2) for stage, total in seconds.items()}
    stages["thinker around its decoder"] = round(stages.pop("thinker (with its decoder)") - stages["text decoder"], 2)
    return stages


def unsynchronised_milliseconds(loaded, encoded_records: list, wait_before_head: bool = False,
                                towers_attention: str = serve_clef.PACKED_ATTENTION, repeats: int = 5) -> float:
    """Median wall time of `score_records` as a request runs it (no stage synchronised), in ms. wait_before_head:
    the host first waits for the device to finish the decoder before it queues the joint head, as it did until the
    head's copy of its option rows came from pinned memory (a pageable copy waits for the device's queued work).
    towers_attention: the vision and audio towers' attention implementation ("sdpa": transformers' call per image or
    audio window, as before they took the packed attention)."""
    head = loaded.model.head
    towers = serve_clef.thinker_towers(loaded.model.thinker)
    for tower in towers:
        tower.config._attn_implementation = towers_attention

    def forward_after_waiting(*args, **kwargs):
        torch.cuda.synchronize()
        return type(head).forward(head, *args, **kwargs)

    if wait_before_head:
        head.forward = forward_after_waiting
    times = []
    try:
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            serve_clef.score_records(loaded, encoded_records)  # synchronises at its end
            times.append((time.perf_counter() - start) * 1000)
    finally:
        if wait_before_head:
            del head.forward  # back to the class's method
        for tower in towers:
            tower.config._attn_implementation = serve_clef.PACKED_ATTENTION
    return round(sorted(times)[repeats // 2], 2)


@contextlib.contextmanager
def one_record_on_the_batch_graphs(loaded):
    """One-record batches replay the graphs of batches of several records (their packed attention kernel), as before
    they had graphs of their own (cuDNN's attention)."""
    decoder = next(m for m in loaded.model.modules() if isinstance(m, serve_clef.PackedTextDecoder))
    served = dict(decoder.graphs)
    decoder.graphs.update({(bucket, True): graph for (bucket, one), graph in served.items() if not one})
    try:
        yield
    finally:
        decoder.graphs.update(served)


def profiled(run) -> dict:
    run()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        run()
        torch.cuda.synchronize()
    device_events = [(event.name, event.time_range.start, event.time_range.end) for event in profile.events()
                     if event.device_type == torch.autograd.DeviceType.CUDA]
    events = profile.key_averages()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total),
                     key=lambda e: -e.self_device_time_total)
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)
    return {
        "gpu_busy_ms": round(sum(e.self_device_time_total for e in kernels) / 1000, 2),
        "kernel_launches": sum(e.count for e in kernels),
        "device_idle": idle_gaps(device_events),
        "kernels": [(e.key[:70], round(e.self_device_time_total / 1000, 3), e.count) for e in kernels],
        "top_kernels": [(e.key[:70], round(e.self_device_time_total / 1000, 2), e.count)
                        for e in kernels[:KERNELS_REPORTED]],
        "top_host_operators": [(e.key[:70], round(e.self_cpu_time_total / 1000, 2), e.count)
                               for e in host[:HOST_OPERATORS_REPORTED]],
    }


def text_cases(loaded, max_length: int) -> dict[str, list]:
    """The encoded text records timed here and by time_forward.py: one of 516 tokens, and 16 of 480-510."""
    tokenizer = loaded.processor.tokenizer
    return {
        "1 record": [serve_clef.prepare(loaded, text_request(tokenizer, 516, 4242), max_length).encoded],
        "16 records": [serve_clef.prepare(loaded, text_request(tokenizer, 480 + 2 * i, 500 + i), max_length).encoded
                       for i in range(16)],
    }


def main() -> int:
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: print("   ", line, flush=True))
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    cases = text_cases(loaded, args.max_length)
    cases.update({name: [serve_clef.prepare(loaded, request, args.max_length).encoded]
                  for name, request in media_requests().items()})
    for name, records in cases.items():
        tokens = sum(len(record.input_ids) for record in records)
        stages = stage_milliseconds(loaded, records)
        stages["whole, as served"] = unsynchronised_milliseconds(loaded, records)
        stages["whole, the head queued after the decoder ran"] = unsynchronised_milliseconds(
            loaded, records, wait_before_head=True)
        stages["whole, the towers' attention a call per image or window"] = unsynchronised_milliseconds(
            loaded, records, towers_attention="sdpa")
        profile = profiled(lambda: serve_clef.score_records(loaded, records))
        if len(records) == 1:
            with one_record_on_the_batch_graphs(loaded):
                stages["whole, one record on the batch graphs"] = unsynchronised_milliseconds(loaded, records)
                before = profiled(lambda: serve_clef.score_records(loaded, records))
            profile["gpu_busy_ms_one_record_on_the_batch_graphs"] = before["gpu_busy_ms"]
        results[name] = {"tokens": tokens, "stages_ms": stages, **profile}
        print(f"{name} ({tokens} tokens): stages {stages}")
        print(f"    GPU busy {profile['gpu_busy_ms']} ms, {profile['kernel_launches']} kernel launches"
              + (f" (one record on the batch graphs: {profile['gpu_busy_ms_one_record_on_the_batch_graphs']} ms)"
                 if len(records) == 1 else ""))
        print("    device idle", json.dumps(profile["device_idle"]))
        for kernel in profile["top_kernels"]:
            print("    kernel", kernel)
        for operator in profile["top_host_operators"]:
            print("    host", operator)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "profile_forward.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
