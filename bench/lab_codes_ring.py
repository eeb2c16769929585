"""Lab (not committed): the gluon gate_up kernel with its codes and block scales fetched by cp.async into a
shared-memory ring of STAGES steps (beside the activation rows), instead of two steps ahead in registers.
Times served vs variants on one random full-size layer, gate_up alone, in CUDA graphs; checks bit-identity."""

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
from serve_clef import (FRAGMENT_STEP_WORDS, FRAGMENT_STEP, FRAGMENT_WORDS, FRAGMENT_ROWS_COPY, FRAGMENT_ROWS,
    _decode_fragment_step, fragment_accumulator_layout, _allocate_fragment_ring, _fragment_step_pointers,
    DECODED_WEIGHT_DIVISOR, gl, gluon, async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait)  # noqa: E402

WORDS_SHARED = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
SCALES_SHARED = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))


@gluon.jit
def _copy_step(ring, words_ring, scales_ring, scales8_ring, slot, rows_ptr, rows_mask, words_ptr, scales_ptr,
               reduced, step, COPY_ROWS: gl.constexpr):
    if COPY_ROWS:
        async_copy.async_copy_global_to_shared(ring.index(slot), rows_ptr + step * FRAGMENT_STEP, mask=rows_mask)
    async_copy.async_copy_global_to_shared(words_ring.index(slot), words_ptr + step * FRAGMENT_STEP_WORDS)
    async_copy.async_copy_global_to_shared(scales_ring.index(slot), scales_ptr + step)
    async_copy.async_copy_global_to_shared(scales8_ring.index(slot), scales_ptr + 8 * (reduced // 64) + step)


@gluon.jit
def _decode_slot(words_ring, scales_ring, scales8_ring, slot, byte_shifts, DOT_A: gl.constexpr):
    words = words_ring.index(slot).load(FRAGMENT_WORDS)
    scale_words = scales_ring.index(slot).load(gl.SliceLayout(3, FRAGMENT_WORDS))
    scale_words_8 = scales8_ring.index(slot).load(gl.SliceLayout(3, FRAGMENT_WORDS))
    return _decode_fragment_step(words, scale_words, scale_words_8, byte_shifts, DOT_A)


@gluon.jit
def gate_up_codes_ring_kernel(
    hidden_states_ptr, slot_pairs_ptr, tile_experts_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
    intermediate_ptr, num_experts, hidden, width, pairs_per_row,
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
):
    tile, slab_column = gl.program_id(0), gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
        ring = _allocate_fragment_ring(BLOCK_R, STAGES)
        gate_words_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 4, 4], WORDS_SHARED)
        up_words_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 4, 4], WORDS_SHARED)
        gate_scales_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 4], SCALES_SHARED)
        gate_scales8_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 4], SCALES_SHARED)
        up_scales_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 4], SCALES_SHARED)
        up_scales8_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 4], SCALES_SHARED)
        num_steps = hidden // FRAGMENT_STEP
        gate_slab = expert * (2 * width // FRAGMENT_ROWS) + slab_column
        gate_words_ptr, gate_scales_ptr, byte_shifts = _fragment_step_pointers(
            fragment_words_ptr, block_scales_ptr, gate_slab, num_steps, hidden)
        up_words_ptr, up_scales_ptr, _ = _fragment_step_pointers(
            fragment_words_ptr, block_scales_ptr, gate_slab + width // FRAGMENT_ROWS, num_steps, hidden)
        copy_columns = gl.arange(0, FRAGMENT_STEP, layout=gl.SliceLayout(0, FRAGMENT_ROWS_COPY))
        pairs = gl.load(slot_pairs_ptr + tile * BLOCK_R
                        + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, FRAGMENT_ROWS_COPY)))
        tokens = gl.where(pairs >= 0, pairs // pairs_per_row, 0).to(gl.int64)
        rows_ptr = hidden_states_ptr + tokens[:, None] * hidden + copy_columns[None, :]
        rows_mask = gl.broadcast((pairs >= 0)[:, None], copy_columns[None, :] >= 0)
        rows_mask = rows_mask[0] & rows_mask[1]
        for first in gl.static_range(STAGES - 1):
            _copy_step(ring, gate_words_ring, gate_scales_ring, gate_scales8_ring, first, rows_ptr, rows_mask,
                       gate_words_ptr, gate_scales_ptr, hidden, gl.minimum(first, num_steps - 1), True)
            _copy_step(ring, up_words_ring, up_scales_ring, up_scales8_ring, first, rows_ptr, rows_mask,
                       up_words_ptr, up_scales_ptr, hidden, gl.minimum(first, num_steps - 1), False)
            async_copy.commit_group()
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        gate_weights = _decode_slot(gate_words_ring, gate_scales_ring, gate_scales8_ring, 0, byte_shifts, DOT_A)
        up_weights = _decode_slot(up_words_ring, up_scales_ring, up_scales8_ring, 0, byte_shifts, DOT_A)
        gate = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
        up = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
        for step in range(num_steps):
            fence_async_shared()
            rows = ring.index(step % STAGES).permute((1, 0))
            gate = warpgroup_mma(gate_weights, rows, gate, is_async=True)
            up = warpgroup_mma(up_weights, rows, up, is_async=True)
            async_copy.wait_group(STAGES - 3)
            gl.thread_barrier()  # step + 1's copies are in, from every thread
            next_slot = (step + 1) % STAGES
            next_gate_weights = _decode_slot(gate_words_ring, gate_scales_ring, gate_scales8_ring, next_slot,
                                             byte_shifts, DOT_A)
            next_up_weights = _decode_slot(up_words_ring, up_scales_ring, up_scales8_ring, next_slot, byte_shifts,
                                           DOT_A)
            gate, up, gate_weights, up_weights = warpgroup_mma_wait(
                num_outstanding=0, deps=(gate, up, gate_weights, up_weights))
            refill = (step + STAGES - 1) % STAGES
            ahead = gl.minimum(step + STAGES - 1, num_steps - 1)
            _copy_step(ring, gate_words_ring, gate_scales_ring, gate_scales8_ring, refill, rows_ptr, rows_mask,
                       gate_words_ptr, gate_scales_ptr, hidden, ahead, True)
            _copy_step(ring, up_words_ring, up_scales_ring, up_scales8_ring, refill, rows_ptr, rows_mask,
                       up_words_ptr, up_scales_ptr, hidden, ahead, False)
            async_copy.commit_group()
            gate_weights, up_weights = next_gate_weights, next_up_weights
        async_copy.wait_group(0)
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
    for num_tokens in (512, 2048, 8192):
        hidden_states, top_k_index, _ = routed_inputs(num_tokens, seed=num_tokens)
        tiles = sc.expert_tiles(top_k_index.numel(), 128, sc.FRAGMENT_TILES)
        slot_pairs, tile_experts = sc.route_to_row_tiles(top_k_index, 128, tiles.rows)
        num_tiles = tile_experts.numel()
        args = (hidden_states, slot_pairs, tile_experts, layer.gate_up_fragment_words,
                layer.gate_up_block_scales.view(torch.int32), layer.gate_up_global_scale)
        grid = (num_tiles, 768 // 64)

        def served(out):
            sc.nvfp4_gate_up_fragment_kernel[grid](*args, out, 128, 2048, 768, 8, BLOCK_R=tiles.rows,
                                                   STAGES=tiles.num_stages, num_warps=4)

        reference = hidden_states.new_zeros(num_tiles * tiles.rows, 768)
        served(reference)
        row = {"tokens": num_tokens, "rows": tiles.rows, "served_ms": graph_ms(lambda: served(reference))}
        for stages in (4, 5, 6):
            out = hidden_states.new_zeros(num_tiles * tiles.rows, 768)

            def variant(out=out, stages=stages):
                gate_up_codes_ring_kernel[grid](*args, out, 128, 2048, 768, 8, BLOCK_R=tiles.rows, STAGES=stages,
                                                num_warps=4)
            try:
                variant()
                filled = slot_pairs.view(-1) >= 0
                same = torch.equal(out[filled].view(torch.int16), reference[filled].view(torch.int16))
                row[f"ring{stages}_ms"] = graph_ms(variant)
                row[f"ring{stages}_identical"] = same
            except Exception as error:  # a lab: report and go on
                row[f"ring{stages}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        print(row, flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_codes_ring.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
