"""Lab, not served: a Gluon gate_up kernel for Hopper whose decoded weights are the tensor cores' left operand straight
from registers (out^T = W a^T, the routed rows as the products' N), against the served Triton kernel on one random
full-size layer (H200, 2026-12-04; results in docs/benchmarks.md).

No decoded weight goes through shared memory: each thread reads from the ring the code bytes of its own part of the
left operand (a linear layout written out below), decodes them with the served PTX, and the even and odd columns
join into the operand's register layout with no data movement (checked at compile time). The activations are the
right operand, from a cp.async ring. With 128 routed rows the outputs are not repeatable (a race not chased).
Gluon has no interpreter: this kernel cannot run on CPU.

Usage: python3 bench/gluon_register_operand_lab.py            (GPU; exit status 1 on a mismatch)
       python3 bench/gluon_register_operand_lab.py --compile  (CPU: build for sm_90 offline with triton 3.6 on the
                                                                path, PTX into /tmp/lab)
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


@gluon.jit
def _decoded_weights(raw_codes, raw_scales, CODES: gl.constexpr, DOT_A: gl.constexpr, BLOCK_W: gl.constexpr,
                     BLOCK_C: gl.constexpr):
    """One step's codes [W, C/2] and scales [W, C/16] in shared memory -> weights [W, C] bf16 (times 2**-8) in the
    register layout of the tensor cores' left operand."""
    codes = raw_codes.reshape([BLOCK_W, BLOCK_C // 16, 8]).load(CODES)
    scales = raw_scales.load(gl.SliceLayout(2, CODES))
    scales = scales.to(gl.float8e4nv, bitcast=True).to(gl.float32) * SCALE_TO_DECODE
    scales = gl.expand_dims(scales.to(gl.bfloat16), 2)  # [W, C/16, 1]
    codes, scales = gl.broadcast(codes, scales)
    low, high = gl.inline_asm_elementwise(DECODE_PTX, "=r,=r,=r,=r,r,r,r", [codes, scales],
                                          dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    return gl.convert_layout(gl.reshape(gl.join(low, high), [BLOCK_W, BLOCK_C]), DOT_A, assert_trivial=True)


@gluon.jit
def _issue_copies(step, stage, a_ptrs, a_mask, gate_code_ptrs, up_code_ptrs, gate_scale_ptrs, up_scale_ptrs, a_ring,
                  gate_codes, up_codes, gate_scales, up_scales, BLOCK_C: gl.constexpr):
    async_copy.async_copy_global_to_shared(a_ring.index(stage), a_ptrs + step * BLOCK_C, mask=a_mask)
    async_copy.async_copy_global_to_shared(gate_codes.index(stage), gate_code_ptrs + step * (BLOCK_C // 2))
    async_copy.async_copy_global_to_shared(up_codes.index(stage), up_code_ptrs + step * (BLOCK_C // 2))
    async_copy.async_copy_global_to_shared(gate_scales.index(stage), gate_scale_ptrs + step * (BLOCK_C // 16))
    async_copy.async_copy_global_to_shared(up_scales.index(stage), up_scale_ptrs + step * (BLOCK_C // 16))
    async_copy.commit_group()


@gluon.jit
def rega_gate_up_kernel(
    hidden_states_ptr, slot_pairs_ptr, tile_experts_ptr, packed_codes_ptr, block_scales_ptr, global_scale_ptr,
    intermediate_ptr, num_experts, hidden, width, pairs_per_row, code_stride, scale_stride,
    BLOCK_R: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_C: gl.constexpr, STAGES: gl.constexpr,
):
    NUM_WARPS: gl.constexpr = 4
    tile = gl.program_id(0)
    column_block = gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, BLOCK_R, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        # the bytes each thread needs for its part of DOT_A (weights in pairs of columns = one code byte each),
        # [W, C/16, 8]: rows r and r + 8, bytes q and q + 4 of each 16-column block, for W = 64 and C = 64
        CODES: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[8, 0, 0], [0, 0, 4], [0, 1, 0], [0, 2, 0]],
            lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[BLOCK_W, BLOCK_C // 16, 8])
        A_COPY: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_C // 8), BLOCK_C // 8], [NUM_WARPS, 1],
                                                [1, 0])
        CODE_COPY: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_C // 32), BLOCK_C // 32],
                                                   [NUM_WARPS, 1], [1, 0])
        SCALE_COPY: gl.constexpr = gl.BlockedLayout([1, BLOCK_C // 16], [32, 1], [NUM_WARPS, 1], [1, 0])
        A_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_C], gl.bfloat16)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, BLOCK_C], A_SMEM)
        gate_codes = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_W, BLOCK_C // 2], PLAIN)
        up_codes = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_W, BLOCK_C // 2], PLAIN)
        gate_scales = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_W, BLOCK_C // 16], PLAIN)
        up_scales = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_W, BLOCK_C // 16], PLAIN)

        gate_row0 = expert * 2 * width + column_block * BLOCK_W
        code_rows = (gate_row0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, CODE_COPY))).to(gl.int64)
        code_bytes = gl.arange(0, BLOCK_C // 2, layout=gl.SliceLayout(0, CODE_COPY))
        gate_code_ptrs = packed_codes_ptr + code_rows[:, None] * code_stride + code_bytes[None, :]
        up_code_ptrs = gate_code_ptrs + width * code_stride
        scale_rows = (gate_row0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, SCALE_COPY))).to(gl.int64)
        scale_blocks = gl.arange(0, BLOCK_C // 16, layout=gl.SliceLayout(0, SCALE_COPY))
        gate_scale_ptrs = block_scales_ptr + scale_rows[:, None] * scale_stride + scale_blocks[None, :]
        up_scale_ptrs = gate_scale_ptrs + width * scale_stride
        a_columns = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, A_COPY))
        a_pairs = gl.load(slot_pairs_ptr + tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, A_COPY)))
        a_tokens = gl.where(a_pairs >= 0, a_pairs // pairs_per_row, 0).to(gl.int64)
        a_ptrs = hidden_states_ptr + a_tokens[:, None] * hidden + a_columns[None, :]
        a_mask = gl.broadcast((a_pairs >= 0)[:, None], a_columns[None, :] >= 0)
        a_mask = a_mask[0] & a_mask[1]

        num_steps = hidden // BLOCK_C
        for first in gl.static_range(STAGES - 1):
            _issue_copies(first, first, a_ptrs, a_mask, gate_code_ptrs, up_code_ptrs, gate_scale_ptrs, up_scale_ptrs,
                          a_ring, gate_codes, up_codes, gate_scales, up_scales, BLOCK_C)
        gate = gl.zeros([BLOCK_W, BLOCK_R], gl.float32, ACC)
        up = gl.zeros([BLOCK_W, BLOCK_R], gl.float32, ACC)
        for step in range(num_steps):
            stage = step % STAGES
            async_copy.wait_group(STAGES - 2)  # this step's copies have landed (own thread) ...
            gl.thread_barrier()  # ... and every thread's
            fence_async_shared()
            gate_weights = _decoded_weights(gate_codes.index(stage), gate_scales.index(stage), CODES, DOT_A, BLOCK_W,
                                            BLOCK_C)
            up_weights = _decoded_weights(up_codes.index(stage), up_scales.index(stage), CODES, DOT_A, BLOCK_W,
                                          BLOCK_C)
            gate = warpgroup_mma(gate_weights, a_ring.index(stage).permute((1, 0)), gate, is_async=True)
            up = warpgroup_mma(up_weights, a_ring.index(stage).permute((1, 0)), up, is_async=True)
            # the previous step's products are done: its stage may be refilled
            gate, up = warpgroup_mma_wait(num_outstanding=2, deps=(gate, up))
            ahead = gl.minimum(step + STAGES - 1, num_steps - 1)
            _issue_copies(ahead, (step + STAGES - 1) % STAGES, a_ptrs, a_mask, gate_code_ptrs, up_code_ptrs,
                          gate_scale_ptrs, up_scale_ptrs, a_ring, gate_codes, up_codes, gate_scales, up_scales,
                          BLOCK_C)
        gate, up = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up))
        async_copy.wait_group(0)

        gate = (gate * (gl.load(global_scale_ptr + 2 * expert) * DIVISOR)).to(gl.bfloat16).to(gl.float32)
        up = (up * (gl.load(global_scale_ptr + 2 * expert + 1) * DIVISOR)).to(gl.bfloat16).to(gl.float32)
        activated = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        intermediate = (activated * up).to(gl.bfloat16)  # [W, R]: output columns x slots
        out_columns = column_block * BLOCK_W + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, ACC))
        out_slots = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, ACC))
        gl.store(intermediate_ptr + out_slots.to(gl.int64)[None, :] * width + out_columns[:, None], intermediate)


def rega_intermediate(layer, hidden_states, top_k_index, rows, stages):
    import torch
    slot_pairs, tile_experts = serve_clef.route_to_row_tiles(top_k_index, layer.num_experts, rows)
    intermediate = hidden_states.new_empty(tile_experts.numel() * rows, layer.width)
    rega_gate_up_kernel[(tile_experts.numel(), layer.width // 64)](
        hidden_states, slot_pairs, tile_experts, layer.gate_up_packed_codes,
        layer.gate_up_block_scales.view(torch.uint8), layer.gate_up_global_scale, intermediate,
        layer.num_experts, layer.hidden, layer.width, top_k_index.shape[1], layer.hidden // 2, layer.hidden // 16,
        BLOCK_R=rows, BLOCK_W=64, BLOCK_C=64, STAGES=stages, num_warps=WARPS)
    return intermediate, slot_pairs


# routed rows (the products' N), stages
CONFIGS = [(32, 4), (64, 3), (64, 4), (128, 3), (128, 4)]


def offline_compile() -> int:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    names = ["hidden_states_ptr", "slot_pairs_ptr", "tile_experts_ptr", "packed_codes_ptr", "block_scales_ptr",
             "global_scale_ptr", "intermediate_ptr", "num_experts", "hidden", "width", "pairs_per_row",
             "code_stride", "scale_stride"]
    kinds = ["*bf16", "*i32", "*i32", "*u8", "*u8", "*fp32", "*bf16", "i32", "i32", "i32", "i32", "i32", "i32"]
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12)}
    for rows, stages in CONFIGS:
        constexprs = dict(BLOCK_R=rows, BLOCK_W=64, BLOCK_C=64, STAGES=stages)
        signature = dict(zip(names, kinds), **{k: "constexpr" for k in constexprs})
        src = GluonASTSource(fn=rega_gate_up_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=WARPS))
        name = f"rega_{rows}_{stages}"
        print(name, "shared", compiled.metadata.shared, flush=True)
        Path(f"/tmp/lab/{name}.ptx").write_text(compiled.asm["ptx"])
    return 0


def main() -> int:
    import torch
    import check_expert_kernels
    import gluon_warp_specialised_lab as _ws_lab

    layer = check_expert_kernels.random_layer(True, seed=1)
    failures = 0
    for num_tokens in (64, 512, 2048, 8192):
        hidden_states, top_k_index, _ = check_expert_kernels.routed_inputs(num_tokens, seed=num_tokens)
        num_pairs = top_k_index.numel()
        served = _ws_lab.by_pair(*_ws_lab.served_intermediate(layer, hidden_states, top_k_index), num_pairs)
        served_ms = check_expert_kernels.graph_ms(
            lambda: _ws_lab.served_intermediate(layer, hidden_states, top_k_index))
        print(f"{num_tokens:5d} tokens: served gate_up {served_ms:.3f} ms (routing included)", flush=True)
        for config in CONFIGS:
            try:
                lab = _ws_lab.by_pair(*rega_intermediate(layer, hidden_states, top_k_index, *config), num_pairs)
                again = _ws_lab.by_pair(*rega_intermediate(layer, hidden_states, top_k_index, *config), num_pairs)
                lab_ms = check_expert_kernels.graph_ms(
                    lambda: rega_intermediate(layer, hidden_states, top_k_index, *config))
            except Exception as error:
                print(f"      {config}: {type(error).__name__}: {str(error)[:300]}", flush=True)
                failures += 1
                continue
            diff = (served.float() - lab.float()).abs().max().item()
            failures += diff > 0.02 or not torch.equal(lab, again)
            print(f"      {config}: registers-A {lab_ms:.3f} ms, bit-identical to served {torch.equal(served, lab)}, "
                  f"repeat identical {torch.equal(lab, again)}, max diff {diff:.3g} of "
                  f"{served.float().abs().max().item():.3g}", flush=True)
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(offline_compile() if "--compile" in sys.argv else main())
