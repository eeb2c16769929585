# /// script
# requires-python = ">=3.11"
# dependencies = [
#   "torch==2.11.0",  # the build serve_clef runs on the H200 (CUDA 13.0); CPU machines: see the README
#   "transformers>=5.17",
#   "triton",
#   "safetensors",
#   "tokenizers",
#   "huggingface_hub",
#   "numpy",
#   "pillow",
#   "av",
#   "fastapi",
#   "uvicorn",
#   "requests",
#   "prometheus-client",
#   "zstandard",
# ]
# ///
"""serve_clef: serve Clef-Omni decisions from an NVFP4 (ModelOpt) checkpoint on one GPU.

Sections, top to bottom, in the order data flows: the command line's flags (parsed before the heavy imports, so that
--help answers at once), packed experts (the NVFP4 format, the activation replay, the Triton packed-expert kernels, the
experts module), checkpoint loading, the engine (the text decoder in CUDA graphs), decisions (requests), HTTP, running
the command line.
Dimension letters in shape comments: T tokens, E experts, H hidden, I expert width, K experts per token (top-k),
S (token, expert) pairs, P padded slots, R/N/C the rows, output columns and reduced columns of a kernel tile.
"""

import argparse
import asyncio
import atexit
import base64
import binascii
import concurrent.futures
import contextlib
import enum
import gc
import hmac
import http
import importlib.util
import io
import json
import math
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
import types
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


# ==== command line: the flags =========================================================================================
# Defined and parsed before the heavy imports below (torch, transformers and triton take ~7 s), so that --help and a
# mistyped flag answer at once; running the command line is the last section.

DEFAULT_MODEL = "dbirks/clef-omni-nvfp4"
DEFAULT_MAX_LENGTH = 64_000  # tokens, the decision API's default context (joint_schema_model.DEFAULT_MAX_LENGTH)
EXPERT_KERNELS = ("auto", "triton", "unpack", "native")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="serve_clef.py",
        description="Serve Clef-Omni decisions (POST /v1/systemone) from a BF16 release or a ModelOpt NVFP4 export.",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="Hugging Face hub id or local model directory; 'synthetic' serves a tiny random NVFP4 checkpoint built "
        "offline, 'synthetic:full' a full-size one streamed into GPU memory (both give meaningless answers). "
        f"Default: {DEFAULT_MODEL}.",
    )
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model.")
    parser.add_argument("--device", help="Torch device to run on. Default: cuda when available, else cpu.")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on. Default: 127.0.0.1.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on. Default: 8000.")
    parser.add_argument("--demo", action="store_true",
                        help="Answer one built-in request: print the request (stderr) and the answer (stdout), exit.")
    parser.add_argument("--request", type=Path, metavar="FILE", help="Answer the JSON request in FILE, print, exit.")
    parser.add_argument(
        "--simulate-fp4-activations",
        action="store_true",
        help="W4A4 (ModelOpt NVFP4) checkpoints only: round every expert input to NVFP4 as ModelOpt calibrated it, "
        "reproducing Blackwell W4A4 numerics on any device (without it, experts run W4A16: FP4 weights, BF16 inputs).",
    )
    parser.add_argument(
        "--no-packed-nvfp4",
        action="store_true",
        help="Unpack all NVFP4 experts to BF16 at load and run stock transformers experts (~4x the expert memory).",
    )
    parser.add_argument(
        "--expert-kernels",
        choices=EXPERT_KERNELS,
        default="auto",
        help="How packed NVFP4 experts compute. triton: kernels that read the packed weights directly (CUDA; on CPU "
        "only under TRITON_INTERPRET=1, slowly, for tests); unpack: each layer unpacked to BF16 just before a grouped "
        "GEMM (the reference); native: FP4 tensor cores (not built yet). Default auto: triton on CUDA, unpack on CPU.",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=DEFAULT_MAX_LENGTH,
        help=f"Context limit in tokens per decision. Default: {DEFAULT_MAX_LENGTH}.",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SERVE_CLEF_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on API requests. Default: $SERVE_CLEF_API_KEY, else no auth.",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # exits here on --help or a bad flag; main() parses again once everything below is defined

import av
import huggingface_hub
import numpy as np
import PIL.Image
import prometheus_client
import safetensors
import safetensors.torch
import torch
import transformers
import triton
import triton.language as tl
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers.integrations.moe import grouped_mm_experts_forward

# torch.compile (below) imports torch._inductor, which still builds torch.utils.mkldnn's modules with the deprecated
# torch.jit.script_method: torch's own deprecation, nothing a user of serve_clef can act on.
warnings.filterwarnings("ignore", r"`torch\.jit\.script_method` is deprecated", DeprecationWarning, r"torch\.jit\.")


# ==== packed experts and their kernels ================================================================================

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign (docs/nvfp4-format.md §2)


def round_to_e2m1_codes(magnitude: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 (uint8) of non-negative values rounded to the E2M1 grid, to nearest with ties to even.

    One step up per midpoint passed (docs/nvfp4-format.md §2.3's table). A tie goes to the even mantissa: it steps up
    only past the midpoints whose upper neighbour is even (0.75 -> 1, 1.75 -> 2, 3.5 -> 4), hence >= there and >
    elsewhere. Plain comparisons, so torch.compile fuses the rounding into the kernels around it.
    """
    codes = (
        (magnitude > 0.25).to(torch.uint8)
        + (magnitude >= 0.75)
        + (magnitude > 1.25)
        + (magnitude >= 1.75)
        + (magnitude > 2.5)
        + (magnitude >= 3.5)
        + (magnitude > 5.0)
    )
    return codes


def unpack_nvfp4(packed_codes: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Dequantise NVFP4 expert weights to BF16 (docs/nvfp4-format.md §2.1): W = e2m1(code) * (block_scale *
    global_scale).

    packed_codes uint8 [E, O, K/2] (element 2i in the low nibble), block_scales float8_e4m3fn [E, O, K/16],
    global_scale fp32 [E] -> BF16 [E, O, K]. Plain elementwise torch, so torch.compile fuses it into one kernel.
    """
    num_experts, rows, half_columns = packed_codes.shape
    codes = torch.stack((packed_codes & 0x0F, packed_codes >> 4), dim=-1).view(num_experts, rows, 2 * half_columns)
    # E2M1: bit 3 sign, bits 1-2 exponent, bit 0 mantissa; exponent 0 is subnormal (0 or 0.5), otherwise
    # 2**(exponent - 1) * (1 + mantissa / 2): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. In integer halves, so the
    # compiled kernel stays exact (GPU exp2 is approximate): 0, 1, 2, 3, 4, 6, 8, 12.
    exponent = ((codes >> 1) & 0b11).to(torch.int32)
    mantissa = (codes & 1).to(torch.int32)
    halves = torch.where(exponent == 0, mantissa, (2 + mantissa) << (exponent - 1).clamp(min=0))
    magnitude = halves.float() * 0.5
    values = torch.where(codes >= 8, -magnitude, magnitude)  # [E, O, K]
    per_block = block_scales.float() * global_scale[:, None, None]  # [E, O, K/16]
    weight = values.view(num_experts, rows, -1, 16) * per_block.unsqueeze(-1)  # [E, O, K/16, 16]
    return weight.view(num_experts, rows, 2 * half_columns).to(torch.bfloat16)


# On CUDA the eager unpack takes ~8 passes over a layer's experts; compiled it is one kernel reading the packed bytes
# once (bandwidth floor ~0.4 ms per full-size layer on an H200). CPU keeps the eager version.
unpack_nvfp4_compiled = torch.compile(unpack_nvfp4, fullgraph=True, dynamic=False)


# ==== activation replay (faithful W4A4) ===============================================================================

def fake_quant_nvfp4_activations(activations: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Round activations [..., K] to NVFP4 as ModelOpt's W4A4 fake-quant does (docs/nvfp4-format.md §2.3), in their own
    dtype.

    Static per-tensor `input_scale` (the layer's calibrated global scale), dynamic e4m3 scales per 16 values along K,
    E2M1 magnitudes rounded to nearest with ties to even. Operation order follows ModelOpt's Triton kernel
    (fp4_fake_quant_block).
    """
    blocks = activations.float().unflatten(-1, (-1, 16))  # [..., K/16, 16]
    input_scale = torch.where(input_scale > 0, input_scale, 1e-12)
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)  # [..., K/16, 1]
    block_scales = (block_amax / (6.0 * input_scale)).clamp(max=448.0).to(torch.float8_e4m3fn).float() * input_scale
    block_scales = torch.where(block_scales >= 1e-5, block_scales, 1.0)
    e2m1_magnitudes = torch.tensor(E2M1_MAGNITUDES, device=activations.device)
    rounded = e2m1_magnitudes[round_to_e2m1_codes(blocks.abs() / block_scales).long()]  # [..., K/16, 16]
    quantized = rounded * block_scales
    quantized = torch.where(blocks >= 0, quantized, -quantized)
    return quantized.flatten(-2).to(activations.dtype)


# Eager, the replay is a dozen passes over every expert input; compiled, one kernel. Token counts vary per request.
fake_quant_nvfp4_activations_compiled = torch.compile(fake_quant_nvfp4_activations, dynamic=True)


# ==== packed-expert kernels (Triton) ==================================================================================
# Two grouped GEMMs that read the experts as they sit in memory (uint8 codes, e4m3 block scales) and decode each
# weight tile in registers, so no BF16 copy of a layer's experts is ever written. Routing sorts the (token, expert)
# pairs by expert and pads each expert's run to the row tile, so one launch covers every expert of a layer; nothing
# reads a GPU value on the host, so the layer can be captured in a CUDA graph. S pairs (T tokens x top-k K), P padded
# slots (a multiple of the row tile), R rows of a tile, N output columns of a tile, C the reduced (K-loop) dimension.
#
# Numerics. A weight is e2m1 * block_scale, exact in BF16 (at most 6 significant bits), so the tensor cores see the
# checkpoint's values exactly; the per-expert global scale multiplies the fp32 accumulator once. Outputs are rounded
# to BF16 where transformers' grouped_mm path rounds them (gate and up, SiLU, their product, the down projection, the
# routing product) and the top-k sum runs in fp32 in a fixed order, so answers are deterministic.
#
# Triton 3.9's CPU interpreter (TRITON_INTERPRET=1, how CI runs these kernels) truncates fp32 -> bf16 and rounds
# fp32 -> e4m3 differently from the GPU, and computes bf16 dots wrongly. So the kernels round to BF16 and to e4m3
# with plain integer and float arithmetic (round to nearest even, the same on both), and on CPU tensors feed the dots
# fp32 operands (the same exact products the tensor cores form from BF16).


@triton.jit
def _round_to_bf16(x):
    """fp32 -> bf16, round to nearest with ties to even (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_to_e4m3(x):
    """Non-negative fp32 up to 448 rounded to the nearest float8_e4m3fn value (ties to even), as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (x + 16384.0) - 16384.0  # below 2**-6 e4m3 steps by 2**-9, the fp32 ulp of 2**14
    return tl.where(x < 0.015625, subnormal, normal)


@triton.jit
def _e2m1_times_block_scale(codes, block_scales_x2p14):
    """E2M1 codes (0..15) times their block scale (fp32, pre-multiplied by 2**14): the weights, exactly, in BF16.

    The 3 magnitude bits go to fp16's exponent and mantissa and the sign bit to fp16's sign, which reads as
    e2m1 * 2**-14 (0.5 lands on an fp16 subnormal, converted exactly); no table, no branches.
    """
    codes = codes.to(tl.uint16)
    fp16_bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    e2m1_x2m14 = fp16_bits.to(tl.float16, bitcast=True).to(tl.float32)
    return (e2m1_x2m14 * block_scales_x2p14).to(tl.bfloat16)  # exact: no rounding happens here


@triton.jit
def _round_activations_to_nvfp4(x, input_scale, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """Activations [R, C] (fp32) rounded to NVFP4 as ModelOpt's W4A4 fake quant does (docs/nvfp4-format.md §2.3),
    returned in BF16.

    The same operations in the same order as `fake_quant_nvfp4_activations`: dynamic e4m3 scale per 16 values from
    the static input scale, E2M1 magnitudes rounded to nearest with ties to even.
    """
    blocks = tl.reshape(x, (ROWS, COLUMNS // 16, 16))
    input_scale = tl.where(input_scale > 0, input_scale, 1e-12)
    block_amax = tl.max(tl.abs(blocks), axis=2)
    block_scales = _round_to_e4m3(tl.minimum(block_amax / (6.0 * input_scale), 448.0)) * input_scale
    block_scales = tl.where(block_scales >= 1e-5, block_scales, 1.0)[:, :, None]
    magnitude = tl.abs(blocks) / block_scales
    rounded = tl.where(magnitude > 0.25, 0.5, 0.0)
    rounded = tl.where(magnitude >= 0.75, 1.0, rounded)
    rounded = tl.where(magnitude > 1.25, 1.5, rounded)
    rounded = tl.where(magnitude >= 1.75, 2.0, rounded)
    rounded = tl.where(magnitude > 2.5, 3.0, rounded)
    rounded = tl.where(magnitude >= 3.5, 4.0, rounded)
    rounded = tl.where(magnitude > 5.0, 6.0, rounded)
    quantized = rounded * block_scales
    quantized = tl.where(blocks >= 0, quantized, -quantized)
    return _round_to_bf16(tl.reshape(quantized, (ROWS, COLUMNS)))


@triton.jit
def nvfp4_round_activations_kernel(activations_ptr, input_scale_ptr, out_ptr, COLUMNS: tl.constexpr):
    """One row of BF16 activations [T, COLUMNS] per program, rounded to NVFP4 with the static input scale."""
    columns = tl.program_id(0).to(tl.int64) * COLUMNS + tl.arange(0, COLUMNS)[None, :]  # [1, C]
    row = tl.load(activations_ptr + columns).to(tl.float32)
    tl.store(out_ptr + columns, _round_activations_to_nvfp4(row, tl.load(input_scale_ptr), 1, COLUMNS))


def round_activations_to_nvfp4(activations: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """BF16 activations [T, H] rounded to NVFP4 by the kernels' helper: the W4A4 replay of the gate_up input, once
    per token (the layer's input scale is shared by its experts), before the packed gate_up kernel."""
    out = torch.empty_like(activations)  # [T, H]
    nvfp4_round_activations_kernel[(activations.shape[0],)](activations.contiguous(), input_scale.float().reshape(1),
                                                             out, COLUMNS=activations.shape[1])
    return out


@triton.jit
def _packed_partial_product(
    a, codes_ptr, block_scales_ptr, weight_rows, reduced_size, c0, FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """a [R, BLOCK_C] (BF16) times the packed weight rows `weight_rows` [N] over columns c0..c0+BLOCK_C, in fp32.

    The even and odd columns are multiplied apart, because the low and high nibbles of a byte hold them: the codes
    are never interleaved back into order (a sum does not care about the order of its terms).
    """
    half_columns = tl.arange(0, BLOCK_C // 2)
    blocks = tl.arange(0, BLOCK_C // 16)
    # [N, C/2]
    codes = tl.load(codes_ptr + weight_rows[:, None] * (reduced_size // 2) + c0 // 2 + half_columns[None, :])
    block_scales = tl.load(block_scales_ptr + weight_rows[:, None] * (reduced_size // 16) + c0 // 16 + blocks[None, :])
    block_scales = block_scales.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0  # [N, C/16]
    # one scale per 8 bytes (16 values, 8 of them even, 8 odd)
    block_scales = tl.reshape(tl.broadcast_to(block_scales[:, :, None], (BLOCK_N, BLOCK_C // 16, 8)),
                              (BLOCK_N, BLOCK_C // 2))
    weights_even = _e2m1_times_block_scale(codes & 0xF, block_scales)  # [N, C/2]
    weights_odd = _e2m1_times_block_scale(codes >> 4, block_scales)
    a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], BLOCK_C // 2, 2)))  # [R, C/2] each
    if FP32_DOT:
        a_even, a_odd = a_even.to(tl.float32), a_odd.to(tl.float32)
        weights_even, weights_odd = weights_even.to(tl.float32), weights_odd.to(tl.float32)
    return tl.dot(a_even, tl.trans(weights_even)) + tl.dot(a_odd, tl.trans(weights_odd))


@triton.jit
def nvfp4_gate_up_kernel(
    hidden_states_ptr,  # BF16 [T, H]
    slot_pairs_ptr,  # int32 [P]: the pair (token * K + k) in each padded slot, -1 for padding
    tile_experts_ptr,  # int32 [P / BLOCK_R]: the expert of each row tile, E for tiles past the last
    packed_codes_ptr,  # uint8 [E, 2I, H/2]: gate rows, then up rows
    block_scales_ptr,  # e4m3 as uint8 [E, 2I, H/16]
    global_scale_ptr,  # fp32 [E]
    down_input_scale_ptr, down_input_scale_stride,  # fp32, the expert's at down_input_scale_ptr + expert * stride
    intermediate_ptr,  # BF16 [P, I]: SiLU(gate) * up of each slot, rounded to NVFP4 under SIMULATE_FP4
    num_experts, hidden, width, top_k,
    SIMULATE_FP4: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    tile, column_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= num_experts:
        return
    slots = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.load(slot_pairs_ptr + slots)
    tokens = tl.where(pairs >= 0, pairs // top_k, 0).to(tl.int64)  # [R]
    columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    gate_rows = expert.to(tl.int64) * 2 * width + columns
    gate = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, hidden, BLOCK_C):
        a = tl.load(hidden_states_ptr + tokens[:, None] * hidden + c0 + tl.arange(0, BLOCK_C)[None, :],
                    mask=(pairs >= 0)[:, None], other=0.0)  # [R, C]
        gate += _packed_partial_product(a, packed_codes_ptr, block_scales_ptr, gate_rows, hidden, c0, FP32_DOT,
                                        BLOCK_N, BLOCK_C)
        up += _packed_partial_product(a, packed_codes_ptr, block_scales_ptr, gate_rows + width, hidden, c0, FP32_DOT,
                                      BLOCK_N, BLOCK_C)
    global_scale = tl.load(global_scale_ptr + expert)
    gate = _round_to_bf16(gate * global_scale).to(tl.float32)
    up = _round_to_bf16(up * global_scale).to(tl.float32)
    activated = _round_to_bf16(gate / (1.0 + tl.exp(-gate))).to(tl.float32)  # SiLU, as torch rounds it
    intermediate = _round_to_bf16(activated * up)  # [R, N]
    if SIMULATE_FP4:  # the down projection's input, rounded once here rather than in every down program
        down_input_scale = tl.load(down_input_scale_ptr + expert * down_input_scale_stride)
        intermediate = _round_activations_to_nvfp4(intermediate.to(tl.float32), down_input_scale, BLOCK_R, BLOCK_N)
    tl.store(intermediate_ptr + slots.to(tl.int64)[:, None] * width + columns[None, :], intermediate)


@triton.jit
def nvfp4_down_kernel(
    intermediate_ptr,  # BF16 [P, I]
    slot_pairs_ptr, tile_experts_ptr,  # as for nvfp4_gate_up_kernel
    routing_weights_ptr,  # BF16 [S]: each pair's routing weight
    packed_codes_ptr,  # uint8 [E, H, I/2]
    block_scales_ptr,  # e4m3 as uint8 [E, H, I/16]
    global_scale_ptr,  # fp32 [E]
    pair_outputs_ptr,  # BF16 [S, H]: routing weight * down projection of each pair
    num_experts, hidden, width,
    FP32_DOT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    tile, column_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= num_experts:
        return
    slots = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    pairs = tl.load(slot_pairs_ptr + slots)
    pair_rows = tl.where(pairs >= 0, pairs, 0).to(tl.int64)  # [R]
    columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    weight_rows = expert.to(tl.int64) * hidden + columns
    out = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, width, BLOCK_C):
        a = tl.load(intermediate_ptr + slots[:, None] * width + c0 + tl.arange(0, BLOCK_C)[None, :])  # [R, C]
        out += _packed_partial_product(a, packed_codes_ptr, block_scales_ptr, weight_rows, width, c0, FP32_DOT,
                                       BLOCK_N, BLOCK_C)
    out = _round_to_bf16(out * tl.load(global_scale_ptr + expert)).to(tl.float32)
    routing_weights = tl.load(routing_weights_ptr + pair_rows).to(tl.float32)  # [R]
    tl.store(pair_outputs_ptr + pair_rows[:, None] * hidden + columns[None, :],
             _round_to_bf16(out * routing_weights[:, None]), mask=(pairs >= 0)[:, None])


def route_to_row_tiles(top_k_index: torch.Tensor, num_experts: int, block_rows: int):
    """Pairs sorted by expert, each expert's run padded to a multiple of `block_rows`, with no host synchronisation.

    top_k_index [T, K] -> slot_pairs int32 [P] (the pair token * K + k in each slot, -1 in padding) and tile_experts
    int32 [P / block_rows] (the expert of each tile; num_experts for the tiles past the last, which do nothing). P is
    the most any routing can need, so the launch grid depends on T alone.
    """
    num_pairs = top_k_index.numel()
    device = top_k_index.device
    expert_of_pair = top_k_index.reshape(-1)  # [S]
    pairs_by_expert = torch.argsort(expert_of_pair, stable=True)  # [S]
    pairs_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=device)
    pairs_per_expert.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))  # [E]
    tiles_per_expert = (pairs_per_expert + block_rows - 1) // block_rows  # [E]
    tile_ends = torch.cumsum(tiles_per_expert, 0)  # [E]
    first_slot = (tile_ends - tiles_per_expert) * block_rows  # [E]
    first_pair = torch.cumsum(pairs_per_expert, 0) - pairs_per_expert  # [E]
    max_tiles = -(-num_pairs // block_rows) + min(num_experts, num_pairs)
    tile_experts = torch.searchsorted(tile_ends, torch.arange(max_tiles, device=device), right=True)  # [P/R]
    sorted_experts = expert_of_pair[pairs_by_expert]  # [S]
    slots = first_slot[sorted_experts] + torch.arange(num_pairs, device=device) - first_pair[sorted_experts]  # [S]
    slot_pairs = torch.full((max_tiles * block_rows,), -1, dtype=torch.int32, device=device)  # [P]
    slot_pairs.scatter_(0, slots, pairs_by_expert.to(torch.int32))
    return slot_pairs, tile_experts.to(torch.int32)


@dataclass(frozen=True)
class ExpertTiles:
    """Tile sizes of both packed-expert kernels: rows (pairs) per tile, output columns per program, reduced columns
    per step, and Triton's warps and pipeline stages (the tile sweep gave both kernels the same sizes)."""

    rows: int
    columns: int
    reduced: int
    num_warps: int
    num_stages: int


# By mean pairs per expert (T * K / E): few rows per tile while each expert sees few tokens, so that little of each
# tile is padding. The fastest of 28 candidates per token count on an H200 (bench/check_expert_kernels.py,
# docs/benchmarks.md).
EXPERT_TILES = (
    (8, ExpertTiles(16, 64, 128, 4, 3)),
    (24, ExpertTiles(32, 128, 64, 4, 3)),
    (192, ExpertTiles(64, 64, 128, 4, 3)),
    (None, ExpertTiles(128, 128, 64, 8, 3)),
)


def expert_tiles(num_pairs: int, num_experts: int) -> ExpertTiles:
    for most_pairs_per_expert, tiles in EXPERT_TILES:
        if most_pairs_per_expert is None or num_pairs <= most_pairs_per_expert * num_experts:
            return tiles
    raise AssertionError("EXPERT_TILES ends with a catch-all row")


def fitted_block(block: int, size: int) -> int:
    """The largest power of two up to `block` that divides `size` (tiny test models have 32-wide experts)."""
    while size % block:
        block //= 2
    return block


class PackedNVFP4Experts(torch.nn.Module):
    """One layer's experts kept NVFP4-packed in device memory exactly as on disk, in transformers' fused order.

    Stands in for transformers' Qwen3OmniMoeThinkerTextExperts, with the same forward signature. `kernels` says how
    it computes: "triton", the packed-expert kernels above on the packed bytes; "unpack", this layer unpacked to BF16
    scratch tensors, transformers' grouped_mm experts function on them, then freed (the reference).
    E experts, H hidden, I expert width, T tokens, K experts per token.
    """

    def __init__(self, text_config, act_fn: Callable, has_input_scales: bool):
        super().__init__()
        num_experts, hidden, width = text_config.num_experts, text_config.hidden_size, text_config.moe_intermediate_size
        self.num_experts, self.hidden, self.width = num_experts, hidden, width
        self.act_fn = act_fn
        self.has_input_scales = has_input_scales  # W4A4 exports carry input scales, W4A16 ones do not
        self.simulate_fp4_activations = False
        self.kernels = "unpack"
        self.top_k = text_config.num_experts_per_tok
        uint8, e4m3, fp32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        # gate rows [0, I) then up rows [I, 2I), as transformers fuses them
        self.register_buffer("gate_up_packed_codes", torch.zeros(num_experts, 2 * width, hidden // 2, dtype=uint8))
        self.register_buffer("gate_up_block_scales", torch.zeros(num_experts, 2 * width, hidden // 16, dtype=e4m3))
        self.register_buffer("gate_up_global_scale", torch.zeros(num_experts, dtype=fp32))
        self.register_buffer("down_packed_codes", torch.zeros(num_experts, hidden, width // 2, dtype=uint8))
        self.register_buffer("down_block_scales", torch.zeros(num_experts, hidden, width // 16, dtype=e4m3))
        self.register_buffer("down_global_scale", torch.zeros(num_experts, dtype=fp32))
        # The layer's shared activation scales (one input quantizer per projection type per layer,
        # docs/nvfp4-format.md §3.2).
        self.register_buffer("gate_up_input_scale", torch.zeros((), dtype=fp32))
        self.register_buffer("down_input_scale", torch.zeros((), dtype=fp32))
        self.stored = set()  # (expert, projection, field) received so far
        self.first_input_scale_name = {}  # "gate_up" / "down" -> checkpoint name that set the layer's input scale

    @torch.no_grad()
    def store(self, expert: int, projection: str, field: str, tensor: torch.Tensor, checkpoint_name: str) -> None:
        """Put one checkpoint tensor of one expert in place, checking dtype, shape, NaN bytes and scale equalities."""
        group = "down" if projection == "down_proj" else "gate_up"
        rows = slice(0, None)
        if projection == "gate_proj":
            rows = slice(0, self.width)
        elif projection == "up_proj":
            rows = slice(self.width, 2 * self.width)
        in_features = self.width if group == "down" else self.hidden
        out_features = self.hidden if group == "down" else self.width

        def fail(problem: str) -> None:
            raise CheckpointError(f"checkpoint tensor {checkpoint_name}: {problem}")

        if field == "weight":
            if tensor.dtype != torch.uint8 or tuple(tensor.shape) != (out_features, in_features // 2):
                fail(f"{tensor.dtype} {list(tensor.shape)}, expected packed uint8 {[out_features, in_features // 2]}")
            getattr(self, f"{group}_packed_codes")[expert, rows].copy_(tensor)
        elif field == "weight_scale":
            if tensor.dtype != torch.float8_e4m3fn or tuple(tensor.shape) != (out_features, in_features // 16):
                fail(f"{tensor.dtype} {list(tensor.shape)}, expected float8_e4m3fn {[out_features, in_features // 16]}")
            if ((tensor.view(torch.uint8) & 0x7F) == 0x7F).any():
                fail("NaN block scale bytes (0x7F/0xFF) as ModelOpt < 0.47 wrote them: re-export with ModelOpt >= 0.47")
            getattr(self, f"{group}_block_scales")[expert, rows].copy_(tensor)
        else:
            if tensor.dtype != torch.float32 or tensor.numel() != 1:
                fail(f"{tensor.dtype} {list(tensor.shape)}, expected a float32 scalar")
            value = tensor.reshape(()).to(self.gate_up_global_scale.device)
            if not torch.isfinite(value) or value <= 0:
                fail(f"scale {value.item()} must be finite and positive")
            if field == "weight_scale_2":
                global_scale = getattr(self, f"{group}_global_scale")
                partner = {"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(projection)
                if (expert, partner, field) in self.stored and global_scale[expert] != value:
                    fail(
                        f"{value.item()} differs from the {partner} weight_scale_2 {global_scale[expert].item()} of "
                        "the same expert; ModelOpt shares one weight_scale_2 between gate and up "
                        "(docs/nvfp4-format.md §3.2): re-export with nvidia-modelopt>=0.47"
                    )
                global_scale[expert] = value
            elif not self.has_input_scales:
                fail("input_scale in a W4A16_NVFP4 export (weight-only exports have none); fix hf_quant_config.json")
            else:
                input_scale = getattr(self, f"{group}_input_scale")
                if group in self.first_input_scale_name and input_scale != value:
                    fail(
                        f"input_scale {value.item()} differs from {self.first_input_scale_name[group]} = "
                        f"{input_scale.item()}; ModelOpt shares one input quantizer for gate and up of all experts of "
                        "a layer and one for down (docs/nvfp4-format.md §3.2), so this export is broken: re-export it"
                    )
                self.first_input_scale_name.setdefault(group, checkpoint_name)
                input_scale.copy_(value)
        self.stored.add((expert, projection, field))

    def missing_tensors(self, experts_name: str) -> list[str]:
        fields = ("weight", "weight_scale", "weight_scale_2") + (("input_scale",) if self.has_input_scales else ())
        return [
            f"{experts_name}.{expert}.{projection}.{field}"
            for expert in range(self.num_experts)
            for projection in ("gate_proj", "up_proj", "down_proj")
            for field in fields
            if (expert, projection, field) not in self.stored
        ]

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's experts in BF16: gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
        unpack = unpack_nvfp4_compiled if self.gate_up_packed_codes.is_cuda else unpack_nvfp4
        gate_up_proj = unpack(self.gate_up_packed_codes, self.gate_up_block_scales, self.gate_up_global_scale)
        down_proj = unpack(self.down_packed_codes, self.down_block_scales, self.down_global_scale)
        return gate_up_proj, down_proj

    @torch.no_grad()
    def unpack_into(self, experts: torch.nn.Module) -> None:
        """--no-packed-nvfp4: write the dequantised weights into transformers' stock experts module."""
        gate_up_proj, down_proj = self.unpacked()
        experts.gate_up_proj.copy_(gate_up_proj)
        experts.down_proj.copy_(down_proj)

    def fake_quant(self, activations: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
        fake_quant = fake_quant_nvfp4_activations_compiled if activations.is_cuda else fake_quant_nvfp4_activations
        return fake_quant(activations, input_scale)

    def apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:  # [S, 2I] -> [S, I]
        gate, up = gate_up_out.chunk(2, dim=-1)
        intermediate = self.act_fn(gate) * up
        if self.simulate_fp4_activations:
            intermediate = self.fake_quant(intermediate, self.down_input_scale)
        return intermediate

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # hidden_states [T, H], top_k_index / top_k_weights [T, K] -> [T, H]
        if self.kernels == "triton":
            return self.forward_packed(hidden_states, top_k_index, top_k_weights)
        return self.forward_unpacked(hidden_states, top_k_index, top_k_weights)

    def forward_packed(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The packed-expert kernels: route, gate_up with SiLU * up fused, down with the routing weight, top-k sum."""
        num_tokens, top_k = top_k_index.shape
        tiles = expert_tiles(top_k_index.numel(), self.num_experts)
        slot_pairs, tile_experts = route_to_row_tiles(top_k_index, self.num_experts, tiles.rows)
        num_tiles = tile_experts.numel()
        common = dict(
            FP32_DOT=not hidden_states.is_cuda, BLOCK_R=tiles.rows, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
        if self.simulate_fp4_activations:
            hidden_states = round_activations_to_nvfp4(hidden_states, self.gate_up_input_scale)
        gate_up_columns = fitted_block(tiles.columns, self.width)
        intermediate = hidden_states.new_empty(num_tiles * tiles.rows, self.width)  # [P, I]
        nvfp4_gate_up_kernel[(num_tiles, self.width // gate_up_columns)](
            hidden_states.contiguous(), slot_pairs, tile_experts,
            self.gate_up_packed_codes, self.gate_up_block_scales.view(torch.uint8), self.gate_up_global_scale,
            self.down_input_scale, 0, intermediate, self.num_experts, self.hidden, self.width, top_k,
            SIMULATE_FP4=self.simulate_fp4_activations, BLOCK_N=gate_up_columns,
            BLOCK_C=fitted_block(tiles.reduced, self.hidden), **common,
        )
        down_columns = fitted_block(tiles.columns, self.hidden)
        pair_outputs = hidden_states.new_empty(num_tokens * top_k, self.hidden)  # [S, H]
        nvfp4_down_kernel[(num_tiles, self.hidden // down_columns)](
            intermediate, slot_pairs, tile_experts, top_k_weights.to(hidden_states.dtype).reshape(-1),
            self.down_packed_codes, self.down_block_scales.view(torch.uint8), self.down_global_scale,
            pair_outputs, self.num_experts, self.hidden, self.width,
            BLOCK_N=down_columns, BLOCK_C=fitted_block(tiles.reduced, self.width), **common,
        )
        return pair_outputs.view(num_tokens, top_k, self.hidden).sum(dim=1).to(hidden_states.dtype)  # fp32 sum

    @torch.no_grad()
    def compile_kernels(self) -> None:
        """Run the packed kernels once per tile configuration, so that no request pays Triton's compile (seconds)."""
        generator = torch.Generator(self.gate_up_packed_codes.device).manual_seed(0)
        for most_pairs_per_expert, _ in EXPERT_TILES:
            # the catch-all row (no bound): twice the last bound
            pairs_per_expert = most_pairs_per_expert or 2 * EXPERT_TILES[-2][0]
            num_tokens = max(1, pairs_per_expert * self.num_experts // self.top_k)
            hidden_states = torch.randn(num_tokens, self.hidden, generator=generator, device=generator.device)
            router_logits = torch.randn(num_tokens, self.num_experts, generator=generator, device=generator.device)
            top_k_weights, top_k_index = router_logits.softmax(-1).topk(self.top_k, dim=-1)
            self.forward_packed(hidden_states.to(torch.bfloat16), top_k_index, top_k_weights.to(torch.bfloat16))

    def forward_unpacked(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.simulate_fp4_activations:
            hidden_states = self.fake_quant(hidden_states, self.gate_up_input_scale)
        gate_up_proj, down_proj = self.unpacked()
        # The attributes transformers' grouped_mm experts function reads from a stock experts module
        # (docs/nvfp4-format.md §8.3).
        stock_experts_view = types.SimpleNamespace(
            num_experts=self.num_experts,
            has_gate=True,
            has_bias=False,
            is_transposed=False,
            is_concatenated=True,
            has_post_expert_norm=False,
            _is_expert_parallel=False,
            act_fn=self.act_fn,
            _apply_gate=self.apply_gate,
            gate_up_proj=gate_up_proj,
            down_proj=down_proj,
        )
        return grouped_mm_experts_forward(stock_experts_view, hidden_states, top_k_index, top_k_weights)


# ==== checkpoint loading ==============================================================================================

SIBLING_FILES = "joint_schema_model.py and synthetic_release.py, beside serve_clef.py in the serve_clef repository"
SYNTHETIC_MODELS = ("synthetic", "synthetic:full")


class CheckpointError(ValueError):
    """A checkpoint or flag combination that cannot be served; the message says what is wrong and how to fix it."""


class CheckpointFormat(enum.StrEnum):
    """The format of a checkpoint's thinker, read from its files (never from a flag); its value is what the console
    and /healthz show."""

    BF16 = "bf16"  # a BF16 release
    MODELOPT_NVFP4 = "modelopt:NVFP4"  # ModelOpt W4A4: packed experts and their calibrated input scales
    MODELOPT_W4A16_NVFP4 = "modelopt:W4A16_NVFP4"  # ModelOpt weight-only: packed experts, no input scales

    @property
    def quantized(self) -> bool:
        return self is not CheckpointFormat.BF16

    @property
    def has_input_scales(self) -> bool:
        return self is CheckpointFormat.MODELOPT_NVFP4

    @property
    def tensors_per_expert_matrix(self) -> int:
        """weight; + weight_scale and weight_scale_2 when packed; + input_scale for W4A4."""
        return 1 + 2 * self.quantized + self.has_input_scales


@dataclass
class LoadedClef:
    model: torch.nn.Module  # schema.ClefModel, eval, on device
    processor: Any
    schema: types.ModuleType  # the joint_schema_model module in use
    kind: CheckpointFormat
    expert_kernels: str  # "triton" or "unpack" for packed experts, "bf16" for stock BF16 experts
    model_id: str  # what --model said
    checkpoint_dir: Path
    load_s: float
    notice: str | None  # e.g. the synthetic warning


SYNTHETIC_NOTICE = "synthetic checkpoint: random weights, every answer is meaningless (for testing the server only)"
SYNTHETIC_MARKER = "synthetic_release.json"  # synthetic_release.py writes it into every release; exports copy it
# Nothing is calibrated in a synthetic checkpoint, so every expert input gets the input_scale that max calibration
# gives activations whose absolute max is 6: 6 / (6 * 448).
SYNTHETIC_INPUT_SCALE = 6.0 / (6 * 448)
SERVED_QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4")  # ModelOpt's quant_algo of the CheckpointFormats
WARM_UP_REQUEST = {"model": "warm-up", "state": "warm up", "questions": {"ready": {"type": "noul"}}}

# The two on-disk name layouts of the thinker's tensors (docs/nvfp4-format.md §3.4), as (hub layout,
# transformers-internal) prefixes.
THINKER_NAME_LAYOUTS = (
    ("model.layers.", "model.language_model.layers."),
    ("model.embed_tokens.", "model.language_model.embed_tokens."),
    ("model.norm.", "model.language_model.norm."),
    ("visual.", "model.visual."),
    ("audio_tower.", "model.audio_tower."),
)
# One tensor of one expert as every export writes it (per expert, per projection; docs/nvfp4-format.md §3.1).
EXPERT_TENSOR = re.compile(
    r"(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)"
    r"\.(?P<field>weight|weight_scale|weight_scale_2|input_scale)"
)


def is_talker_tensor(name: str) -> bool:
    # Clef only runs the thinker: the speech talker and code2wav of an Omni checkpoint are never read.
    return name.startswith(("talker.", "code2wav."))


def resolve_checkpoint_dir(model_id: str, revision: str | None) -> Path:
    path = Path(model_id).expanduser()
    if path.is_dir():
        return path
    if model_id.startswith(("/", "./", "../", "~")) or path.exists():  # meant as a local path, not a hub id
        problem = "is a file, not a model directory" if path.exists() else "does not exist"
        raise CheckpointError(f"--model {model_id}: {problem}; pass the directory that holds config.json and the "
                              "safetensors shards")
    try:
        return Path(huggingface_hub.snapshot_download(model_id, revision=revision))
    except Exception as error:
        raise CheckpointError(
            f"--model {model_id}: not a local directory and the hub download failed ({type(error).__name__}); "
            f"download it where the hub is reachable (hf download {model_id} --local-dir DIR) and "
            "pass --model DIR"
        ) from error


def checkpoint_kind(checkpoint_dir: Path) -> CheckpointFormat:
    for required in ("config.json", "joint_head_config.json", "joint_head.safetensors"):
        if not (checkpoint_dir / required).exists():
            raise CheckpointError(
                f"{checkpoint_dir} has no {required}: not a Clef-Omni model directory (a ModelOpt export needs the "
                "release's joint_head*, tokenizer and processor files copied beside it)"
            )
    quant_config_path = checkpoint_dir / "hf_quant_config.json"
    if not quant_config_path.exists():
        quantization = json.loads((checkpoint_dir / "config.json").read_text()).get("quantization_config")
        if quantization is not None:
            raise CheckpointError(
                f"{checkpoint_dir}: config.json has a {quantization.get('quant_method')!r} quantization_config but no "
                "hf_quant_config.json; serve_clef serves BF16 releases and ModelOpt NVFP4 / W4A16_NVFP4 exports"
            )
        return CheckpointFormat.BF16
    quantization = json.loads(quant_config_path.read_text())["quantization"]
    if quantization.get("quant_algo") not in SERVED_QUANT_ALGOS or quantization.get("group_size", 16) != 16:
        raise CheckpointError(
            f"{quant_config_path}: quant_algo {quantization.get('quant_algo')!r}, group_size "
            f"{quantization.get('group_size')} is not served; export the thinker experts with ModelOpt as NVFP4 or "
            "W4A16_NVFP4 (group size 16)"
        )
    return CheckpointFormat("modelopt:" + quantization["quant_algo"])


def resolve_expert_kernels(choice: str, device: torch.device) -> str:
    """What --expert-kernels means on `device`: "triton" or "unpack" (see PackedNVFP4Experts)."""
    if choice == "native":
        raise CheckpointError(
            "--expert-kernels native (FP4 tensor cores, compute capability 10.x/12.x) is not built yet: serve_clef has "
            "had no Blackwell GPU to test it on; use --expert-kernels triton, which runs on any CUDA GPU"
        )
    if choice == "auto":
        return "triton" if device.type == "cuda" else "unpack"
    if choice == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise CheckpointError(
            "--expert-kernels triton on CPU runs only under Triton's interpreter (slow, for tests): set "
            "TRITON_INTERPRET=1, or use --expert-kernels unpack"
        )
    return choice


def import_sibling(name: str, needed_for: str) -> types.ModuleType:
    """serve_clef's own joint_schema_model or synthetic_release, which serve_clef.py alone does without."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        raise CheckpointError(f"{needed_for} needs serve_clef's {name}.py, which is not beside serve_clef.py; copy "
                              f"{SIBLING_FILES}") from None


def import_joint_schema_model(checkpoint_dir: Path, progress: Callable[[str], None]) -> types.ModuleType:
    """The checkpoint's own decision module when it carries one (as releases do), else serve_clef's."""
    path = checkpoint_dir / "joint_schema_model.py"
    if not path.exists():
        module = import_sibling("joint_schema_model", f"{checkpoint_dir}, which carries no joint_schema_model.py,")
        progress(f"decision code: serve_clef's joint_schema_model.py ({checkpoint_dir} carries none)")
        return module
    spec = importlib.util.spec_from_file_location("_checkpoint_joint_schema_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules while the file executes
    spec.loader.exec_module(module)
    progress(f"decision code: the checkpoint's own {path}")
    return module


def load_processor(checkpoint_dir: Path, schema: types.ModuleType):
    """The release's processor, through the decision module's own `load_processor` where it has one (serve_clef's
    also builds one on machines without torchvision), else transformers' AutoProcessor."""
    if hasattr(schema, "load_processor"):
        processor = schema.load_processor(checkpoint_dir)
    else:
        processor = transformers.AutoProcessor.from_pretrained(checkpoint_dir)
    # A state is tokenised whole, then cut to --max-length by encode_record, so the tokenizer's own limit (65,536 in
    # the release's tokenizer_config.json) would only warn, misleadingly, of "indexing errors" on every long state.
    processor.tokenizer.model_max_length = transformers.tokenization_utils_base.VERY_LARGE_INTEGER
    return processor


def checkpoint_tensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every thinker tensor of a safetensors checkpoint as (name on disk, tensor on CPU), one shard at a time."""
    index_path = checkpoint_dir / "model.safetensors.index.json"
    if index_path.exists():
        shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    for shard in shards:
        if not (checkpoint_dir / shard).exists():
            raise CheckpointError(f"{checkpoint_dir}: shard {shard} is missing; download the whole model directory")
        with safetensors.safe_open(checkpoint_dir / shard, framework="pt") as tensors:
            for name in tensors.keys():
                if not is_talker_tensor(name):
                    yield name, tensors.get_tensor(name)


def build_backbone(config: transformers.PretrainedConfig, device: torch.device, zero_width_experts: bool):
    """Talker-less Qwen3-Omni with random BF16 weights on `device`, to be filled by `load_thinker_weights`."""
    config.enable_audio_output = False
    text_config = config.thinker_config.text_config
    for sub_config in (config, config.thinker_config, text_config):
        if "quantization_config" in sub_config.__dict__:
            del sub_config.quantization_config  # transformers has no "modelopt" quantizer (docs/nvfp4-format.md §8.5)
    expert_width = text_config.moe_intermediate_size
    if zero_width_experts:
        # Packed modules replace every experts module right after: build them zero-wide so the BF16 experts
        # (58 GB at full size) are never allocated.
        text_config.moe_intermediate_size = 0
    with torch.device(device):
        backbone = transformers.Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    text_config.moe_intermediate_size = expert_width
    backbone.config.thinker_config.text_config.moe_intermediate_size = expert_width  # in case _from_config copied
    return backbone.eval()


def experts_modules(thinker: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in thinker.named_modules() if name.endswith(".mlp.experts")}


def thinker_tensor_name(checkpoint_name: str, live_names: set[str], experts_names: set[str]) -> str | None:
    """The live thinker name of a checkpoint tensor in either layout (docs/nvfp4-format.md §3.4), or None when nothing
    matches."""
    name = checkpoint_name.removeprefix("thinker.")
    candidates = [name]
    for hub_prefix, internal_prefix in THINKER_NAME_LAYOUTS:
        if name.startswith(hub_prefix):
            candidates.append(internal_prefix + name.removeprefix(hub_prefix))
        if name.startswith(internal_prefix):
            candidates.append(hub_prefix + name.removeprefix(internal_prefix))
    for candidate in candidates:
        expert_match = EXPERT_TENSOR.fullmatch(candidate)
        if candidate in live_names or (expert_match is not None and expert_match["experts"] in experts_names):
            return candidate
    return None


@torch.no_grad()
def load_thinker_weights(
    thinker: torch.nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    kind: CheckpointFormat,
    expert_stores: dict[str, "PackedNVFP4Experts"],
    progress: Callable[[str], None],
) -> None:
    """Fill the thinker from a stream of (checkpoint name, tensor) in any on-disk layout.

    Experts go to `expert_stores` (NVFP4 kinds: packed, as on disk) or into the stock fused BF16 parameters (bf16
    kind). Fails naming any checkpoint tensor that maps to nothing and any parameter or expert tensor left unfilled.
    """
    experts = experts_modules(thinker)
    targets = {
        name: tensor
        for name, tensor in thinker.state_dict(keep_vars=True).items()
        if not name.startswith(tuple(experts_name + "." for experts_name in experts))
    }
    live_names, experts_names = set(targets), set(experts)
    filled, bf16_experts_filled = set(), set()
    expert_tensors_per_layer = {name: 0 for name in experts}
    fields_per_expert = 3 * kind.tensors_per_expert_matrix
    num_experts = thinker.config.text_config.num_experts
    tensor_count, byte_count, layers_done, start = 0, 0, 0, time.perf_counter()
    for checkpoint_name, tensor in tensors:
        if is_talker_tensor(checkpoint_name):
            continue
        name = thinker_tensor_name(checkpoint_name, live_names, experts_names)
        if name is None:
            raise CheckpointError(
                f"checkpoint tensor {checkpoint_name} maps to no parameter of the Qwen3-Omni thinker of transformers "
                f"{transformers.__version__} (in neither the hub nor the transformers-internal name layout); is this "
                "a Clef-Omni checkpoint, with only the experts quantized?"
            )
        expert_match = EXPERT_TENSOR.fullmatch(name)
        if expert_match is None:
            if tuple(tensor.shape) != tuple(targets[name].shape) or not tensor.dtype.is_floating_point:
                raise CheckpointError(
                    f"checkpoint tensor {checkpoint_name}: {tensor.dtype} {list(tensor.shape)}, the thinker expects "
                    f"a floating point {list(targets[name].shape)}; only the experts may be quantized"
                )
            targets[name].copy_(tensor)
            filled.add(name)
        else:
            experts_name, expert = expert_match["experts"], int(expert_match["expert"])
            projection, field = expert_match["projection"], expert_match["field"]
            if expert >= num_experts:
                raise CheckpointError(f"checkpoint tensor {checkpoint_name}: the model has only {num_experts} experts")
            if not kind.quantized:
                store_bf16_expert(experts[experts_name], expert, projection, field, tensor, checkpoint_name)
                bf16_experts_filled.add((experts_name, expert, projection))
            else:
                expert_stores[experts_name].store(expert, projection, field, tensor, checkpoint_name)
            expert_tensors_per_layer[experts_name] += 1
            if expert_tensors_per_layer[experts_name] == num_experts * fields_per_expert:
                layers_done += 1
                progress(
                    f"experts of {layers_done}/{len(experts)} layers loaded "
                    f"({tensor_count + 1} tensors, {(byte_count + tensor.nbytes) / 2**30:.2f} GiB read)"
                )
        tensor_count += 1
        byte_count += tensor.nbytes

    missing = sorted(set(targets) - filled)
    if not kind.quantized:
        missing += [
            f"{experts_name}.{expert}.{projection}.weight"
            for experts_name in experts
            for expert in range(num_experts)
            for projection in ("gate_proj", "up_proj", "down_proj")
            if (experts_name, expert, projection) not in bf16_experts_filled
        ]
    else:
        for experts_name, store in expert_stores.items():
            missing += store.missing_tensors(experts_name)
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} thinker tensors, first {missing[:3]} (transformers-internal names); "
            "the download or export is incomplete"
        )
    load_s = time.perf_counter() - start
    progress(f"thinker loaded: {tensor_count} tensors, {byte_count / 2**30:.2f} GiB in {load_s:.1f} s")


def store_bf16_expert(
    experts: torch.nn.Module, expert: int, projection: str, field: str, weight: torch.Tensor, checkpoint_name: str
) -> None:
    """Copy one per-expert BF16 matrix into transformers' fused [E, 2I, H] / [E, H, I] parameters
    (docs/nvfp4-format.md §3.1)."""
    expert_width = experts.gate_up_proj.shape[1] // 2
    if projection == "down_proj":
        target = experts.down_proj[expert]  # [H, I]
    else:
        rows = slice(0, expert_width) if projection == "gate_proj" else slice(expert_width, 2 * expert_width)
        target = experts.gate_up_proj[expert, rows]  # [I, H]
    if field != "weight" or not weight.dtype.is_floating_point or weight.shape != target.shape:
        raise CheckpointError(
            f"checkpoint tensor {checkpoint_name}: {weight.dtype} {list(weight.shape)} in a checkpoint without "
            f"hf_quant_config.json, expected a BF16 {list(target.shape)} weight; a ModelOpt export needs its "
            "hf_quant_config.json"
        )
    target.copy_(weight)


def quantize_nvfp4(weight: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize a [O, K] weight exactly as ModelOpt's exporter does (docs/nvfp4-format.md §2.2), given its
    weight_scale_2.

    Returns packed_codes uint8 [O, K/2] (element 2i in the low nibble) and block_scales float8_e4m3fn [O, K/16].
    """
    rows, columns = weight.shape
    blocks = weight.float().view(rows, columns // 16, 16)  # [O, K/16, 16]
    block_scales = blocks.abs().amax(dim=-1) / (6 * global_scale)  # [O, K/16]
    block_scales = torch.where(block_scales == 0, 1.0, block_scales)
    block_scales = block_scales.clamp(min=2**-9, max=448).to(torch.float8_e4m3fn)
    scaled = blocks / (block_scales.float() * global_scale).unsqueeze(-1)  # [O, K/16, 16]
    magnitude_codes = round_to_e2m1_codes(scaled.abs())  # [O, K/16, 16] 0..7
    codes = ((scaled < 0).to(torch.uint8) << 3) | magnitude_codes  # [O, K/16, 16]
    codes = codes.view(rows, columns)
    packed_codes = (codes[:, 1::2] << 4) | codes[:, 0::2]  # [O, K/2]
    return packed_codes, block_scales


def quantize_experts_to_nvfp4(
    tensors: Iterable[tuple[str, torch.Tensor]], input_scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """A BF16 tensor stream turned into a ModelOpt NVFP4 (W4A4) export's: every expert matrix becomes weight,
    weight_scale, weight_scale_2 and input_scale as ModelOpt writes them, everything else passes through.

    Gate and up of one expert share one weight_scale_2 computed from both (ModelOpt calibrates the fused gate_up
    tensor, docs/nvfp4-format.md §3.2), so a gate waits here for its up (and the other way round); nothing else is held
    back.
    """
    waiting_for_partner = {}  # "<experts>.<E>" -> {projection: BF16 weight}
    for name, tensor in tensors:
        expert_match = EXPERT_TENSOR.fullmatch(name)
        if expert_match is None:
            yield name, tensor
            continue
        expert_prefix = f"{expert_match['experts']}.{expert_match['expert']}"
        if expert_match["projection"] == "down_proj":
            group = {"down_proj": tensor}
        else:
            group = waiting_for_partner.setdefault(expert_prefix, {})
            group[expert_match["projection"]] = tensor
            if len(group) < 2:
                continue
            del waiting_for_partner[expert_prefix]
        global_scale = torch.stack([weight.abs().amax() for weight in group.values()]).amax().float() / (6 * 448)
        for projection, weight in sorted(group.items()):
            packed_codes, block_scales = quantize_nvfp4(weight, global_scale)
            yield f"{expert_prefix}.{projection}.weight", packed_codes
            yield f"{expert_prefix}.{projection}.weight_scale", block_scales
            yield f"{expert_prefix}.{projection}.weight_scale_2", global_scale.clone()
            yield f"{expert_prefix}.{projection}.input_scale", torch.tensor(input_scale, device=weight.device)
    if waiting_for_partner:
        raise CheckpointError(f"BF16 experts without their gate/up partner: {sorted(waiting_for_partner)[:3]}")


def write_modelopt_metadata(checkpoint_dir: Path) -> None:
    """hf_quant_config.json and config.json's quantization_config of an NVFP4 (W4A4) export, as ModelOpt's exporter
    writes them for the thinker experts (docs/nvfp4-format.md §1)."""
    exclude_modules = [
        "thinker.audio_tower*",
        "thinker.lm_head",
        "thinker.model.embed_tokens",
        "thinker.model.layers.*.mlp.gate",
        "thinker.model.layers.*.self_attn*",
        "thinker.visual*",
    ]
    producer = {"name": "modelopt", "version": "0.47.0"}
    quantization = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16}
    hf_quant_config = {"producer": producer, "quantization": quantization | {"exclude_modules": exclude_modules}}
    (checkpoint_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=4))
    nvfp4 = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    config = json.loads((checkpoint_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "producer": producer,
        "config_groups": {"group_0": {"weights": nvfp4, "input_activations": nvfp4, "targets": ["Linear"]}},
        "ignore": exclude_modules,
    }
    (checkpoint_dir / "config.json").write_text(json.dumps(config, indent=2))


def synthetic_checkpoint(model_id: str, device: torch.device, progress: Callable[[str], None]):
    """The checkpoint dir (ModelOpt NVFP4 layout) of a synthetic model and, for synthetic:full, its tensor stream.

    `synthetic`: synthetic_release.py's tiny BF16 release, its experts quantized and written as a ModelOpt export,
    then loaded from disk like any other. `synthetic:full`: the full-size release without weights on disk; its
    tensors are generated on `device` one at a time and quantized on the way into the packed store.
    """
    synthetic_release = import_sibling("synthetic_release", f"--model {model_id}")
    out_dir = Path(tempfile.mkdtemp(prefix="serve_clef-synthetic-"))
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)  # a synthetic checkpoint lives as long as its process
    if model_id == "synthetic:full":
        checkpoint_dir = synthetic_release.write_release(out_dir / "nvfp4", "full", weights=False)
        write_modelopt_metadata(checkpoint_dir)
        config = transformers.AutoConfig.from_pretrained(checkpoint_dir)
        text_config = config.thinker_config.text_config
        expert_parameters = (text_config.num_hidden_layers * text_config.num_experts * 3 * text_config.hidden_size
                             * text_config.moe_intermediate_size)
        if device.type != "cuda" and expert_parameters > 1e9:  # refused before a single weight is generated
            raise CheckpointError(f"--model synthetic:full generates {expert_parameters / 1e9:.0f} B expert parameters "
                                  "in GPU memory and needs a CUDA GPU; on CPU use --model synthetic (the tiny one)")
        bf16_tensors = synthetic_release.release_tensors(config, device=device)
        tensors = quantize_experts_to_nvfp4(bf16_tensors, SYNTHETIC_INPUT_SCALE)
        return checkpoint_dir, tensors
    release_dir = synthetic_release.write_release(out_dir / "bf16", "tiny")
    checkpoint_dir = out_dir / "nvfp4"
    checkpoint_dir.mkdir()
    for path in release_dir.iterdir():
        if path.is_file() and not (path.name.startswith("model-") or path.name == "model.safetensors.index.json"):
            shutil.copy(path, checkpoint_dir / path.name)
    tensors = dict(quantize_experts_to_nvfp4(checkpoint_tensors(release_dir), SYNTHETIC_INPUT_SCALE))
    shard = "model-00001-of-00001.safetensors"
    safetensors.torch.save_file(tensors, checkpoint_dir / shard, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(tensor.nbytes for tensor in tensors.values())},
        "weight_map": {name: shard for name in tensors},
    }
    (checkpoint_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_modelopt_metadata(checkpoint_dir)
    progress(f"synthetic tiny NVFP4 checkpoint written to {checkpoint_dir}")
    return checkpoint_dir, None


def load_clef(
    model: str = DEFAULT_MODEL,
    *,
    device: str | torch.device | None = None,
    revision: str | None = None,
    expert_kernels: str = "auto",
    simulate_fp4_activations: bool = False,
    packed_nvfp4: bool = True,
    progress: Callable[[str], None] = print,
) -> LoadedClef:
    """Load a Clef-Omni checkpoint for `decide`: the Python API behind the command line's flags.

    model: a hub id, a local model directory, "synthetic" or "synthetic:full" (--model). device: a torch device,
    default cuda when available, else cpu (--device). revision: the hub revision (--revision). expert_kernels:
    "auto", "triton", "unpack" or "native" (--expert-kernels). simulate_fp4_activations: faithful W4A4 replay
    (--simulate-fp4-activations). packed_nvfp4: False unpacks NVFP4 experts to BF16 at load (--no-packed-nvfp4).
    progress: receives one line per loading step. Raises CheckpointError with a one-line fix.
    """
    start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"--device {device}: this machine has no CUDA GPU that torch can use (torch "
                              f"{torch.__version__}); run with --device cpu, or install a CUDA build of torch")
    notice, tensors = None, None
    if model in SYNTHETIC_MODELS:
        notice = SYNTHETIC_NOTICE
        progress(f"{model}: {notice}")
        checkpoint_dir, tensors = synthetic_checkpoint(model, device, progress)
    else:
        checkpoint_dir = resolve_checkpoint_dir(model, revision)
        if (checkpoint_dir / SYNTHETIC_MARKER).exists():
            notice = SYNTHETIC_NOTICE
            progress(f"{checkpoint_dir}: {notice}")
    kind = checkpoint_kind(checkpoint_dir)
    if simulate_fp4_activations and not kind.has_input_scales:
        raise CheckpointError(
            f"--simulate-fp4-activations replays W4A4 activations and needs a ModelOpt NVFP4 (W4A4) export with "
            f"input scales; {checkpoint_dir} is {kind}: drop the flag"
        )
    if simulate_fp4_activations and not packed_nvfp4:
        raise CheckpointError("--simulate-fp4-activations runs inside the packed experts: drop --no-packed-nvfp4")
    packed = kind.quantized and packed_nvfp4
    expert_kernels = resolve_expert_kernels(expert_kernels, device) if packed else "bf16"
    schema = import_joint_schema_model(checkpoint_dir, progress)

    config = transformers.AutoConfig.from_pretrained(checkpoint_dir)
    text_config = config.thinker_config.text_config
    experts_form = f"packed NVFP4 experts, {expert_kernels} kernels" if packed else "BF16 experts"
    progress(f"loading {kind} checkpoint {checkpoint_dir} onto {device} ({experts_form})")
    if expert_kernels == "triton" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10:
        progress("this GPU has FP4 tensor cores, but serve_clef's native FP4 path is not built yet: the experts run "
                 "W4A16 (or the W4A4 replay) through the Triton kernels")
    if expert_kernels == "triton" and text_config.hidden_act != "silu":
        raise CheckpointError(f"--expert-kernels triton fuses SiLU; this model's experts use {text_config.hidden_act}: "
                              "use --expert-kernels unpack")
    thinker = build_backbone(config, device, zero_width_experts=packed).thinker
    expert_stores = {}
    if kind.quantized:
        with torch.device(device):
            expert_stores = {
                name: PackedNVFP4Experts(text_config, experts.act_fn, has_input_scales=kind.has_input_scales)
                for name, experts in experts_modules(thinker).items()
            }
    if packed:
        for experts_name, store in expert_stores.items():
            parent_name, _, attribute = experts_name.rpartition(".")
            setattr(thinker.get_submodule(parent_name), attribute, store)
    if tensors is None:
        tensors = checkpoint_tensors(checkpoint_dir)
    load_thinker_weights(thinker, tensors, kind, expert_stores, progress)
    if kind.quantized and not packed:
        for experts_name, store in expert_stores.items():
            store.unpack_into(thinker.get_submodule(experts_name))
    del expert_stores  # --no-packed-nvfp4: the packed copies are no longer needed
    for experts in experts_modules(thinker).values():
        if isinstance(experts, PackedNVFP4Experts):
            experts.simulate_fp4_activations = simulate_fp4_activations
            experts.kernels = expert_kernels

    head_config = json.loads((checkpoint_dir / "joint_head_config.json").read_text())
    if head_config["hidden_size"] != text_config.hidden_size:
        raise CheckpointError(
            f"{checkpoint_dir}/joint_head_config.json: hidden_size {head_config['hidden_size']} differs from the "
            f"thinker's text hidden size {text_config.hidden_size}; the joint head belongs to another model"
        )
    head = schema.JointSchemaHead(**head_config)
    try:
        head.load_state_dict(safetensors.torch.load_file(checkpoint_dir / "joint_head.safetensors"), strict=True)
    except RuntimeError as error:
        problem = " ".join(str(error).split())[:300]
        raise CheckpointError(
            f"{checkpoint_dir}/joint_head.safetensors does not fit joint_head_config.json ({problem}); copy both "
            "files from the same release"
        ) from error
    head.to(device=device, dtype=torch.bfloat16)
    clef_model = schema.ClefModel(thinker, head).eval()
    processor = load_processor(checkpoint_dir, schema)
    if device.type == "cuda":
        # The first decision on a GPU sets up its libraries (seconds) and compiles the packed-expert kernels: do it
        # now, not in the first request.
        # cuDNN's fused attention builds a plan per new sequence length (~150 ms each on an H200); flash attention
        # needs none, and the captured graphs run it.
        torch.backends.cuda.enable_cudnn_sdp(False)
        graphed_decoder = graph_text_decoder(thinker)
        progress("warming up: one decision" + (" and compiling the packed-expert kernels" if packed else ""))
        schema.systemone(clef_model, processor, WARM_UP_REQUEST)
        if expert_kernels == "triton":
            packed_layer = next(m for m in clef_model.modules() if isinstance(m, PackedNVFP4Experts))
            packed_layer.compile_kernels()
        graphed_decoder.capture_graphs(like=thinker.get_input_embeddings().weight, progress=progress)
    load_s = time.perf_counter() - start
    progress(f"Clef model ready ({kind}) in {load_s:.1f} s")
    return LoadedClef(clef_model, processor, schema, kind, expert_kernels, model, checkpoint_dir, load_s, notice)


def load_from_args(args: argparse.Namespace, progress: Callable[[str], None] = print) -> LoadedClef:
    """load_clef with the command line's flags (see parse_args)."""
    return load_clef(
        args.model, device=args.device, revision=args.revision, expert_kernels=args.expert_kernels,
        simulate_fp4_activations=args.simulate_fp4_activations, packed_nvfp4=not args.no_packed_nvfp4,
        progress=progress,
    )


# ==== engine: the text decoder in CUDA graphs =========================================================================
# A decision is one prefill of a few hundred to a few thousand tokens: launched op by op it is bound by the host
# (5,559 kernel launches for ~42 ms of GPU work at 516 tokens on an H200). So the thinker's text decoder runs from CUDA
# graphs captured at load, one per bucket of lengths: a record's embeddings and positions are copied into the
# bucket's static inputs, padded at the end, the graph is replayed and the real rows of its output are copied out.
# Causal attention and per-token MoE routing mean padding at the end cannot reach a real token's output. The vision
# and audio towers and the embedding merge stay eager; records whose decoder input carries deepstack image features,
# and records longer than the largest bucket, run the decoder eagerly.

# Steps of 64 tokens up to 1,024, then 128 up to 2,048 and 256 up to 4,096: a record pays at most ~12% padding past
# 512 tokens (coarser buckets, up to 50%, measured 66 ms at 516 tokens and 203 ms at 2,050 on an H200).
DECODER_BUCKETS = (*range(64, 1024 + 1, 64), *range(1152, 2048 + 1, 128), *range(2304, 4096 + 1, 256))  # tokens


class GraphedTextDecoder(torch.nn.Module):
    """Stands in for the thinker's text decoder (transformers' Qwen3OmniMoeThinkerTextModel), with its forward
    signature. Forwards of one record of at most DECODER_BUCKETS[-1] tokens run padded to the next bucket: from the
    bucket's CUDA graph once `capture_graphs` has run, else eagerly on the padded inputs (how CPU tests check the
    padding). Everything else is handed to the eager decoder as it came."""

    def __init__(self, decoder: torch.nn.Module, buckets: tuple[int, ...] = DECODER_BUCKETS):
        super().__init__()
        self.decoder = decoder
        self.buckets = buckets
        self.position_rows = None  # 3 or 4 rows of rotary positions, as the thinker of this transformers builds them
        self.graphs = {}  # bucket -> (CUDAGraph, inputs_embeds [1, L, H], position_ids [P, 1, L], hidden [1, L, H])

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # the thinker reads the decoder's own attributes (embed_tokens, config, ...)
            decoder = self.__dict__["_modules"].get("decoder")
            if decoder is None:
                raise
            return getattr(decoder, name)

    def forward(self, *args, **kwargs):
        inputs_embeds, position_ids = kwargs.get("inputs_embeds"), kwargs.get("position_ids")
        if args or inputs_embeds is None or position_ids is None or position_ids.ndim != 3:
            return self.decoder(*args, **kwargs)
        self.position_rows = position_ids.shape[0]
        batch, length, _ = inputs_embeds.shape  # [B, T, H]
        attention_mask = kwargs.get("attention_mask")
        bucket = next((bucket for bucket in self.buckets if bucket >= length), None)
        if (
            batch != 1
            or bucket is None
            or kwargs.get("deepstack_visual_embeds") is not None
            or kwargs.get("use_cache")
            or (attention_mask is not None and not bool(attention_mask.all()))
        ):
            return self.decoder(*args, **kwargs)
        if bucket in self.graphs:
            graph, static_embeds, static_positions, static_hidden = self.graphs[bucket]
        else:
            static_embeds, static_positions = self.static_inputs(bucket, inputs_embeds)
        static_embeds[:, :length].copy_(inputs_embeds)
        static_embeds[:, length:].zero_()
        static_positions[..., :length].copy_(position_ids)
        static_positions[..., length:].zero_()
        if bucket in self.graphs:
            graph.replay()
        else:
            static_hidden = self.run_padded(static_embeds, static_positions)
        return transformers.modeling_outputs.MoeModelOutputWithPast(
            last_hidden_state=static_hidden[:, :length].clone()  # [1, T, H]; the next replay overwrites the graph's
        )

    def static_inputs(self, bucket: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs_embeds = torch.zeros(1, bucket, like.shape[-1], dtype=like.dtype, device=like.device)  # [1, L, H]
        position_ids = torch.zeros(self.position_rows, 1, bucket, dtype=torch.long, device=like.device)  # [P, 1, L]
        return inputs_embeds, position_ids

    def run_padded(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # No mask: causal attention is all a single unpadded record needs, and it is what flash attention runs.
        return self.decoder(inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False).last_hidden_state

    @torch.inference_mode()
    def capture_graphs(self, like: torch.Tensor, progress: Callable[[str], None]) -> None:
        """Capture one graph per bucket, largest first, all in one memory pool (they never run at the same time).
        Needs `position_rows`, known after one decision has gone through the decoder (load's warm-up)."""
        if self.position_rows is None:
            progress("the thinker passed the text decoder no rotary positions: it stays eager (no CUDA graphs)")
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            static_embeds, static_positions = self.static_inputs(bucket, like)
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):  # a first run outside the graph sets up kernels and workspaces
                self.run_padded(static_embeds, static_positions)
            torch.cuda.current_stream().wait_stream(side_stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                static_hidden = self.run_padded(static_embeds, static_positions)
            self.graphs[bucket] = (graph, static_embeds, static_positions, static_hidden)
        progress(f"text decoder captured in CUDA graphs for {len(self.buckets)} lengths up to {self.buckets[-1]} "
                 f"tokens in {time.perf_counter() - start:.1f} s")


def graph_text_decoder(thinker: torch.nn.Module) -> GraphedTextDecoder:
    """Put a GraphedTextDecoder in place of the thinker's text decoder (found by class, as transformers versions nest
    it differently) and return it."""
    name = next(name for name, module in thinker.named_modules()
                if type(module).__name__ == "Qwen3OmniMoeThinkerTextModel")
    parent_name, _, attribute = name.rpartition(".")
    parent = thinker.get_submodule(parent_name) if parent_name else thinker
    graphed = GraphedTextDecoder(getattr(parent, attribute))
    setattr(parent, attribute, graphed)
    return graphed


# ==== decisions =======================================================================================================
# A request is checked field by field (docs/api.md §2) before anything is decoded; then its media are decoded and
# measured; then the release's own `systemone()` scores it. Decisions run one at a time, on one thread (the server's
# scoring thread): the device does one decision at a time, and the fast tokenizer is not thread safe.

MiB = 1024 * 1024
MAX_QUESTIONS = 64
MAX_CHOICE_OPTIONS = 255
MIN_SCORE_LEVELS, MAX_SCORE_LEVELS = 2, 10
# field: (max items, accepted content types, max decoded bytes per item)
MEDIA_LIMITS = {
    "images": (4, ("image/png", "image/jpeg", "image/jpg", "image/webp"), 4 * MiB),
    "audio": (4, ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/mpeg", "audio/mp3"), 8 * MiB),
    "videos": (2, ("video/mp4", "video/webm"), 16 * MiB),
}
MAX_IMAGE_BYTES_TOTAL = 8 * MiB
MAX_AUDIO_VIDEO_BYTES_TOTAL = 16 * MiB
MAX_IMAGE_PIXELS = 16_000_000
MAX_AUDIO_SECONDS = 300
MAX_VIDEO_SECONDS = 60
MEDIA_DATA_URL = re.compile(r"^data:(?P<content_type>[\w.+-]+/[\w.+-]+);base64,(?P<data>.*)$", re.DOTALL)
INLINE_MEDIA = "send it inline as a data URL (data:<type>;base64,<data>) or as {\"content_type\": ..., \"base64\": ...}"


class RequestError(Exception):
    """A refused request: HTTP status, the path of the offending field (FastAPI style), a message and an error type."""

    def __init__(self, status: int, loc: tuple, message: str, error_type: str = "value_error"):
        super().__init__(message)
        self.status = status
        self.loc = loc
        self.message = message
        self.error_type = error_type


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _is_description(value: Any) -> bool:
    """Instructions and option descriptions are text or JSON: a string, an object, an array or null."""
    return value is None or isinstance(value, (str, dict, list))


def _invalid(loc: tuple, message: str, error_type: str = "value_error") -> RequestError:
    return RequestError(422, ("body", *loc), message, error_type)


def _validate_question(question_id: str, question: Any) -> None:
    loc = ("questions", question_id)
    if question_id == "":
        raise _invalid(loc, "question ids must be non-empty strings")
    if not isinstance(question, dict):
        raise _invalid(loc, f"{question_id}: a question must be an object with a type, not {json_type(question)}")
    question_type = question.get("type")
    if question_type not in ("noul", "choice", "score"):
        raise _invalid((*loc, "type"), f"{question_id}: type must be noul, choice, or score")
    if not _is_description(question.get("instructions")):
        raise _invalid(
            (*loc, "instructions"),
            f"{question_id}: instructions must be a string, an object, an array or null, "
            f"not {json_type(question['instructions'])}",
        )
    criteria = question.get("criteria")
    loc = (*loc, "criteria")
    if question_type == "noul":
        if criteria is not None and not isinstance(criteria, dict):
            raise _invalid(loc, f"{question_id}: noul criteria must be an object with keys \"true\" and/or \"false\"")
        descriptions = {key: value for key, value in (criteria or {}).items() if key in ("true", "false")}
    elif question_type == "choice":
        if criteria is None:
            raise _invalid(loc, f"{question_id}: a choice needs at least two options; criteria is missing", "missing")
        if not isinstance(criteria, dict):
            raise _invalid(
                loc, f"{question_id}: choice criteria must be an object mapping option id to description, "
                f"not {json_type(criteria)}"
            )
        if len(criteria) < 2:
            raise _invalid(loc, f"{question_id}: a choice needs at least two options; got {len(criteria)}")
        if len(criteria) > MAX_CHOICE_OPTIONS:
            raise _invalid(
                loc, f"{question_id}: {len(criteria)} options given; at most {MAX_CHOICE_OPTIONS} options per choice"
            )
        descriptions = criteria
    else:
        if criteria is None:
            raise _invalid(loc, f"{question_id}: a score takes 2 to 10 levels; criteria is missing", "missing")
        if not isinstance(criteria, list):
            raise _invalid(
                loc, f"{question_id}: score criteria must be an array of level descriptions, lowest first, "
                f"not {json_type(criteria)}"
            )
        if not MIN_SCORE_LEVELS <= len(criteria) <= MAX_SCORE_LEVELS:
            raise _invalid(loc, f"{question_id}: a score takes 2 to 10 levels; got {len(criteria)}")
        descriptions = dict(enumerate(criteria))
    for option_id, description in descriptions.items():
        if not _is_description(description):
            raise _invalid(
                (*loc, option_id),
                f"{question_id}: the description of option {option_id} must be a string, an object, an array or "
                f"null, not {json_type(description)}",
            )


def _media_item(field_name: str, index: int, item: Any) -> tuple[str, str]:
    """(content type, base64 text) of one media item, refusing anything that is not inline data."""
    loc, name = (field_name, index), f"{field_name}[{index}]"
    if isinstance(item, dict):
        content_type, data = item.get("content_type"), item.get("base64")
        if not isinstance(content_type, str) or not isinstance(data, str):
            raise _invalid(loc, f"{name}: a media object needs the string fields content_type and base64")
    elif isinstance(item, str):
        match = MEDIA_DATA_URL.match(item)
        if match is None:
            if "://" in item[:16]:
                raise _invalid(loc, f"{name} is a remote URL: the server never fetches URLs; {INLINE_MEDIA}")
            if item.startswith("data:"):
                raise _invalid(loc, f"{name} is not a base64 data URL; {INLINE_MEDIA}")
            raise _invalid(loc, f"{name} looks like a file path: the server never reads files; {INLINE_MEDIA}")
        content_type, data = match["content_type"], match["data"]
    else:
        raise _invalid(loc, f"{name} must be a data URL or a {{content_type, base64}} object, not {json_type(item)}")
    accepted = MEDIA_LIMITS[field_name][1]
    content_type = content_type.strip().lower()
    if content_type not in accepted:
        raise _invalid(loc, f"{name} has content type {content_type!r}; {field_name} accept {', '.join(accepted)}")
    return content_type, data


def validate_request(request: Any) -> tuple[dict, bool]:
    """Check a SystemOne request field by field, decoding nothing; return (the record for systemone, truncate).

    The record keeps only the fields systemone reads (unknown fields are ignored, `media_kwargs` is refused), and its
    media items become (content type, base64 text) pairs for `decode_media`.
    """
    if not isinstance(request, dict):
        raise RequestError(422, ("body",), f"the body must be a JSON object, not {json_type(request)}", "dict_type")
    for name in ("model", "state", "questions"):
        if name not in request:
            raise _invalid((name,), f"{name} is required", "missing")
    if not isinstance(request["model"], str) or not request["model"]:
        raise _invalid(("model",), f"model must be a non-empty string, not {json_type(request['model'])}")
    if not isinstance(request["state"], (str, dict, list)):
        raise _invalid(("state",), f"state must be a string, an object or an array, not {json_type(request['state'])}")
    questions = request["questions"]
    if not isinstance(questions, dict):
        raise _invalid(("questions",), f"questions must be an object mapping question id to question, "
                       f"not {json_type(questions)}")
    if not 1 <= len(questions) <= MAX_QUESTIONS:
        raise _invalid(("questions",), f"questions holds 1 to {MAX_QUESTIONS} entries; got {len(questions)}")
    for question_id, question in questions.items():
        _validate_question(question_id, question)
    truncate = request.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _invalid(("truncate",), f"truncate must be true or false, not {json_type(truncate)}")
    if "media_kwargs" in request:
        raise _invalid(("media_kwargs",), "media_kwargs is not accepted over the network: the server sets the "
                       "processor options itself; remove the field")

    record = {name: request[name] for name in ("id", "model", "state", "questions") if name in request}
    for field_name, (max_items, _, _) in MEDIA_LIMITS.items():
        items = request.get(field_name)
        if items is None:
            continue
        if not isinstance(items, list):
            raise _invalid((field_name,), f"{field_name} must be an array, not {json_type(items)}")
        if len(items) > max_items:
            raise _invalid((field_name,), f"{field_name} holds at most {max_items} items; got {len(items)}")
        record[field_name] = [_media_item(field_name, index, item) for index, item in enumerate(items)]
    return record, truncate


def _decode_base64(text: str, loc: tuple) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except binascii.Error as error:
        raise _invalid(loc, f"{loc[0]}[{loc[1]}] is not valid base64: {error}") from None


def _decode_image(data: bytes, loc: tuple) -> PIL.Image.Image:
    """The decoded image: PNG, JPEG or WebP of at most 16 megapixels (checked before the pixels are decoded)."""
    name = f"{loc[0]}[{loc[1]}]"
    try:
        image = PIL.Image.open(io.BytesIO(data))
        if image.format not in ("PNG", "JPEG", "WEBP"):
            raise _invalid(loc, f"{name} is {image.format}; images must be PNG, JPEG or WebP")
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise _invalid(loc, f"{name} has {width}x{height} pixels; at most 16 megapixels per image")
        image.load()
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as error:
        raise _invalid(loc, f"{name} could not be decoded as an image: {error}") from None
    return image


def _decode_audio_clip(data: bytes, loc: tuple, schema: types.ModuleType) -> np.ndarray:
    """16 kHz mono samples of a WAV or MP3 clip of at most 300 s, measured on the decoded samples."""
    name = f"{loc[0]}[{loc[1]}]"
    try:
        with av.open(io.BytesIO(data)) as container:
            container_format = container.format.name
        if container_format not in ("wav", "mp3"):
            raise _invalid(loc, f"{name} is {container_format}; audio must be WAV or MP3")
        samples = schema.load_audio(data)
    except (av.FFmpegError, ValueError) as error:
        raise _invalid(loc, f"{name} could not be decoded as audio: {error}") from None
    seconds = len(samples) / schema.AUDIO_SAMPLE_RATE
    if seconds > MAX_AUDIO_SECONDS:
        raise _invalid(loc, f"{name} lasts {seconds:.1f} s; at most {MAX_AUDIO_SECONDS} s per clip")
    return samples


def _check_video(data: bytes, loc: tuple) -> None:
    """Refuse a video that is not MP4 or WebM, has no decodable frame, or lasts over 60 s by its decoded frames."""
    name = f"{loc[0]}[{loc[1]}]"
    try:
        with av.open(io.BytesIO(data)) as container:
            container_formats = container.format.name.split(",")
            if "mp4" not in container_formats and "webm" not in container_formats:
                raise _invalid(loc, f"{name} is {container.format.name}; videos must be MP4 or WebM")
            if not container.streams.video:
                raise _invalid(loc, f"{name} has no video stream")
            decoded_frames = 0
            for frame in container.decode(video=0):
                decoded_frames += 1
                if frame.time is not None and frame.time > MAX_VIDEO_SECONDS:
                    raise _invalid(loc, f"{name} lasts over {MAX_VIDEO_SECONDS} s; at most {MAX_VIDEO_SECONDS} s each")
    except (av.FFmpegError, ValueError) as error:
        raise _invalid(loc, f"{name} could not be decoded as a video: {error}") from None
    if decoded_frames == 0:
        raise _invalid(loc, f"{name} has no decodable frames")


def decode_media(record: dict, schema: types.ModuleType) -> dict:
    """The record with its media decoded and measured against the limits of docs/api.md §2.4.

    Every size is checked before any medium is decoded. Images become PIL images and audio clips 16 kHz samples,
    which systemone takes as they are; videos stay bytes, checked here, because systemone reads their soundtrack
    from the container.
    """
    data = {}  # field -> decoded base64 bytes of each item
    for field_name, (_, _, max_item_bytes) in MEDIA_LIMITS.items():
        data[field_name] = [_decode_base64(text, (field_name, index)) for index, (_, text) in
                            enumerate(record.get(field_name, []))]
        for index, item in enumerate(data[field_name]):
            if len(item) > max_item_bytes:
                raise _invalid((field_name, index), f"{field_name}[{index}] is {len(item) / MiB:.1f} MiB decoded; "
                               f"at most {max_item_bytes // MiB} MiB each")
    image_bytes = sum(len(item) for item in data["images"])
    if image_bytes > MAX_IMAGE_BYTES_TOTAL:
        raise _invalid(("images",), f"images total {image_bytes / MiB:.1f} MiB decoded; at most "
                       f"{MAX_IMAGE_BYTES_TOTAL // MiB} MiB per request")
    audio_video_bytes = sum(len(item) for item in data["audio"] + data["videos"])
    if audio_video_bytes > MAX_AUDIO_VIDEO_BYTES_TOTAL:
        raise _invalid(("audio",), f"audio and videos total {audio_video_bytes / MiB:.1f} MiB decoded; at most "
                       f"{MAX_AUDIO_VIDEO_BYTES_TOTAL // MiB} MiB per request")

    decoded = dict(record)
    if data["images"]:
        decoded["images"] = [_decode_image(item, ("images", index)) for index, item in enumerate(data["images"])]
    if data["audio"]:
        decoded["audio"] = [_decode_audio_clip(item, ("audio", index), schema) for index, item in
                            enumerate(data["audio"])]
    if data["videos"]:
        for index, item in enumerate(data["videos"]):
            _check_video(item, ("videos", index))
        decoded["videos"] = data["videos"]
    return decoded


def encode(loaded: LoadedClef, record: dict, max_length: int, truncate: bool):
    """(the record encoded by the decision module's own encode_record, how many state tokens were cut to fit), or a
    RequestError: 413 when it cannot fit `max_length` tokens (truncate false: at all; truncate true: not even with
    its state cut), 422 for other refusals. Only a record cut to fit is encoded a second time, to count the cut."""
    schema, processor = loaded.schema, loaded.processor

    def encode_within(limit: int):
        return schema.encode_record(processor.tokenizer, record, limit, processor=processor)

    try:
        encoded = encode_within(max_length if truncate else sys.maxsize)
    except (av.FFmpegError, ValueError) as error:
        refusal = error
    else:
        needed = len(encoded.input_ids)
        if needed < max_length:
            return encoded, 0
        if needed == max_length:  # encode_record cuts the state to exactly max_length: count what was cut
            return encoded, (len(encode_within(sys.maxsize).input_ids) - max_length if truncate else 0)
        raise RequestError(413, ("body", "state"), f"maximum context length: the request needs {needed} tokens and "
                           f"truncate is false; maximum is {max_length}", "context_too_long")
    # encode_record refuses a record whose questions and media leave no room for the state; tell that apart from
    # other refusals by measuring the record without a limit rather than by reading the message.
    try:
        needed = len(encode_within(sys.maxsize).input_ids)
    except (av.FFmpegError, ValueError):
        needed = 0
    if needed > max_length:
        raise RequestError(413, ("body",), f"maximum context length: the questions and media alone need more than "
                           f"{max_length} tokens ({refusal})", "context_too_long") from None
    raise _invalid((), str(refusal)) from None


@torch.inference_mode()
def score(loaded: LoadedClef, encoded) -> list:
    """The joint head's option logits of one encoded record, per question, from one forward of the model."""
    device = next(loaded.model.parameters()).device
    batch = loaded.schema.collate_records([encoded], loaded.processor.tokenizer.pad_token_id, device)
    return loaded.model(batch)[0]


def decide(
    loaded: LoadedClef, request: Any, max_length: int = DEFAULT_MAX_LENGTH, timings: dict[str, float] | None = None
) -> dict:
    """Answer one SystemOne request (docs/decision-api.md), or raise RequestError saying why it is refused.

    The server's own walk, which the decision module's `systemone()` does in one call: validate, decode each medium,
    encode once, one forward, then the module's own answer code. `timings`, when given, receives the seconds each
    stage took (decode, encode, forward, answer). Not thread safe: call it from one thread at a time (the HTTP server
    calls it on its scoring thread only).
    """
    started = time.perf_counter()
    stage_started = started
    timings = {} if timings is None else timings

    def stage_done(stage: str) -> None:
        nonlocal stage_started
        now = time.perf_counter()
        timings[stage] = now - stage_started
        stage_started = now

    record, truncate = validate_request(request)
    record = decode_media(record, loaded.schema)
    stage_done("decode")
    encoded, state_tokens_dropped = encode(loaded, record, max_length, truncate)
    stage_done("encode")
    try:
        logits = score(loaded, encoded)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the forward's GPU work counts as forward, not as the answers that read it
    except torch.OutOfMemoryError:
        logits = None  # memory is freed below, once the exception (and the frames it holds) is gone
    except ValueError as error:  # what the decision module refuses while batching (e.g. mixed video soundtracks)
        raise _invalid((), str(error)) from None
    stage_done("forward")
    if logits is None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise RequestError(413, ("body",), "too many tokens: the device ran out of memory scoring this request; send "
                           "a shorter state or fewer or smaller media", "too_many_tokens")
    answers = {}
    for (question_id, question), encoded_question, question_logits in zip(
        record["questions"].items(), encoded.questions, logits
    ):
        probabilities = dict(zip(encoded_question.option_ids, question_logits.float().softmax(-1).tolist()))
        answers[question_id] = loaded.schema.systemone_answer(question, probabilities)
        if "legend" in answers[question_id]:  # the SystemOne clients refuse null legend values: a level's own index
            legend = answers[question_id]["legend"]
            answers[question_id]["legend"] = {level: level if text is None else text for level, text in legend.items()}
    stage_done("answer")
    usage = {"input_tokens": len(encoded.input_ids), "output_tokens": 0}
    if state_tokens_dropped:  # the state was cut to fit the context (truncate: true, the default)
        usage["state_tokens_dropped"] = state_tokens_dropped
    usage["latency_ms"] = round((time.perf_counter() - started) * 1000, 1)
    return {"model": record["model"], "answers": answers, "usage": usage}


# ==== HTTP ============================================================================================================
# FastAPI app over `decide`: the port opens at once and the model loads on the scoring thread; until it is ready the
# decision and health endpoints answer 503. Every error body has the shapes of docs/api.md §6.1.

MAX_BODY_BYTES = 13 * MiB
RETRY_AFTER_S = 10
SERVED_NAME = "clef-omni"
CLEF_OMNI_RELEASED = 1791504000  # 2026-10-09 00:00 UTC, the Cloudflare/clef-omni release date, as a unix time
ERROR_CATEGORY = {401: "authentication_error", 500: "server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, error_type: str, loc: tuple = ("body",)) -> dict:
    """422: FastAPI's `detail` list beside the SystemOne `error`; other statuses: TypeSafe's `detail` object instead."""
    if status == 422:
        param = ".".join(str(part) for part in loc[1:]) or None
        return {
            "detail": [{"loc": list(loc), "msg": message, "type": error_type}],
            "error": {"message": message, "type": "invalid_request_error", "param": param},
        }
    return {
        "detail": {"error_type": error_type, "message": message},
        "error": {"message": message, "type": ERROR_CATEGORY.get(status, "invalid_request_error")},
    }


def error_response(error: RequestError, **fields: Any) -> JSONResponse:
    """The JSON response for a refusal, with `fields` placed before the error keys."""
    headers = {}
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if error.error_type == "model_loading":
        headers["Retry-After"] = str(RETRY_AFTER_S)
    body = {**fields, **error_body(error.status, error.message, error.error_type, error.loc)}
    return JSONResponse(body, error.status, headers)


class ServingMetrics:
    """The Prometheus metrics of one app, served at GET /metrics. Each app has its own registry, so that several
    apps (tests) can live in one process."""

    def __init__(self):
        self.registry = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "serve_clef_requests", "Decision requests answered, by HTTP status.", ["status"], registry=self.registry
        )
        self.request_seconds = prometheus_client.Histogram(
            "serve_clef_request_seconds", "Decision request latency in the server, body read to answer.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry,
        )
        self.batch_records = prometheus_client.Histogram(
            "serve_clef_batch_records", "Records per model forward.", buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.tokens = prometheus_client.Counter(
            "serve_clef_tokens", "Input tokens of the decisions answered.", registry=self.registry
        )
        self.queue_depth = prometheus_client.Gauge(
            "serve_clef_queue_depth", "Jobs waiting for the scoring thread.", registry=self.registry
        )


class ClefService:
    """What the endpoints share: the model once loaded (or why loading failed), the thread that uses the device, and
    the metrics."""

    def __init__(self, args: argparse.Namespace, load: Callable[..., LoadedClef]):
        self.args = args
        self.load = load
        self.loaded: LoadedClef | None = None
        self.load_error: str | None = None
        self.metrics = ServingMetrics()
        # Loading and every decision run on one long-lived thread: the device does one decision at a time anyway, and
        # a fresh thread pays CUDA's per-thread set-up (library handles) again on its first decision. A daemon thread,
        # so that stopping the server during a long load does not wait for the load to finish.
        self.scorer_jobs = queue.SimpleQueue()
        threading.Thread(target=self.score_forever, name="serve_clef-scorer", daemon=True).start()

    def on_scorer(self, function: Callable, *args: Any) -> concurrent.futures.Future:
        """Run function(*args) on the scoring thread, after the jobs queued before it."""
        future = concurrent.futures.Future()
        self.metrics.queue_depth.inc()
        self.scorer_jobs.put((future, function, args))
        return future

    def score_forever(self) -> None:
        while True:
            future, function, args = self.scorer_jobs.get()
            self.metrics.queue_depth.dec()
            if not future.set_running_or_notify_cancel():
                continue  # its client went away while it waited
            try:
                future.set_result(function(*args))
            except BaseException as error:  # handed to the request that is waiting for it
                future.set_exception(error)

    def load_in_background(self) -> None:
        try:
            self.loaded = self.load(self.args, progress=console)
        except Exception as error:  # whatever went wrong is reported by /healthz; the server keeps answering
            self.load_error = f"the model failed to load: {error}"
            if not isinstance(error, CheckpointError):
                traceback.print_exc()
            console(f"serve_clef: {self.load_error}")

    def ready(self) -> LoadedClef:
        """The loaded model, or a 503 saying it is still loading or failed to load."""
        if self.loaded is not None:
            return self.loaded
        if self.load_error is not None:
            raise RequestError(503, ("body",), self.load_error, "load_failed")
        raise RequestError(503, ("body",), "model loading", "model_loading")

    def check_api_key(self, request: Request) -> None:
        if not self.args.api_key:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.args.api_key.encode()):
            raise RequestError(401, ("header", "authorization"), "a valid API key is required: send "
                               "Authorization: Bearer <key>", "authentication_error")


CONTENT_ENCODINGS = ("identity", "gzip", "deflate", "zstd")  # what the SystemOne clients send (zstd, gzip by default)


def decompress_body(body: bytes, encoding: str) -> bytes:
    """The body decoded from its Content-Encoding, never more than MAX_BODY_BYTES: a small compressed body that
    expands past the limit (a decompression bomb) gets 413 after at most MAX_BODY_BYTES + 1 bytes of output."""
    loc = ("header", "content-encoding")
    too_large = RequestError(413, ("body",), f"the body decompresses to over {MAX_BODY_BYTES // MiB} MiB",
                             "request_too_large")

    def corrupt(error: Exception) -> RequestError:
        return RequestError(400, loc, f"the body is not valid {encoding} data: {error}", "invalid_encoding")

    if encoding == "zstd":
        try:
            import zstandard  # only zstd bodies need it
        except ImportError:
            raise RequestError(415, loc, "zstd bodies need the zstandard package on the server; send gzip or an "
                               "uncompressed body", "unsupported_media_type") from None
        decoded = b""
        try:
            with zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True) as reader:
                while len(decoded) <= MAX_BODY_BYTES and (chunk := reader.read(MAX_BODY_BYTES + 1 - len(decoded))):
                    decoded += chunk
        except zstandard.ZstdError as error:
            raise corrupt(error) from None
    else:
        window = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}[encoding]
        if encoding == "deflate" and body[:1] and body[0] & 0x0F != 8:
            window = -zlib.MAX_WBITS  # raw deflate, without the zlib header some clients leave out
        try:
            decoded = zlib.decompressobj(window).decompress(body, MAX_BODY_BYTES + 1)
        except zlib.error as error:
            raise corrupt(error) from None
    if len(decoded) > MAX_BODY_BYTES:
        raise too_large
    return decoded


async def read_json_body(request: Request) -> Any:
    """The parsed body: 415 if not JSON or in an unknown Content-Encoding, 413 over 13 MiB (declared, streamed or
    decompressed), 422 if it does not parse, 400 for values nothing can represent."""
    media_type = request.headers.get("content-type", "application/json").partition(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise RequestError(415, ("header", "content-type"), f"the body must be application/json, not {media_type}",
                           "unsupported_media_type")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in CONTENT_ENCODINGS:
        raise RequestError(415, ("header", "content-encoding"), f"Content-Encoding {encoding!r} is not accepted; send "
                           f"one of {', '.join(CONTENT_ENCODINGS)}", "unsupported_media_type")
    too_large = RequestError(413, ("body",), f"the body is over {MAX_BODY_BYTES // MiB} MiB", "request_too_large")
    declared_length = request.headers.get("content-length", "")
    if declared_length.isdigit() and int(declared_length) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    if encoding != "identity":
        body = decompress_body(bytes(body), encoding)

    def refuse_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    try:
        parsed = json.loads(body, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        # FastAPI's shape for a body that does not parse: 422, json_invalid, located at the character where it broke
        position = getattr(error, "pos", getattr(error, "start", None))
        loc = ("body",) if position is None else ("body", position)
        raise RequestError(422, loc, f"the body is not valid JSON: {error}", "json_invalid") from None
    refuse_unrepresentable_values(parsed, ("body",))
    return parsed


def refuse_unrepresentable_values(value: Any, loc: tuple) -> None:
    """400 for a value JSON parses but nothing downstream can represent: a number that overflowed to infinity (1e999)
    or text with a lone UTF-16 surrogate (an unpaired \\ud800 escape), keys included; the message names the field,
    its own surrogates written as escapes. Walked with a stack, not recursion: a body nested as deep as the JSON
    parser allows must not exhaust Python's recursion limit here."""
    pending = [(value, loc)]
    while pending:
        value, loc = pending.pop()
        problem = None
        if isinstance(value, float) and not math.isfinite(value):
            problem = "a number too large for a 64-bit float"
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                problem = "text with a lone UTF-16 surrogate is not valid Unicode; send paired surrogates or the text"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):  # reversed: the first offending field is reported first
                pending += [(item, (*loc, key)), (key, (*loc, key))]
        elif isinstance(value, list):
            pending += [(item, (*loc, index)) for index, item in reversed(list(enumerate(value)))]
        if problem is not None:
            path = ".".join(str(part).encode("utf-8", "backslashreplace").decode() for part in loc[1:])
            raise RequestError(400, ("body",), f"{path or 'the body'}: {problem}", "invalid_json")


def create_app(args: argparse.Namespace, load: Callable[..., LoadedClef] | None = None) -> FastAPI:
    """The HTTP app; its startup begins loading the model with `load(args, progress)` (default `load_from_args`) on
    the scoring thread."""
    service = ClefService(args, load or load_from_args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.on_scorer(service.load_in_background)  # the thread that loads (and warms up) is the one that scores
        yield

    app = FastAPI(title="serve_clef", lifespan=lifespan)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        detail = [{"loc": list(item["loc"]), "msg": item["msg"], "type": item["type"]} for item in error.errors()]
        body = error_body(422, detail[0]["msg"], detail[0]["type"], tuple(detail[0]["loc"]))
        return JSONResponse({"detail": detail, "error": body["error"]}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        error_type = http.HTTPStatus(error.status_code).phrase.lower().replace(" ", "_")
        response = error_response(RequestError(error.status_code, ("body",), str(error.detail), error_type))
        response.headers.update(error.headers or {})  # 405's Allow, for one
        return response

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        # A fault of the server: the details go to the console under the request id, the client gets the id only,
        # and the connection is closed, since the handler that failed may have left it mid-stream.
        request_id = getattr(request.state, "request_id", uuid.uuid4().hex[:16])
        console(f"request {request_id}: internal error\n{traceback.format_exc()}")
        response = error_response(RequestError(500, ("body",), f"internal error; the server's log has its details "
                                               f"under request id {request_id}", "internal_error"))
        response.headers.update({"Connection": "close", "X-Request-Id": request_id})
        return response

    @app.middleware("http")
    async def observe_decisions(request: Request, call_next: Callable) -> Response:
        """Every decision request, answered or refused: a request id, the metrics, one console line."""
        if request.url.path != "/v1/systemone":
            return await call_next(request)
        request.state.request_id = uuid.uuid4().hex[:16]
        request.state.tokens = 0
        started = time.perf_counter()
        status = 500  # unless a response comes back: an unhandled error
        try:
            response = await call_next(request)
            status = response.status_code
            response.headers["X-Request-Id"] = request.state.request_id
            return response
        finally:
            seconds = time.perf_counter() - started
            service.metrics.requests.labels(status=str(status)).inc()
            service.metrics.request_seconds.observe(seconds)
            console(f"request {request.state.request_id} {status} {request.state.tokens} tokens "
                    f"{seconds * 1000:.1f} ms")

    @app.post("/v1/systemone")
    async def systemone(request: Request) -> JSONResponse:
        service.check_api_key(request)
        loaded = service.ready()
        payload = await read_json_body(request)
        timings = {}
        enqueued = time.perf_counter()

        def decide_when_its_turn_comes() -> dict:
            timings["queue"] = time.perf_counter() - enqueued
            return decide(loaded, payload, args.max_length, timings)

        # Off the event loop: media decoding and scoring block, and other requests keep being read meanwhile.
        response = await asyncio.wrap_future(service.on_scorer(decide_when_its_turn_comes))
        request.state.tokens = response["usage"]["input_tokens"]
        service.metrics.tokens.inc(request.state.tokens)
        service.metrics.batch_records.observe(1)  # one record per forward until the scheduler batches them
        server_timing = ", ".join(f"{stage};dur={timings[stage] * 1000:.1f}"
                                  for stage in ("queue", "decode", "encode", "forward", "answer"))
        headers = {"Server-Timing": server_timing}
        if "state_tokens_dropped" in response["usage"]:
            headers["X-State-Tokens-Dropped"] = str(response["usage"]["state_tokens_dropped"])
        return JSONResponse(response, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus_client.generate_latest(service.metrics.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        service.check_api_key(request)
        names = [SERVED_NAME] + ([args.model] if args.model != SERVED_NAME else [])
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": CLEF_OMNI_RELEASED, "owned_by": "cloudflare"}
                     for name in names],
            "models": [{"name": name, "description": f"Clef-Omni decisions, served from {args.model}",
                        "release_date": "2026-10-09"} for name in names],
        }

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> JSONResponse:
        try:
            loaded = service.ready()
        except RequestError as error:
            return error_response(error, ready=False, model_id=args.model)
        return JSONResponse({"ready": True, "model_id": loaded.model_id, "kind": loaded.kind,
                             "expert_kernels": loaded.expert_kernels, "load_s": round(loaded.load_s, 3),
                             "notice": loaded.notice})

    @app.get("/livez")
    async def livez() -> dict:
        return {"live": True}

    return app


def console(line: str) -> None:
    """Progress and notices go to stderr, so that --demo and --request print nothing but JSON on stdout."""
    print(line, file=sys.stderr, flush=True)


# ==== command line: running ===========================================================================================

DEMO_REQUEST = {
    "model": SERVED_NAME,
    "state": {
        "ticket": "My order #1042 arrived with a cracked screen and I was charged twice. I need this fixed today.",
        "customer": {"plan": "pro", "orders": 12, "previous_complaints": 1},
    },
    "questions": {
        "urgent": {"type": "noul", "instructions": "Does the customer need an answer today?"},
        "team": {
            "type": "choice",
            "instructions": "Which team should handle the ticket?",
            "criteria": {"billing": "charges and refunds", "shipping": "damaged or lost parcels", "technical": None},
        },
        "frustration": {
            "type": "score",
            "instructions": "How frustrated is the customer?",
            "criteria": ["calm", "annoyed", "angry"],
        },
    },
}


def answer_once(args: argparse.Namespace) -> int:
    """--demo / --request FILE: load the model, answer one request, print the response JSON."""
    request = DEMO_REQUEST
    if args.request:
        try:
            request = json.loads(Path(args.request).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            console(f"serve_clef: cannot read the request file {args.request}: {error}")
            return 2
    try:
        validate_request(request)  # a malformed request is refused before the model is loaded for nothing
        loaded = load_from_args(args, progress=console)  # prints the synthetic notice, if any
        if args.demo:  # the answer means little without the question: show it, on stderr so stdout stays JSON
            console("the built-in request:\n" + json.dumps(request, indent=2, ensure_ascii=False))
        response = decide(loaded, request, args.max_length)
    except CheckpointError as error:
        console(f"serve_clef: {error}")
        return 2
    except RequestError as error:
        where = ".".join(str(part) for part in error.loc[1:])
        console(f"serve_clef: the request is refused with HTTP {error.status}{f' at {where}' if where else ''}: "
                f"{error.message}")
        return 2
    print(json.dumps(response, indent=2, ensure_ascii=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.demo or args.request:
        return answer_once(args)
    uvicorn.run(create_app(args), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
