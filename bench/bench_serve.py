"""Latency and memory of serve_clef's decision path on `synthetic:full` (the real Clef-Omni dimensions, random
weights), side by side in one run:

- packed experts with the Triton kernels, launched op by op as before the engine (the text decoder put back eager,
  cuDNN attention back on): the baseline;
- the same with the engine: the text decoder replayed from CUDA graphs per length bucket (the default);
- `--no-packed-nvfp4`: experts unpacked to BF16 once at load, stock transformers grouped_mm, with the engine;
- the Triton kernels with `--simulate-fp4-activations` (faithful W4A4), with the engine.

Each decision goes through `serve_clef.decide`, the server's own path (validation, media decoding, encode_record,
the model, answers). Text latency is timed on what users send, distinct requests of lengths not seen before, each
timed once (`first_sight`), then one of them again (`repeat`). One more new request is recorded by torch.profiler:
the GPU's busy time, the kernels launched and the largest of them. (bench/check_engine_gpu.py checks the graphs'
answers.) Run on the GPU machine:

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

MODES = {  # name: (flags, text decoder in CUDA graphs)
    "packed, Triton kernels, op by op (before the engine)": ([], False),
    "packed, Triton kernels, CUDA graphs (default)": ([], True),
    "BF16 experts (--no-packed-nvfp4), CUDA graphs": (["--no-packed-nvfp4"], True),
    "packed, Triton + --simulate-fp4-activations, CUDA graphs": (["--simulate-fp4-activations"], True),
}
# Text latency per length class: one request per target length, each with its own seed, so every one is new content
# of a new length (as users send them) and is timed once; then the first of them is timed `repeats` more times.
TEXT_GROUPS = {
    "512": {"targets": (512, 517, 523, 530, 541, 549, 556, 563), "first_seed": 0, "repeats": 5},
    "2048": {"targets": (2048, 2061, 2077, 2090), "first_seed": 8, "repeats": 3},
}
PROFILED_KERNELS_REPORTED = 6
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


def media_requests(variant: int = 0) -> dict[str, dict]:
    """One request per medium; each `variant` has its own media (same sizes, other pixels and tones) and a state text
    of its own length, as distinct requests in real traffic are."""
    def data_url(mime, data):
        import base64

        return f"data:{mime};base64," + base64.b64encode(data).decode()

    state = f"Judge the attached media of ticket {variant}." + " The customer wrote again." * variant
    base = {"model": "clef-omni", "state": state, "questions": QUESTIONS}
    png = synthetic_release.synthetic_png(640, 480, shift=7 * variant)
    wav = synthetic_release.synthetic_wav(10.0, frequency=440.0 + 11 * variant)
    mp4 = synthetic_release.synthetic_mp4(True, seconds=4, size=(320, 240), shift=7 * variant)
    return {
        "image 640x480": {**base, "images": [data_url("image/png", png)]},
        "audio 10 s": {**base, "audio": [data_url("audio/wav", wav)]},
        "video 4 s 320x240 + sound": {**base, "videos": [data_url("video/mp4", mp4)]},
    }


def timed_decision(decide, request) -> tuple[float, dict]:
    """One decision's wall time in milliseconds, its GPU work included, and its response."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    response = decide(request)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000, response


def profile_decision(decide, request, kernels_reported: int = PROFILED_KERNELS_REPORTED) -> dict:
    """The GPU's busy time, the kernels launched and the largest kernels of one decision, from torch.profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as profile:
        decide(request)
        torch.cuda.synchronize()
    # The device's own events (kernels, memcpy, memset); a user annotation's GPU copy spans kernels counted already.
    kernels = [
        event for event in profile.key_averages()
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)
    ]

    def device_ms(event) -> float:
        device_us = getattr(event, "self_device_time_total", None)  # torch before 2.4: self_cuda_time_total
        return (event.self_cuda_time_total if device_us is None else device_us) / 1000

    largest = sorted(kernels, key=device_ms, reverse=True)[:kernels_reported]
    return {
        "profile_gpu_busy_ms": round(sum(device_ms(event) for event in kernels), 1),
        "profile_kernel_launches": sum(event.count for event in kernels),
        "profile_top_kernels": [[event.key[:60], round(device_ms(event), 2), event.count] for event in largest],
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


def swap_text_decoder(loaded, graphed: bool) -> None:
    """Put the engine's PackedTextDecoder in place (graphed) or transformers' own decoder it wraps, with its own
    attention and router and its layers run eagerly, not compiled (not graphed): the path before the engine."""
    torch.compiler.set_stance("default" if graphed else "force_eager")
    thinker = loaded.model.thinker
    fused_routers = [(module.mlp, module.mlp.gate) for module in thinker.modules()
                     if isinstance(getattr(getattr(module, "mlp", None), "gate", None), serve_clef.FusedTopKRouter)]
    if fused_routers:  # transformers' own router in each layer, in place of the engine's fused one
        loaded.fused_routers = fused_routers
    for mlp, fused_router in getattr(loaded, "fused_routers", []):
        mlp.gate = fused_router if graphed else fused_router.router  # the same modules, so nothing recompiles
    for name, module in list(thinker.named_modules()):
        if isinstance(module, serve_clef.PackedTextDecoder) or type(module).__name__ == "Qwen3OmniMoeThinkerTextModel":
            parent_name, _, attribute = name.rpartition(".")
            parent = thinker.get_submodule(parent_name) if parent_name else thinker
            if isinstance(module, serve_clef.PackedTextDecoder) and not graphed:
                loaded.packed_decoder = module
                module.decoder.config._attn_implementation = "sdpa"
                del module.decoder._deepstack_process  # transformers' own, through the visual tokens' mask
                setattr(parent, attribute, module.decoder)
            elif not isinstance(module, serve_clef.PackedTextDecoder) and graphed:
                module.config._attn_implementation = serve_clef.PACKED_ATTENTION
                module._deepstack_process = serve_clef.add_dense_deepstack_features
                setattr(parent, attribute, loaded.packed_decoder)
            return


def bench_mode(flags: list[str], graphs: bool) -> dict:
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda", *flags])
    # the stance is global, and a mode before this one may have left torch.compile forced eager (swap_text_decoder):
    # each mode loads, compiles and captures as served
    torch.compiler.set_stance("default")
    torch.cuda.reset_peak_memory_stats()
    loaded = serve_clef.load_from_args(args, progress=lambda line: print("   ", line, flush=True))
    if not graphs:
        swap_text_decoder(loaded, graphed=False)
        torch.backends.cuda.enable_cudnn_sdp(True)  # as before the engine
    weights_gib = torch.cuda.memory_allocated() / 2**30
    load_peak_gib = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()  # from here on, the peak of serving alone
    tokenizer = loaded.processor.tokenizer

    def decide(request):
        return serve_clef.decide(loaded, request, args.max_length)

    result = {"load_s": round(loaded.load_s, 1), "weights_gib": round(weights_gib, 2)}
    # The first decision after load, before any other: what is left of one-time costs after load's warm-up.
    first_ms, _ = timed_decision(decide, text_request(tokenizer, 505, 999))
    result["first_decision_ms"] = round(first_ms, 1)
    for name, group in TEXT_GROUPS.items():
        seeded_targets = enumerate(group["targets"], start=group["first_seed"])  # (seed, target length)
        requests = [text_request(tokenizer, target, seed) for seed, target in seeded_targets]
        first_sight = [timed_decision(decide, request) for request in requests]
        result[f"text_{name}_first_sight_ms"] = round(statistics.median(ms for ms, _ in first_sight), 1)
        result[f"text_{name}_tokens"] = first_sight[0][1]["usage"]["input_tokens"]
        repeat_times = milliseconds(lambda: decide(requests[0]), group["repeats"])
        result[f"text_{name}_repeat_ms"] = round(statistics.median(repeat_times), 1)

    result.update(profile_decision(decide, text_request(tokenizer, 516, 4242)))
    # The profiler slows the decision it records: the wall time is of another new request, unprofiled.
    profile_wall_ms, _ = timed_decision(decide, text_request(tokenizer, 516, 4243))
    result["profile_wall_ms"] = round(profile_wall_ms, 1)

    burst = [text_request(tokenizer, 512, 100 + i) for i in range(16)]
    # 16 requests arriving at once, queued on one long-lived scoring thread as the HTTP server queues them.
    with ThreadPoolExecutor(max_workers=1) as scorer:
        scorer.submit(torch.cuda.synchronize).result()
        start = time.perf_counter()
        list(scorer.map(decide, burst))
        scorer.submit(torch.cuda.synchronize).result()
    result["burst_16x512_ms"] = round((time.perf_counter() - start) * 1000, 1)

    new_media = [media_requests(variant) for variant in range(1, 4)]  # distinct media for each timed decision
    for name, request in media_requests().items():
        decide(request)  # the medium's first decision, untimed
        timed = [timed_decision(decide, requests[name]) for requests in new_media]
        result[f"{name}_ms"] = round(statistics.median(ms for ms, _ in timed), 1)
        result[f"{name}_tokens"] = [response["usage"]["input_tokens"] for _, response in timed]

    torch.backends.cuda.enable_cudnn_sdp(False)
    result["load_peak_gib"] = round(load_peak_gib, 2)
    result["serving_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    packed_layers = [m for m in loaded.model.modules() if isinstance(m, serve_clef.PackedNVFP4Experts)]
    if packed_layers and loaded.expert_kernels != "gluon":  # the gluon kernels keep no checkpoint-order codes
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
    for name, (flags, graphs) in MODES.items():
        print(f"== {name}", flush=True)
        results[name] = bench_mode(flags, graphs)
        gc.collect()  # the mode's model went out of scope with bench_mode: give its GPU memory back
        torch.cuda.empty_cache()
        print(json.dumps(results[name], indent=1), flush=True)
    # Lists (profile_top_kernels) do not fit a table cell: they are printed below it, one line per mode.
    rows = sorted({key for result in results.values() for key, value in result.items() if not isinstance(value, list)})
    print("\n| metric | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for row in rows:
        print(f"| {row} | " + " | ".join(str(results[name].get(row, "")) for name in MODES) + " |")
    print("\nprofile_top_kernels ([kernel, total ms, count]) per mode:")
    for name in MODES:
        print(f"- {name}: {json.dumps(results[name]['profile_top_kernels'])}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_serve.json").write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": serve_clef.transformers.__version__, "results": results,
        }, indent=2))


if __name__ == "__main__":
    main()
