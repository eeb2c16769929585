"""Time the engine's forward as served (synthetic:full): one ~516-token record and 16 records of ~500 tokens, with
torch._inductor.config options if given, set before the load so the decoder layers' compile takes them.

For each: the forward as served (median of 9), torch.profiler's GPU busy time, launches and largest kernels, and the
answers' option logits saved to $OUT/NAME.pt. Run it once per setting or per tree (each in its own process: a load
takes 110-150 s on an H100), then compare the saved logits. It imports the serve_clef.py of the tree it lies in, so
to compare main's tree (extracted in base/) with this one, give base/ a copy of this script:

    python3 bench/time_forward.py changed
    cp bench/time_forward.py base/bench/ && (cd base && python3 bench/time_forward.py main)
    python3 bench/time_forward.py --compare main changed

Usage: python3 bench/time_forward.py NAME [OPTION=VALUE ...]   (OPTION: a torch._inductor.config name)
       python3 bench/time_forward.py --compare NAME NAME       (largest logit and probability differences)
"""

import ast
import json
import os
import sys
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
    name, settings = sys.argv[1], {}
    for item in sys.argv[2:]:
        key, _, value = item.partition("=")
        settings[key] = ast.literal_eval(value)
        setattr(inductor_config, key, settings[key])
    import serve_clef
    from profile_forward import profiled, text_cases, unsynchronised_milliseconds

    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: None)
    report, logits = {"name": name, "settings": settings}, {}
    for case, records in text_cases(loaded, args.max_length).items():
        logits[case] = serve_clef.score_records(loaded, records)
        profile = profiled(lambda: serve_clef.score_records(loaded, records))
        report[case] = {"as_served_ms": unsynchronised_milliseconds(loaded, records, repeats=9),
                        "gpu_busy_ms": profile["gpu_busy_ms"], "launches": profile["kernel_launches"],
                        "top_kernels": profile["top_kernels"][:12]}
        print(name, case, json.dumps(report[case]), flush=True)
    out = Path(os.environ.get("OUT", "."))
    torch.save(logits, out / f"{name}.pt")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
