"""Lab (GPU): a video forward with the thinker's 3-D positions from rope_index_from_host (served since 2026-12-05)
against transformers' own `get_rope_index`, interleaved in one process on `synthetic:full`.

Records: bench_serve's 4 s 320x240 video with its soundtrack (new media for every forward) and one 20 s video with
its soundtrack; each forward (`score_records`, the server's) timed to its end, 9 of each setting in turn, and the
host-device synchronisations of one forward of each counted by torch's sync debug mode. The two settings' logits
must be bit-identical (the positions are).

Usage (GPU, the wheels the server needs installed): python3 bench/lab_positions_gpu.py
"""

import base64
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serve  # noqa: E402
import serve_clef  # noqa: E402
import synthetic_release  # noqa: E402

FORWARDS = 9


def main() -> int:
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: print("   ", line, flush=True))
    modules = [module for module in loaded.model.thinker.modules() if "get_rope_index" in module.__dict__]
    ours = [module.__dict__["get_rope_index"] for module in modules]
    if not modules:
        print("rope_index_from_host is not installed (the load said why): nothing to compare")
        return 1

    def use(host_walk: bool) -> None:
        for module, function in zip(modules, ours):
            if host_walk:
                module.get_rope_index = function
            else:
                module.__dict__.pop("get_rope_index", None)

    long_video = synthetic_release.synthetic_mp4(True, seconds=20, size=(320, 240), shift=11)
    records = {
        "4 s video + sound": [serve_clef.prepare(loaded, bench_serve.media_requests(variant)[
            "video 4 s 320x240 + sound"], args.max_length).encoded for variant in range(2 * FORWARDS + 1)],
        "20 s video + sound": [serve_clef.prepare(loaded, {
            **bench_serve.media_requests(0)["video 4 s 320x240 + sound"],
            "videos": ["data:video/mp4;base64," + base64.b64encode(long_video).decode()]}, args.max_length).encoded],
    }
    failures = 0
    for name, prepared in records.items():
        times = {True: [], False: []}
        for index in range(2 * FORWARDS):
            host_walk = index % 2 == 0
            use(host_walk)
            record = prepared[index % len(prepared)]
            torch.cuda.synchronize()
            start = time.perf_counter()
            serve_clef.score_records(loaded, [record])
            times[host_walk].append((time.perf_counter() - start) * 1000)
        logits, syncs = {}, {}
        for host_walk in (True, False):
            use(host_walk)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits[host_walk] = serve_clef.score_records(loaded, [prepared[-1]])
            torch.cuda.set_sync_debug_mode(0)
            syncs[host_walk] = sum("synchroniz" in str(warning.message) for warning in caught)
        use(True)
        equal = all(torch.equal(a, b) for first, second in zip(logits[True], logits[False])
                    for a, b in zip(first, second))
        failures += not equal
        print(f"{name} ({len(prepared[-1].input_ids)} tokens), forward medians of {FORWARDS}: host walk "
              f"{statistics.median(times[True]):.1f} ms ({syncs[True]} synchronisations), transformers' "
              f"{statistics.median(times[False]):.1f} ms ({syncs[False]}); logits bit-identical {equal}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
