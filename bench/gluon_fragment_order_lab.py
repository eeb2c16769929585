"""Lab, not served: the register-operand gate_up kernel of bench/gluon_register_operand_lab.py (commit bc39c96) with
the codes and scales stored once in the order of the operand's register fragments, so that each thread reads its
16 code bytes of a step in one load, straight from global memory into registers two steps ahead (no ring for them);
activations from a cp.async ring. Against the served Triton kernel, one random full-size layer (H200, 2026-12-04;
results in docs/benchmarks.md).

Usage: python3 bench/gluon_fragment_order_lab.py            (GPU; exit status 1 on a mismatch)
       python3 bench/gluon_fragment_order_lab.py --compile  (CPU: build for sm_90 offline with triton 3.6 on the path)
"""
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402

DECODE_PTX = gl.constexpr(serve_clef.decode_e2m1_ptx())
SCALE_TO_DECODE = gl.constexpr(2.0 ** 118)
DIVISOR = gl.constexpr(2.0 ** 8)
WARPS = 4
# one step of one 64-row slab: 128 threads x 16 code bytes, 32 row groups x 8 scale bytes
STEP_CODE_BYTES = gl.constexpr(2048)
STEP_SCALE_BYTES = gl.constexpr(256)


@gluon.jit
def _load_step(codes_ptrs, scales_ptrs, slab, step, num_steps):
    return (gl.load(codes_ptrs + (slab * num_steps + step) * STEP_CODE_BYTES),
            gl.load(scales_ptrs + (slab * num_steps + step) * STEP_SCALE_BYTES))


@gluon.jit
def _decode(codes_raw, scales, CODES: gl.constexpr, DOT_A: gl.constexpr, BLOCK_W: gl.constexpr,
            BLOCK_C: gl.constexpr):
    """codes [128 threads, 16 bytes] in fragment order, scales [64, 4] -> weights [W, C] bf16 in DOT_A."""
    # thread t = (w, lr, q), byte i = (h, e, c): the fragment's row 16w + 8e + lr, block c, byte 4h + q
    codes = gl.reshape(codes_raw, [4, 8, 4, 2, 2, 4])
    codes = gl.permute(codes, (0, 4, 1, 5, 3, 2))
    codes = gl.convert_layout(gl.reshape(codes, [BLOCK_W, BLOCK_C // 16, 8]), CODES, assert_trivial=True)
    scales = scales.to(gl.float8e4nv, bitcast=True).to(gl.float32) * SCALE_TO_DECODE
    scales = gl.expand_dims(scales.to(gl.bfloat16), 2)  # [W, C/16, 1]
    codes, scales = gl.broadcast(codes, scales)
    low, high = gl.inline_asm_elementwise(DECODE_PTX, "=r,=r,=r,=r,r,r,r", [codes, scales],
                                          dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    return gl.convert_layout(gl.reshape(gl.join(low, high), [BLOCK_W, BLOCK_C]), DOT_A, assert_trivial=True)


@gluon.jit
def frag_gate_up_kernel(
    hidden_states_ptr, slot_pairs_ptr, tile_experts_ptr, fragment_codes_ptr, fragment_scales_ptr, global_scale_ptr,
    intermediate_ptr, num_experts, hidden, width, pairs_per_row,
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr,
):
    BLOCK_W: gl.constexpr = 64
    BLOCK_C: gl.constexpr = 64
    NUM_WARPS: gl.constexpr = 4
    tile = gl.program_id(0)
    column_block = gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, BLOCK_R, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        CODES: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1, 0], [0, 2, 0], [8, 0, 0], [0, 0, 4]],
            lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[BLOCK_W, BLOCK_C // 16, 8])
        SCALES: gl.constexpr = gl.SliceLayout(2, CODES)
        RAW: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [NUM_WARPS, 1], [1, 0])
        A_COPY: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_C // 8), BLOCK_C // 8], [NUM_WARPS, 1],
                                                [1, 0])
        A_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_C], gl.bfloat16)
        a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, BLOCK_C], A_SMEM)

        num_steps = hidden // BLOCK_C
        slabs_per_expert = 2 * width // BLOCK_W
        gate_slab = expert * slabs_per_expert + column_block
        up_slab = gate_slab + width // BLOCK_W
        threads = gl.arange(0, 128, layout=gl.SliceLayout(1, RAW))
        code_bytes = gl.arange(0, 16, layout=gl.SliceLayout(0, RAW))
        codes_ptrs = fragment_codes_ptr + threads[:, None] * 16 + code_bytes[None, :]  # [128, 16]
        # scales [W, C/16]: row 16w + 8e + lr, block c at (w * 8 + lr) * 8 + 4e + c
        rows = gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, SCALES))
        blocks = gl.arange(0, BLOCK_C // 16, layout=gl.SliceLayout(0, SCALES))
        row_groups = (rows // 16) * 8 + rows % 8
        scales_ptrs = fragment_scales_ptr + (row_groups * 8 + ((rows // 8) % 2) * 4)[:, None] + blocks[None, :]

        a_columns = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, A_COPY))
        a_pairs = gl.load(slot_pairs_ptr + tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, A_COPY)))
        a_tokens = gl.where(a_pairs >= 0, a_pairs // pairs_per_row, 0).to(gl.int64)
        a_ptrs = hidden_states_ptr + a_tokens[:, None] * hidden + a_columns[None, :]
        a_mask = gl.broadcast((a_pairs >= 0)[:, None], a_columns[None, :] >= 0)
        a_mask = a_mask[0] & a_mask[1]

        for first in gl.static_range(STAGES - 1):
            async_copy.async_copy_global_to_shared(a_ring.index(first), a_ptrs + first * BLOCK_C, mask=a_mask)
            async_copy.commit_group()
        # register prefetch: steps 0 and 1 (AHEAD = 2)
        gate_codes0, gate_scales0 = _load_step(codes_ptrs, scales_ptrs, gate_slab, 0, num_steps)
        up_codes0, up_scales0 = _load_step(codes_ptrs, scales_ptrs, up_slab, 0, num_steps)
        gate_codes1, gate_scales1 = _load_step(codes_ptrs, scales_ptrs, gate_slab, 1, num_steps)
        up_codes1, up_scales1 = _load_step(codes_ptrs, scales_ptrs, up_slab, 1, num_steps)
        gate = gl.zeros([BLOCK_W, BLOCK_R], gl.float32, ACC)
        up = gl.zeros([BLOCK_W, BLOCK_R], gl.float32, ACC)
        for step in range(num_steps):
            stage = step % STAGES
            ahead = gl.minimum(step + AHEAD, num_steps - 1)
            gate_codes2, gate_scales2 = _load_step(codes_ptrs, scales_ptrs, gate_slab, ahead, num_steps)
            up_codes2, up_scales2 = _load_step(codes_ptrs, scales_ptrs, up_slab, ahead, num_steps)
            gate_weights = _decode(gate_codes0, gate_scales0, CODES, DOT_A, BLOCK_W, BLOCK_C)
            up_weights = _decode(up_codes0, up_scales0, CODES, DOT_A, BLOCK_W, BLOCK_C)
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            fence_async_shared()
            gate = warpgroup_mma(gate_weights, a_ring.index(stage).permute((1, 0)), gate, is_async=True)
            up = warpgroup_mma(up_weights, a_ring.index(stage).permute((1, 0)), up, is_async=True)
            gate, up = warpgroup_mma_wait(num_outstanding=2, deps=(gate, up))
            a_ahead = gl.minimum(step + STAGES - 1, num_steps - 1)
            async_copy.async_copy_global_to_shared(a_ring.index((step + STAGES - 1) % STAGES),
                                                   a_ptrs + a_ahead * BLOCK_C, mask=a_mask)
            async_copy.commit_group()
            gate_codes0, gate_scales0, up_codes0, up_scales0 = gate_codes1, gate_scales1, up_codes1, up_scales1
            gate_codes1, gate_scales1, up_codes1, up_scales1 = gate_codes2, gate_scales2, up_codes2, up_scales2
        gate, up = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up))
        async_copy.wait_group(0)

        gate = (gate * (gl.load(global_scale_ptr + 2 * expert) * DIVISOR)).to(gl.bfloat16).to(gl.float32)
        up = (up * (gl.load(global_scale_ptr + 2 * expert + 1) * DIVISOR)).to(gl.bfloat16).to(gl.float32)
        activated = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        intermediate = (activated * up).to(gl.bfloat16)  # [W, R]: output columns x slots
        out_columns = column_block * BLOCK_W + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, ACC))
        out_slots = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, ACC))
        gl.store(intermediate_ptr + out_slots.to(gl.int64)[None, :] * width + out_columns[:, None], intermediate)


def fragment_order(layer):
    """The layer's gate_up codes and scales in the order the kernel reads them (done once, at load)."""
    codes = layer.gate_up_packed_codes  # [E, 2I, H/2]
    num_experts, rows, half = codes.shape
    steps = half // 32
    # row = 64 slab + 16 w + 8 e + lr; byte = 32 s + 8 c + 4 h + q -> [E, slab, s, (w, lr, q), (h, e, c)]
    view = codes.view(num_experts, rows // 64, 4, 2, 8, steps, 4, 2, 4)  # E slab w e lr s c h q
    fragment_codes = view.permute(0, 1, 5, 2, 4, 8, 7, 3, 6).contiguous()
    scales = layer.gate_up_block_scales.view(torch.uint8)  # [E, 2I, H/16]
    view = scales.view(num_experts, rows // 64, 4, 2, 8, steps, 4)  # E slab w e lr s c
    fragment_scales = view.permute(0, 1, 5, 2, 4, 3, 6).contiguous()
    return fragment_codes, fragment_scales


def frag_intermediate(layer, fragments, hidden_states, top_k_index, rows, stages, ahead=2):
    slot_pairs, tile_experts = serve_clef.route_to_row_tiles(top_k_index, layer.num_experts, rows)
    intermediate = hidden_states.new_empty(tile_experts.numel() * rows, layer.width)
    frag_gate_up_kernel[(tile_experts.numel(), layer.width // 64)](
        hidden_states, slot_pairs, tile_experts, fragments[0], fragments[1], layer.gate_up_global_scale,
        intermediate, layer.num_experts, layer.hidden, layer.width, top_k_index.shape[1],
        BLOCK_R=rows, STAGES=stages, AHEAD=ahead, num_warps=WARPS)
    return intermediate, slot_pairs


CONFIGS = [(32, 4), (64, 3), (64, 4)]


def offline_compile() -> int:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    names = ["hidden_states_ptr", "slot_pairs_ptr", "tile_experts_ptr", "fragment_codes_ptr", "fragment_scales_ptr",
             "global_scale_ptr", "intermediate_ptr", "num_experts", "hidden", "width", "pairs_per_row"]
    kinds = ["*bf16", "*i32", "*i32", "*u8", "*u8", "*fp32", "*bf16", "i32", "i32", "i32", "i32"]
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)}
    for rows, stages in CONFIGS:
        constexprs = dict(BLOCK_R=rows, STAGES=stages, AHEAD=2)
        signature = dict(zip(names, kinds), **{k: "constexpr" for k in constexprs})
        src = GluonASTSource(fn=frag_gate_up_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=WARPS))
        name = f"frag_{rows}_{stages}"
        print(name, "shared", compiled.metadata.shared, flush=True)
        Path(f"/tmp/lab/{name}.ptx").write_text(compiled.asm["ptx"])
    return 0


def served_intermediate(layer, hidden_states, top_k_index):
    tiles = serve_clef.expert_tiles(top_k_index.numel(), layer.num_experts)
    slot_pairs, tile_experts = serve_clef.route_to_row_tiles(top_k_index, layer.num_experts, tiles.rows)
    intermediate = hidden_states.new_empty(tile_experts.numel() * tiles.rows, layer.width)
    serve_clef.nvfp4_gate_up_kernel[(tile_experts.numel(), layer.width // tiles.columns)](
        hidden_states, slot_pairs, tile_experts, layer.gate_up_packed_codes,
        layer.gate_up_block_scales.view(torch.uint8), layer.gate_up_global_scale, layer.down_input_scale, 1,
        intermediate, layer.num_experts, layer.hidden, layer.width, top_k_index.shape[1],
        SIMULATE_FP4=False, INTERPRETED=False, BLOCK_R=tiles.rows, BLOCK_N=tiles.columns, BLOCK_C=tiles.reduced,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return intermediate, slot_pairs


def by_pair(intermediate, slot_pairs, num_pairs):
    """The intermediate rows in pair order [S, I], whatever the tiling."""
    out = intermediate.new_zeros(num_pairs, intermediate.shape[1])
    live = slot_pairs >= 0
    out[slot_pairs[live].long()] = intermediate[live]
    return out


def main() -> int:
    import check_expert_kernels

    layer = check_expert_kernels.random_layer(True, seed=1)
    fragments = fragment_order(layer)
    failures = 0
    for num_tokens in (64, 512, 2048, 8192):
        hidden_states, top_k_index, _ = check_expert_kernels.routed_inputs(num_tokens, seed=num_tokens)
        num_pairs = top_k_index.numel()
        served = by_pair(*served_intermediate(layer, hidden_states, top_k_index), num_pairs)
        served_ms = check_expert_kernels.graph_ms(
            lambda: served_intermediate(layer, hidden_states, top_k_index))
        print(f"{num_tokens:5d} tokens: served gate_up {served_ms:.3f} ms (routing included)", flush=True)
        for config in CONFIGS:
            try:
                lab = by_pair(*frag_intermediate(layer, fragments, hidden_states, top_k_index, *config),
                                      num_pairs)
                again = by_pair(*frag_intermediate(layer, fragments, hidden_states, top_k_index, *config),
                                        num_pairs)
                lab_ms = check_expert_kernels.graph_ms(
                    lambda: frag_intermediate(layer, fragments, hidden_states, top_k_index, *config))
            except Exception as error:
                print(f"      {config}: {type(error).__name__}: {str(error)[:300]}", flush=True)
                failures += 1
                continue
            diff = (served.float() - lab.float()).abs().max().item()
            failures += diff > 0.02 or not torch.equal(lab, again)
            print(f"      {config}: fragment order {lab_ms:.3f} ms, repeat identical {torch.equal(lab, again)}, "
                  f"max diff {diff:.3g} of {served.float().abs().max().item():.3g}", flush=True)
    return int(failures > 0)


if __name__ == "__main__":
    import torch  # noqa: E402  (the GPU run and fragment_order; the offline build needs no torch)
    sys.exit(offline_compile() if "--compile" in sys.argv else main())
