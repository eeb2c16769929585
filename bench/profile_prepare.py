"""Where a media request's host preparation goes (the `decode` and `encode` stages of Server-Timing), on this
machine's CPUs: no model runs, so it needs no GPU, but it is meant for the GPU machine's host, whose CPUs prepare
the served requests.

For each medium of bench_serve's media requests (image 640x480, audio 10 s, video 4 s 320x240 with sound), eight
distinct variants (other pixels and tones) are prepared by the server's own `prepare` at several torch thread
counts (the server caps them at PREPARATION_CPU_THREADS on a GPU); reported: the medians of decode and encode. Then
the audio's and the video's encode, at the served thread count, profiled by cProfile (the top functions by cumulative
time: frames and soundtrack decoded, the processor's video and audio parts, the tokenizer).

Usage: python3 bench/profile_prepare.py   (writes $OUT/profile_prepare.json when OUT is set)
"""

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serve  # bench/: the media requests

import serve_clef  # the repository root

THREAD_COUNTS = (1, 2, 4, 8, 16)
VARIANTS = range(1, 9)
AUDIO, VIDEO = "audio 10 s", "video 4 s 320x240 + sound"


def stage_medians(loaded, name: str) -> dict[str, float]:
    """Median decode and encode of the medium's variants, ms (a first, unmeasured call warms the path)."""
    serve_clef.prepare(loaded, bench_serve.media_requests(0)[name], 8192)
    stages = []
    for variant in VARIANTS:
        timings = {}
        serve_clef.prepare(loaded, bench_serve.media_requests(variant)[name], 8192, timings)
        stages.append(timings)
    return {stage: round(statistics.median(timings[stage] for timings in stages) * 1000, 2)
            for stage in ("decode", "encode")}


def main() -> int:
    loaded = serve_clef.load_clef("synthetic", device="cpu", progress=lambda message: None)
    served_threads = serve_clef.PREPARATION_CPU_THREADS
    results = {"cpus": os.cpu_count(), "torch threads at start": torch.get_num_threads(), "by thread count": {}}
    print(f"{os.cpu_count()} CPUs; torch starts {torch.get_num_threads()} threads; served: at most {served_threads}")
    for threads in THREAD_COUNTS:
        torch.set_num_threads(threads)
        row = {name: stage_medians(loaded, name) for name in bench_serve.media_requests(0)}
        results["by thread count"][threads] = row
        print(f"{threads:2d} torch threads: {row}")
    torch.set_num_threads(min(os.cpu_count(), served_threads))
    for name in (AUDIO, VIDEO):  # the audio's too: its Whisper features are the video soundtrack's counterpart
        profile = cProfile.Profile()
        record = serve_clef.decode_media(serve_clef.validate_request(bench_serve.media_requests(9)[name])[0],
                                         loaded.schema)
        profile.enable()
        for _ in range(5):
            loaded.schema.encode_record(loaded.processor.tokenizer, record, 8192, processor=loaded.processor)
        profile.disable()
        report = io.StringIO()
        pstats.Stats(profile, stream=report).sort_stats("cumulative").print_stats(30)
        results[f"{name} encode profile, 5 calls"] = report.getvalue()
        print(f"{name}, encode profiled:\n{report.getvalue()}")
    if out := os.environ.get("OUT"):
        Path(out, "profile_prepare.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
