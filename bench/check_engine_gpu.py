"""GPU check of the engine on `synthetic:full`: packed batches and CUDA graphs against transformers' own decoder, with
the noise floor they are judged by, then first-sight latency, a profile and batch throughput.

On new requests (text of 90 to 3,000 tokens, image, audio, video), the answers of one loaded model are compared:

- transformers' own text decoder, eager, with cuDNN attention and without it: the two differ only in the attention
  kernel, and that difference is the BF16 noise floor of this random model;
- the engine, each record alone (padded to its bucket, replayed from the bucket's CUDA graph where it has one);
- the engine, all records in one packed forward (a graph, images and videos included);
- the engine, each record alone, with the vision and audio towers' attention put back to transformers' SDPA (a call
  per image, frame or audio window) instead of the packed attention.

All of them score with the batched joint head, which the load checked against the decision module's own head.

Gates (exit status 1 when one fails): the noise floor at most 0.1 (the two baselines sane); engine alone vs
transformers' decoder, the batch vs each record alone and the towers' two attentions, at most twice the floor plus
0.005, a NaN failing; the same request and the same batch bit-identical run after run, in their raw option logits; a
text batch queued while the device runs another waits for nothing on the device; every decoder layer routing with
the fused router, which gives transformers' router's logits and, away from ties at the K-th place, its experts with
weights at most one BF16 unit in the last place apart; the first decision after load at most half again the median of
the new ~512-token ones.

Usage: python3 bench/check_engine_gpu.py [server flags, e.g. --expert-kernels triton]
       (writes $OUT/check_engine_gpu.json when OUT is set)
"""

import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402
from bench_serve import (  # noqa: E402
    media_requests, milliseconds, profile_decision, swap_text_decoder, text_request, timed_decision,
)

PROFILED_KERNELS_REPORTED = 12
MEDIA_REPEATS = 7  # decisions and forwards per medium
MAX_NOISE_FLOOR = 0.1  # measured 0.047-0.056 on the H200; far more means the two baselines themselves went wrong
# K-th and next probabilities closer than this, relatively, are a near-tie: fp32 exps that differ by an ulp or two
# may order them either way
ROUTER_NEAR_TIE = 2.0 ** -18


@contextlib.contextmanager
def towers_own_layers(loaded):
    """The towers' own layers in place of their TowerLayerSteps (no padding, no graphs): the baseline of the steps."""
    swapped = []
    for tower in serve_clef.thinker_towers(loaded.model.thinker):
        layers = tower.blocks if hasattr(tower, "blocks") else tower.layers
        steps = list(layers)
        for index, step in enumerate(steps):
            layers[index] = step.layer
        swapped.append((layers, steps))
    try:
        yield
    finally:
        for layers, steps in swapped:
            for index, step in enumerate(steps):
                layers[index] = step


def compare_routers(router: torch.nn.Module) -> list[dict]:
    """The fused router (serve_clef.route_top_k) against transformers' router (its own forward: softmax, torch.topk,
    renormalisation) on this GPU, for random hidden states of 517 and 8,192 tokens and for logits made coarse so that
    many are equal: the tokens choosing other experts (the K compared as a set) and the largest difference of their
    weights in BF16 units in the last place, away from ties and near-ties at the K-th place; how many tokens have
    such a tie and how many of them choose otherwise; and the GPU time of each (CUDA events, median of 50).

    Two rules keep a comparison at a tie from meaning anything: torch.topk leaves unspecified which of equal values it
    returns, and Triton's fp32 exp on CUDA (ex2.approx after a scaling) and torch's softmax (expf) may differ in the
    last bits of a probability, so that two probabilities a few units in the last place apart may swap places."""
    fused = serve_clef.FusedTopKRouter(router)
    rows = []
    for num_tokens, coarse in ((517, False), (8192, False), (8192, True)):
        hidden_states = torch.randn(num_tokens, router.hidden_dim, device="cuda", dtype=torch.bfloat16)
        if coarse:  # transformers' router from given logits: its weight made the identity on the first E columns
            router = type(router)(router_config(router)).to(device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                router.weight.zero_().diagonal().fill_(1.0)
            hidden_states = (hidden_states * 4).round() / 4  # logits on a grid of 0.25: many equal
            fused = serve_clef.FusedTopKRouter(router)
        with torch.no_grad():
            logits, weights, experts = router(hidden_states)
            fused_logits, fused_weights, fused_experts = fused(hidden_states)
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, experts, True)  # [T, E]
        fused_chosen = torch.zeros_like(chosen).scatter_(1, fused_experts, True)
        chooses_otherwise = (chosen != fused_chosen).any(dim=1)  # [T]
        ordered = logits.float().softmax(dim=-1).sort(dim=-1, descending=True).values  # [T, E]
        at_the_cut, next_one = ordered[:, router.top_k - 1], ordered[:, router.top_k]
        near_tie = at_the_cut - next_one <= ROUTER_NEAR_TIE * at_the_cut  # [T]
        same_choice = ~chooses_otherwise & ~near_tie
        # each chosen expert's weight in both, in the order of the expert ids, then its difference in BF16 ulps
        weights_by_expert = torch.zeros_like(logits, dtype=torch.float32).scatter_(1, experts, weights.float())
        fused_by_expert = torch.zeros_like(weights_by_expert).scatter_(1, fused_experts, fused_weights.float())
        ulps = torch.exp2(torch.floor(torch.log2(weights_by_expert.abs().clamp(min=1e-30))) - 7)  # [T, E]
        weight_ulps = ((fused_by_expert - weights_by_expert).abs() / ulps)[same_choice[:, None] & chosen]
        timings = {}
        for name, function in (("transformers' router", router), ("fused router", fused)):
            times = []
            for _ in range(50):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                with torch.no_grad():
                    function(hidden_states)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            timings[f"{name} ms"] = round(statistics.median(times), 4)
        rows.append({
            "tokens": num_tokens, "coarse logits": coarse, "logits equal": torch.equal(fused_logits, logits),
            "tokens choosing other experts, away from ties": int((chooses_otherwise & ~near_tie).sum()),
            "largest weight difference away from ties, BF16 ulps": float(weight_ulps.max()) if weight_ulps.numel()
            else 0.0,
            "tokens with a tie or near-tie at the K-th place": int(near_tie.sum()),
            "of them choosing otherwise": int((chooses_otherwise & near_tie).sum()),
            **timings,
        })
        print(f"router, {rows[-1]}", flush=True)
    return rows


def router_config(router: torch.nn.Module):
    return types.SimpleNamespace(num_experts=router.num_experts, num_experts_per_tok=router.top_k,
                                 norm_topk_prob=router.norm_topk_prob, hidden_size=router.hidden_dim)


def largest_difference(answers_a: list[dict], answers_b: list[dict]) -> float:
    """The largest difference of one option's probability between two runs' answers; infinity where either is NaN
    (Python's max would pass over a NaN, and a gate would then pass it)."""
    largest = 0.0
    for first, second in zip(answers_a, answers_b, strict=True):
        for question_id, answer in first.items():
            for option, probability in answer.get("probabilities", {"true": answer.get("noul")}).items():
                other = second[question_id].get("probabilities", {"true": second[question_id].get("noul")})
                difference = abs(probability - other[option])
                if math.isnan(difference):
                    return math.inf
                largest = max(largest, difference)
    return largest


def same_bits(logits_a: list[list[torch.Tensor]], logits_b: list[list[torch.Tensor]]) -> bool:
    """Whether two runs gave every record's option logits bit for bit (the answers round them to 4 decimals)."""
    return all(torch.equal(first, second) for record_a, record_b in zip(logits_a, logits_b, strict=True)
               for first, second in zip(record_a, record_b, strict=True))


def main() -> int:
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda", *sys.argv[1:]])
    loaded = serve_clef.load_from_args(
        args, progress=lambda line: print(f"    [{torch.cuda.memory_allocated() / 2**30:.2f} GiB]", line, flush=True))
    tokenizer = loaded.processor.tokenizer
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": serve_clef.transformers.__version__, "load_s": round(loaded.load_s, 1),
               "after_load_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
               "load_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
               "cpu_threads": f"{torch.get_num_threads()} of {os.cpu_count()} CPUs"}  # load_clef caps them on a GPU
    # What one of the full garbage collections Python starts now and then costs with everything the load made
    # tracked, then frozen: what the server does once loaded (ClefService.load_in_background), before its first
    # request. Unfrozen, such a collection may fall in any decision. The first decision below runs after the same
    # collection and freeze, and records the collections Python runs during it (on 2026-12-05 its ~240 ms turned out
    # to be a Triton compile, not a collection: docs/benchmarks.md).
    tracked = len(gc.get_objects())
    collections_ms = []
    for freeze in (False, True):
        if freeze:
            gc.freeze()
        start = time.perf_counter()
        gc.collect()
        collections_ms.append(round((time.perf_counter() - start) * 1000, 1))
    results["full_garbage_collection_ms"] = {"objects tracked after load": tracked, "as loaded": collections_ms[0],
                                             "frozen": collections_ms[1]}
    print(f"one full garbage collection over the {tracked:,} objects tracked after load: {collections_ms[0]} ms; "
          f"frozen: {collections_ms[1]} ms")
    torch.cuda.reset_peak_memory_stats()  # from here on, the peak of serving
    first_stages, collections = {}, []  # collections: (generation, ms) of those Python runs during the decision
    started = {}

    def record_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started["at"] = time.perf_counter()
        else:
            collections.append((info["generation"], round((time.perf_counter() - started["at"]) * 1000, 2)))

    gc.callbacks.append(record_collection)
    try:
        first_ms, _ = timed_decision(lambda request: serve_clef.decide(loaded, request, args.max_length, first_stages),
                                     text_request(tokenizer, 505, 999))
    finally:
        gc.callbacks.remove(record_collection)
    results["first_decision_after_load_ms"] = round(first_ms, 1)  # a new length, before any other decision
    results["first_decision_stages_ms"] = {stage: round(seconds * 1000, 2) for stage, seconds in first_stages.items()}
    results["first_decision_garbage_collections"] = {  # generation -> [collections, ms in all]
        generation: [sum(1 for g, _ in collections if g == generation),
                     round(sum(ms for g, ms in collections if g == generation), 2)]
        for generation in sorted({g for g, _ in collections})}
    print(f"first decision after load (505 tokens), as the server runs it (after its collection and freeze): "
          f"{first_ms:.1f} ms, stages {results['first_decision_stages_ms']}; Python's collections during it, by "
          f"generation (count, ms): {results['first_decision_garbage_collections']}")

    def scored(requests, together: bool) -> tuple[list[dict], list[list[torch.Tensor]]]:
        """Each request's answers and its raw option logits, its record scored alone or all records in one forward."""
        prepared = [serve_clef.prepare(loaded, request, args.max_length) for request in requests]
        encoded = [record.encoded for record in prepared]
        logits = (serve_clef.score_records(loaded, encoded) if together
                  else [serve_clef.score_records(loaded, [record])[0] for record in encoded])
        return ([serve_clef.answer(loaded, record, record_logits)["answers"]
                 for record, record_logits in zip(prepared, logits)], logits)

    def alone(requests):
        return scored(requests, together=False)

    def batched(requests):
        return scored(requests, together=True)

    requests = [text_request(tokenizer, target, 7000 + target) for target in (90, 515, 1500, 3000)]
    requests += list(media_requests().values())
    text_only = requests[:4]
    (engine_alone, engine_alone_logits), (_, engine_alone_logits_again) = alone(requests), alone(requests)
    (engine_batch, engine_batch_logits), (_, engine_batch_logits_again) = batched(requests), batched(requests)
    text_batch, _ = batched(text_only)  # no deepstack: the packed batch replays a graph
    towers = serve_clef.thinker_towers(loaded.model.thinker)
    for tower in towers:  # transformers' own: SDPA, a call per image, frame or audio window
        tower.config._attn_implementation = "sdpa"
    towers_own_attention, _ = alone(requests)
    for tower in towers:
        tower.config._attn_implementation = serve_clef.PACKED_ATTENTION
    swap_text_decoder(loaded, graphed=False)
    stock, _ = alone(requests)
    torch.backends.cuda.enable_cudnn_sdp(True)
    stock_cudnn, _ = alone(requests)
    torch.backends.cuda.enable_cudnn_sdp(False)
    swap_text_decoder(loaded, graphed=True)

    floor = largest_difference(stock_cudnn, stock)
    gate = 2 * floor + 0.005
    differences = {
        "noise floor: transformers' decoder, cuDNN vs other attention": floor,
        "engine alone (graphs) vs transformers' decoder": largest_difference(engine_alone, stock),
        "engine batch of 7 (graph, media in it) vs engine alone": largest_difference(engine_batch, engine_alone),
        "engine batch of 4 texts (graph) vs engine alone": largest_difference(text_batch, engine_alone[:4]),
        "engine batch of 7 vs transformers' decoder (informational: the two gated rows above bound it)":
            largest_difference(engine_batch, stock),
        "engine alone, towers' packed attention vs their own SDPA": largest_difference(engine_alone,
                                                                                    towers_own_attention),
    }
    print(f"gate for the differences: twice the noise floor plus 0.005 = {gate:.4f}")
    for name, value in differences.items():
        print(f"max |dp|, {name}: {value:.4f}")
    checks = {
        # a floor this large would let almost anything through the gate: the comparison itself would be broken
        f"the noise floor small enough to judge by (at most {MAX_NOISE_FLOOR})": floor <= MAX_NOISE_FLOOR,
        "engine alone within the gate": differences["engine alone (graphs) vs transformers' decoder"] <= gate,
        "batch of 7 within the gate": differences["engine batch of 7 (graph, media in it) vs engine alone"] <= gate,
        "batch of 4 within the gate": differences["engine batch of 4 texts (graph) vs engine alone"] <= gate,
        "towers' packed attention within the gate":
            differences["engine alone, towers' packed attention vs their own SDPA"] <= gate,
        "alone bit-identical run after run (raw logits)": same_bits(engine_alone_logits, engine_alone_logits_again),
        "batch bit-identical run after run (raw logits)": same_bits(engine_batch_logits, engine_batch_logits_again),
    }
    embedding = loaded.model.thinker.get_input_embeddings()
    token_ids = torch.randint(0, embedding.weight.shape[0], (3, 100), device="cuda")
    checks["input embeddings on the host, lookups equal the table's rows"] = (
        isinstance(embedding, serve_clef.HostEmbedding)
        and torch.equal(embedding(token_ids), embedding.weight.to("cuda")[token_ids])
    )
    decoder = next(module for module in loaded.model.modules() if isinstance(module, serve_clef.PackedTextDecoder))
    routers = [layer.mlp.gate for layer in decoder.decoder.layers]
    checks["every decoder layer routes with the fused router"] = all(
        isinstance(router, serve_clef.FusedTopKRouter) for router in routers)
    results["router"] = compare_routers(routers[0].router)
    checks["the fused router's logits are transformers' router's, and away from ties at the K-th place it chooses "
           "the same experts with weights at most one BF16 ulp apart"] = all(
        row["logits equal"] and row["tokens choosing other experts, away from ties"] == 0
        and row["largest weight difference away from ties, BF16 ulps"] <= 1 for row in results["router"])
    tower_graphs = [len(graphs.graphs) for graphs in decoder.tower_graphs]  # vision, audio
    results["tower_graphs"] = tower_graphs
    checks["the vision and audio towers' layers captured in CUDA graphs at load"] = (
        len(tower_graphs) == 2 and all(tower_graphs)
    )
    checks["joint head batched (checked at load), output embeddings on the host"] = (
        isinstance(loaded.model.head, serve_clef.BatchedJointSchemaHead)
        and isinstance(loaded.model.output_embeddings, serve_clef.HostEmbedding)
    )
    # The head's graphs replay what the head runs op by op on the same slots: the same kernels on the same inputs
    head = loaded.model.head
    results["head_graphs"] = len(head.graphs)
    checks["the joint head's graphs captured at load, one per decoder bucket and slots row"] = (
        len(head.graphs) == len(decoder.buckets) * len(serve_clef.HEAD_GRAPH_SLOTS))
    encoded_texts = [serve_clef.prepare(loaded, request, args.max_length).encoded for request in text_only]
    head_batches = [encoded_texts[:1], encoded_texts[1:2], encoded_texts]
    replayed = [serve_clef.score_records(loaded, batch) for batch in head_batches]
    graphs, head.graphs = head.graphs, {}
    try:
        op_by_op = [serve_clef.score_records(loaded, batch) for batch in head_batches]
    finally:
        head.graphs = graphs
    checks["the joint head's graphs give its op-by-op logits bit for bit (1 and 4 records)"] = all(
        same_bits(a, b) for a, b in zip(replayed, op_by_op))
    for name, passed in checks.items():
        print(f"{name}: {passed}")
    results.update(differences=differences, checks=checks, gate=gate)

    decide = lambda request: serve_clef.decide(loaded, request, args.max_length)  # noqa: E731
    # The baseline first, in the same process: transformers' own decoder op by op, with cuDNN attention as before the
    # engine; then the engine. Each set is new requests of new lengths, each timed once.
    # the peak of the comparisons above (transformers' own decoder op by op, the batch of seven with every medium)
    results["comparisons_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    peaks = {}  # the engine's own, per kind of request
    for engine in (False, True):
        swap_text_decoder(loaded, graphed=engine)
        torch.backends.cuda.enable_cudnn_sdp(not engine)
        torch.cuda.reset_peak_memory_stats()  # the engine's own peak, apart from the op-by-op path's before it
        name = "engine" if engine else "before the engine (op by op, cuDNN attention)"
        for target, first_seed in ((256, 60 + 100 * engine), (512, 20 + 100 * engine), (2048, 40 + 100 * engine)):
            new_requests = [text_request(tokenizer, target + 7 * i, first_seed + i)
                            for i in range(4 if target == 2048 else 8)]
            times = [timed_decision(decide, request)[0] for request in new_requests]
            repeats = [timed_decision(decide, new_requests[0])[0] for _ in range(3)]
            results[f"text_{target}_first_sight_ms, {name}"] = round(statistics.median(times), 1)
            results[f"text_{target}_repeat_ms, {name}"] = round(statistics.median(repeats), 1)
            print(f"~{target} tokens, new lengths, {name}: median {statistics.median(times):.1f} ms "
                  f"({', '.join(f'{t:.0f}' for t in times)}); the first again: {statistics.median(repeats):.1f} ms")
    peaks["engine, text of 256, 512 and 2,048 tokens"] = torch.cuda.max_memory_allocated()
    # The target: the first request after load no slower than the rest (a compile, a plan or a collection that
    # the load left to the first request shows here: one took ~220 ms on 2026-12-05). Half again the median of the new
    # ~512-token decisions leaves room for the host's own spread.
    checks["the first decision after load no slower than half again the median of new ~512-token ones"] = (
        first_ms <= 1.5 * results["text_512_first_sight_ms, engine"])
    new_media = [media_requests(variant) for variant in range(1, MEDIA_REPEATS + 1)]  # each decision its own media
    for name, request in media_requests().items():
        # Whole decisions vary with the host's CPU preparation (10-45 ms for these media), so each stage's time is
        # reported, and the forward alone is timed too, on one record prepared once.
        torch.cuda.reset_peak_memory_stats()
        times, stages = [], []
        for requests in new_media:
            stages.append({})
            times.append(timed_decision(
                lambda new_request: serve_clef.decide(loaded, new_request, args.max_length, stages[-1]),
                requests[name])[0])
        stage_ms = {stage: round(statistics.median(timing[stage] for timing in stages) * 1000, 1)
                    for stage in stages[0]}
        encoded = serve_clef.prepare(loaded, request, args.max_length).encoded
        forwards = milliseconds(lambda: serve_clef.score_records(loaded, [encoded]), MEDIA_REPEATS)
        peaks[name] = torch.cuda.max_memory_allocated()
        with towers_own_layers(loaded):  # the baseline in the same process: the towers' layers op by op
            own_forwards = milliseconds(lambda: serve_clef.score_records(loaded, [encoded]), MEDIA_REPEATS)
        results[f"{name}_ms"] = round(statistics.median(times), 1)
        results[f"{name}_stages_ms"] = stage_ms
        results[f"{name}_forward_ms"] = round(statistics.median(forwards), 1)
        results[f"{name}_forward_towers_op_by_op_ms"] = round(statistics.median(own_forwards), 1)
        print(f"{name}: median of {MEDIA_REPEATS} decisions, each its own media, {statistics.median(times):.1f} ms "
              f"({', '.join(f'{t:.0f}' for t in times)}; stages {stage_ms}), "
              f"forwards {statistics.median(forwards):.1f} ms "
              f"(towers' layers op by op: {statistics.median(own_forwards):.1f} ms)")
    results["serving_peak_by_request_gib"] = {name: round(peak / 2**30, 2) for name, peak in peaks.items()}
    print(f"serving peaks: {results['serving_peak_by_request_gib']} (the comparisons: "
          f"{results['comparisons_peak_gib']} GiB)")

    results["serving_peak_alone_gib"] = round(max(peaks.values()) / 2**30, 2)
    torch.cuda.reset_peak_memory_stats()
    profile = profile_decision(decide, text_request(tokenizer, 516, 4242), PROFILED_KERNELS_REPORTED)
    results["profile_516"] = profile
    print(f"516 tokens: GPU busy {profile['profile_gpu_busy_ms']} ms, {profile['profile_kernel_launches']} launches")
    for kernel in profile["profile_top_kernels"]:
        print("   ", kernel)
    stage_timings = {}
    serve_clef.decide(loaded, text_request(tokenizer, 516, 4244), args.max_length, stage_timings)
    results["stages_516_ms"] = {stage: round(seconds * 1000, 2) for stage, seconds in stage_timings.items()}
    print(f"516 tokens, stages: {results['stages_516_ms']}")

    # Throughput of one packed forward: 16 distinct ~500-token records (under 8,192 tokens: the largest graph)
    prepared = [serve_clef.prepare(loaded, text_request(tokenizer, 480 + 2 * i, 500 + i), args.max_length)
                for i in range(16)]
    tokens = sum(record.tokens for record in prepared)
    for records in (1, 4, 16):
        torch.cuda.synchronize()
        start = time.perf_counter()
        serve_clef.score_records(loaded, [record.encoded for record in prepared[:records]])
        torch.cuda.synchronize()
        batch_ms = (time.perf_counter() - start) * 1000
        batch_tokens = sum(record.tokens for record in prepared[:records])
        results[f"forward_{records}_records_ms"] = round(batch_ms, 1)
        print(f"one forward of {records} records ({batch_tokens} tokens): {batch_ms:.1f} ms, "
              f"{batch_tokens / batch_ms * 1000:,.0f} tokens/s")
    # The server queues the next forward while the device still runs the last: queueing it must not wait for the
    # device (each wait would leave the device idle while the host finishes queueing). Counted by torch's sync debug
    # mode, which warns on every host-device synchronisation.
    running = serve_clef.queue_forward(loaded, [record.encoded for record in prepared])
    started = time.perf_counter()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        following = serve_clef.queue_forward(loaded, [record.encoded for record in prepared[:4]])
    torch.cuda.set_sync_debug_mode(0)
    queued_ms = (time.perf_counter() - started) * 1000
    running.wait()
    running_ms = (time.perf_counter() - started) * 1000
    following.wait()
    syncs = sum("synchroniz" in str(warning.message) for warning in caught)
    results["queued_behind_a_forward"] = {"syncs": syncs, "queueing_ms": round(queued_ms, 1),
                                          "running_forward_left_ms": round(running_ms, 1)}
    checks["a text batch queued behind a running forward waits for nothing on the device"] = syncs == 0
    print(f"4 records queued behind a forward of 16: {syncs} host-device synchronisations, the host held "
          f"{queued_ms:.1f} ms of the {running_ms:.1f} ms the forward of 16 still ran")
    profile = profile_decision(lambda _: serve_clef.score_records(loaded, [r.encoded for r in prepared]), None,
                               PROFILED_KERNELS_REPORTED)
    results["profile_batch_16"] = {**profile, "tokens": tokens}
    print(f"16 records ({tokens} tokens): GPU busy {profile['profile_gpu_busy_ms']} ms")
    for kernel in profile["profile_top_kernels"]:
        print("   ", kernel)
    results["serving_peak_batches_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)  # profile, batches
    print(f"GPU memory after load {results['after_load_gib']} GiB; serving peak: the engine's records alone "
          f"{results['serving_peak_alone_gib']} GiB, its batches of 1-16 records "
          f"{results['serving_peak_batches_gib']} GiB")
    passed = all(checks.values())
    print("ok" if passed else "FAILED")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "check_engine_gpu.json").write_text(json.dumps(results, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
