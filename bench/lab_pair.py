"""Lab (not committed): gate_up with 8 warps, gate rows on warp group 0 and up rows on warp group 1, one product
[128 weight rows, R] a step sharing the activation ring; vs the served kernel, bit for bit, on a random layer."""

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
from serve_clef import FRAGMENT_WORD_PTX  # noqa: E402



PAIR_WORDS = gl.constexpr(gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [8, 1, 1, 1], [3, 2, 1, 0]))
PAIR_ROWS_COPY = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))
EPILOGUE = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))


@gluon.jit
def _decode_pair_step(words, scale_words, scale_words_8, byte_shifts, DOT_A: gl.constexpr):
    scales, scales_8 = _fragment_scales(scale_words, byte_shifts), _fragment_scales(scale_words_8, byte_shifts)
    scales = gl.join(gl.join(scales, scales), gl.join(scales_8, scales_8))
    scales = gl.join(scales, scales)
    weights = gl.inline_asm_elementwise(FRAGMENT_WORD_PTX, "=r,=r,=r,=r" + ",r" * 12, [_repeat_eight(words), scales],
                                        dtype=gl.bfloat16, is_pure=False, pack=8)
    weights = gl.permute(weights, (0, 5, 1, 3, 4, 2, 6))
    return gl.convert_layout(gl.reshape(weights, [2 * FRAGMENT_ROWS, FRAGMENT_STEP]), DOT_A, assert_trivial=True)


@gluon.jit
def _pair_step_pointers(fragment_words_ptr, block_scales_ptr, gate_slab, up_slab, num_steps, reduced):
    """Warps 0-3: the gate slab's words and scales, warps 4-7: the up slab's."""
    w = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, PAIR_WORDS))))
    rl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, PAIR_WORDS))))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, PAIR_WORDS))))
    s = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, PAIR_WORDS))))
    w = gl.expand_dims(gl.expand_dims(gl.expand_dims(w, 1), 2), 3)
    rl = gl.expand_dims(gl.expand_dims(gl.expand_dims(rl, 0), 2), 3)
    q = gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 3)
    s = gl.expand_dims(gl.expand_dims(gl.expand_dims(s, 0), 1), 2)
    slab = gl.where(w < 4, gate_slab, up_slab).to(gl.int64)  # [w, 1, 1, 1]
    warp = w % 4
    words_ptr = fragment_words_ptr + slab * num_steps * FRAGMENT_STEP_WORDS + ((warp * 8 + rl) * 4 + q) * 4 + s
    rows = gl.sum(slab * FRAGMENT_ROWS + warp * 16 + rl + q * 0, axis=3)  # [w, rl, q]
    scales_ptr = block_scales_ptr + rows * (reduced // 64)
    return words_ptr, scales_ptr, s * 8


@gluon.jit
def gate_up_pair_kernel(
    hidden_states_ptr, slot_pairs_ptr, tile_experts_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
    intermediate_ptr, num_experts, hidden, width, pairs_per_row,
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
):
    tile, slab_column = gl.program_id(0), gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        ACCUMULATOR: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                              instr_shape=[16, BLOCK_R, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
        ring = _allocate_fragment_ring(BLOCK_R, STAGES)
        num_steps = hidden // FRAGMENT_STEP
        gate_slab = expert * (2 * width // FRAGMENT_ROWS) + slab_column
        words_ptr, scales_ptr, byte_shifts = _pair_step_pointers(
            fragment_words_ptr, block_scales_ptr, gate_slab, gate_slab + width // FRAGMENT_ROWS, num_steps, hidden)
        copy_columns = gl.arange(0, FRAGMENT_STEP, layout=gl.SliceLayout(0, PAIR_ROWS_COPY))
        pairs = gl.load(slot_pairs_ptr + tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, PAIR_ROWS_COPY)))
        tokens = gl.where(pairs >= 0, pairs // pairs_per_row, 0).to(gl.int64)
        rows_ptr = hidden_states_ptr + tokens[:, None] * hidden + copy_columns[None, :]
        rows_mask = gl.broadcast((pairs >= 0)[:, None], copy_columns[None, :] >= 0)
        rows_mask = rows_mask[0] & rows_mask[1]
        for first in gl.static_range(STAGES - 1):
            async_copy.async_copy_global_to_shared(ring.index(first), rows_ptr + first * FRAGMENT_STEP, mask=rows_mask)
            async_copy.commit_group()
        weights = _decode_pair_step(*_load_fragment_step(words_ptr, scales_ptr, hidden, 0), byte_shifts, DOT_A)
        codes = _load_fragment_step(words_ptr, scales_ptr, hidden, gl.minimum(1, num_steps - 1))
        out = gl.zeros([2 * FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)  # [64 gate + 64 up rows, R slots]
        for step in range(num_steps):
            next_codes = _load_fragment_step(words_ptr, scales_ptr, hidden, gl.minimum(step + 2, num_steps - 1))
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            fence_async_shared()
            out = warpgroup_mma(weights, ring.index(step % STAGES).permute((1, 0)), out, is_async=True)
            next_weights = _decode_pair_step(*codes, byte_shifts, DOT_A)
            out, weights = warpgroup_mma_wait(num_outstanding=0, deps=(out, weights))
            async_copy.async_copy_global_to_shared(
                ring.index((step + STAGES - 1) % STAGES),
                rows_ptr + gl.minimum(step + STAGES - 1, num_steps - 1) * FRAGMENT_STEP, mask=rows_mask)
            async_copy.commit_group()
            weights, codes = next_weights, next_codes
        async_copy.wait_group(0)
        out_rows = gl.arange(0, 2 * FRAGMENT_ROWS, layout=gl.SliceLayout(1, ACCUMULATOR))
        global_scale = gl.load(global_scale_ptr + 2 * expert + (out_rows >= FRAGMENT_ROWS).to(gl.int32))
        out = (out * (global_scale * DECODED_WEIGHT_DIVISOR)[:, None]).to(gl.bfloat16)
        exchange = gl.allocate_shared_memory(gl.bfloat16, [2 * FRAGMENT_ROWS, BLOCK_R],
                                             gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        exchange.store(out)
        gl.thread_barrier()
        gate = exchange.slice(0, FRAGMENT_ROWS).load(EPILOGUE).to(gl.float32)  # [64 columns, R]
        up = exchange.slice(FRAGMENT_ROWS, FRAGMENT_ROWS).load(EPILOGUE).to(gl.float32)
        activated = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        intermediate = (activated * up).to(gl.bfloat16)
        columns = slab_column * FRAGMENT_ROWS + gl.arange(0, FRAGMENT_ROWS, layout=gl.SliceLayout(1, EPILOGUE))
        slots = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, EPILOGUE))
        gl.store(intermediate_ptr + slots.to(gl.int64)[None, :] * width + columns[:, None], intermediate)


def main():
    layer = random_layer(False, seed=3)
    layer.to_fragment_order()
    report = []
    configurations = [(512, 64, 4), (512, 64, 3), (512, 128, 3), (2048, 64, 4), (2048, 128, 3), (8192, 128, 3),
                      (8192, 128, 4)]
    served_tiles = {}
    for num_tokens, rows, stages in configurations:
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
            gate_up_pair_kernel[grid](*common, out, 128, 2048, 768, 8, BLOCK_R=rows, STAGES=stages, num_warps=8)
        row = {"tokens": num_tokens, "rows": rows, "stages": stages}
        try:
            key = (num_tokens, rows, stages)
            if key not in served_tiles:
                served_tiles[key] = graph_ms(served)
            row["served_ms"] = served_tiles[key]
            served()
            variant()
            row["pair_ms"] = graph_ms(variant)
            filled = slot_pairs.view(-1) >= 0
            row["identical"] = torch.equal(out[filled].view(torch.int16), reference[filled].view(torch.int16))
            repeat = out.clone()
            variant()
            row["repeat_identical"] = torch.equal(out.view(torch.int16), repeat.view(torch.int16))
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error)[-900:]}"
        print(row, flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_pair.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
