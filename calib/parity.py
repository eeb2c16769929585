# /// script
# requires-python = ">=3.11"
# dependencies = [
#   "torch==2.11.0",  # the build serve_clef runs on the H200 (CUDA 13.0); CPU machines: see the README
#   "transformers>=5.17",
#   "safetensors",
#   "tokenizers",
#   "huggingface_hub",
#   "numpy",
#   "pillow",
#   "av>=17",  # VideoFrame.to_ndarray(threads=...)
#   "triton",
#   "fastapi",
#   "uvicorn",
#   "requests",
#   "prometheus-client",
#   "zstandard",
#   "python-multipart",
#   "tqdm",
# ]
# ///
"""Parity of two Clef-Omni checkpoints on the held-out records (docs/nvfp4-format.md §6).

    python calib/parity.py REFERENCE CANDIDATE [--records 128] [--simulate-fp4-activations] [--out parity.json]

Both checkpoints are loaded with serve_clef's `load_clef`, so they run the code that serves them. For every question
of every record, p = fp32 softmax of the joint head's option logits; the report gives top-1 agreement, the total
variation TV = 0.5 * sum_o |p_ref(o) - p_cand(o)| (mean, p95, max), every flipped question with the reference's top-1
minus top-2 margin (a flip with a small margin is noise, one with a large margin is damage), tokens, and forward
milliseconds, and each side's memory: its weights in GiB, and on a GPU the peak allocated while it scored. When the
reference is BF16 the report also holds its noise floor: the same weights through the other experts kernel (eager
against grouped_mm), so a candidate's TV can be read against what kernel order alone moves. Either side may instead
be the base URL of a running serve_clef: its answers give the probabilities, rounded to 1e-4 as the API returns them
(records go over the wire with media as PNG, WAV and MPEG-4 data URLs).

The verdict applies the gates of docs/nvfp4-format.md §6 (top1_agreement >= 0.98, mean_tv <= 0.03) to the candidate:
"pass", or "fail" with exit status 1. When either side is synthetic (random weights, written by synthetic_release.py)
the numbers say nothing about quantization, and the verdict is "not judged".
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: find serve_clef, joint_schema_model and calib
    sys.path.insert(0, str(REPO_ROOT))

from calib.records import evaluation_records, to_request

# The gates of docs/nvfp4-format.md §6, applied to the candidate against the reference.
MIN_TOP1_AGREEMENT = 0.98
MAX_MEAN_TV = 0.03


def progress(line: str) -> None:
    """Progress goes to stderr, so that stdout holds the summary alone."""
    print(line, file=sys.stderr, flush=True)


def progress_bar(records: list[dict], what: str):
    """The records, counted on stderr as they are scored."""
    from tqdm import tqdm

    return tqdm(records, desc=f"scoring {what}", unit="record", file=sys.stderr)


@torch.inference_mode()
def score_records(loaded, records: list[dict], what: str = "records") -> list[dict]:
    """Per question of every record, in order: ids, option ids, fp32 probabilities, the record's tokens and ms."""
    schema, processor, model = loaded.schema, loaded.processor, loaded.model
    device = next(model.parameters()).device
    scored = []
    for record in progress_bar(records, what):
        encoded = schema.encode_record(processor.tokenizer, record, processor=processor)
        batch = schema.collate_records([encoded], processor.tokenizer.pad_token_id, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        logits = model(batch)[0]  # one 1-D tensor of option logits per question
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        forward_ms = (time.perf_counter() - started) * 1000
        for question, question_logits in zip(encoded.questions, logits):
            scored.append({
                "record_id": encoded.record_id, "question_id": question.question_id,
                "option_ids": list(question.option_ids),
                "probabilities": question_logits.float().softmax(-1).tolist(),
                "tokens": len(encoded.input_ids), "forward_ms": forward_ms,
            })
    return scored


def score_server(base_url: str, records: list[dict]) -> list[dict]:
    """score_records through a running serve_clef (POST /v1/systemone): probabilities come back rounded to 1e-4,
    noul answers give only P(true), and `forward_ms` is the whole request round trip."""
    import requests

    from joint_schema_model import question_options

    scored = []
    for record in progress_bar(records, base_url):
        started = time.perf_counter()
        response = requests.post(f"{base_url.rstrip('/')}/v1/systemone", json=to_request(record), timeout=600)
        request_ms = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            raise RuntimeError(f"{base_url}: HTTP {response.status_code} for record {record['id']}: "
                               f"{response.text[:500]}")
        body = response.json()
        for question_id, question in record["questions"].items():
            answer = body["answers"][question_id]
            option_ids = [option_id for option_id, _ in question_options(question)]  # the order the model scores
            if answer["type"] == "noul":
                probabilities = [answer["noul"], 1.0 - answer["noul"]]  # options ("true", "false")
            else:
                probabilities = [answer["probabilities"][option_id] for option_id in option_ids]
            scored.append({
                "record_id": str(record["id"]), "question_id": question_id, "option_ids": option_ids,
                "probabilities": probabilities, "tokens": body["usage"]["input_tokens"], "forward_ms": request_ms,
            })
    return scored


def compare(reference: list[dict], candidate: list[dict]) -> dict:
    """Top-1 agreement, TV statistics and flips of a candidate's per-question probabilities against a reference's."""
    if [(r["record_id"], r["question_id"], r["option_ids"]) for r in reference] != \
            [(c["record_id"], c["question_id"], c["option_ids"]) for c in candidate]:
        raise ValueError("reference and candidate scored different questions or options: use the same records")
    total_variations, flips = [], []
    max_abs_difference = 0.0
    for ref, cand in zip(reference, candidate):
        p, q = np.asarray(ref["probabilities"]), np.asarray(cand["probabilities"])
        total_variations.append(0.5 * float(np.abs(p - q).sum()))
        max_abs_difference = float(np.max([max_abs_difference, np.abs(p - q).max()]))  # NaN stays NaN
        if int(p.argmax()) != int(q.argmax()):
            top2 = np.sort(p)[-2:]
            flips.append({"record_id": ref["record_id"], "question_id": ref["question_id"],
                          "reference_top1": ref["option_ids"][int(p.argmax())],
                          "candidate_top1": cand["option_ids"][int(q.argmax())],
                          "reference_margin": float(top2[1] - top2[0]), "tv": total_variations[-1]})
    return {
        "questions": len(reference),
        "top1_agreement": 1.0 - len(flips) / len(reference),
        "mean_tv": float(np.mean(total_variations)),
        "p95_tv": float(np.percentile(total_variations, 95)),
        "max_tv": float(np.max(total_variations)),
        "max_abs_dp": max_abs_difference,
        "flips": sorted(flips, key=lambda flip: -flip["reference_margin"]),
    }


def _per_record(scored: list[dict], key: str) -> list[float]:
    return list({s["record_id"]: s[key] for s in scored}.values())


def _forward_ms(scored: list[dict]) -> dict:
    per_record = _per_record(scored, "forward_ms")
    return {"median": float(np.median(per_record)), "p95": float(np.percentile(per_record, 95))}


def _stock_experts_modules(model) -> list[torch.nn.Module]:
    """transformers' own experts modules, which dispatch on their (text) config's experts implementation per call."""
    return [module for module in model.modules()
            if hasattr(module, "gate_up_proj") and hasattr(getattr(module, "config", None), "_experts_implementation")]


def weights_gib(model: torch.nn.Module) -> float:
    """What a loaded model's parameters and buffers hold (the packed experts' codes and scales among them), each
    storage counted once (tied weights share one), in GiB: the checkpoint's cost in the memory it was loaded to, before
    any activation. Tables serve_clef keeps in host memory on a GPU (its token and output embeddings' lookups) are
    plain attributes, not counted."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                for tensor in itertools.chain(model.parameters(), model.buffers())}
    return sum(storages.values()) / 2**30


def score_with_other_experts_kernel(loaded, records: list[dict]) -> tuple[list[str], list[dict]]:
    """The noise-floor run: a BF16 model scored again through the other experts kernel (eager <-> grouped_mm)."""
    experts_modules = _stock_experts_modules(loaded.model)
    if not experts_modules:
        raise ValueError(f"{loaded.checkpoint_dir} has no transformers experts modules to switch (packed experts?)")
    current = experts_modules[0].config._experts_implementation
    other = "eager" if current != "eager" else "grouped_mm"
    for experts in experts_modules:
        experts.config._experts_implementation = other
    try:
        return [current, other], score_records(loaded, records, f"the noise floor ({other} experts)")
    finally:
        for experts in experts_modules:
            experts.config._experts_implementation = current


def judge(stats: dict, synthetic_sides: list[str]) -> dict:
    """The verdict on a candidate's `compare` statistics against the gates of docs/nvfp4-format.md §6."""
    failed = []
    # `not`: a NaN statistic (NaN probabilities) fails its gate, where `<` and `>` would pass it
    if not stats["top1_agreement"] >= MIN_TOP1_AGREEMENT:
        failed.append(f"top1_agreement {stats['top1_agreement']:.3f} < {MIN_TOP1_AGREEMENT}")
    if not stats["mean_tv"] <= MAX_MEAN_TV:
        failed.append(f"mean_tv {stats['mean_tv']:.4f} > {MAX_MEAN_TV}")
    if synthetic_sides:
        verdict = "not judged"
    else:
        verdict = "fail" if failed else "pass"
    return {"verdict": verdict, "gates": {"min_top1_agreement": MIN_TOP1_AGREEMENT, "max_mean_tv": MAX_MEAN_TV},
            "failed_gates": failed, "synthetic": synthetic_sides}


def parity_report(reference: dict, candidate: dict, reference_scores: list[dict], candidate_scores: list[dict],
                  noise_floor: tuple[list[str], list[dict]] | None = None) -> dict:
    """The report (see the module doc); `reference` / `candidate` say what was scored ({"source", "kind",
    "synthetic", "memory_gib": {"weights", "peak"}})."""
    tokens = _per_record(reference_scores, "tokens")
    candidate_vs_reference = compare(reference_scores, candidate_scores)
    synthetic_sides = [side for side, description in (("reference", reference), ("candidate", candidate))
                       if description["synthetic"]]
    report = {
        "reference": reference,
        "candidate": candidate,
        "records": len(tokens),
        "tokens": {"total": int(sum(tokens)), "per_record_mean": float(np.mean(tokens))},
        "forward_ms": {"reference": _forward_ms(reference_scores), "candidate": _forward_ms(candidate_scores)},
        "candidate_vs_reference": candidate_vs_reference,
        **judge(candidate_vs_reference, synthetic_sides),
        "noise_floor": None,
        "per_question": [
            {"record_id": ref["record_id"], "question_id": ref["question_id"], "option_ids": ref["option_ids"],
             "reference": ref["probabilities"], "candidate": cand["probabilities"]}
            for ref, cand in zip(reference_scores, candidate_scores)
        ],
    }
    if noise_floor is not None:
        implementations, floor_scores = noise_floor
        report["noise_floor"] = {"experts_implementations": implementations, **compare(reference_scores, floor_scores)}
    return report


def print_summary(report: dict) -> None:
    rows = [("candidate vs reference", report["candidate_vs_reference"])]
    if report["noise_floor"] is not None:
        rows.append(("BF16 noise floor ({}/{})".format(*report["noise_floor"]["experts_implementations"]),
                     report["noise_floor"]))
    print(f"reference {report['reference']['kind']} {report['reference']['source']}")
    print(f"candidate {report['candidate']['kind']} {report['candidate']['source']}")
    print(f"{'':36} {'top-1':>7} {'mean TV':>8} {'p95 TV':>8} {'max TV':>8} {'flips':>9}")
    for label, stats in rows:
        print(f"{label:36} {stats['top1_agreement']:7.3f} {stats['mean_tv']:8.4f} {stats['p95_tv']:8.4f} "
              f"{stats['max_tv']:8.4f} {len(stats['flips']):4d}/{stats['questions']}")
    forward_ms = report["forward_ms"]
    print(f"{report['records']} records, {report['tokens']['total']} tokens; forward ms median/p95: reference "
          f"{forward_ms['reference']['median']:.1f}/{forward_ms['reference']['p95']:.1f}, candidate "
          f"{forward_ms['candidate']['median']:.1f}/{forward_ms['candidate']['p95']:.1f}")
    for side in ("reference", "candidate"):
        memory = report[side]["memory_gib"]
        if memory["weights"] is None:
            print(f"{side} memory: not known (a server)")
            continue
        peak = "not measured on CPU" if memory["peak"] is None else f"{memory['peak']:.2f} GiB"
        print(f"{side} memory: weights {memory['weights']:.2f} GiB, peak while scoring {peak}")
    for flip in report["candidate_vs_reference"]["flips"]:
        print(f"  flip {flip['record_id']} {flip['question_id']}: {flip['reference_top1']} -> "
              f"{flip['candidate_top1']} (reference margin {flip['reference_margin']:.3f}, TV {flip['tv']:.3f})")
    gates = f"top1_agreement >= {MIN_TOP1_AGREEMENT}, mean_tv <= {MAX_MEAN_TV} (docs/nvfp4-format.md §6)"
    if report["verdict"] == "not judged":
        print(f"verdict: not judged: synthetic (random weights): {' and '.join(report['synthetic'])}; these numbers "
              f"say nothing about quantization, only that both checkpoints load and score. Gates: {gates}")
    elif report["verdict"] == "fail":
        print(f"verdict: FAIL: {'; '.join(report['failed_gates'])}. Gates: {gates}")
    else:
        print(f"verdict: pass. Gates: {gates}")


def _score(checkpoint: str, records: list[dict], device: str, flags: list[str], with_noise_floor: bool, what: str):
    """(description, scores, noise floor or None) of a checkpoint loaded here, or of a server given by its URL."""
    import serve_clef

    if checkpoint.startswith(("http://", "https://")):
        import requests

        notice = requests.get(f"{checkpoint.rstrip('/')}/healthz", timeout=60).json().get("notice")
        progress(f"{what}: the server at {checkpoint}")
        description = {"source": checkpoint, "kind": "server", "synthetic": notice == serve_clef.SYNTHETIC_NOTICE,
                       "memory_gib": {"weights": None, "peak": None}}
        return description, score_server(checkpoint, records), None
    progress(f"{what}: loading {checkpoint}")
    loaded = serve_clef.load_from_args(serve_clef.parse_args(["--model", checkpoint, "--device", device] + flags),
                                       progress=progress)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    scores = score_records(loaded, records, f"the {what}")
    memory_gib = {"weights": weights_gib(loaded.model),
                  "peak": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
    noise_floor = None
    if with_noise_floor and loaded.kind == "bf16":
        noise_floor = score_with_other_experts_kernel(loaded, records)
    description = {"source": str(loaded.checkpoint_dir), "kind": loaded.kind,
                   "synthetic": loaded.notice == serve_clef.SYNTHETIC_NOTICE, "memory_gib": memory_gib}
    del loaded
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return description, scores, noise_floor


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="reference checkpoint (normally the BF16 release): directory, hub id, "
                        "or the http(s) base URL of a running serve_clef")
    parser.add_argument("candidate", help="candidate checkpoint (normally the NVFP4 export), same forms")
    parser.add_argument("--records", type=int, default=128, help="held-out records (1..128, default 128)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--simulate-fp4-activations", action="store_true",
                        help="run a candidate checkpoint with serve_clef's W4A4 activation replay")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    records = evaluation_records(args.records)
    progress(f"{len(records)} held-out records, {sum(len(r['questions']) for r in records)} questions")
    # One checkpoint in memory at a time: BF16 Clef-Omni alone takes ~64 GB.
    reference_description, reference_scores, noise_floor = _score(args.reference, records, args.device, [], True,
                                                                  "reference")
    candidate_flags = ["--simulate-fp4-activations"] if args.simulate_fp4_activations else []
    candidate_description, candidate_scores, _ = _score(args.candidate, records, args.device, candidate_flags, False,
                                                        "candidate")
    report = parity_report(reference_description, candidate_description, reference_scores, candidate_scores,
                           noise_floor)
    print_summary(report)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["verdict"] == "fail" else 0)
