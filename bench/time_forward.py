"""Time the engine's forward as served (synthetic:full): one ~516-token record and 16 records of ~500 tokens, with
torch._inductor.config options if given, set before the load so the decoder layers' compile takes them.

For each: the forward as served (median of 9), torch.profiler's GPU busy time, launches, largest kernels and the
device's idle stretches (profile_forward.idle_gaps), and the answers' option logits saved to $OUT/NAME.pt. Then lone
decisions as users send them: 16 new texts of 484-544 tokens, each decided once (`decide`, synchronised), their
median. Run it once per setting or per tree (each in its own process: a load takes 110-150 s on an H100), then
compare the saved logits. It imports the serve_clef.py of the tree it lies in, so to compare main's tree (extracted
in base/) with this one, give base/ a copy of this script and of profile_forward.py, whose profiles it reads (and
leave base/ untracked but not ignored by git: a device run's copy of the tree carries only such files).
`--after FILE` lets two processes load side by side and time one after the other: each writes $OUT/NAME.loaded once
loaded, then waits until FILE exists, and writes $OUT/NAME.done when it has timed everything:

    cp bench/time_forward.py bench/profile_forward.py base/bench/
    python3 bench/time_forward.py changed --after "$OUT/go" & changed=$!
    (cd base && python3 bench/time_forward.py main --after "$OUT/changed.done") & main=$!
    until [ -e "$OUT/changed.loaded" ] && [ -e "$OUT/main.loaded" ]
    do kill -0 $changed && kill -0 $main || break; sleep 1; done
    touch "$OUT/go"; wait
    python3 bench/time_forward.py --compare main changed

(the loop stops waiting once either process has ended, so that one that failed to start costs no device time).

Usage: python3 bench/time_forward.py NAME [--after FILE] [OPTION=VALUE ...]   (OPTION: a torch._inductor.config name)
       python3 bench/time_forward.py --compare NAME NAME       (largest logit and probability differences)
"""

import ast
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def compare(first: str, second: str) -> int:
    """The largest difference between two saved runs' option logits, and between their options' probabilities
    (softmax over each question's options)."""
    out = Path(os.environ.get("OUT", "."))
    runs = torch.load(out / f"{first}.pt"), torch.load(out / f"{second}.pt")
    logits_gap = probability_gap = 0.0
    for case in runs[0]:
        for record_a, record_b in zip(runs[0][case], runs[1][case], strict=True):
            for logits_a, logits_b in zip(record_a, record_b, strict=True):
                logits_a, logits_b = logits_a.float(), logits_b.float()
                logits_gap = max(logits_gap, (logits_a - logits_b).abs().max().item())
                probability_gap = max(probability_gap,
                                      (logits_a.softmax(-1) - logits_b.softmax(-1)).abs().max().item())
    print(f"{first} vs {second}: max |logit difference| {logits_gap:.5f}, max |probability difference| "
          f"{probability_gap:.5f}")
    return 0


def main() -> int:
    if sys.argv[1] == "--compare":
        return compare(sys.argv[2], sys.argv[3])
    import torch._inductor.config as inductor_config
    name, options = sys.argv[1], sys.argv[2:]
    after = None
    if options[:1] == ["--after"]:
        after, options = Path(options[1]), options[2:]
    settings = {}
    for item in options:
        key, _, value = item.partition("=")
        settings[key] = ast.literal_eval(value)
        setattr(inductor_config, key, settings[key])
    import serve_clef
    from bench_serve import text_request, timed_decision
    from profile_forward import profiled, text_cases, unsynchronised_milliseconds

    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: None)
    out = Path(os.environ.get("OUT", "."))
    (out / f"{name}.loaded").touch()
    while after is not None and not after.exists():  # the other process times first
        time.sleep(0.5)
    report, logits = {"name": name, "settings": settings}, {}
    for case, records in text_cases(loaded, args.max_length).items():
        logits[case] = serve_clef.score_records(loaded, records)
        profile = profiled(lambda: serve_clef.score_records(loaded, records))
        report[case] = {"as_served_ms": unsynchronised_milliseconds(loaded, records, repeats=9),
                        "gpu_busy_ms": profile["gpu_busy_ms"], "launches": profile["kernel_launches"],
                        "device_idle": profile["device_idle"],
                        "top_kernels": profile["top_kernels"][:12]}
        print(name, case, json.dumps(report[case]), flush=True)
        report[case]["kernels"] = profile["kernels"]  # every kernel, in the saved report only
    # lone decisions on new texts, each timed once (seeds apart from text_cases' and from check_engine_gpu.py's)
    tokenizer = loaded.processor.tokenizer
    decide = lambda request: serve_clef.decide(loaded, request, args.max_length)  # noqa: E731
    timed_decision(decide, text_request(tokenizer, 500, 1))  # a warm-up, not counted
    times = [timed_decision(decide, text_request(tokenizer, 484 + 4 * i, 700 + i))[0] for i in range(16)]
    report["lone decisions, new texts"] = {"median_ms": round(statistics.median(times), 2),
                                           "ms": [round(t, 2) for t in times]}
    print(name, "lone decisions, new texts", json.dumps(report["lone decisions, new texts"]), flush=True)
    torch.save(logits, out / f"{name}.pt")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    (out / f"{name}.done").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
