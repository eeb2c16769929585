"""Lab (not served): the gluon expert kernels' products on mma.sync instead of wgmma, timed against the served ones.

Why: at 512 tokens the served gate_up kernel kept 83% of its time with its decode replaced by register moves
(docs/expert-kernels.md): the products and the waits that end each of them bound it. On wgmma a warp group issues a
step's products together and waits for them as one; on mma.sync (m16n8k16, Ampere's instruction, which Hopper runs)
each warp issues its own products on the same decoded registers (the decode's layout is mma.sync's A fragment, warp
for warp) and waits on nothing but their results, so one warp's decode overlaps another's products without any
warp-group barrier. Its cost: each warp reads the activation rows from shared memory itself (ldmatrix), where wgmma
reads them once for the warp group.

Variants, each for gate_up (gate and up slabs of one program) and down (one output slab a program, as served at R = 64):
- `step`: a whole step (64 reduced columns) at once: the step's rows loaded into registers, both slabs decoded, the
  products issued (more registers: the step's B fragments are live together);
- `slice`: one k16 slice at a time: its rows, its weights, its products (fewer registers).
Everything else (routing, fragment order, ring of cp.async rows, epilogues) is the served kernels'. The outputs must
stay within two BF16 steps of the served kernels' (only the tensor cores' summation differs) and repeat bit for bit.

Run on an H100 or H200: python3 bench/lab_mma_sync.py   (writes $OUT/lab_mma_sync.json when OUT is set)
Offline (any machine, triton 3.6 first on PYTHONPATH): python3 bench/lab_mma_sync.py --registers
"""

import json
import os
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402
from serve_clef import (  # noqa: E402
    FRAGMENT_STEP_WORDS,
    DECODED_WEIGHT_DIVISOR,
    FRAGMENT_ROWS,
    FRAGMENT_STEP,
    FRAGMENT_WORD_PTX,
    _decode_fragment_step,
    _fragment_scales,
    _fragment_step_pointers,
    _load_fragment_step,
    _refill_fragment_ring,
    _repeat_eight,
    _ring_step,
    _run_tile,
    _start_fragment_ring,
)

TOKEN_COUNTS = (64, 256, 512, 1024, 2048, 4096, 8192)
VARIANTS = ("step", "slice")


@gluon.constexpr_function
def mma_sync_layout(warps):
    """The products' accumulator [16 W weight rows, R routed rows] on mma.sync: warp w owns rows 16w..16w+15 (of
    W / 4 adjacent slabs of 64 rows)."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def words_layout(warps):
    """serve_clef.FRAGMENT_WORDS_LAYOUT on W warps: [w, rl, q, s], a thread's four words of a step in its registers."""
    return gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [warps, 1, 1, 1], [3, 2, 1, 0])


@gluon.constexpr_function
def rows_copy_layout(warps):
    """serve_clef.FRAGMENT_ROWS_COPY_LAYOUT on W warps: 16-byte copies of a tile's rows [R, 64]."""
    return gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])


@gluon.jit
def _wide_step_pointers(fragment_words_ptr, block_scales_ptr, slab, num_steps, reduced, WARPS: gl.constexpr):
    """serve_clef._fragment_step_pointers for W warps over W / 4 adjacent slabs from `slab`: warp w reads slab
    slab + w // 4 as that slab's warp w % 4 would (the slabs' block scale rows follow each other)."""
    WORDS: gl.constexpr = words_layout(WARPS)
    w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WORDS))))
    rl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, WORDS))))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, WORDS))))
    s = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WORDS))))
    w = gl.expand_dims(gl.expand_dims(gl.expand_dims(w, 1), 2), 3)
    rl = gl.expand_dims(gl.expand_dims(gl.expand_dims(rl, 0), 2), 3)
    q = gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 3)
    s = gl.expand_dims(gl.expand_dims(gl.expand_dims(s, 0), 1), 2)
    slab_words = num_steps.to(gl.int64) * FRAGMENT_STEP_WORDS
    words_ptr = (fragment_words_ptr + slab.to(gl.int64) * slab_words + (w // 4) * slab_words
                 + (((w % 4) * 8 + rl) * 4 + q) * 4 + s)  # [w, rl, q, s]
    rows = gl.sum(w * 16 + rl + q * 0, axis=3)  # [w, rl, q]: row r of the slabs
    scales_ptr = block_scales_ptr + (slab.to(gl.int64) * FRAGMENT_ROWS + rows) * (reduced // 64)
    return words_ptr, scales_ptr, s


@gluon.jit
def _wide_run_tile(tile_work: gl.constexpr, args, slot_pairs_ptr, tile, BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
                   SMALLEST_ROWS: gl.constexpr, BY_SLICE: gl.constexpr, WARPS: gl.constexpr):
    """serve_clef._run_tile (the fewest first slots of the tile that hold its pairs) on W warps: tile_work(*args,
    BY_SLICE, W, BLOCK_R, N, STAGES). (Constexprs handed on inside `args` arrive as values: both branches of an `if`
    on them are built, which the 8-warp build cannot.)"""
    SLOTS: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    if SMALLEST_ROWS == BLOCK_R:
        tile_work(*args, BY_SLICE, WARPS, BLOCK_R, BLOCK_R, STAGES)
    else:
        pairs = gl.load(slot_pairs_ptr + tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=SLOTS))
        filled = gl.sum((pairs >= 0).to(gl.int32), axis=0)
        if filled * 2 > BLOCK_R:
            tile_work(*args, BY_SLICE, WARPS, BLOCK_R, BLOCK_R, STAGES)
        elif SMALLEST_ROWS == BLOCK_R // 2:
            tile_work(*args, BY_SLICE, WARPS, BLOCK_R, BLOCK_R // 2, STAGES)
        elif filled * 4 > BLOCK_R:
            tile_work(*args, BY_SLICE, WARPS, BLOCK_R, BLOCK_R // 2, STAGES)
        else:
            tile_work(*args, BY_SLICE, WARPS, BLOCK_R, BLOCK_R // 4, STAGES)


@gluon.jit
def _slices_of(x):
    """[W, 8, 4, 4] (w, rl, q, s) -> its four k16 slices [W, 8, 4], s = 0..3 (register moves only)."""
    low, high = gl.split(gl.reshape(x, [x.shape[0], 8, 4, 2, 2]))  # s = 2 i + j: j = 0 (s = 0, 2), j = 1 (1, 3)
    s0, s2 = gl.split(low)
    s1, s3 = gl.split(high)
    return s0, s1, s2, s3


@gluon.jit
def _decode_fragment_slice(words, scales, scales_8, DOT_A: gl.constexpr):
    """One k16 slice of a slab (or, on W = 8 warps, of two adjacent slabs): words int32 [w, rl, q] and the BF16 scales
    of rows r and r + 8 [w, rl, q] -> the weights BF16 [16 W rows, 16 columns] in DOT_A, as _decode_fragment_step
    decodes a whole step."""
    pair_scales = gl.join(gl.join(scales, scales), gl.join(scales_8, scales_8))  # [w, rl, q, h, e]
    pair_scales = gl.join(pair_scales, pair_scales)  # [w, rl, q, h, e, p]
    weights = gl.inline_asm_elementwise(FRAGMENT_WORD_PTX, "=r,=r,=r,=r" + ",r" * 12,
                                        [_repeat_eight(words), pair_scales], dtype=gl.bfloat16, is_pure=False,
                                        pack=8)  # [w, rl, q, h, e, p]
    weights = gl.permute(weights, (0, 4, 1, 3, 2, 5))  # [w, e, rl, h, q, p]: row, then column order
    return gl.convert_layout(gl.reshape(weights, [16 * words.shape[0], 16]), DOT_A, assert_trivial=True)


@gluon.jit
def _slab_slices(codes, slices):
    """A slab's codes of one step (_load_fragment_step) -> per k16 slice (words, scales of rows r, of rows r + 8)."""
    words, scale_words, scale_words_8 = codes
    return (_slices_of(words), _slices_of(_fragment_scales(scale_words, slices)),
            _slices_of(_fragment_scales(scale_words_8, slices)))


@gluon.jit
def _mma_sync_step(codes, rows, out, slices, BY_SLICE: gl.constexpr, ACC: gl.constexpr):
    """One step of one slab's products on mma.sync: out [64, R] += weights [64, 64] x rows [64, R] (shared memory)."""
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    DOT_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=2)
    if BY_SLICE:
        words, scales, scales_8 = _slab_slices(codes, slices)
        for s in gl.static_range(4):
            weights = _decode_fragment_slice(words[s], scales[s], scales_8[s], DOT_A)
            out = mma_v2(weights, rows.slice(16 * s, 16, 0).load(DOT_B), out)
    else:
        out = mma_v2(_decode_fragment_step(*codes, slices, DOT_A), rows.load(DOT_B), out)
    return out


@gluon.jit
def _mma_sync_paired_step(first_codes, second_codes, rows, first, second, slices, BY_SLICE: gl.constexpr,
                          ACC: gl.constexpr):
    """One step of two slabs' products on the same rows: slice by slice, or the whole step, in turn."""
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    DOT_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=2)
    if BY_SLICE:
        first_words, first_scales, first_scales_8 = _slab_slices(first_codes, slices)
        second_words, second_scales, second_scales_8 = _slab_slices(second_codes, slices)
        for s in gl.static_range(4):
            slice_rows = rows.slice(16 * s, 16, 0).load(DOT_B)  # [16, R]
            first = mma_v2(_decode_fragment_slice(first_words[s], first_scales[s], first_scales_8[s], DOT_A),
                           slice_rows, first)
            second = mma_v2(_decode_fragment_slice(second_words[s], second_scales[s], second_scales_8[s], DOT_A),
                            slice_rows, second)
    else:
        step_rows = rows.load(DOT_B)  # [64, R]
        first = mma_v2(_decode_fragment_step(*first_codes, slices, DOT_A), step_rows, first)
        second = mma_v2(_decode_fragment_step(*second_codes, slices, DOT_A), step_rows, second)
    return first, second


@gluon.jit
def _mma_sync_products(first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr, slices, rows_ptr,
                       rows_mask, num_steps, reduced, BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
                       PAIRED: gl.constexpr, BY_SLICE: gl.constexpr, WARPS: gl.constexpr):
    """One slab's (PAIRED: two slabs') weights times a tile's R rows -> fp32 products [16 W, R] each, on mma.sync
    (W = 8: two adjacent slabs' rows each, warps 4-7 the second's). Codes are loaded two steps ahead, as served; each
    step waits for its rows (the ring's barrier), refills the slot the step before read (every warp has passed the
    barrier, so its reads are done), then decodes and multiplies."""
    ACC: gl.constexpr = mma_sync_layout(WARPS)
    ring = _start_fragment_ring(rows_ptr, rows_mask, BLOCK_R, STAGES)
    first = gl.zeros([16 * WARPS, BLOCK_R], gl.float32, ACC)  # [16 W weight rows, R slots]
    second = gl.zeros([16 * WARPS, BLOCK_R], gl.float32, ACC)
    first_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, 0)
    first_next = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    second_codes = first_codes
    second_next = first_next
    if PAIRED:
        second_codes = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, 0)
        second_next = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    for step in range(num_steps):
        ahead = gl.minimum(step + 2, num_steps - 1)
        first_ahead = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, ahead)
        second_ahead = first_ahead
        if PAIRED:
            second_ahead = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, ahead)
        rows = _ring_step(ring, step, STAGES)  # [64, R]
        _refill_fragment_ring(ring, rows_ptr, rows_mask, step, num_steps, STAGES)
        if PAIRED:
            first, second = _mma_sync_paired_step(first_codes, second_codes, rows, first, second, slices, BY_SLICE,
                                                  ACC)
        else:
            first = _mma_sync_step(first_codes, rows, first, slices, BY_SLICE, ACC)
        first_codes, first_next = first_next, first_ahead
        second_codes, second_next = second_next, second_ahead
    async_copy.wait_group(0)
    return first, second


@gluon.jit
def _mma_sync_gate_up_tile(hidden_states_ptr, slot_pairs_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
                           intermediate_ptr, expert, tile, column_group, hidden, width, pairs_per_row,
                           BY_SLICE: gl.constexpr, WARPS: gl.constexpr, TILE_ROWS: gl.constexpr,
                           BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    """serve_clef._gate_up_tile with its products on mma.sync, on W / 4 adjacent slab columns (gate and up) that
    share the tile's ring of activation rows."""
    ACC: gl.constexpr = mma_sync_layout(WARPS)
    ROWS_COPY: gl.constexpr = rows_copy_layout(WARPS)
    num_steps = hidden // FRAGMENT_STEP
    slab_column = column_group * (WARPS // 4)
    gate_slab = expert * (2 * width // FRAGMENT_ROWS) + slab_column
    gate_words_ptr, gate_scales_ptr, slices = _wide_step_pointers(
        fragment_words_ptr, block_scales_ptr, gate_slab, num_steps, hidden, WARPS)
    up_words_ptr, up_scales_ptr, _ = _wide_step_pointers(
        fragment_words_ptr, block_scales_ptr, gate_slab + width // FRAGMENT_ROWS, num_steps, hidden, WARPS)
    copy_columns = gl.arange(0, FRAGMENT_STEP, layout=gl.SliceLayout(0, ROWS_COPY))
    pairs = gl.load(slot_pairs_ptr + tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ROWS_COPY)))
    tokens = gl.where(pairs >= 0, pairs // pairs_per_row, 0).to(gl.int64)
    rows_ptr = hidden_states_ptr + tokens[:, None] * hidden + copy_columns[None, :]  # [R, 64]
    rows_mask = gl.broadcast((pairs >= 0)[:, None], copy_columns[None, :] >= 0)
    gate, up = _mma_sync_products(gate_words_ptr, gate_scales_ptr, up_words_ptr, up_scales_ptr, slices, rows_ptr,
                                  rows_mask[0] & rows_mask[1], num_steps, hidden, BLOCK_R, STAGES, True, BY_SLICE,
                                  WARPS)
    gate = (gate * (gl.load(global_scale_ptr + 2 * expert) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
    up = (up * (gl.load(global_scale_ptr + 2 * expert + 1) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
    gate, up = gate.to(gl.float32), up.to(gl.float32)
    activated = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
    intermediate = (activated * up).to(gl.bfloat16)
    columns = slab_column * FRAGMENT_ROWS + gl.arange(0, 16 * WARPS, layout=gl.SliceLayout(1, ACC))
    slots = tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, ACC))
    gl.store(intermediate_ptr + slots.to(gl.int64)[None, :] * width + columns[:, None], intermediate)


@gluon.jit
def lab_gate_up_mma_sync_kernel(
    hidden_states_ptr, slot_pairs_ptr, tile_experts_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
    intermediate_ptr, num_experts, hidden, width, pairs_per_row,
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr, SMALLEST_ROWS: gl.constexpr, BY_SLICE: gl.constexpr,
    WARPS: gl.constexpr,  # 4: one slab column a program (the served grid); 8: two adjacent ones sharing the rows
):
    """serve_clef.nvfp4_gate_up_fragment_kernel, its products on mma.sync (same arguments; grid (tiles, I / 16 W))."""
    tile, column_group = gl.program_id(0), gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        args = (hidden_states_ptr, slot_pairs_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
                intermediate_ptr, expert, tile, column_group, hidden, width, pairs_per_row)
        _wide_run_tile(_mma_sync_gate_up_tile, args, slot_pairs_ptr, tile, BLOCK_R, STAGES, SMALLEST_ROWS, BY_SLICE,
                       WARPS)


@gluon.jit
def _mma_sync_down_tile(intermediate_ptr, slot_pairs_ptr, routing_weights_ptr, fragment_words_ptr, block_scales_ptr,
                        global_scale_ptr, pair_outputs_ptr, expert, tile, slab_group, hidden, width,
                        BY_SLICE: gl.constexpr, WARPS: gl.constexpr, TILE_ROWS: gl.constexpr, BLOCK_R: gl.constexpr,
                        STAGES: gl.constexpr):
    """serve_clef._down_tile with its products on mma.sync, on W / 4 adjacent output slabs that share the tile's
    ring of intermediate rows."""
    ACC: gl.constexpr = mma_sync_layout(WARPS)
    ROWS_COPY: gl.constexpr = rows_copy_layout(WARPS)
    num_steps = width // FRAGMENT_STEP
    slab = slab_group * (WARPS // 4)
    words_ptr, scales_ptr, slices = _wide_step_pointers(
        fragment_words_ptr, block_scales_ptr, expert * (hidden // FRAGMENT_ROWS) + slab, num_steps, width, WARPS)
    copy_columns = gl.arange(0, FRAGMENT_STEP, layout=gl.SliceLayout(0, ROWS_COPY))
    copy_slots = tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ROWS_COPY))
    rows_ptr = intermediate_ptr + copy_slots.to(gl.int64)[:, None] * width + copy_columns[None, :]  # [R, 64]
    out, _ = _mma_sync_products(words_ptr, scales_ptr, words_ptr, scales_ptr, slices, rows_ptr, None, num_steps,
                                width, BLOCK_R, STAGES, False, BY_SLICE, WARPS)
    pairs = gl.load(slot_pairs_ptr + tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, ACC)))
    out = (out * (gl.load(global_scale_ptr + expert) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16).to(gl.float32)
    columns = slab * FRAGMENT_ROWS + gl.arange(0, 16 * WARPS, layout=gl.SliceLayout(1, ACC))
    pair_rows = gl.where(pairs >= 0, pairs, 0).to(gl.int64)
    out = (out * gl.load(routing_weights_ptr + pair_rows).to(gl.float32)[None, :]).to(gl.bfloat16)
    mask = gl.broadcast((pairs >= 0)[None, :], columns[:, None] >= 0)
    gl.store(pair_outputs_ptr + pair_rows[None, :] * hidden + columns[:, None], out, mask=mask[0] & mask[1])


@gluon.jit
def lab_down_mma_sync_kernel(
    intermediate_ptr, slot_pairs_ptr, tile_experts_ptr, routing_weights_ptr, fragment_words_ptr, block_scales_ptr,
    global_scale_ptr, pair_outputs_ptr, num_experts, hidden, width,
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr, SMALLEST_ROWS: gl.constexpr, BY_SLICE: gl.constexpr,
    WARPS: gl.constexpr,  # 4: one output slab a program; 8: two adjacent ones sharing the rows
):
    """serve_clef.nvfp4_down_fragment_kernel, its products on mma.sync (grid (H / 16 W, tiles))."""
    slab_group, tile = gl.program_id(0), gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        args = (intermediate_ptr, slot_pairs_ptr, routing_weights_ptr, fragment_words_ptr, block_scales_ptr,
                global_scale_ptr, pair_outputs_ptr, expert, tile, slab_group, hidden, width)
        _wide_run_tile(_mma_sync_down_tile, args, slot_pairs_ptr, tile, BLOCK_R, STAGES, SMALLEST_ROWS, BY_SLICE,
                       WARPS)


def lab_forward(layer, hidden_states, top_k_index, top_k_weights, gate_up: str | None, down: str | None,
                table: tuple = serve_clef.FRAGMENT_TILES):
    """PackedNVFP4Experts.forward_fragments (W4A16) with gate_up and/or down on mma.sync (`step`, `slice`, or
    `slice8`: by slice on 8 warps, two slab columns a program; None: the served kernel) and tiles from `table`. Down
    on mma.sync runs one output slab a program (two with `slice8`), also where the table pairs them."""
    num_tokens, top_k = top_k_index.shape
    tiles = serve_clef.expert_tiles(top_k_index.numel(), layer.num_experts, table)
    pair_outputs = hidden_states.new_empty(num_tokens * top_k, layer.hidden)  # [S, H]
    slot_pairs, tile_experts = serve_clef.route_to_row_tiles(top_k_index, layer.num_experts, tiles.rows, None)
    num_tiles = tile_experts.numel()
    common = dict(BLOCK_R=tiles.rows, STAGES=tiles.num_stages, SMALLEST_ROWS=tiles.smallest_rows or tiles.rows,
                  num_warps=4)
    intermediate = hidden_states.new_empty(num_tiles * tiles.rows, layer.width)  # [P, I]
    gate_up_input, pairs_per_row = layer.kernels_gate_up_input(hidden_states, top_k_index)
    gate_up_args = (gate_up_input.contiguous(), slot_pairs, tile_experts, layer.gate_up_fragment_words,
                    layer.gate_up_fragment_scales.view(torch.int32), layer.gate_up_global_scale, intermediate,
                    layer.num_experts, layer.hidden, layer.width, pairs_per_row)
    if gate_up is None:
        serve_clef.nvfp4_gate_up_fragment_kernel[(num_tiles, layer.width // FRAGMENT_ROWS.value)](
            *gate_up_args, **common)
    else:
        warps = 8 if gate_up == "slice8" else 4
        lab_gate_up_mma_sync_kernel[(num_tiles, layer.width // (16 * warps))](
            *gate_up_args, BY_SLICE=gate_up != "step", WARPS=warps, **{**common, "num_warps": warps})
    down_args = (intermediate, slot_pairs, tile_experts, top_k_weights.to(hidden_states.dtype).reshape(-1),
                 layer.down_fragment_words, layer.down_fragment_scales.view(torch.int32), layer.down_global_scale,
                 pair_outputs, layer.num_experts, layer.hidden, layer.width)
    if down is None:
        slab_pairs = tiles.down_slab_pairs and (layer.hidden // FRAGMENT_ROWS.value) % 2 == 0
        serve_clef.nvfp4_down_fragment_kernel[(layer.hidden // (FRAGMENT_ROWS.value * (2 if slab_pairs else 1)),
                                               num_tiles)](*down_args, SLAB_PAIRS=slab_pairs, **common)
    else:
        warps = 8 if down == "slice8" else 4
        lab_down_mma_sync_kernel[(layer.hidden // (16 * warps), num_tiles)](
            *down_args, BY_SLICE=down != "step", WARPS=warps, **{**common, "num_warps": warps})
    return serve_clef.sum_top_k(pair_outputs, top_k, None)


# The served rows, and rows of 32 up to 128 pairs per expert (2,048 tokens), where mma.sync by slice compiles to 120
# registers for gate_up (four programs an SM) against 161 at R = 64 (three).
ROWS_OF_32_TO_128 = ((128, serve_clef.FRAGMENT_TILES[0][1]), *serve_clef.FRAGMENT_TILES[2:])
SETTINGS = {  # name: (gate_up, down, tile table)
    "served (wgmma)": (None, None, serve_clef.FRAGMENT_TILES),
    "gate_up mma.sync by step": ("step", None, serve_clef.FRAGMENT_TILES),
    "gate_up mma.sync by slice": ("slice", None, serve_clef.FRAGMENT_TILES),
    "down mma.sync by step": (None, "step", serve_clef.FRAGMENT_TILES),
    "down mma.sync by slice": (None, "slice", serve_clef.FRAGMENT_TILES),
    "both mma.sync by slice": ("slice", "slice", serve_clef.FRAGMENT_TILES),
    "both by slice, R = 32 to 128 pairs": ("slice", "slice", ROWS_OF_32_TO_128),
    "served, R = 32 to 128 pairs": (None, None, ROWS_OF_32_TO_128),
    "gate_up by slice on 8 warps (2 columns)": ("slice8", None, serve_clef.FRAGMENT_TILES),
    "gate_up by slice on 8 warps, R = 32 to 128": ("slice8", None, ROWS_OF_32_TO_128),
    "down by slice on 8 warps (2 slabs)": (None, "slice8", serve_clef.FRAGMENT_TILES),
    "both by slice on 8 warps": ("slice8", "slice8", serve_clef.FRAGMENT_TILES),
}


def registers() -> int:
    """Compile the lab kernels for sm_90a offline and print registers, spills and programs an SM per tile row."""
    import inspect_gluon_kernels as inspect  # bench/: the compiler and ptxas report the served kernels get
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def compiled(kernel, constexprs: dict, warps: int):  # inspect.compile_for_hopper on `warps` warps
        names = list(kernel.arg_names)
        signature = {name: inspect.POINTER_TYPES.get(name, "constexpr" if name in constexprs else "i32")
                     for name in names}
        aligned = {(names.index(name),): [["tt.divisibility", 16]] for name in names
                   if name in inspect.POINTER_TYPES or name in inspect.MULTIPLES_OF_16}
        source = GluonASTSource(fn=kernel, signature=signature, attrs=aligned,
                                constexprs={(names.index(name),): value for name, value in constexprs.items()})
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

    builds = [("gate_up", lab_gate_up_mma_sync_kernel, variant, 4) for variant in VARIANTS]
    builds += [("gate_up", lab_gate_up_mma_sync_kernel, "slice", 8)]
    builds += [("down", lab_down_mma_sync_kernel, variant, 4) for variant in VARIANTS]
    builds += [("down", lab_down_mma_sync_kernel, "slice", 8)]
    for rows, stages, smallest in ((32, 3, 16), (64, 4, 16), (128, 3, 32)):
        for name, kernel, variant, warps in builds:
            constexprs = {"BLOCK_R": rows, "STAGES": stages, "SMALLEST_ROWS": smallest, "BY_SLICE": variant == "slice",
                          "WARPS": warps}
            build = compiled(kernel, constexprs, warps)
            loop = inspect.loops(inspect.sass(build))[-1]  # the smallest rows' loop (the tile runner's last)
            counts = {opcode: sum(instruction.startswith(opcode) for instruction in loop)
                      for opcode in ("HMMA", "HGMMA", "LDSM", "BAR")}
            print(f"R = {rows:3} {name:7} {variant:5} {warps} warps: {inspect.assembler_report(build)}, last loop "
                  f"{counts}", flush=True)
    return 0


def main() -> int:
    import check_expert_kernels as check  # bench/: random full-size layers, routed inputs, CUDA-graph timing
    report = {"gpu": torch.cuda.get_device_name(), "rows": []}
    layer = check.random_layer(False, seed=3)
    layer.to_fragment_order()
    failures = 0
    for num_tokens in TOKEN_COUNTS:
        inputs = check.routed_inputs(num_tokens, seed=10 + num_tokens)
        served = lab_forward(layer, *inputs, None, None)
        if not torch.equal(served, layer.forward_fragments(*inputs)):  # the lab's launches are the served ones
            print(f"{num_tokens} tokens: lab_forward with the served kernels differs from forward_fragments -> FAIL")
            failures += 1
        largest = served.float().abs().max().item()
        row = {"tokens": num_tokens}
        for name, (gate_up, down, table) in SETTINGS.items():
            out = lab_forward(layer, *inputs, gate_up, down, table)
            again = lab_forward(layer, *inputs, gate_up, down, table)
            error = (out.float() - served.float()).abs().max().item()
            ok = torch.equal(out, again) and error <= 2 * 2.0**-7 * largest
            failures += not ok
            milliseconds = [check.graph_ms(lambda g=gate_up, d=down, t=table: lab_forward(layer, *inputs, g, d, t))
                            for _ in range(2)]
            row[name] = {"ms": milliseconds, "max_error_of_largest": error / largest,
                         "bit_equal_share": (out == served).float().mean().item(), "ok": ok}
            print(f"{num_tokens:5} tokens, {name:28}: {milliseconds[0]:.4f} / {milliseconds[1]:.4f} ms, max error "
                  f"{error / largest:.4f} of the largest, {row[name]['bit_equal_share']:.3f} bit-equal -> "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
        report["rows"].append(row)
    if out_dir := os.environ.get("OUT"):
        Path(out_dir, "lab_mma_sync.json").write_text(json.dumps(report, indent=2))
    print("ok" if not failures else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(registers() if "--registers" in sys.argv[1:] else main())
