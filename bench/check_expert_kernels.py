"""GPU check and timing of serve_clef's packed-expert Triton kernels on full-size Clef-Omni layers (H200).

Checks (each counts toward the exit status; nothing is printed as OK that was not compared):
1. The activations the W4A4 kernels round (`round_activations_to_nvfp4`, whose helper also rounds the down input in
   the epilogues of both gate_up kernels, Triton and gluon) equal the compiled replay the unpack path uses
   (`fake_quant_nvfp4_activations_compiled`) bit for bit.
2. On random full-size layers (128 experts, hidden 2048, width 768, top-8), the kernels' output equals the unpack +
   grouped_mm reference to within BF16 error, W4A16 and W4A4, at several token counts: the max and mean absolute
   error relative to the reference's mean absolute output are printed and gated.
3. With power-of-two global scales every weight is exact in BF16 on both paths, so the two differ only in summation
   order: that gate is tighter (max two BF16 steps of the largest output, printed as a share of the mean output, and
   mean 0.001, against 0.25 and 0.01 for W4A16 and 1.0 and 0.05 for W4A4 otherwise), W4A16 and W4A4 alike.
2 and 3 run the Triton kernels and, on a Hopper GPU, the gluon kernels, W4A16 and W4A4 alike; so does the check of
input scales per expert (older exports, which round the gate_up input once per pair). On a GPU with FP4 tensor cores
(compute capability 10.x and later) whose torch runs the grouped FP4 matmul (serve_clef's own check at load passes),
they also run the native kernels, W4A4 only, with the W4A4 gates (their inputs are quantized with scales that are not
powers of two, so they never match the replay to the bit); elsewhere the script says why they were not checked.

Timings: one layer's experts (gate_up + down) per token count, each captured in a CUDA graph and replayed as the
serving engine runs it: the Triton kernels' tiles as served (also without a graph: eager launches), the gluon
kernels (Hopper), the native kernels (FP4 tensor cores), the unpack path, the W4A4 replay, and with --sweep
every candidate tile configuration (how EXPERT_TILES was chosen; minutes of compiling); the bf16 matmul rate and
copy bandwidth of this GPU in the same run, for the ceilings.

Usage: python3 bench/check_expert_kernels.py [--sweep]   (writes $OUT/expert_kernels.json when OUT is set)
"""

import dataclasses
import functools
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import serve_clef  # noqa: E402

TOKEN_COUNTS = (1, 64, 256, 512, 1024, 2048, 4096, 8192)
# Where only the summation order differs (power-of-two scales) a BF16 rounding may flip, in a pair's output and in the
# top-k sum: the largest error is gated at two BF16 steps (2**-7 of the binade) of the largest output (the Triton
# kernels: one step, 0.054 of the mean output, at 2,048 tokens and more on an H100); the mean error relative to the mean
# output at 0.001 (measured: 0)
POWER_OF_TWO_STEPS, POWER_OF_TWO_MEAN_GATE = 2, 0.001
CONFIG = Qwen3OmniMoeTextConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
CANDIDATE_TILES = [
    serve_clef.ExpertTiles(rows, columns, reduced, warps, stages)
    for rows in (16, 32, 64, 128)
    for columns, reduced in ((64, 128), (128, 64), (64, 256), (128, 128))
    for warps, stages in ((4, 3), (8, 3))
    if not (rows == 128 and warps == 4)
]


def other_version(path: Path):
    """Another serve_clef.py (e.g. `git show REV:serve_clef.py > bench/other_serve_clef.py`), loaded as a module of
    its own beside this tree's, so that its kernels can be timed in the same run."""
    spec = importlib.util.spec_from_file_location("other_serve_clef", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_layer(power_of_two_global_scales: bool, seed: int, version=serve_clef) -> serve_clef.PackedNVFP4Experts:
    """A random full-size layer of `version`'s experts class (this tree's, or another_version's: the same weights for
    the same seed)."""
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        layer = version.PackedNVFP4Experts(CONFIG, F.silu, has_input_scales=True)
    for name in ("gate_up", "down"):
        codes = getattr(layer, f"{name}_packed_codes")
        codes.copy_(torch.randint(0, 256, codes.shape, generator=generator, device=device, dtype=torch.int16))
        scales = getattr(layer, f"{name}_block_scales")
        scales.copy_((torch.rand(scales.shape, generator=generator, device=device) * 100 + 20).to(torch.float8_e4m3fn))
        global_scale = getattr(layer, f"{name}_global_scale").view(128, -1)  # gate_up: [E, 2], gate and up alike
        if power_of_two_global_scales:
            global_scale.copy_(2.0 ** torch.randint(-15, -12, (128, 1), generator=generator, device=device).float())
        else:
            global_scale.copy_(torch.rand(128, 1, generator=generator, device=device) * 1e-4 + 5e-5)
    layer.gate_up_input_scale.fill_(3.0 / (6 * 448))
    layer.down_input_scale.fill_(0.05 / (6 * 448))
    return layer


def routed_inputs(num_tokens: int, seed: int):
    generator = torch.Generator("cuda").manual_seed(seed)
    hidden_states = (torch.randn(num_tokens, 2048, generator=generator, device="cuda") * 0.7).to(torch.bfloat16)
    router_logits = torch.randn(num_tokens, 128, generator=generator, device="cuda")
    top_k_weights, top_k_index = router_logits.softmax(-1).topk(8, dim=-1)
    return hidden_states, top_k_index, top_k_weights.to(torch.bfloat16)


def median_ms(function) -> float:
    return triton.testing.do_bench(function, warmup=25, rep=100, return_mode="median")


def graph_ms(function) -> float:
    """Median time of `function` captured in a CUDA graph and replayed, as the engine runs it: no launch gaps."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        function()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    return median_ms(graph.replay)


def main() -> int:
    failures = 0
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    print(f"{report['gpu']}, torch {torch.__version__}, triton {triton.__version__}", flush=True)

    # 1. rounding, bit for bit
    generator = torch.Generator("cuda").manual_seed(1)
    for rows, spread in ((512, 3.0), (77, 0.02)):
        activations = (torch.randn(rows, 2048, generator=generator, device="cuda") * spread).to(torch.bfloat16)
        input_scale = torch.tensor(11.0 / (6 * 448), device="cuda")
        ours = serve_clef.round_activations_to_nvfp4(activations, input_scale)
        reference = serve_clef.fake_quant_nvfp4_activations_compiled(activations, input_scale)
        differ = int((ours.view(torch.int16) != reference.view(torch.int16)).sum())
        failures += differ != 0
        print(f"W4A4 rounding in the kernels vs the compiled replay, [{rows}, 2048]: {differ} of "
              f"{activations.numel()} values differ (gate: 0)")

    # 2, 3. layer outputs against the unpack reference
    report["accuracy"] = []
    capability = torch.cuda.get_device_capability()
    hopper, blackwell = capability == (9, 0), capability[0] >= 10
    not_run = []  # kernels this GPU cannot run, named in the JSON and the last line
    if not hopper:
        not_run.append(f"gluon (Hopper only; compute capability {capability[0]}.{capability[1]})")
        print("gluon kernels: not checked, they run on Hopper (compute capability 9.0) only")
    if not blackwell:
        print(f"native FP4 kernels: not checked, this GPU (compute capability {capability[0]}.{capability[1]}) has no "
              "FP4 tensor cores")
    else:
        try:
            serve_clef.check_native_fp4({}, CONFIG, torch.device("cuda"))
        except serve_clef.CheckpointError as refusal:  # a failure where torch should run them (10.x)
            blackwell = False
            failures += capability[0] == 10
            print(f"native FP4 kernels: not checked: {refusal}")
    if not blackwell:
        not_run.append("native (FP4 tensor cores, or torch's grouped FP4 matmul, missing here)")
    kernel_choices = ("triton",) + ("gluon",) * hopper + ("native",) * blackwell
    for power_of_two in (False, True):
        layer = random_layer(power_of_two, seed=2)
        fragments = random_layer(power_of_two, seed=2)  # the same weights, for the gluon kernels
        fragments.to_fragment_order()
        forwards = {"triton": functools.partial(serve_clef.PackedNVFP4Experts.forward_packed, layer),
                    "gluon": fragments.forward_fragments}
        natives = random_layer(power_of_two, seed=2) if blackwell else None  # and for the native ones
        if natives is not None:
            natives.to_native_order()
            forwards["native"] = natives.forward_native
        for kernels, simulate in itertools.product(kernel_choices, (False, True)):
            if kernels == "native" and not simulate:
                continue  # they compute W4A4 only
            layer.simulate_fp4_activations = fragments.simulate_fp4_activations = simulate
            forward = forwards[kernels]
            for num_tokens in (1, 7, 512, 2048, 4096, 8192):
                inputs = routed_inputs(num_tokens, seed=num_tokens)
                reference = layer.forward_unpacked(*inputs).float()
                output, repeat = forward(*inputs), forward(*inputs)
                scale = reference.abs().mean()
                max_error = ((output.float() - reference).abs().max() / scale).item()
                mean_error = ((output.float() - reference).abs().mean() / scale).item()
                # BF16 outputs carry 2**-9 relative rounding; W4A4 adds E2M1 steps where rounding flips. With
                # power-of-two global scales only the summation order differs (measured: mean error 0), and the native
                # kernels quantize their inputs themselves
                if power_of_two and kernels != "native":
                    largest_step = 2.0 ** (reference.abs().max().log2().floor().item() - 7)  # BF16's, largest outputs
                    max_gate, mean_gate = POWER_OF_TWO_STEPS * largest_step / scale.item(), POWER_OF_TWO_MEAN_GATE
                else:
                    max_gate, mean_gate = (0.25, 0.01) if not simulate else (1.0, 0.05)
                ok = max_error <= max_gate and mean_error <= mean_gate and torch.equal(output, repeat)
                failures += not ok
                row = {"kernels": kernels, "power_of_two_global_scales": power_of_two, "w4a4": simulate,
                       "tokens": num_tokens, "max_error": max_error, "mean_error": mean_error,
                       "deterministic": torch.equal(output, repeat)}
                report["accuracy"].append(row)
                print(f"{kernels} kernels vs unpack: 2^k scales {power_of_two}, W4A4 {simulate}, {num_tokens:5} "
                      f"tokens: max |err| {max_error:.4f}, mean |err| {mean_error:.5f} of mean |out| (gates "
                      f"{max_gate:.4g}, {mean_gate}); repeat identical {torch.equal(output, repeat)} -> "
                      f"{'ok' if ok else 'FAIL'}", flush=True)
        del layer, fragments, natives

    # 2b. input scales per expert (ModelOpt before 0.43): the W4A4 replay rounds the gate_up input per (token, expert)
    layer = random_layer(True, seed=4)
    generator = torch.Generator("cuda").manual_seed(4)
    for name in ("gate_up", "down"):
        scales = getattr(layer, f"{name}_input_scale")
        scales.copy_((torch.rand(scales.shape, generator=generator, device="cuda") + 0.5) * scales)
        layer.input_scale_values[name] = set(scales.tolist())  # what store() records while loading a checkpoint
    layer.simulate_fp4_activations = True
    assert not layer.gate_up_input_scales_shared
    fragments = random_layer(True, seed=4)
    fragments.load_state_dict(layer.state_dict())
    fragments.input_scale_values, fragments.simulate_fp4_activations = layer.input_scale_values, True
    fragments.to_fragment_order()
    forwards = {"triton": layer.forward_packed} | ({"gluon": fragments.forward_fragments} if hopper else {})
    natives = random_layer(True, seed=4) if blackwell else None
    if natives is not None:
        natives.load_state_dict(layer.state_dict())
        natives.input_scale_values = layer.input_scale_values
        natives.to_native_order()
        forwards["native"] = natives.forward_native
    for (kernels, forward), num_tokens in itertools.product(forwards.items(), (7, 512)):
        inputs = routed_inputs(num_tokens, seed=num_tokens)
        reference = layer.forward_unpacked(*inputs).float()
        output = forward(*inputs)
        scale = reference.abs().mean()
        mean_error = ((output.float() - reference).abs().mean() / scale).item()
        deterministic = torch.equal(output, forward(*inputs))
        mean_gate = 0.05 if kernels == "native" else 0.01
        ok = mean_error <= mean_gate and deterministic
        failures += not ok
        per_pair_ms = graph_ms(lambda: forward(*inputs))
        report.setdefault("per_expert_input_scales", []).append(
            {"kernels": kernels, "tokens": num_tokens, "mean_error": mean_error, "deterministic": deterministic,
             "w4a4_per_pair_ms": per_pair_ms})
        print(f"{kernels} kernels vs unpack, input scales per expert, W4A4, {num_tokens} tokens: mean |err| "
              f"{mean_error:.5f} of mean |out| (gate {mean_gate}), repeat identical {deterministic}; "
              f"{per_pair_ms:.3f} ms -> {'ok' if ok else 'FAIL'}", flush=True)
    del layer, fragments, natives

    # ceilings of this GPU, in the same run
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul_tflops = 2 * 8192**3 / median_ms(lambda: a @ a) / 1e9
    big = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    copy_gbs = 2 * big.nbytes / median_ms(lambda: big.clone()) / 1e6
    del a, big
    report["ceilings"] = {"bf16_matmul_tflops": matmul_tflops, "copy_gb_per_s": copy_gbs}
    print(f"ceilings: bf16 matmul {matmul_tflops:.0f} TFLOP/s, device copy {copy_gbs:.0f} GB/s", flush=True)

    # timings per token count
    layer = random_layer(False, seed=3)
    packed_bytes = sum(buffer.nbytes for buffer in layer.buffers())
    fragments = random_layer(False, seed=3)
    fragments.to_fragment_order()
    natives = random_layer(False, seed=3) if blackwell else None
    if natives is not None:
        natives.to_native_order()
    report["timings"] = []
    tables = serve_clef.EXPERT_TILES
    for num_tokens in TOKEN_COUNTS:
        inputs = routed_inputs(num_tokens, seed=10 + num_tokens)
        flops = 2 * num_tokens * 8 * (2048 * 1536 + 768 * 2048)
        row = {"tokens": num_tokens}
        layer.simulate_fp4_activations = False
        row["unpack_ms"] = graph_ms(lambda: layer.forward_unpacked(*inputs))
        layer.simulate_fp4_activations = True
        row["unpack_w4a4_ms"] = graph_ms(lambda: layer.forward_unpacked(*inputs))
        layer.simulate_fp4_activations = False
        best = None
        served = serve_clef.expert_tiles(8 * num_tokens, 128, tables)
        for tiles in CANDIDATE_TILES if "--sweep" in sys.argv[1:] else [served]:
            serve_clef.EXPERT_TILES = ((None, tiles),)
            try:
                milliseconds = graph_ms(lambda: layer.forward_packed(*inputs))
            except Exception as error:  # a configuration that does not fit this GPU (shared memory, registers)
                print(f"  {tiles}: {type(error).__name__}", flush=True)
                continue
            if best is None or milliseconds < best[0]:
                best = (milliseconds, tiles)
        serve_clef.EXPERT_TILES = ((None, best[1]),)
        layer.simulate_fp4_activations = True
        row["triton_w4a4_ms"] = graph_ms(lambda: layer.forward_packed(*inputs))
        layer.simulate_fp4_activations = False
        serve_clef.EXPERT_TILES = tables
        row["triton_served_tiles_ms"] = graph_ms(lambda: layer.forward_packed(*inputs))
        row["triton_served_tiles_eager_ms"] = median_ms(lambda: layer.forward_packed(*inputs))
        row["triton_best_ms"], row["best_tiles"] = best[0], dataclasses.asdict(best[1])
        row["triton_tflops"] = flops / best[0] / 1e9
        row["triton_gb_per_s"] = packed_bytes / best[0] / 1e6
        if hopper:
            row["gluon_ms"] = graph_ms(lambda: fragments.forward_fragments(*inputs))
            fragments.simulate_fp4_activations = True
            row["gluon_w4a4_ms"] = graph_ms(lambda: fragments.forward_fragments(*inputs))
            fragments.simulate_fp4_activations = False
        if blackwell:
            row["native_w4a4_ms"] = graph_ms(lambda: natives.forward_native(*inputs))
        report["timings"].append(row)
        print(f"{num_tokens:5} tokens, CUDA graph: unpack {row['unpack_ms']:.3f} ms "
              f"(W4A4 {row['unpack_w4a4_ms']:.3f}); "
              f"triton best {best[0]:.3f} ms (W4A4 {row['triton_w4a4_ms']:.3f}; as served "
              f"{row['triton_served_tiles_ms']:.3f}, eager launches {row['triton_served_tiles_eager_ms']:.3f}) "
              f"{row['triton_tflops']:.0f} TFLOP/s, {row['triton_gb_per_s']:.0f} GB/s of packed weights; "
              f"{best[1]}" + (f"; gluon {row['gluon_ms']:.3f} ms (W4A4 {row['gluon_w4a4_ms']:.3f})" if hopper else "")
              + (f"; native W4A4 {row['native_w4a4_ms']:.3f} ms" if blackwell else ""), flush=True)

    report |= {"failures": failures, "not_run": not_run}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "expert_kernels.json").write_text(json.dumps(report, indent=2))
    print("FAILED" if failures else "every comparison that ran was within its gate"
          + (f"; not run: {'; '.join(not_run)}" if not_run else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
