"""Lab, not served: the packed-expert kernels written in Gluon (Triton's lower-level dialect) for Hopper, against the
served Triton kernels on one random full-size layer (H200, 2026-12-03; results in docs/benchmarks.md).

What Gluon allows that Triton's `tl` does not: each step's two tensor-core products stay in flight (asynchronous
warp-group MMA, at most one step pending) while the next step's weights are decoded, and every step's activations,
codes and scales are copied to a ring of shared memory STAGES - 1 steps ahead (`cp.async`). The decode is the served
PTX, its even and odd columns joined back into column order in registers. Outputs equal the served kernels' to one
BF16 step (the products add the columns in another order). Gluon does not run under Triton's interpreter, so these
kernels could not be checked on CPU as the served ones are.

Usage: python3 bench/gluon_expert_lab.py   (GPU; exit status 1 if an output differs beyond BF16 rounding)
"""

import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402

DECODE_PTX = gl.constexpr(serve_clef.decode_e2m1_ptx())
SCALE_TO_DECODE = gl.constexpr(2.0 ** 118)
DIVISOR = gl.constexpr(2.0 ** 8)


@gluon.jit
def _issue_step_copies(step, stage, hidden_states_ptr, tokens, live_rows, codes_ptr, scales_ptr, hidden, width,
                       code_stride, scale_stride,
                       expert_row0, a_ring, gate_codes_ring, up_codes_ring, gate_scales_ring, up_scales_ring,
                       BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr, num_warps: gl.constexpr):
    """cp.async of one step's activations [R, C], gate and up codes [N, C/2] and scales [N, C/16] into `stage`."""
    A_COPY: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_C // 8), BLOCK_C // 8], [num_warps, 1], [1, 0])
    CODE_COPY: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_C // 32), BLOCK_C // 32], [num_warps, 1], [1, 0])
    SCALE_COPY: gl.constexpr = gl.BlockedLayout([1, BLOCK_C // 16], [32, 1], [num_warps, 1], [1, 0])
    c0 = step * BLOCK_C
    a_columns = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, A_COPY))
    a_tokens = gl.convert_layout(tokens, gl.SliceLayout(1, A_COPY))
    a_live = gl.convert_layout(live_rows, gl.SliceLayout(1, A_COPY))
    a_mask = gl.broadcast(a_live[:, None], a_columns[None, :] >= 0)
    async_copy.async_copy_global_to_shared(
        a_ring.index(stage), hidden_states_ptr + a_tokens[:, None] * hidden + c0 + a_columns[None, :],
        mask=a_mask[0] & a_mask[1])
    code_rows = expert_row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CODE_COPY))
    code_bytes = gl.arange(0, BLOCK_C // 2, layout=gl.SliceLayout(0, CODE_COPY))
    gate_code_ptrs = codes_ptr + code_rows[:, None] * code_stride + step * (BLOCK_C // 2) + code_bytes[None, :]
    async_copy.async_copy_global_to_shared(gate_codes_ring.index(stage), gate_code_ptrs)
    async_copy.async_copy_global_to_shared(up_codes_ring.index(stage), gate_code_ptrs + width * code_stride)
    scale_rows = expert_row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCALE_COPY))
    scale_blocks = gl.arange(0, BLOCK_C // 16, layout=gl.SliceLayout(0, SCALE_COPY))
    gate_scale_ptrs = scales_ptr + scale_rows[:, None] * scale_stride + step * (BLOCK_C // 16) + scale_blocks[None, :]
    async_copy.async_copy_global_to_shared(gate_scales_ring.index(stage), gate_scale_ptrs)
    async_copy.async_copy_global_to_shared(up_scales_ring.index(stage), gate_scale_ptrs + width * scale_stride)
    async_copy.commit_group()


@gluon.jit
def _decode(codes, scales, BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr):
    """codes uint8 [N, C/16, 8], scales e4m3 bytes [N, C/16] -> weights bf16 [N, C] in column order, times 2**-8."""
    scales = scales.to(gl.float8e4nv, bitcast=True).to(gl.float32) * SCALE_TO_DECODE
    scales = gl.expand_dims(scales.to(gl.bfloat16), 2)  # [N, C/16, 1]
    codes, scales = gl.broadcast(codes, scales)
    even, odd = gl.inline_asm_elementwise(DECODE_PTX, "=r,=r,=r,=r,r,r,r", [codes, scales],
                                          dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    return gl.reshape(gl.join(even, odd), [BLOCK_N, BLOCK_C])


@gluon.jit
def gluon_gate_up_kernel(
    hidden_states_ptr, slot_pairs_ptr, tile_experts_ptr, packed_codes_ptr, block_scales_ptr, global_scale_ptr,
    intermediate_ptr, num_experts, hidden, width, pairs_per_row, code_stride, scale_stride,
    BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    tile = gl.program_id(0)
    column_block = gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        CODE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // (BLOCK_C // 16), BLOCK_C // 16, 1],
                                                     [num_warps, 1, 1], [2, 1, 0])
        ROW_LAYOUT: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        A_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_C], gl.bfloat16)
        W_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_C], gl.bfloat16)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, BLOCK_C], A_SMEM)
        gate_codes_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_C // 2], PLAIN)
        up_codes_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_C // 2], PLAIN)
        gate_scales_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_C // 16], PLAIN)
        up_scales_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_C // 16], PLAIN)
        gate_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_C], W_SMEM)
        up_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_C], W_SMEM)

        slots = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=ROW_LAYOUT)
        pairs = gl.load(slot_pairs_ptr + slots)
        live_rows = pairs >= 0
        tokens = gl.where(live_rows, pairs // pairs_per_row, 0).to(gl.int64)
        expert_row0 = expert.to(gl.int64) * 2 * width + column_block * BLOCK_N
        num_steps = hidden // BLOCK_C
        for first in gl.static_range(STAGES - 1):
            _issue_step_copies(first, first, hidden_states_ptr, tokens, live_rows, packed_codes_ptr, block_scales_ptr,
                               hidden, width, code_stride, scale_stride, expert_row0, a_ring, gate_codes_ring, up_codes_ring, gate_scales_ring,
                               up_scales_ring, BLOCK_R, BLOCK_N, BLOCK_C, num_warps)

        gate = gl.zeros([BLOCK_R, BLOCK_N], gl.float32, ACC_LAYOUT)
        up = gl.zeros([BLOCK_R, BLOCK_N], gl.float32, ACC_LAYOUT)
        for step in range(num_steps):
            stage = step % STAGES
            buffer = step % 2
            async_copy.wait_group(STAGES - 2)  # this step's copies have landed
            gl.thread_barrier()
            codes = gate_codes_ring.index(stage).reshape([BLOCK_N, BLOCK_C // 16, 8]).load(CODE_LAYOUT)
            scales = gate_scales_ring.index(stage).load(gl.SliceLayout(2, CODE_LAYOUT))
            gate_smem.index(buffer).store(_decode(codes, scales, BLOCK_N, BLOCK_C))
            codes = up_codes_ring.index(stage).reshape([BLOCK_N, BLOCK_C // 16, 8]).load(CODE_LAYOUT)
            scales = up_scales_ring.index(stage).load(gl.SliceLayout(2, CODE_LAYOUT))
            up_smem.index(buffer).store(_decode(codes, scales, BLOCK_N, BLOCK_C))
            fence_async_shared()
            gate = warpgroup_mma(a_ring.index(stage), gate_smem.index(buffer).permute((1, 0)), gate, is_async=True)
            up = warpgroup_mma(a_ring.index(stage), up_smem.index(buffer).permute((1, 0)), up, is_async=True)
            # this step's products stay in flight while the next step decodes; the previous step's are done, so its
            # stage of the ring and its weight buffer may be written again
            gate, up = warpgroup_mma_wait(num_outstanding=2, deps=(gate, up))
            _issue_step_copies(gl.minimum(step + STAGES - 1, num_steps - 1), (step + STAGES - 1) % STAGES,
                               hidden_states_ptr, tokens, live_rows, packed_codes_ptr, block_scales_ptr, hidden,
                               width, code_stride, scale_stride, expert_row0, a_ring, gate_codes_ring, up_codes_ring, gate_scales_ring,
                               up_scales_ring, BLOCK_R, BLOCK_N, BLOCK_C, num_warps)
        gate, up = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up))
        async_copy.wait_group(0)

        gate = gate * (gl.load(global_scale_ptr + 2 * expert) * DIVISOR)
        up = up * (gl.load(global_scale_ptr + 2 * expert + 1) * DIVISOR)
        gate = gate.to(gl.bfloat16).to(gl.float32)
        up = up.to(gl.bfloat16).to(gl.float32)
        activated = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        intermediate = (activated * up).to(gl.bfloat16)
        out_slots = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ACC_LAYOUT))
        out_columns = column_block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ACC_LAYOUT))
        gl.store(intermediate_ptr + out_slots.to(gl.int64)[:, None] * width + out_columns[None, :], intermediate)


@gluon.jit
def gluon_down_kernel(
    intermediate_ptr, slot_pairs_ptr, tile_experts_ptr, routing_weights_ptr, packed_codes_ptr, block_scales_ptr,
    global_scale_ptr, pair_outputs_ptr, num_experts, hidden, width, code_stride, scale_stride,
    BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    tile = gl.program_id(0)
    column_block = gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        CODE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // (BLOCK_C // 16), BLOCK_C // 16, 1],
                                                     [num_warps, 1, 1], [2, 1, 0])
        A_COPY: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_C // 8), BLOCK_C // 8], [num_warps, 1], [1, 0])
        CODE_COPY: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_C // 32), BLOCK_C // 32], [num_warps, 1],
                                                   [1, 0])
        SCALE_COPY: gl.constexpr = gl.BlockedLayout([1, BLOCK_C // 16], [32, 1], [num_warps, 1], [1, 0])
        ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        A_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_C], gl.bfloat16)
        W_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_C], gl.bfloat16)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, BLOCK_C], A_SMEM)
        codes_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_C // 2], PLAIN)
        scales_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_C // 16], PLAIN)
        w_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_C], W_SMEM)

        a_rows = (tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, A_COPY))).to(gl.int64)
        a_columns = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, A_COPY))
        code_rows = expert.to(gl.int64) * hidden + column_block * BLOCK_N + gl.arange(
            0, BLOCK_N, layout=gl.SliceLayout(1, CODE_COPY))
        code_bytes = gl.arange(0, BLOCK_C // 2, layout=gl.SliceLayout(0, CODE_COPY))
        scale_rows = expert.to(gl.int64) * hidden + column_block * BLOCK_N + gl.arange(
            0, BLOCK_N, layout=gl.SliceLayout(1, SCALE_COPY))
        scale_blocks = gl.arange(0, BLOCK_C // 16, layout=gl.SliceLayout(0, SCALE_COPY))
        num_steps = width // BLOCK_C
        for first in gl.static_range(STAGES - 1):
            async_copy.async_copy_global_to_shared(
                a_ring.index(first), intermediate_ptr + a_rows[:, None] * width + first * BLOCK_C + a_columns[None, :])
            async_copy.async_copy_global_to_shared(
                codes_ring.index(first),
                packed_codes_ptr + code_rows[:, None] * code_stride + first * (BLOCK_C // 2) + code_bytes[None, :])
            async_copy.async_copy_global_to_shared(
                scales_ring.index(first),
                block_scales_ptr + scale_rows[:, None] * scale_stride + first * (BLOCK_C // 16) + scale_blocks[None, :])
            async_copy.commit_group()
        out = gl.zeros([BLOCK_R, BLOCK_N], gl.float32, ACC_LAYOUT)
        for step in range(num_steps):
            stage = step % STAGES
            buffer = step % 2
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            codes = codes_ring.index(stage).reshape([BLOCK_N, BLOCK_C // 16, 8]).load(CODE_LAYOUT)
            scales = scales_ring.index(stage).load(gl.SliceLayout(2, CODE_LAYOUT))
            w_smem.index(buffer).store(_decode(codes, scales, BLOCK_N, BLOCK_C))
            fence_async_shared()
            out = warpgroup_mma(a_ring.index(stage), w_smem.index(buffer).permute((1, 0)), out, is_async=True)
            out = warpgroup_mma_wait(num_outstanding=1, deps=(out,))
            ahead = gl.minimum(step + STAGES - 1, num_steps - 1)
            slot = (step + STAGES - 1) % STAGES
            async_copy.async_copy_global_to_shared(
                a_ring.index(slot), intermediate_ptr + a_rows[:, None] * width + ahead * BLOCK_C + a_columns[None, :])
            async_copy.async_copy_global_to_shared(
                codes_ring.index(slot),
                packed_codes_ptr + code_rows[:, None] * code_stride + ahead * (BLOCK_C // 2) + code_bytes[None, :])
            async_copy.async_copy_global_to_shared(
                scales_ring.index(slot),
                block_scales_ptr + scale_rows[:, None] * scale_stride + ahead * (BLOCK_C // 16) + scale_blocks[None, :])
            async_copy.commit_group()
        out = warpgroup_mma_wait(num_outstanding=0, deps=(out,))
        async_copy.wait_group(0)

        out = (out * (gl.load(global_scale_ptr + expert) * DIVISOR)).to(gl.bfloat16).to(gl.float32)
        out_slots = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ACC_LAYOUT))
        pairs = gl.load(slot_pairs_ptr + out_slots)
        pair_rows = gl.where(pairs >= 0, pairs, 0).to(gl.int64)
        routing_weights = gl.load(routing_weights_ptr + pair_rows).to(gl.float32)
        out_columns = column_block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ACC_LAYOUT))
        live = gl.broadcast((pairs >= 0)[:, None], out_columns[None, :] >= 0)
        gl.store(pair_outputs_ptr + pair_rows[:, None] * hidden + out_columns[None, :],
                 (out * routing_weights[:, None]).to(gl.bfloat16), mask=live[0] & live[1])


def by_pair(intermediate, slot_pairs, num_pairs):
    """The intermediate rows in pair order [S, I], whatever the tiling."""
    out = intermediate.new_zeros(num_pairs, intermediate.shape[1])
    live = slot_pairs >= 0
    out[slot_pairs[live].long()] = intermediate[live]
    return out


def gluon_intermediate(layer, hidden_states, top_k_index, rows, columns, reduced, warps, stages=3):
    slot_pairs, tile_experts = serve_clef.route_to_row_tiles(top_k_index, layer.num_experts, rows)
    intermediate = hidden_states.new_empty(tile_experts.numel() * rows, layer.width)
    gluon_gate_up_kernel[(tile_experts.numel(), layer.width // columns)](
        hidden_states, slot_pairs, tile_experts, layer.gate_up_packed_codes,
        layer.gate_up_block_scales.view(torch.uint8), layer.gate_up_global_scale, intermediate,
        layer.num_experts, layer.hidden, layer.width, top_k_index.shape[1], layer.hidden // 2, layer.hidden // 16,
        BLOCK_R=rows, BLOCK_N=columns, BLOCK_C=reduced, STAGES=stages, num_warps=warps)
    return intermediate, slot_pairs


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


def gluon_down(layer, intermediate, slot_pairs, tile_experts, top_k_weights, num_pairs, rows, columns, warps,
               stages=3):
    pair_outputs = intermediate.new_zeros(num_pairs, layer.hidden)
    gluon_down_kernel[(tile_experts.numel(), layer.hidden // columns)](
        intermediate, slot_pairs, tile_experts, top_k_weights.reshape(-1), layer.down_packed_codes,
        layer.down_block_scales.view(torch.uint8), layer.down_global_scale, pair_outputs, layer.num_experts,
        layer.hidden, layer.width, layer.width // 2, layer.width // 16,
        BLOCK_R=rows, BLOCK_N=columns, BLOCK_C=64, STAGES=stages, num_warps=warps)
    return pair_outputs


def served_down(layer, intermediate, slot_pairs, tile_experts, top_k_weights, num_pairs, rows, columns, warps):
    pair_outputs = intermediate.new_zeros(num_pairs, layer.hidden)
    serve_clef.nvfp4_down_kernel[(tile_experts.numel(), layer.hidden // columns)](
        intermediate, slot_pairs, tile_experts, top_k_weights.reshape(-1), layer.down_packed_codes,
        layer.down_block_scales.view(torch.uint8), layer.down_global_scale, pair_outputs, layer.num_experts,
        layer.hidden, layer.width, INTERPRETED=False, ROUTED_ROWS=rows, BLOCK_R=rows, BLOCK_N=columns, BLOCK_C=64,
        num_warps=warps, num_stages=3)
    return pair_outputs


DOWN_CONFIGS = ((64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8))


def compare_down(layer, num_tokens) -> int:
    import check_expert_kernels

    hidden_states, top_k_index, top_k_weights = check_expert_kernels.routed_inputs(num_tokens, seed=num_tokens)
    failures = 0
    for rows, columns, warps in DOWN_CONFIGS:
        slot_pairs, tile_experts = serve_clef.route_to_row_tiles(top_k_index, layer.num_experts, rows)
        intermediate = (torch.randn(slot_pairs.numel(), layer.width, device="cuda") * 0.05).to(torch.bfloat16)
        args = (layer, intermediate, slot_pairs, tile_experts, top_k_weights, top_k_index.numel(), rows, columns, warps)
        served = served_down(*args)
        try:
            lab = gluon_down(*args)
            lab_ms = check_expert_kernels.graph_ms(lambda: gluon_down(*args))
        except Exception as error:
            print(f"      down {rows}x{columns} w{warps}: {type(error).__name__}: {str(error)[:200]}")
            continue
        served_ms = check_expert_kernels.graph_ms(lambda: served_down(*args))
        close = (served.float() - lab.float()).abs().max().item() <= 0.02 * served.float().abs().max().item()
        failures += not close
        print(f"      down {rows}x{columns} w{warps}: served {served_ms:.3f} ms, gluon {lab_ms:.3f} ms, equal "
              f"{torch.equal(served, lab)}, max diff {(served.float() - lab.float()).abs().max().item():.3g} of "
              f"{served.float().abs().max().item():.3g}", flush=True)
    return failures


CONFIGS = ((64, 64, 64, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3),
           (128, 128, 64, 8, 3), (128, 64, 64, 4, 3))


def main() -> int:
    import check_expert_kernels

    layer = check_expert_kernels.random_layer(True, seed=1)
    failures = 0
    for num_tokens in (64, 512, 2048, 8192):
        hidden_states, top_k_index, _ = check_expert_kernels.routed_inputs(num_tokens, seed=num_tokens)
        num_pairs = top_k_index.numel()
        served = by_pair(*served_intermediate(layer, hidden_states, top_k_index), num_pairs)
        served_ms = check_expert_kernels.graph_ms(lambda: served_intermediate(layer, hidden_states, top_k_index))
        print(f"{num_tokens:5d} tokens: served gate_up {served_ms:.3f} ms (routing included)", flush=True)
        for rows, columns, reduced, warps, stages in CONFIGS:
            try:
                lab = by_pair(*gluon_intermediate(layer, hidden_states, top_k_index, rows, columns, reduced, warps,
                                                 stages),
                              num_pairs)
                lab_ms = check_expert_kernels.graph_ms(
                    lambda: gluon_intermediate(layer, hidden_states, top_k_index, rows, columns, reduced, warps,
                                               stages))
            except Exception as error:  # a configuration that does not compile or fit
                print(f"      {rows}x{columns}x{reduced} w{warps} s{stages}: {type(error).__name__}: {str(error)[:200]}")
                continue
            equal = torch.equal(served, lab)
            failures += (served.float() - lab.float()).abs().max().item() > 0.02
            print(f"      {rows}x{columns}x{reduced} w{warps} s{stages}: gluon {lab_ms:.3f} ms, bit-identical {equal}, max diff "
                  f"{(served.float() - lab.float()).abs().max().item():.3g}", flush=True)
        failures += compare_down(layer, num_tokens)
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
