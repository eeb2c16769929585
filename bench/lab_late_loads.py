"""Lab (kept in history only): the gluon expert kernels' main loops changed one way at a time, each output compared
with the served kernels' bit for bit, gate_up and down timed apart on one random full-size layer (routing
precomputed, 20 launches a CUDA graph). LATE 1: each slab's next codes loaded right after its current codes are
decoded (one set of codes live instead of two); PREFETCH: the codes PREFETCH steps ahead prefetched into L2 by each
thread; caps (maxnreg) for one more program per SM; LATE 2: two steps a loop iteration with two alternating sets of
codes, so that no register move at the loop's end waits for that iteration's loads; LATE 3: the ring of activation
rows signalled by an mbarrier per slot instead of a copy-group wait and a warp-group barrier each step. Three runs on
an H100 on 2026-12-06 (docs/benchmarks.md): VARIANTS as in the first run (LATE 1, prefetch 4 and 8, caps), then
(False, 0), (2, 0), (2, 0, caps), then as below. `python3 bench/lab_late_loads.py --compile` builds them offline
(triton 3.6) and prints registers; on a GPU it checks and times them."""
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_clef import (  # noqa: E402
    DECODED_WEIGHT_DIVISOR, FRAGMENT_ROWS, FRAGMENT_ROWS_COPY_LAYOUT, FRAGMENT_STEP, FRAGMENT_STEP_WORDS,
    _decode_fragment_step, _down_tile_pairs, _down_tile_rows, _fragment_step_pointers, _load_fragment_step,
    _refill_fragment_ring, _ring_step, _start_fragment_ring, _store_pair_outputs, _tile_pairs,
    fragment_accumulator_layout)

PREFETCH_PTX = gl.constexpr("{\n.reg .pred first;\nsetp.eq.s32 first, $2, 0;\n@first prefetch.global.L2 [$1];\n"
                            "mov.b32 $0, 0;\n}")


@gluon.jit
def _prefetch_step(words_ptr, slices, step):
    """One L2 prefetch per thread of its 16 bytes of a slab's step `step` (the lanes of a warp cover 4 lines)."""
    pointers, first_word = gl.broadcast(words_ptr + step * FRAGMENT_STEP_WORDS, slices)
    gl.inline_asm_elementwise(PREFETCH_PTX, "=r,l,r", [pointers, first_word], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _fragment_products_lab(words_ptr, scales_ptr, slices, rows_ptr, num_steps, reduced, BLOCK_R: gl.constexpr,
                           STAGES: gl.constexpr, LATE: gl.constexpr, PREFETCH: gl.constexpr):
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
    ring = _start_fragment_ring(rows_ptr, None, BLOCK_R, STAGES)
    out = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
    weights = _decode_fragment_step(*_load_fragment_step(words_ptr, scales_ptr, reduced, 0), slices, DOT_A)
    codes = _load_fragment_step(words_ptr, scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    for step in range(num_steps):
        if PREFETCH > 0:
            _prefetch_step(words_ptr, slices, gl.minimum(step + PREFETCH, num_steps - 1))
        if LATE:
            out = warpgroup_mma(weights, _ring_step(ring, step, STAGES), out, is_async=True)
            next_weights = _decode_fragment_step(*codes, slices, DOT_A)
            codes = _load_fragment_step(words_ptr, scales_ptr, reduced, gl.minimum(step + 2, num_steps - 1))
            out, weights = warpgroup_mma_wait(num_outstanding=0, deps=(out, weights))
            _refill_fragment_ring(ring, rows_ptr, None, step, num_steps, STAGES)
            weights = next_weights
        else:
            next_codes = _load_fragment_step(words_ptr, scales_ptr, reduced, gl.minimum(step + 2, num_steps - 1))
            out = warpgroup_mma(weights, _ring_step(ring, step, STAGES), out, is_async=True)
            next_weights = _decode_fragment_step(*codes, slices, DOT_A)
            out, weights = warpgroup_mma_wait(num_outstanding=0, deps=(out, weights))
            _refill_fragment_ring(ring, rows_ptr, None, step, num_steps, STAGES)
            weights, codes = next_weights, next_codes
    async_copy.wait_group(0)
    return out


@gluon.jit
def _paired_products_lab(first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr, slices,
                         rows_ptr, rows_mask, num_steps, reduced, BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
                         LATE: gl.constexpr, PREFETCH: gl.constexpr):
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
    ring = _start_fragment_ring(rows_ptr, rows_mask, BLOCK_R, STAGES)
    first = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
    second = warpgroup_mma_init(gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR))
    first_weights = _decode_fragment_step(*_load_fragment_step(first_words_ptr, first_scales_ptr, reduced, 0),
                                          slices, DOT_A)
    second_weights = gl.zeros([FRAGMENT_ROWS, FRAGMENT_STEP], gl.bfloat16, DOT_A)
    second_codes = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, 0)
    first_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    first = warpgroup_mma(first_weights, _ring_step(ring, 0, STAGES), first, is_async=True)
    for step in range(num_steps - 1):
        if PREFETCH > 0:
            ahead = gl.minimum(step + PREFETCH, num_steps - 1)
            _prefetch_step(first_words_ptr, slices, ahead)
            _prefetch_step(second_words_ptr, slices, ahead)
        if LATE:
            rows = ring.index(step % STAGES).permute((1, 0))
            second, second_weights = warpgroup_mma_wait(num_outstanding=1, deps=(second, second_weights))
            _refill_fragment_ring(ring, rows_ptr, rows_mask, step, num_steps, STAGES)
            second_weights = _decode_fragment_step(*second_codes, slices, DOT_A)
            second_codes = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, step + 1)
            second = warpgroup_mma(second_weights, rows, second, is_async=True)
            first, first_weights = warpgroup_mma_wait(num_outstanding=1, deps=(first, first_weights))
            first_weights = _decode_fragment_step(*first_codes, slices, DOT_A)
            first_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced,
                                              gl.minimum(step + 2, num_steps - 1))
            first = warpgroup_mma(first_weights, _ring_step(ring, step + 1, STAGES), first, is_async=True)
        else:
            next_second_codes = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, step + 1)
            next_first_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced,
                                                   gl.minimum(step + 2, num_steps - 1))
            rows = ring.index(step % STAGES).permute((1, 0))
            second, second_weights = warpgroup_mma_wait(num_outstanding=1, deps=(second, second_weights))
            _refill_fragment_ring(ring, rows_ptr, rows_mask, step, num_steps, STAGES)
            second_weights = _decode_fragment_step(*second_codes, slices, DOT_A)
            second = warpgroup_mma(second_weights, rows, second, is_async=True)
            first, first_weights = warpgroup_mma_wait(num_outstanding=1, deps=(first, first_weights))
            first_weights = _decode_fragment_step(*first_codes, slices, DOT_A)
            first = warpgroup_mma(first_weights, _ring_step(ring, step + 1, STAGES), first, is_async=True)
            first_codes, second_codes = next_first_codes, next_second_codes
    second, second_weights = warpgroup_mma_wait(num_outstanding=1, deps=(second, second_weights))
    second_weights = _decode_fragment_step(*second_codes, slices, DOT_A)
    second = warpgroup_mma(second_weights, ring.index((num_steps - 1) % STAGES).permute((1, 0)), second,
                           is_async=True)
    first, second, first_weights, second_weights = warpgroup_mma_wait(
        num_outstanding=0, deps=(first, second, first_weights, second_weights))
    async_copy.wait_group(0)
    return first, second


# UNROLL: two steps a loop iteration, each slab's codes in two alternating sets loaded two steps ahead, so that no
# register move at the loop's end waits for a load in flight (the served loop's rotation `codes = next_codes`
# compiles to moves that wait on that iteration's own loads: long-scoreboard stalls at the loop's end under ncu)

@gluon.jit
def _single_step(ring, rows_ptr, words_ptr, scales_ptr, slices, out, weights, codes, step, num_steps, reduced,
                 STAGES: gl.constexpr, DOT_A: gl.constexpr):
    """Step `step` of one slab: its products issued, step + 1's weights decoded from `codes`, which then take step
    + 3's."""
    out = warpgroup_mma(weights, _ring_step(ring, step, STAGES), out, is_async=True)
    next_weights = _decode_fragment_step(*codes, slices, DOT_A)
    codes = _load_fragment_step(words_ptr, scales_ptr, reduced, gl.minimum(step + 3, num_steps - 1))
    out, weights = warpgroup_mma_wait(num_outstanding=0, deps=(out, weights))
    _refill_fragment_ring(ring, rows_ptr, None, step, num_steps, STAGES)
    return out, next_weights, codes


@gluon.jit
def _fragment_products_unrolled(words_ptr, scales_ptr, slices, rows_ptr, num_steps, reduced, BLOCK_R: gl.constexpr,
                                STAGES: gl.constexpr):
    """_fragment_products for an even number of steps, two a loop iteration."""
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
    ring = _start_fragment_ring(rows_ptr, None, BLOCK_R, STAGES)
    out = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
    weights = _decode_fragment_step(*_load_fragment_step(words_ptr, scales_ptr, reduced, 0), slices, DOT_A)
    odd_codes = _load_fragment_step(words_ptr, scales_ptr, reduced, 1)  # for step 1, then 3, 5, ...
    even_codes = _load_fragment_step(words_ptr, scales_ptr, reduced, gl.minimum(2, num_steps - 1))  # 2, 4, ...
    for step in range(0, num_steps, 2):
        out, weights, odd_codes = _single_step(ring, rows_ptr, words_ptr, scales_ptr, slices, out, weights,
                                               odd_codes, step, num_steps, reduced, STAGES, DOT_A)
        out, weights, even_codes = _single_step(ring, rows_ptr, words_ptr, scales_ptr, slices, out, weights,
                                                even_codes, step + 1, num_steps, reduced, STAGES, DOT_A)
    async_copy.wait_group(0)
    return out


@gluon.jit
def _paired_step(ring, rows_ptr, rows_mask, first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr,
                 slices, first, second, first_weights, second_weights, second_codes, first_codes, step, num_steps,
                 reduced, STAGES: gl.constexpr, DOT_A: gl.constexpr):
    """Iteration `step` of the paired loop: the second slab's step (its codes `second_codes`, which then take step
    + 2's) and the first slab's step + 1 (`first_codes`, then step + 3's)."""
    rows = ring.index(step % STAGES).permute((1, 0))
    second, second_weights = warpgroup_mma_wait(num_outstanding=1, deps=(second, second_weights))
    _refill_fragment_ring(ring, rows_ptr, rows_mask, step, num_steps, STAGES)
    second_weights = _decode_fragment_step(*second_codes, slices, DOT_A)
    second_codes = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced,
                                       gl.minimum(step + 2, num_steps - 1))
    second = warpgroup_mma(second_weights, rows, second, is_async=True)
    first, first_weights = warpgroup_mma_wait(num_outstanding=1, deps=(first, first_weights))
    first_weights = _decode_fragment_step(*first_codes, slices, DOT_A)
    first_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, gl.minimum(step + 3, num_steps - 1))
    first = warpgroup_mma(first_weights, _ring_step(ring, step + 1, STAGES), first, is_async=True)
    return first, second, first_weights, second_weights, second_codes, first_codes


@gluon.jit
def _paired_products_unrolled(first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr, slices,
                              rows_ptr, rows_mask, num_steps, reduced, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    """_paired_fragment_products for an even number of steps: its n - 1 iterations as (n - 2) / 2 pairs and one."""
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
    ring = _start_fragment_ring(rows_ptr, rows_mask, BLOCK_R, STAGES)
    first = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
    second = warpgroup_mma_init(gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR))
    first_weights = _decode_fragment_step(*_load_fragment_step(first_words_ptr, first_scales_ptr, reduced, 0),
                                          slices, DOT_A)
    second_weights = gl.zeros([FRAGMENT_ROWS, FRAGMENT_STEP], gl.bfloat16, DOT_A)
    # even iterations' codes (second slab's step s, first slab's s + 1) and odd iterations'
    even_second = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, 0)
    even_first = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, 1)
    odd_second = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, 1)
    odd_first = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, gl.minimum(2, num_steps - 1))
    first = warpgroup_mma(first_weights, _ring_step(ring, 0, STAGES), first, is_async=True)
    for step in range(0, num_steps - 2, 2):
        first, second, first_weights, second_weights, even_second, even_first = _paired_step(
            ring, rows_ptr, rows_mask, first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr,
            slices, first, second, first_weights, second_weights, even_second, even_first, step, num_steps, reduced,
            STAGES, DOT_A)
        first, second, first_weights, second_weights, odd_second, odd_first = _paired_step(
            ring, rows_ptr, rows_mask, first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr,
            slices, first, second, first_weights, second_weights, odd_second, odd_first, step + 1, num_steps,
            reduced, STAGES, DOT_A)
    first, second, first_weights, second_weights, even_second, even_first = _paired_step(
        ring, rows_ptr, rows_mask, first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr,
        slices, first, second, first_weights, second_weights, even_second, even_first, num_steps - 2, num_steps,
        reduced, STAGES, DOT_A)
    # the second slab's last step: its codes are the odd iterations' (step n - 1, loaded by iteration n - 3)
    second, second_weights = warpgroup_mma_wait(num_outstanding=1, deps=(second, second_weights))
    second_weights = _decode_fragment_step(*odd_second, slices, DOT_A)
    second = warpgroup_mma(second_weights, ring.index((num_steps - 1) % STAGES).permute((1, 0)), second,
                           is_async=True)
    first, second, first_weights, second_weights = warpgroup_mma_wait(
        num_outstanding=0, deps=(first, second, first_weights, second_weights))
    async_copy.wait_group(0)
    return first, second


# MBAR (LATE == 3): the ring of activation rows signalled by an mbarrier per slot, on which each thread's copies
# arrive when they land (cp.async.mbarrier.arrive.noinc), instead of a copy-group wait and a barrier of the warp
# group every step: a warp waits for the rows, not for the other warps (12-16% of the samples stalled on that barrier
# under ncu at 512 tokens)

@gluon.jit
def _start_ring_mb(rows_ptr, rows_mask, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, FRAGMENT_STEP],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_R, FRAGMENT_STEP], gl.bfloat16))
    landed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(landed.index(slot), count=128)  # every thread of the warp group, once a fill
    gl.thread_barrier()
    for first_step in gl.static_range(STAGES - 1):
        async_copy.async_copy_global_to_shared(ring.index(first_step), rows_ptr + first_step * FRAGMENT_STEP,
                                               mask=rows_mask)
        async_copy.mbarrier_arrive(landed.index(first_step), increment_count=False)
    return ring, landed


@gluon.jit
def _refill_ring_mb(ring, landed, rows_ptr, rows_mask, step, num_steps, STAGES: gl.constexpr):
    slot = (step + STAGES - 1) % STAGES
    async_copy.async_copy_global_to_shared(ring.index(slot),
                                           rows_ptr + gl.minimum(step + STAGES - 1, num_steps - 1) * FRAGMENT_STEP,
                                           mask=rows_mask)
    async_copy.mbarrier_arrive(landed.index(slot), increment_count=False)


@gluon.jit
def _ring_step_mb(ring, landed, step, STAGES: gl.constexpr):
    mbarrier.wait(landed.index(step % STAGES), (step // STAGES) & 1)
    fence_async_shared()
    return ring.index(step % STAGES).permute((1, 0))


@gluon.jit
def _fragment_products_mb(words_ptr, scales_ptr, slices, rows_ptr, num_steps, reduced, BLOCK_R: gl.constexpr,
                          STAGES: gl.constexpr):
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
    ring, landed = _start_ring_mb(rows_ptr, None, BLOCK_R, STAGES)
    out = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
    weights = _decode_fragment_step(*_load_fragment_step(words_ptr, scales_ptr, reduced, 0), slices, DOT_A)
    codes = _load_fragment_step(words_ptr, scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    for step in range(num_steps):
        next_codes = _load_fragment_step(words_ptr, scales_ptr, reduced, gl.minimum(step + 2, num_steps - 1))
        out = warpgroup_mma(weights, _ring_step_mb(ring, landed, step, STAGES), out, is_async=True)
        next_weights = _decode_fragment_step(*codes, slices, DOT_A)
        out, weights = warpgroup_mma_wait(num_outstanding=0, deps=(out, weights))
        _refill_ring_mb(ring, landed, rows_ptr, None, step, num_steps, STAGES)
        weights, codes = next_weights, next_codes
    async_copy.wait_group(0)
    return out


@gluon.jit
def _paired_products_mb(first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr, slices,
                        rows_ptr, rows_mask, num_steps, reduced, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
    ring, landed = _start_ring_mb(rows_ptr, rows_mask, BLOCK_R, STAGES)
    first = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)
    second = warpgroup_mma_init(gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR))
    first_weights = _decode_fragment_step(*_load_fragment_step(first_words_ptr, first_scales_ptr, reduced, 0),
                                          slices, DOT_A)
    second_weights = gl.zeros([FRAGMENT_ROWS, FRAGMENT_STEP], gl.bfloat16, DOT_A)
    second_codes = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, 0)
    first_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    first = warpgroup_mma(first_weights, _ring_step_mb(ring, landed, 0, STAGES), first, is_async=True)
    for step in range(num_steps - 1):
        next_second_codes = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, step + 1)
        next_first_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced,
                                               gl.minimum(step + 2, num_steps - 1))
        rows = ring.index(step % STAGES).permute((1, 0))
        second, second_weights = warpgroup_mma_wait(num_outstanding=1, deps=(second, second_weights))
        _refill_ring_mb(ring, landed, rows_ptr, rows_mask, step, num_steps, STAGES)
        second_weights = _decode_fragment_step(*second_codes, slices, DOT_A)
        second = warpgroup_mma(second_weights, rows, second, is_async=True)
        first, first_weights = warpgroup_mma_wait(num_outstanding=1, deps=(first, first_weights))
        first_weights = _decode_fragment_step(*first_codes, slices, DOT_A)
        first = warpgroup_mma(first_weights, _ring_step_mb(ring, landed, step + 1, STAGES), first, is_async=True)
        first_codes, second_codes = next_first_codes, next_second_codes
    second, second_weights = warpgroup_mma_wait(num_outstanding=1, deps=(second, second_weights))
    second_weights = _decode_fragment_step(*second_codes, slices, DOT_A)
    second = warpgroup_mma(second_weights, ring.index((num_steps - 1) % STAGES).permute((1, 0)), second,
                           is_async=True)
    first, second, first_weights, second_weights = warpgroup_mma_wait(
        num_outstanding=0, deps=(first, second, first_weights, second_weights))
    async_copy.wait_group(0)
    return first, second


@gluon.jit
def _gate_up_tile_lab(hidden_states_ptr, slot_pairs_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
                      intermediate_ptr, expert, tile, slab_column, hidden, width, pairs_per_row,
                      TILE_ROWS: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr, LATE: gl.constexpr,
                      PREFETCH: gl.constexpr):
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    ROWS_COPY: gl.constexpr = FRAGMENT_ROWS_COPY_LAYOUT
    num_steps = hidden // FRAGMENT_STEP
    gate_slab = expert * (2 * width // FRAGMENT_ROWS) + slab_column
    gate_words_ptr, gate_scales_ptr, slices = _fragment_step_pointers(
        fragment_words_ptr, block_scales_ptr, gate_slab, num_steps, hidden)
    up_words_ptr, up_scales_ptr, _ = _fragment_step_pointers(
        fragment_words_ptr, block_scales_ptr, gate_slab + width // FRAGMENT_ROWS, num_steps, hidden)
    copy_columns = gl.arange(0, FRAGMENT_STEP, layout=gl.SliceLayout(0, ROWS_COPY))
    pairs = gl.load(slot_pairs_ptr + tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ROWS_COPY)))
    tokens = gl.where(pairs >= 0, pairs // pairs_per_row, 0).to(gl.int64)
    rows_ptr = hidden_states_ptr + tokens[:, None] * hidden + copy_columns[None, :]
    rows_mask = gl.broadcast((pairs >= 0)[:, None], copy_columns[None, :] >= 0)
    if LATE == 3:
        gate, up = _paired_products_mb(gate_words_ptr, gate_scales_ptr, up_words_ptr, up_scales_ptr, slices,
                                       rows_ptr, rows_mask[0] & rows_mask[1], num_steps, hidden, BLOCK_R, STAGES)
    elif LATE == 2:
        gate, up = _paired_products_unrolled(gate_words_ptr, gate_scales_ptr, up_words_ptr, up_scales_ptr, slices,
                                             rows_ptr, rows_mask[0] & rows_mask[1], num_steps, hidden, BLOCK_R,
                                             STAGES)
    else:
        gate, up = _paired_products_lab(gate_words_ptr, gate_scales_ptr, up_words_ptr, up_scales_ptr, slices,
                                        rows_ptr, rows_mask[0] & rows_mask[1], num_steps, hidden, BLOCK_R, STAGES,
                                        LATE, PREFETCH)
    gate = (gate * (gl.load(global_scale_ptr + 2 * expert) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
    up = (up * (gl.load(global_scale_ptr + 2 * expert + 1) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
    gate, up = gate.to(gl.float32), up.to(gl.float32)
    activated = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
    intermediate = (activated * up).to(gl.bfloat16)
    columns = slab_column * FRAGMENT_ROWS + gl.arange(0, FRAGMENT_ROWS, layout=gl.SliceLayout(1, ACCUMULATOR))
    slots = tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, ACCUMULATOR))
    gl.store(intermediate_ptr + slots.to(gl.int64)[None, :] * width + columns[:, None], intermediate)


@gluon.jit
def gate_up_lab_kernel(hidden_states_ptr, slot_pairs_ptr, tile_experts_ptr, fragment_words_ptr, block_scales_ptr,
                       global_scale_ptr, intermediate_ptr, num_experts, hidden, width, pairs_per_row,
                       BLOCK_R: gl.constexpr, STAGES: gl.constexpr, SMALLEST_ROWS: gl.constexpr,
                       LATE: gl.constexpr, PREFETCH: gl.constexpr):
    tile, slab_column = gl.program_id(0), gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        args = (hidden_states_ptr, slot_pairs_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
                intermediate_ptr, expert, tile, slab_column, hidden, width, pairs_per_row)
        filled = _tile_pairs(slot_pairs_ptr, tile, BLOCK_R)
        if filled * 2 > BLOCK_R:
            _gate_up_tile_lab(*args, BLOCK_R, BLOCK_R, STAGES, LATE, PREFETCH)
        elif SMALLEST_ROWS == BLOCK_R // 2:
            _gate_up_tile_lab(*args, BLOCK_R, BLOCK_R // 2, STAGES, LATE, PREFETCH)
        elif filled * 4 > BLOCK_R:
            _gate_up_tile_lab(*args, BLOCK_R, BLOCK_R // 2, STAGES, LATE, PREFETCH)
        else:
            _gate_up_tile_lab(*args, BLOCK_R, BLOCK_R // 4, STAGES, LATE, PREFETCH)


@gluon.jit
def _down_tile_lab(intermediate_ptr, slot_pairs_ptr, routing_weights_ptr, fragment_words_ptr, block_scales_ptr,
                   global_scale_ptr, pair_outputs_ptr, expert, tile, slab, hidden, width,
                   TILE_ROWS: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr, LATE: gl.constexpr,
                   PREFETCH: gl.constexpr):
    num_steps = width // FRAGMENT_STEP
    words_ptr, scales_ptr, slices = _fragment_step_pointers(
        fragment_words_ptr, block_scales_ptr, expert * (hidden // FRAGMENT_ROWS) + slab, num_steps, width)
    rows_ptr = _down_tile_rows(intermediate_ptr, tile, width, TILE_ROWS, BLOCK_R)
    if LATE == 3:
        out = _fragment_products_mb(words_ptr, scales_ptr, slices, rows_ptr, num_steps, width, BLOCK_R, STAGES)
    elif LATE == 2:
        out = _fragment_products_unrolled(words_ptr, scales_ptr, slices, rows_ptr, num_steps, width, BLOCK_R, STAGES)
    else:
        out = _fragment_products_lab(words_ptr, scales_ptr, slices, rows_ptr, num_steps, width, BLOCK_R, STAGES,
                                     LATE, PREFETCH)
    pairs = _down_tile_pairs(slot_pairs_ptr, tile, TILE_ROWS, BLOCK_R)
    _store_pair_outputs(out, slab, pairs, expert, routing_weights_ptr, global_scale_ptr, pair_outputs_ptr, hidden,
                        BLOCK_R)


@gluon.jit
def down_lab_kernel(intermediate_ptr, slot_pairs_ptr, tile_experts_ptr, routing_weights_ptr, fragment_words_ptr,
                    block_scales_ptr, global_scale_ptr, pair_outputs_ptr, num_experts, hidden, width,
                    BLOCK_R: gl.constexpr, STAGES: gl.constexpr, SMALLEST_ROWS: gl.constexpr,
                    LATE: gl.constexpr, PREFETCH: gl.constexpr):
    slab, tile = gl.program_id(0), gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        args = (intermediate_ptr, slot_pairs_ptr, routing_weights_ptr, fragment_words_ptr, block_scales_ptr,
                global_scale_ptr, pair_outputs_ptr, expert, tile, slab, hidden, width)
        filled = _tile_pairs(slot_pairs_ptr, tile, BLOCK_R)
        if filled * 2 > BLOCK_R:
            _down_tile_lab(*args, BLOCK_R, BLOCK_R, STAGES, LATE, PREFETCH)
        elif SMALLEST_ROWS == BLOCK_R // 2:
            _down_tile_lab(*args, BLOCK_R, BLOCK_R // 2, STAGES, LATE, PREFETCH)
        elif filled * 4 > BLOCK_R:
            _down_tile_lab(*args, BLOCK_R, BLOCK_R // 2, STAGES, LATE, PREFETCH)
        else:
            _down_tile_lab(*args, BLOCK_R, BLOCK_R // 4, STAGES, LATE, PREFETCH)


# (late, prefetch, gate_up maxnreg, down maxnreg); None: no cap
VARIANTS = [
    (False, 0, None, None),
    (3, 0, None, None),
    (3, 4, None, None),
]
# caps: one more program per SM than the served kernels get, by rows (gate_up, down)
CAPS = {32: (96, 56), 64: (128, 80)}


def offline() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import inspect_gluon_kernels as inspect
    for rows, stages in ((32, 3), (64, 4), (128, 3)):
        for late, prefetch, cap_up, cap_down in VARIANTS:
            for name, kernel, cap in (("gate_up", gate_up_lab_kernel, cap_up), ("down", down_lab_kernel, cap_down)):
                constexprs = dict(BLOCK_R=rows, STAGES=stages, SMALLEST_ROWS=16, LATE=late, PREFETCH=prefetch)
                if cap is not None and rows not in CAPS:
                    continue
                compiled = compile_capped(inspect, kernel, constexprs,
                                          None if cap is None else CAPS[rows][name == "down"])
                report = inspect.assembler_report(compiled)
                print(f"R {rows} {name:7s} late {late!s:5} prefetch {prefetch} cap {cap!s:4}: {report}", flush=True)


def compile_capped(inspect, kernel, constexprs, maxnreg):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    names = list(kernel.arg_names)
    signature = {name: inspect.POINTER_TYPES.get(name, "constexpr" if name in constexprs else "i32") for name in names}
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name in names
               if name in inspect.POINTER_TYPES or name in inspect.MULTIPLES_OF_16}
    source = GluonASTSource(fn=kernel, signature=signature, attrs=aligned,
                            constexprs={(names.index(name),): value for name, value in constexprs.items()})
    options = {"num_warps": 4} | ({} if maxnreg is None else {"maxnreg": maxnreg})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def on_gpu() -> int:
    import serve_clef
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from check_expert_kernels import random_layer, routed_inputs

    layer = random_layer(False, seed=3)
    layer.to_fragment_order()
    failures = 0
    print(torch.cuda.get_device_name(), flush=True)
    for num_tokens in (64, 256, 512, 1024, 2048, 4096):
        hidden_states, top_k_index, top_k_weights = routed_inputs(num_tokens, seed=num_tokens)
        tiles = serve_clef.expert_tiles(top_k_index.numel(), layer.num_experts, serve_clef.FRAGMENT_TILES)
        pairs_down = tiles.rows == 128  # down takes slab pairs there: only gate_up is compared
        slot_pairs, tile_experts = serve_clef.route_to_row_tiles(top_k_index, layer.num_experts, tiles.rows)
        num_tiles = tile_experts.numel()
        routing = top_k_weights.reshape(-1).contiguous()
        intermediate = hidden_states.new_zeros(num_tiles * tiles.rows, layer.width)
        pair_outputs = hidden_states.new_zeros(top_k_index.numel(), layer.hidden)
        up_words, up_scales = layer.gate_up_fragment_words, layer.gate_up_fragment_scales.view(torch.int32)
        down_words, down_scales = layer.down_fragment_words, layer.down_fragment_scales.view(torch.int32)
        common = dict(BLOCK_R=tiles.rows, STAGES=tiles.num_stages,
                      SMALLEST_ROWS=tiles.smallest_rows or tiles.rows, num_warps=4)

        def served_gate_up():
            serve_clef.nvfp4_gate_up_fragment_kernel[(num_tiles, layer.width // 64)](
                hidden_states, slot_pairs, tile_experts, up_words, up_scales, layer.gate_up_global_scale,
                intermediate, layer.num_experts, layer.hidden, layer.width, 8, **common)

        def served_down():
            serve_clef.nvfp4_down_fragment_kernel[(layer.hidden // (64 * (1 + pairs_down)), num_tiles)](
                intermediate, slot_pairs, tile_experts, routing, down_words, down_scales, layer.down_global_scale,
                pair_outputs, layer.num_experts, layer.hidden, layer.width, SLAB_PAIRS=pairs_down, **common)

        served_gate_up()
        served_down()
        want_intermediate, want_outputs = intermediate.clone(), pair_outputs.clone()
        times = {"served": (graph_us(served_gate_up), graph_us(served_down))}
        for late, prefetch, cap_up, cap_down in VARIANTS:
            if cap_up is not None and tiles.rows not in CAPS:
                continue
            extra = dict(LATE=late, PREFETCH=prefetch)
            up_cap = {} if cap_up is None else {"maxnreg": CAPS[tiles.rows][0]}
            down_cap = {} if cap_down is None else {"maxnreg": CAPS[tiles.rows][1]}

            def gate_up(extra=extra, up_cap=up_cap):
                gate_up_lab_kernel[(num_tiles, layer.width // 64)](
                    hidden_states, slot_pairs, tile_experts, up_words, up_scales, layer.gate_up_global_scale,
                    intermediate, layer.num_experts, layer.hidden, layer.width, 8, **common, **extra, **up_cap)

            def down(extra=extra, down_cap=down_cap):
                down_lab_kernel[(layer.hidden // 64, num_tiles)](
                    intermediate, slot_pairs, tile_experts, routing, down_words, down_scales,
                    layer.down_global_scale, pair_outputs, layer.num_experts, layer.hidden, layer.width,
                    **common, **extra, **down_cap)

            intermediate.zero_()
            pair_outputs.zero_()
            gate_up()
            same_intermediate = torch.equal(intermediate, want_intermediate)
            intermediate.copy_(want_intermediate)
            same_outputs = True
            if not pairs_down:
                down()
                same_outputs = torch.equal(pair_outputs[slot_pairs[slot_pairs >= 0].long()],
                                           want_outputs[slot_pairs[slot_pairs >= 0].long()])
            failures += not (same_intermediate and same_outputs)
            label = f"late {late!s:5} prefetch {prefetch} cap {cap_up is not None!s:5}"
            times[label] = (graph_us(gate_up), float("nan") if pairs_down else graph_us(down))
            if not (same_intermediate and same_outputs):
                print(f"  {label}: MISMATCH gate_up {same_intermediate} down {same_outputs}", flush=True)
        served = times["served"]
        print(f"\n{num_tokens} tokens, R {tiles.rows}: gate_up / down us (served {served[0]:.1f} / {served[1]:.1f})")
        for label, (up_us, down_us) in times.items():
            print(f"  {label:36s} {up_us:7.1f} ({up_us / served[0]:.3f})  {down_us:7.1f} ({down_us / served[1]:.3f})",
                  flush=True)
    return 1 if failures else 0


def graph_us(launch, repeats=20):
    import triton
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            launch()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1000 / repeats


if __name__ == "__main__":
    if "--compile" in sys.argv:
        offline()
    else:
        sys.exit(on_gpu())
