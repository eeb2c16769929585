"""Lab (kept in history only; H100, 2026-12-06, docs/benchmarks.md): a media forward's synchronisations (synthetic:full on the GPU): for the image, audio and video records of
bench_serve.media_requests(3), the forward as served (median of 5, twice), then one forward under torch's sync debug
mode, each synchronising operation counted by the serve_clef / transformers frames that made it."""
import collections
import statistics
import traceback
import warnings
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402
from bench_serve import media_requests  # noqa: E402


def served_ms(loaded, records):
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        serve_clef.score_records(loaded, records)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main():
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: None)
    logits = {}
    for name, request in media_requests(3).items():
        records = [serve_clef.prepare(loaded, request, args.max_length).encoded]
        logits[name] = serve_clef.score_records(loaded, records)
        print(f"\n{name}: as served {served_ms(loaded, records):.2f} ms, again {served_ms(loaded, records):.2f} ms",
              flush=True)
        stacks = collections.Counter()

        def show(message, category, filename, lineno, file=None, line=None, stacks=stacks):
            frames = [f"{Path(frame.filename).name}:{frame.lineno} {frame.name}" for frame in traceback.extract_stack()
                      if any(part in frame.filename for part in ("serve_clef", "transformers", "joint_schema"))]
            stacks[(str(message)[:60], " <- ".join(reversed(frames[-4:])))] += 1
        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        serve_clef.score_records(loaded, records)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(0)
        for (message, place), count in stacks.most_common(30):
            print(f"  sync {count:3d}x {message} @ {place}", flush=True)


    if len(sys.argv) > 1:  # where to keep the logits, to compare two trees' bit for bit
        torch.save(logits, sys.argv[1])


if __name__ == "__main__":
    main()
