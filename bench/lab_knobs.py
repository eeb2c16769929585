"""Lab (not committed): what bounds the gluon gate_up kernel: the served kernel with its products, its decode
(replaced by moves) or its code loads (step 0's reused) taken out, timed on one random full-size layer."""

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import serve_clef as sc  # noqa: E402
from check_expert_kernels import graph_ms, random_layer, routed_inputs  # noqa: E402
from serve_clef import *  # noqa: E402,F403
from serve_clef import (_allocate_fragment_ring, _fragment_scales, _fragment_step_pointers, _load_fragment_step,  # noqa: E402
                        _repeat_eight, async_copy)

MOVE_PTX = gl.constexpr("mov.b32 $0, $4; mov.b32 $1, $5; mov.b32 $2, $12; mov.b32 $3, $13;")


@gluon.jit
def _decode_fragment_step(words, scale_words, scale_words_8, byte_shifts, DOT_A: gl.constexpr, NO_DECODE: gl.constexpr):
    """One step of a slab: words int32 [w, rl, q, s] and the scale words of rows r and r + 8 -> the weights BF16
    [64 rows, 64 columns] as e2m1 * block_scale * 2**-8, in DOT_A (the operand's register layout; asserted, so no
    data moves between threads)."""
    scales, scales_8 = _fragment_scales(scale_words, byte_shifts), _fragment_scales(scale_words_8, byte_shifts)
    scales = gl.join(gl.join(scales, scales), gl.join(scales_8, scales_8))  # [w, rl, q, s, h, e]
    scales = gl.join(scales, scales)  # [w, rl, q, s, h, e, p]
    # not pure: the compiler keeps the decode where it is written, between the products it overlaps and their wait
    weights = gl.inline_asm_elementwise(MOVE_PTX if NO_DECODE else FRAGMENT_WORD_PTX, "=r,=r,=r,=r" + ",r" * 12, [_repeat_eight(words), scales],
                                        dtype=gl.bfloat16, is_pure=False, pack=8)  # [w, rl, q, s, h, e, p]
    weights = gl.permute(weights, (0, 5, 1, 3, 4, 2, 6))  # [w, e, rl, s, h, q, p]: row, then column order
    return gl.convert_layout(gl.reshape(weights, [FRAGMENT_ROWS, FRAGMENT_STEP]), DOT_A, assert_trivial=True)


@gluon.jit
def gate_up_knobs_kernel(
    hidden_states_ptr,  # BF16 [T, H], or [S, H] (one row per pair) when pairs_per_row is 1
    slot_pairs_ptr, tile_experts_ptr,  # as for nvfp4_gate_up_kernel
    fragment_words_ptr,  # int32 [E, 2I/64, H/64, 512]: gate slabs, then up slabs, in fragment order
    block_scales_ptr,  # int32 [E, 2I, H/64]: the e4m3 block scales, four to a word
    global_scale_ptr,  # fp32 [E, 2]
    intermediate_ptr,  # BF16 [P, I]: SiLU(gate) * up of each slot
    num_experts, hidden, width, pairs_per_row,  # as for nvfp4_gate_up_kernel
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
    NO_MMA: gl.constexpr, NO_DECODE: gl.constexpr, NO_LOADS: gl.constexpr, INFLIGHT: gl.constexpr,
):
    tile, slab_column = gl.program_id(0), gl.program_id(1)  # slab_column: 64 columns of both gate and up
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
        ring = _allocate_fragment_ring(BLOCK_R, STAGES)
        num_steps = hidden // FRAGMENT_STEP
        gate_slab = expert * (2 * width // FRAGMENT_ROWS) + slab_column
        gate_words_ptr, gate_scales_ptr, byte_shifts = _fragment_step_pointers(
            fragment_words_ptr, block_scales_ptr, gate_slab, num_steps, hidden)
        up_words_ptr, up_scales_ptr, _ = _fragment_step_pointers(
            fragment_words_ptr, block_scales_ptr, gate_slab + width // FRAGMENT_ROWS, num_steps, hidden)
        # the tile's token rows, gathered by cp.async into the ring (padding slots read zeros)
        copy_columns = gl.arange(0, FRAGMENT_STEP, layout=gl.SliceLayout(0, FRAGMENT_ROWS_COPY))
        pairs = gl.load(slot_pairs_ptr + tile * BLOCK_R
                        + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, FRAGMENT_ROWS_COPY)))
        tokens = gl.where(pairs >= 0, pairs // pairs_per_row, 0).to(gl.int64)
        rows_ptr = hidden_states_ptr + tokens[:, None] * hidden + copy_columns[None, :]  # [R, 64]
        rows_mask = gl.broadcast((pairs >= 0)[:, None], copy_columns[None, :] >= 0)
        rows_mask = rows_mask[0] & rows_mask[1]
        for first in gl.static_range(STAGES - 1):
            async_copy.async_copy_global_to_shared(ring.index(first), rows_ptr + first * FRAGMENT_STEP, mask=rows_mask)
            async_copy.commit_group()
        # Step 0 decoded, step 1's codes in registers. Each step loads step + 2's codes and decodes step + 1's while
        # its own products run; the products' weights are kept until their wait, since the tensor cores read them
        # from the registers while the products run.
        gate_weights = _decode_fragment_step(*_load_fragment_step(gate_words_ptr, gate_scales_ptr, hidden, 0),
                                             byte_shifts, DOT_A, NO_DECODE)
        up_weights = _decode_fragment_step(*_load_fragment_step(up_words_ptr, up_scales_ptr, hidden, 0), byte_shifts,
                                           DOT_A, NO_DECODE)
        gate_codes = _load_fragment_step(gate_words_ptr, gate_scales_ptr, hidden, gl.minimum(1, num_steps - 1))
        up_codes = _load_fragment_step(up_words_ptr, up_scales_ptr, hidden, gl.minimum(1, num_steps - 1))
        gate = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)  # [64 gate columns, R slots]
        up = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
        inflight_gate, inflight_up = gate_weights, up_weights
        for step in range(num_steps):
            ahead = gl.minimum(step + 2, num_steps - 1)
            if NO_LOADS:
                ahead = 0
            next_gate_codes = _load_fragment_step(gate_words_ptr, gate_scales_ptr, hidden, ahead)
            next_up_codes = _load_fragment_step(up_words_ptr, up_scales_ptr, hidden, ahead)
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()  # every thread's copies of this step are in
            fence_async_shared()
            rows = ring.index(step % STAGES).permute((1, 0))  # [64, R]
            if not NO_MMA:
                gate = warpgroup_mma(gate_weights, rows, gate, is_async=True)
                up = warpgroup_mma(up_weights, rows, up, is_async=True)
            next_gate_weights = _decode_fragment_step(*gate_codes, byte_shifts, DOT_A, NO_DECODE)
            next_up_weights = _decode_fragment_step(*up_codes, byte_shifts, DOT_A, NO_DECODE)
            if INFLIGHT:  # the step's products stay in flight until the next step's are issued
                gate, up, gate_weights, up_weights, inflight_gate, inflight_up = warpgroup_mma_wait(
                    num_outstanding=2, deps=(gate, up, gate_weights, up_weights, inflight_gate, inflight_up))
                inflight_gate, inflight_up = gate_weights, up_weights
            else:
                gate, up, gate_weights, up_weights = warpgroup_mma_wait(
                    num_outstanding=0, deps=(gate, up, gate_weights, up_weights))
            async_copy.async_copy_global_to_shared(
                ring.index((step + STAGES - 1) % STAGES),
                rows_ptr + gl.minimum(step + STAGES - 1, num_steps - 1) * FRAGMENT_STEP, mask=rows_mask)
            async_copy.commit_group()
            gate_weights, up_weights = next_gate_weights, next_up_weights
            gate_codes, up_codes = next_gate_codes, next_up_codes
        async_copy.wait_group(0)
        if INFLIGHT:
            gate, up, inflight_gate, inflight_up = warpgroup_mma_wait(
                num_outstanding=0, deps=(gate, up, inflight_gate, inflight_up))
        # the epilogue of nvfp4_gate_up_kernel: BF16 where transformers rounds, on [64 columns, R slots]
        gate = (gate * (gl.load(global_scale_ptr + 2 * expert) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
        up = (up * (gl.load(global_scale_ptr + 2 * expert + 1) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
        gate, up = gate.to(gl.float32), up.to(gl.float32)
        activated = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        intermediate = (activated * up).to(gl.bfloat16)
        columns = slab_column * FRAGMENT_ROWS + gl.arange(0, FRAGMENT_ROWS, layout=gl.SliceLayout(1, ACCUMULATOR))
        slots = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, ACCUMULATOR))
        gl.store(intermediate_ptr + slots.to(gl.int64)[None, :] * width + columns[:, None], intermediate)




def main():
    layer = random_layer(False, seed=3)
    layer.to_fragment_order()
    report = []
    # (tokens, rows, stages, knobs)
    plain = dict(NO_MMA=False, NO_DECODE=False, NO_LOADS=False, INFLIGHT=False)
    configurations = [
        (512, 64, 4, dict(plain, NO_DECODE=True)), (512, 32, 3, dict(plain, NO_DECODE=True)),
        (512, 128, 3, dict(plain, NO_DECODE=True)),
        (512, 64, 4, dict(plain, INFLIGHT=True)), (512, 64, 5, dict(plain, INFLIGHT=True)),
        (512, 32, 4, dict(plain, INFLIGHT=True)), (512, 128, 3, dict(plain, INFLIGHT=True)),
        (512, 64, 4, dict(plain, INFLIGHT=True, NO_DECODE=True)),
        (2048, 64, 4, dict(plain, INFLIGHT=True)), (2048, 128, 3, dict(plain, INFLIGHT=True)),
        (8192, 128, 3, dict(plain, INFLIGHT=True)), (8192, 128, 4, dict(plain, INFLIGHT=True)),
    ]
    served_tiles = {}
    for num_tokens, rows, stages, knobs in configurations:
        hidden_states, top_k_index, _ = routed_inputs(num_tokens, seed=num_tokens)
        slot_pairs, tile_experts = sc.route_to_row_tiles(top_k_index, 128, rows)
        num_tiles = tile_experts.numel()
        reference = hidden_states.new_zeros(num_tiles * rows, 768)
        out = hidden_states.new_zeros(num_tiles * rows, 768)
        common = (hidden_states, slot_pairs, tile_experts, layer.gate_up_fragment_words,
                  layer.gate_up_block_scales.view(torch.int32), layer.gate_up_global_scale)
        grid = (num_tiles, 768 // 64)

        def served():
            sc.nvfp4_gate_up_fragment_kernel[grid](*common, reference, 128, 2048, 768, 8, BLOCK_R=rows,
                                                   STAGES=stages, num_warps=4)

        def variant():
            gate_up_knobs_kernel[grid](*common, out, 128, 2048, 768, 8, BLOCK_R=rows, STAGES=stages, num_warps=4,
                                       **knobs)
        row = {"tokens": num_tokens, "rows": rows, "stages": stages,
               "knobs": [name for name, on in knobs.items() if on]}
        try:
            key = (num_tokens, rows, stages)
            if key not in served_tiles:
                served_tiles[key] = graph_ms(served)
            row["served_ms"] = served_tiles[key]
            served()
            variant()
            row["variant_ms"] = graph_ms(variant)
            filled = slot_pairs.view(-1) >= 0
            row["identical"] = torch.equal(out[filled].view(torch.int16), reference[filled].view(torch.int16))
            repeat = out.clone()
            variant()
            row["repeat_identical"] = torch.equal(out.view(torch.int16), repeat.view(torch.int16))
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error)[-600:]}"
        print(row, flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_knobs.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
