"""Lab: where the spread of lone decisions comes from. Lone ~512-token decisions on new texts, timed as
time_forward.py does, came out 16.8-19.2 ms in runs of similar values, with medians 1 ms apart between processes of
the same tree. This times 72 new texts in three plans taken in turn (back to back; 50 ms apart, as a client with a
little think time; 500 ms apart, as a quiet server), each decision's stages beside it, while nvidia-smi samples the
GPU's clocks every 10 ms, and prints per plan the medians and the SM clock at each decision's start.

Usage: python3 bench/lab_clocks.py   (writes $OUT/lab_clocks.json and $OUT/clocks.csv)
"""

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLOCK_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
PLANS = {"back to back": 0.0, "50 ms apart": 0.05, "500 ms apart": 0.5}  # seconds slept before each decision


def sampled_clocks(path: Path) -> list[tuple[float, int]]:
    """(epoch seconds, SM MHz) of each nvidia-smi sample (its timestamps are the machine's local time)."""
    samples = []
    for line in path.read_text().splitlines():
        fields = [field.strip() for field in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((stamp, int(fields[1])))
        except (ValueError, IndexError):
            continue
    return samples


def clock_at(samples: list[tuple[float, int]], moment: float) -> int | None:
    """The SM clock of the last sample at or before `moment`."""
    before = [mhz for stamp, mhz in samples if stamp <= moment]
    return before[-1] if before else None


def main() -> int:
    import serve_clef
    from bench_serve import text_request

    out = Path(os.environ.get("OUT", "."))
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: None)
    tokenizer = loaded.processor.tokenizer
    requests = {plan: [text_request(tokenizer, 484 + 4 * (i % 16), 900 + 100 * k + i) for i in range(24)]
                for k, plan in enumerate(PLANS)}
    with open(out / "clocks.csv", "w") as clocks_file:
        sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={CLOCK_FIELDS}", "--format=csv,noheader,nounits",
                                    "-lms", "10"], stdout=clocks_file)
        time.sleep(1.0)
        serve_clef.decide(loaded, text_request(tokenizer, 500, 1), args.max_length)  # a warm-up, not counted
        rows = []
        for turn in range(2):  # the plans in turn, twice, so that a drift over time falls on each
            for plan, gap in PLANS.items():
                for request in requests[plan][12 * turn:12 * (turn + 1)]:
                    time.sleep(gap)
                    timings = {}
                    torch.cuda.synchronize()
                    started_at, started = time.time(), time.perf_counter()
                    serve_clef.decide(loaded, request, args.max_length, timings)
                    torch.cuda.synchronize()
                    rows.append({"plan": plan, "started_at": started_at,
                                 "ms": round((time.perf_counter() - started) * 1000, 2),
                                 **{stage: round(seconds * 1000, 2) for stage, seconds in timings.items()}})
        time.sleep(0.5)
        sampler.terminate()
        sampler.wait()
    samples = sampled_clocks(out / "clocks.csv")
    for row in rows:
        row["sm_mhz_at_start"] = clock_at(samples, row["started_at"])
    summary = {}
    for plan in PLANS:
        mine = [row for row in rows if row["plan"] == plan]
        summary[plan] = {key: round(statistics.median(row.get(key, 0.0) for row in mine), 2)
                         for key in ("ms", "decode", "encode", "forward", "answer")}
        summary[plan]["ms_range"] = [min(row["ms"] for row in mine), max(row["ms"] for row in mine)]
        summary[plan]["sm_mhz_at_start"] = sorted({row["sm_mhz_at_start"] for row in mine if row["sm_mhz_at_start"]})
        print(plan, json.dumps(summary[plan]), flush=True)
    for row in rows:
        print(row["plan"], row["ms"], row.get("forward"), row.get("encode"), row["sm_mhz_at_start"])
    clocks = [mhz for _, mhz in samples]
    print("SM clock samples:", len(clocks), "min / median / max MHz", min(clocks), statistics.median(clocks),
          max(clocks))
    (out / "lab_clocks.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
