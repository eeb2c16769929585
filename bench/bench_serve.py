"""Latency and memory of serve_clef's decision path on `synthetic:full` (the real Clef-Omni dimensions, random
weights), for the three expert paths side by side in one run:

- `--no-packed-nvfp4`: experts unpacked to BF16 once at load, stock transformers grouped_mm (the baseline);
- packed: experts kept NVFP4-packed, each layer unpacked just in time before its grouped GEMM;
- packed + `--simulate-fp4-activations`: the same with every expert input rounded to NVFP4 (faithful W4A4).

Each decision goes through `serve_clef.decide`, the server's own path (validation, media decoding, encode_record,
the model, answers). Run on the GPU machine:

    python3 bench/bench_serve.py            # writes $OUT/bench_serve.json when OUT is set
"""

import gc
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import joint_schema_model  # noqa: E402
import serve_clef  # noqa: E402
import synthetic_release  # noqa: E402

MODES = {
    "BF16 experts (--no-packed-nvfp4)": ["--no-packed-nvfp4"],
    "packed NVFP4": [],
    "packed NVFP4 + --simulate-fp4-activations": ["--simulate-fp4-activations"],
}
QUESTIONS = {
    "intent": {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {"refund": "money back", "exchange": "another item", "cancel": "stop the order", "info": None},
    },
    "urgency": {
        "type": "score", "instructions": "How urgent is it?", "criteria": ["none", "low", "mid", "high", "now"]
    },
    "escalate": {"type": "noul", "instructions": "Should a human take over?"},
}
WORDS = ("order parcel refund late broken customer support delivery invoice account password screen battery courier "
         "warehouse address payment card weekend promise angry polite manager ticket").split()


def text_request(tokenizer, target_tokens: int, seed: int) -> dict:
    """A JSON-state request whose encoded length is just at or above target_tokens."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(8 * target_tokens)]

    def request(word_count):
        return {"model": "clef-omni", "state": {"ticket": seed, "messages": " ".join(words[:word_count])},
                "questions": QUESTIONS}

    low, high = 0, len(words)
    while low < high:  # fewest words reaching the target
        middle = (low + high) // 2
        if len(joint_schema_model.encode_record(tokenizer, request(middle)).input_ids) >= target_tokens:
            high = middle
        else:
            low = middle + 1
    return request(low)


def media_requests() -> dict[str, dict]:
    def data_url(mime, data):
        import base64

        return f"data:{mime};base64," + base64.b64encode(data).decode()

    base = {"model": "clef-omni", "state": "Judge the attached media.", "questions": QUESTIONS}
    return {
        "image 640x480": {**base, "images": [data_url("image/png", synthetic_release.synthetic_png(640, 480))]},
        "audio 10 s": {**base, "audio": [data_url("audio/wav", synthetic_release.synthetic_wav(10.0))]},
        "video 4 s 320x240 + sound": {
            **base, "videos": [data_url("video/mp4", synthetic_release.synthetic_mp4(True, seconds=4, size=(320, 240)))]
        },
    }


def milliseconds(run, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return times


def bench_mode(flags: list[str]) -> dict:
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda", *flags])
    torch.cuda.reset_peak_memory_stats()
    loaded = serve_clef.load_clef(args, progress=lambda line: print("   ", line, flush=True))
    weights_gib = torch.cuda.memory_allocated() / 2**30
    tokenizer = loaded.processor.tokenizer

    def decide(request):
        return serve_clef.decide(loaded, request, args.max_length)

    result = {"load_s": round(loaded.load_s, 1), "weights_gib": round(weights_gib, 2)}
    requests = {"512": text_request(tokenizer, 512, 0), "2048": text_request(tokenizer, 2048, 1)}
    result["first_decision_ms"] = round(milliseconds(lambda: decide(requests["512"]), 1)[0], 1)  # compile, warm-up
    for name, request in requests.items():
        decide(request)
        times = milliseconds(lambda: decide(request), 5)
        result[f"text_{name}_ms"] = round(statistics.median(times), 1)
        result[f"text_{name}_tokens"] = decide(request)["usage"]["input_tokens"]

    burst = [text_request(tokenizer, 512, 100 + i) for i in range(16)]
    # 16 requests arriving at once, queued on one long-lived scoring thread as the HTTP server queues them.
    with ThreadPoolExecutor(max_workers=1) as scorer:
        scorer.submit(torch.cuda.synchronize).result()
        start = time.perf_counter()
        list(scorer.map(decide, burst))
        scorer.submit(torch.cuda.synchronize).result()
    result["burst_16x512_ms"] = round((time.perf_counter() - start) * 1000, 1)

    for name, request in media_requests().items():
        decide(request)
        times = milliseconds(lambda: decide(request), 3)
        result[f"{name}_ms"] = round(statistics.median(times), 1)
        result[f"{name}_tokens"] = decide(request)["usage"]["input_tokens"]

    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    packed_layers = [m for m in loaded.model.modules() if isinstance(m, serve_clef.PackedNVFP4Experts)]
    if packed_layers:
        result.update(unpack_times(packed_layers[0]))
    return result


def unpack_times(layer) -> dict:
    """One layer's just-in-time unpack (gate_up and down), as served and in plain eager torch."""

    def eager():
        serve_clef.unpack_nvfp4(layer.gate_up_packed_codes, layer.gate_up_block_scales, layer.gate_up_global_scale)
        serve_clef.unpack_nvfp4(layer.down_packed_codes, layer.down_block_scales, layer.down_global_scale)

    layer.unpacked()
    eager()
    return {
        "unpack_layer_ms": round(statistics.median(milliseconds(layer.unpacked, 20)), 3),
        "unpack_layer_eager_ms": round(statistics.median(milliseconds(eager, 5)), 3),
    }


def main() -> None:
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
          f"{serve_clef.transformers.__version__}", flush=True)
    results = {}
    for name, flags in MODES.items():
        print(f"== {name}", flush=True)
        results[name] = bench_mode(flags)
        gc.collect()  # the mode's model went out of scope with bench_mode: give its GPU memory back
        torch.cuda.empty_cache()
        print(json.dumps(results[name], indent=1), flush=True)
    rows = sorted({key for result in results.values() for key in result})
    print("\n| metric | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for row in rows:
        print(f"| {row} | " + " | ".join(str(results[name].get(row, "")) for name in MODES) + " |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_serve.json").write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": serve_clef.transformers.__version__, "results": results,
        }, indent=2))


if __name__ == "__main__":
    main()
