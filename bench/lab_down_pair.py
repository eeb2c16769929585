"""Lab (kept in history only): the gluon down kernel with two slabs (128 output columns) per program, its loop shared with
gate_up's (`_slab_pair_products`); timed against the served kernels on one random full-size layer, bit for bit."""

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
from serve_clef import (_allocate_fragment_ring, _decode_fragment_step, _fragment_step_pointers,  # noqa: E402
                        _load_fragment_step, async_copy)


@gluon.jit
def _slab_pair_products(a_words_ptr, a_scales_ptr, b_words_ptr, b_scales_ptr, byte_shifts, rows_ptr, rows_mask,
                        num_steps, reduced, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
    ring = _allocate_fragment_ring(BLOCK_R, STAGES)
    for first in gl.static_range(STAGES - 1):
        async_copy.async_copy_global_to_shared(ring.index(first), rows_ptr + first * FRAGMENT_STEP, mask=rows_mask)
        async_copy.commit_group()
    a_weights = _decode_fragment_step(*_load_fragment_step(a_words_ptr, a_scales_ptr, reduced, 0), byte_shifts, DOT_A)
    b_weights = _decode_fragment_step(*_load_fragment_step(b_words_ptr, b_scales_ptr, reduced, 0), byte_shifts, DOT_A)
    a_codes = _load_fragment_step(a_words_ptr, a_scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    b_codes = _load_fragment_step(b_words_ptr, b_scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    a = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
    b = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
    for step in range(num_steps):
        ahead = gl.minimum(step + 2, num_steps - 1)
        next_a_codes = _load_fragment_step(a_words_ptr, a_scales_ptr, reduced, ahead)
        next_b_codes = _load_fragment_step(b_words_ptr, b_scales_ptr, reduced, ahead)
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        fence_async_shared()
        rows = ring.index(step % STAGES).permute((1, 0))  # [64, R]
        a = warpgroup_mma(a_weights, rows, a, is_async=True)
        b = warpgroup_mma(b_weights, rows, b, is_async=True)
        next_a_weights = _decode_fragment_step(*a_codes, byte_shifts, DOT_A)
        next_b_weights = _decode_fragment_step(*b_codes, byte_shifts, DOT_A)
        a, b, a_weights, b_weights = warpgroup_mma_wait(num_outstanding=0, deps=(a, b, a_weights, b_weights))
        async_copy.async_copy_global_to_shared(
            ring.index((step + STAGES - 1) % STAGES),
            rows_ptr + gl.minimum(step + STAGES - 1, num_steps - 1) * FRAGMENT_STEP, mask=rows_mask)
        async_copy.commit_group()
        a_weights, b_weights = next_a_weights, next_b_weights
        a_codes, b_codes = next_a_codes, next_b_codes
    async_copy.wait_group(0)
    return a, b


@gluon.jit
def _store_down_slab(out, expert, first_column, pairs, routing_weights_ptr, global_scale_ptr, pair_outputs_ptr, hidden,
                     BLOCK_R: gl.constexpr):
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    out = (out * (gl.load(global_scale_ptr + expert) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16).to(gl.float32)
    columns = first_column + gl.arange(0, FRAGMENT_ROWS, layout=gl.SliceLayout(1, ACCUMULATOR))
    pair_rows = gl.where(pairs >= 0, pairs, 0).to(gl.int64)
    out = (out * gl.load(routing_weights_ptr + pair_rows).to(gl.float32)[None, :]).to(gl.bfloat16)
    mask = gl.broadcast((pairs >= 0)[None, :], columns[:, None] >= 0)
    gl.store(pair_outputs_ptr + pair_rows[None, :] * hidden + columns[:, None], out, mask=mask[0] & mask[1])


@gluon.jit
def down_pair_kernel(
    intermediate_ptr, slot_pairs_ptr, tile_experts_ptr, routing_weights_ptr, fragment_words_ptr, block_scales_ptr,
    global_scale_ptr, pair_outputs_ptr, num_experts, hidden, width,
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr, ROUTED_R: gl.constexpr,
):
    tile, slab_pair = gl.program_id(0), gl.program_id(1)  # slab_pair: 128 output columns
    expert = gl.load(tile_experts_ptr + tile // (ROUTED_R // BLOCK_R))
    if expert < num_experts:
        ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
        num_steps = width // FRAGMENT_STEP
        first_slab = expert * (hidden // FRAGMENT_ROWS) + 2 * slab_pair
        a_words_ptr, a_scales_ptr, byte_shifts = _fragment_step_pointers(
            fragment_words_ptr, block_scales_ptr, first_slab, num_steps, width)
        b_words_ptr, b_scales_ptr, _ = _fragment_step_pointers(
            fragment_words_ptr, block_scales_ptr, first_slab + 1, num_steps, width)
        copy_columns = gl.arange(0, FRAGMENT_STEP, layout=gl.SliceLayout(0, FRAGMENT_ROWS_COPY))
        copy_slots = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, FRAGMENT_ROWS_COPY))
        rows_ptr = intermediate_ptr + copy_slots.to(gl.int64)[:, None] * width + copy_columns[None, :]  # [R, 64]
        if MASKED:
            copy_pairs = gl.load(slot_pairs_ptr + copy_slots)
        else:
            copy_pairs = copy_slots * 0
        rows_mask = gl.broadcast((copy_pairs >= 0)[:, None], copy_columns[None, :] >= 0)
        rows_mask = rows_mask[0] & rows_mask[1]
        out_a, out_b = _slab_pair_products(a_words_ptr, a_scales_ptr, b_words_ptr, b_scales_ptr, byte_shifts,
                                           rows_ptr, rows_mask, num_steps, width, BLOCK_R, STAGES)
        pairs = gl.load(slot_pairs_ptr + tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, ACCUMULATOR)))
        first_column = 2 * slab_pair * FRAGMENT_ROWS
        _store_down_slab(out_a, expert, first_column, pairs, routing_weights_ptr, global_scale_ptr, pair_outputs_ptr,
                         hidden, BLOCK_R)
        _store_down_slab(out_b, expert, first_column + FRAGMENT_ROWS, pairs, routing_weights_ptr, global_scale_ptr,
                         pair_outputs_ptr, hidden, BLOCK_R)


@gluon.jit
def gate_up_shared_loop_kernel(
    hidden_states_ptr, slot_pairs_ptr, tile_experts_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
    intermediate_ptr, num_experts, hidden, width, pairs_per_row,
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
):
    tile, slab_column = gl.program_id(0), gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
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
        rows_ptr = hidden_states_ptr + tokens[:, None] * hidden + copy_columns[None, :]  # [R, 64]
        rows_mask = gl.broadcast((pairs >= 0)[:, None], copy_columns[None, :] >= 0)
        rows_mask = rows_mask[0] & rows_mask[1]
        gate, up = _slab_pair_products(gate_words_ptr, gate_scales_ptr, up_words_ptr, up_scales_ptr, byte_shifts,
                                       rows_ptr, rows_mask, num_steps, hidden, BLOCK_R, STAGES)
        gate = (gate * (gl.load(global_scale_ptr + 2 * expert) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
        up = (up * (gl.load(global_scale_ptr + 2 * expert + 1) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
        gate, up = gate.to(gl.float32), up.to(gl.float32)
        activated = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        intermediate = (activated * up).to(gl.bfloat16)
        columns = slab_column * FRAGMENT_ROWS + gl.arange(0, FRAGMENT_ROWS, layout=gl.SliceLayout(1, ACCUMULATOR))
        slots = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, ACCUMULATOR))
        gl.store(intermediate_ptr + slots.to(gl.int64)[None, :] * width + columns[:, None], intermediate)


def kernel_facts(compiled) -> dict:
    return {name: getattr(compiled, name, None) for name in ("n_regs", "n_spills")} | {
        "shared": getattr(getattr(compiled, "metadata", None), "shared", None)}


def main():
    layer = random_layer(False, seed=3)
    layer.to_fragment_order()
    report = []
    # (tokens, routed rows, served stages, variants (down rows, stages, masked))
    configurations = [
        (4096, 64, 4, [(64, 3, True), (64, 4, True)]),
        (6144, 128, 3, [(128, 2, False), (128, 3, False), (64, 3, True), (64, 4, True)]),
        (8192, 128, 3, [(128, 2, False), (128, 3, False), (64, 3, True), (64, 4, True), (64, 3, False)]),
    ]
    gate_up_words = layer.gate_up_fragment_words
    gate_up_scales = layer.gate_up_block_scales.view(torch.int32)
    down_words, down_scales = layer.down_fragment_words, layer.down_block_scales.view(torch.int32)
    for num_tokens, rows, stages, variants in configurations:
        hidden_states, top_k_index, top_k_weights = routed_inputs(num_tokens, seed=num_tokens)
        slot_pairs, tile_experts = sc.route_to_row_tiles(top_k_index, 128, rows)
        num_tiles = tile_experts.numel()
        intermediate = hidden_states.new_zeros(num_tiles * rows, 768)
        routing_weights = top_k_weights.reshape(-1)
        pair_outputs = hidden_states.new_zeros(num_tokens * 8, 2048)
        pair_outputs_variant = hidden_states.new_zeros(num_tokens * 8, 2048)
        facts = {}
        sc.nvfp4_gate_up_fragment_kernel[(num_tiles, 12)](
            hidden_states, slot_pairs, tile_experts, gate_up_words, gate_up_scales, layer.gate_up_global_scale,
            intermediate, 128, 2048, 768, 8, BLOCK_R=rows, STAGES=stages, num_warps=4)

        def served_down():
            facts["down"] = sc.nvfp4_down_fragment_kernel[(num_tiles, 32)](
                intermediate, slot_pairs, tile_experts, routing_weights, down_words, down_scales,
                layer.down_global_scale, pair_outputs, 128, 2048, 768, BLOCK_R=rows, STAGES=stages, num_warps=4)

        row = {"tokens": num_tokens, "rows": rows, "stages": stages, "served_down_ms": graph_ms(served_down)}
        served_down()
        row["facts_down"] = kernel_facts(facts["down"])
        for down_rows, variant_stages, masked in variants:
            name = f"pair_r{down_rows}_s{variant_stages}{'_masked' if masked else ''}"
            try:
                def pair_down():
                    facts[name] = down_pair_kernel[(num_tiles * rows // down_rows, 16)](
                        intermediate, slot_pairs, tile_experts, routing_weights, down_words, down_scales,
                        layer.down_global_scale, pair_outputs_variant, 128, 2048, 768, BLOCK_R=down_rows,
                        STAGES=variant_stages, MASKED=masked, ROUTED_R=rows, num_warps=4)
                row[f"{name}_ms"] = graph_ms(pair_down)
                pair_outputs_variant.zero_()
                pair_down()
                row[f"{name}_identical"] = torch.equal(pair_outputs_variant.view(torch.int16),
                                                       pair_outputs.view(torch.int16))
                row[f"facts_{name}"] = kernel_facts(facts[name])
            except Exception as error:
                row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[-800:]}"
        print(json.dumps(row), flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_down_pair.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
