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
#   "av>=17",  # VideoFrame.to_ndarray(threads=...)
#   "fastapi",
#   "uvicorn",
#   "requests",
#   "prometheus-client",
#   "zstandard",
#   "python-multipart",
# ]
# ///
"""serve_clef: serve Clef-Omni decisions from an NVFP4 (ModelOpt) checkpoint on one GPU.

Sections, top to bottom, in the order data flows: the command line's flags (parsed before the heavy imports, so that
--help answers at once), packed experts (the NVFP4 format, the activation replay, the Triton packed-expert kernels,
their Gluon counterparts for Hopper GPUs, FP4 tensor cores through torch's grouped matmul, the experts module),
checkpoint loading, the engine (the text decoder in CUDA graphs), decisions (requests), HTTP, running the command line.
Dimension letters in shape comments: T tokens, E experts, H hidden, I expert width, K experts per token (top-k),
S (token, expert) pairs, P padded slots, R/N/C the rows, output columns and reduced columns of a kernel tile.
"""

import argparse
import asyncio
import atexit
import base64
import concurrent.futures
import contextlib
import copy
import dataclasses
import enum
import fnmatch
import functools
import gc
import hmac
import html
import http
import importlib.util
import inspect
import io
import itertools
import json
import math
import os
import queue
import re
import shutil
import signal
import socket
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
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple


# ==== command line: the flags =========================================================================================
# Defined and parsed before the heavy imports below (torch, transformers and triton take ~7 s), so that --help and a
# mistyped flag answer at once; running the command line is the last section.

DEFAULT_MODEL = "dbirks/clef-omni-nvfp4"
DEFAULT_MAX_LENGTH = 64_000  # tokens, the decision API's default context (joint_schema_model.DEFAULT_MAX_LENGTH)
EXPERT_KERNELS = ("auto", "gluon", "triton", "unpack", "native")
DEFAULT_MAX_BATCH_TOKENS = 8192  # tokens per forward: the largest CUDA-graph bucket (DECODER_BUCKETS)
DEFAULT_MAX_QUEUE = 256
DEFAULT_REQUEST_TIMEOUT_S = 60.0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):  # NaN fails the first test
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1 to 65535)")
    return value


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
    parser.add_argument("--port", type=port_number, default=8000, help="Port to listen on. Default: 8000.")
    parser.add_argument("--demo", action="store_true",
                        help="Answer one built-in request: print the request (stderr) and the answer (stdout), exit.")
    parser.add_argument("--request", type=Path, metavar="FILE", help="Answer the JSON request in FILE, print, exit.")
    parser.add_argument(
        "--simulate-fp4-activations",
        action="store_true",
        help="W4A4 (NVFP4) checkpoints only: round every quantized layer's input to NVFP4 as it was calibrated, "
        "reproducing Blackwell W4A4 numerics on any device (without it, experts run W4A16: FP4 weights, BF16 inputs).",
    )
    parser.add_argument(
        "--no-packed-nvfp4",
        action="store_true",
        help="Unpack all NVFP4 experts to BF16 at load and run stock transformers experts (~4x the expert memory).",
    )
    parser.add_argument(
        "--repair-nan-scales",
        action="store_true",
        help="Load NaN block-scale bytes (0x7F/0xFF, written by ModelOpt before 0.45 where a block's scale overflowed) "
        "as 448, the largest e4m3 value, and report how many blocks changed; without it such checkpoints are refused.",
    )
    parser.add_argument(
        "--expert-kernels",
        choices=EXPERT_KERNELS,
        default="auto",
        help="How packed NVFP4 experts compute. native: FP4 tensor cores (compute capability 10.x and later), W4A4 "
        "with each expert input quantized with its calibrated scale, through torch's grouped scaled matmul, checked "
        "against the unpack path at load; gluon: Hopper kernels (compute capability 9.0) that read the packed weights "
        "directly; triton: kernels that read the packed weights directly on any CUDA GPU (on CPU only under "
        "TRITON_INTERPRET=1, slowly, for tests); unpack: each layer unpacked to BF16 just before a grouped GEMM (the "
        "reference). Default auto: native on FP4 tensor cores with a W4A4 export (triton where its check at load "
        "fails), gluon on a Hopper GPU, triton on other CUDA GPUs, unpack on CPU.",
    )
    parser.add_argument(
        "--max-length",
        type=positive_int,
        default=DEFAULT_MAX_LENGTH,
        help=f"Context limit in tokens per decision. Default: {DEFAULT_MAX_LENGTH}.",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="Most tokens the server scores in one forward, over the records of concurrent requests (a longer "
        f"request runs alone). Default: {DEFAULT_MAX_BATCH_TOKENS}.",
    )
    parser.add_argument(
        "--max-queue",
        type=positive_int,
        default=DEFAULT_MAX_QUEUE,
        help=f"Most requests waiting or being scored; more get 503 with Retry-After. Default: {DEFAULT_MAX_QUEUE}.",
    )
    parser.add_argument(
        "--request-timeout",
        type=positive_seconds,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="Seconds a request may wait to be scored before it gets 503 with Retry-After. "
        f"Default: {DEFAULT_REQUEST_TIMEOUT_S:g}.",
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
import h11
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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import (BaseModel, ConfigDict, Field, PlainValidator, ValidationInfo, WithJsonSchema, create_model,
                      model_validator)
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import vision_utils
from transformers.integrations.moe import grouped_mm_experts_forward
from typing_extensions import TypeAliasType
from uvicorn.protocols.http.h11_impl import H11Protocol

# torch.compile (below) imports torch._inductor, which still builds torch.utils.mkldnn's modules with the deprecated
# torch.jit.script_method: torch's own deprecation, nothing a user of serve_clef can act on.
warnings.filterwarnings("ignore", r"`torch\.jit\.script_method` is deprecated", DeprecationWarning, r"torch\.jit\.")


# ==== the NVFP4 format: codes, scales, checks =========================================================================

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
    global_scale fp32 [E], or [E, G] for G equal groups of rows with their own scale (gate rows, then up rows)
    -> BF16 [E, O, K]. Plain elementwise torch, so torch.compile fuses it into one kernel.
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
    row_groups = global_scale.view(num_experts, -1, 1, 1)  # [E, G, 1, 1]
    per_block = block_scales.float().view(num_experts, row_groups.shape[1], -1, block_scales.shape[-1]) * row_groups
    per_block = per_block.view(block_scales.shape)  # [E, O, K/16]
    weight = values.view(num_experts, rows, -1, 16) * per_block.unsqueeze(-1)  # [E, O, K/16, 16]
    return weight.view(num_experts, rows, 2 * half_columns).to(torch.bfloat16)


# On CUDA the eager unpack takes ~8 passes over a layer's experts; compiled it is one kernel reading the packed bytes
# once (bandwidth floor ~0.4 ms per full-size layer on an H200). CPU keeps the eager version.
unpack_nvfp4_compiled = torch.compile(unpack_nvfp4, fullgraph=True, dynamic=False)


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


E4M3_MAX_BYTE = 0x7E  # 448, the largest finite float8_e4m3fn value


def checked_nvfp4_tensor(
    field: str, tensor: torch.Tensor, out_features: int, in_features: int, checkpoint_name: str,
    repair_nan_scales: bool,
) -> tuple[torch.Tensor, int]:
    """One tensor of an NVFP4 linear [out_features, in_features] in ModelOpt's convention (docs/nvfp4-format.md §2),
    checked as it arrives: the tensor to keep (a scale as a 0-d tensor; NaN block scales set to 448 when
    `repair_nan_scales`) and how many blocks were repaired."""

    def fail(problem: str) -> None:
        raise CheckpointError(f"checkpoint tensor {checkpoint_name}: {problem}")

    if field == "weight":
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != (out_features, in_features // 2):
            fail(f"{tensor.dtype} {list(tensor.shape)}, expected packed uint8 {[out_features, in_features // 2]}")
        return tensor, 0
    if field == "weight_scale":
        if tensor.dtype != torch.float8_e4m3fn or tuple(tensor.shape) != (out_features, in_features // 16):
            fail(f"{tensor.dtype} {list(tensor.shape)}, expected float8_e4m3fn {[out_features, in_features // 16]}")
        nan_blocks = (tensor.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn: S.1111.111 is NaN
        repaired = int(nan_blocks.sum())
        if repaired and not repair_nan_scales:
            fail(
                f"{repaired} NaN block scales (bytes 0x7F/0xFF), which ModelOpt before 0.45 wrote where a block's "
                "scale overflowed: re-export with nvidia-modelopt>=0.45, or pass --repair-nan-scales to load them as "
                "448 (the largest e4m3 value)"
            )
        if repaired:
            tensor = tensor.view(torch.uint8).masked_fill(nan_blocks, E4M3_MAX_BYTE).view(torch.float8_e4m3fn)
        return tensor, repaired
    if tensor.dtype != torch.float32 or tensor.numel() != 1:
        fail(f"{tensor.dtype} {list(tensor.shape)}, expected a float32 scalar")
    value = tensor.reshape(())
    if not torch.isfinite(value) or value <= 0:
        fail(f"scale {value.item()} must be finite and positive")
    return value, 0


# ==== activation replay (faithful W4A4) ===============================================================================

def nvfp4_activation_blocks(activations: torch.Tensor, input_scale: torch.Tensor):
    """Activations [..., K] quantized to NVFP4 as ModelOpt's W4A4 fake-quant does (docs/nvfp4-format.md §2.3):
    signed E2M1 codes uint8 [..., K/16, 16] (bit 3 the sign), the e4m3 block scales [..., K/16, 1] and the fp32 scale
    each block's codes are multiplied by [..., K/16, 1], which is e4m3 block scale * input_scale.

    Static per-tensor `input_scale` (the calibrated global scale: 0-d, or [..., 1, 1] for one per row of a [..., K]
    input), dynamic e4m3 scales per 16 values along K, E2M1 magnitudes rounded to nearest with ties to even.
    Operation order follows ModelOpt's Triton kernel (fp4_fake_quant_block), which multiplies a block by 1 where
    e4m3 scale * input_scale is under 1e-5.
    """
    blocks = activations.float().unflatten(-1, (-1, 16))  # [..., K/16, 16]
    input_scale = torch.where(input_scale > 0, input_scale, 1e-12)
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)  # [..., K/16, 1]
    e4m3_scales = (block_amax / (6.0 * input_scale)).clamp(max=448.0).to(torch.float8_e4m3fn)
    block_scales = e4m3_scales.float() * input_scale
    block_scales = torch.where(block_scales >= 1e-5, block_scales, 1.0)
    codes = round_to_e2m1_codes(blocks.abs() / block_scales) | ((blocks < 0).to(torch.uint8) << 3)
    return codes, e4m3_scales, block_scales


def fake_quant_nvfp4_activations(activations: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Activations [..., K] rounded to NVFP4 (nvfp4_activation_blocks) and back, in their own dtype."""
    codes, _, block_scales = nvfp4_activation_blocks(activations, input_scale)
    e2m1_magnitudes = torch.tensor(E2M1_MAGNITUDES, device=activations.device)
    quantized = e2m1_magnitudes[(codes & 0b111).long()] * block_scales  # [..., K/16, 16]
    quantized = torch.where(codes < 8, quantized, -quantized)
    return quantized.flatten(-2).to(activations.dtype)


# Eager, the replay is a dozen passes over every expert input; compiled, one kernel. Token counts vary per request.
fake_quant_nvfp4_activations_compiled = torch.compile(fake_quant_nvfp4_activations, dynamic=True)


def fake_quant(activations: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """fake_quant_nvfp4_activations, compiled on CUDA."""
    replay = fake_quant_nvfp4_activations_compiled if activations.is_cuda else fake_quant_nvfp4_activations
    return replay(activations, input_scale)


def replay_nvfp4_input_rounding(linear: torch.nn.Module, input_scale: torch.Tensor) -> None:
    """--simulate-fp4-activations on an NVFP4 linear outside the experts (unpacked to BF16 at load): its input is
    rounded as it was calibrated, the static `input_scale` with dynamic per-16 block scales."""
    linear.register_forward_pre_hook(lambda module, args: (fake_quant(args[0], input_scale), *args[1:]))


# ==== packed-expert kernels (Triton) ==================================================================================
# Two grouped GEMMs that read the experts as they sit in memory (uint8 codes, e4m3 block scales) and decode each
# weight tile in registers, so no BF16 copy of a layer's experts is ever written. Routing sorts the (token, expert)
# pairs by expert and pads each expert's run to the row tile, so one launch covers every expert of a layer; nothing
# reads a GPU value on the host, so the layer can be captured in a CUDA graph. S pairs (T tokens x top-k K), P padded
# slots (a multiple of the row tile), R rows of a tile, N output columns of a tile, C the reduced (K-loop) dimension.
#
# Numerics. A weight is e2m1 * block_scale, exact in BF16 (at most 6 significant bits), so the tensor cores see the
# checkpoint's values exactly (decoded times 2**-8, to stay finite in BF16 on the way); the per-expert global scale
# times 2**8 multiplies the fp32 accumulator once. Outputs are rounded to BF16 where transformers' grouped_mm path
# rounds them (gate and up, SiLU, their product, the down projection, the routing product) and the top-k sum runs in
# fp32 in a fixed order, so answers are deterministic.
#
# Triton 3.9's CPU interpreter (TRITON_INTERPRET=1, how CI runs these kernels) truncates fp32 -> bf16 and rounds
# fp32 -> e4m3 differently from the GPU, and computes bf16 dots wrongly. So the kernels round to BF16 and to e4m3
# with plain integer and float arithmetic (round to nearest even, the same on both), and on CPU tensors feed the dots
# fp32 operands (the same exact products the tensor cores form from BF16). The interpreter cannot run PTX either, so
# the weights' decode has two forms that give the same bits: a few PTX instructions per eight weights on the GPU,
# and plain arithmetic on one weight at a time in the interpreter (INTERPRETED).


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
def _e2m1_times_block_scale(codes, block_scales_x2p6):
    """E2M1 codes (0..15) times their block scale (fp32, pre-multiplied by 2**6), times 2**-8: the weights, exactly,
    in BF16, by plain arithmetic (Triton's interpreter).

    The 3 magnitude bits go to fp16's exponent and mantissa and the sign bit to fp16's sign, which reads as
    e2m1 * 2**-14 (0.5 lands on an fp16 subnormal, converted exactly); no table, no branches.
    """
    codes = codes.to(tl.uint16)
    fp16_bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    e2m1_x2m14 = fp16_bits.to(tl.float16, bitcast=True).to(tl.float32)
    return (e2m1_x2m14 * block_scales_x2p6).to(tl.bfloat16)  # exact: no rounding happens here


# The same decode on the GPU, on four code bytes (eight weights) per 32-bit register: two bytes at a time are spread to
# the two halves of a register, and each nibble's 3 magnitude bits go to BF16's lowest exponent bits and top mantissa
# bit and its sign bit to BF16's sign, which reads as e2m1 * 2**-126 (0.5 lands on a BF16 subnormal, multiplied
# exactly). One fused multiply-add per two weights by the block scale times 2**118 (the most that keeps 448 * 2**k
# finite in BF16) leaves e2m1 * block_scale * 2**-8. Here $0 $1: the low nibbles (even columns) of bytes 0-1 and 2-3,
# $2 $3: the high nibbles (odd columns); $4: the four bytes; $5 $6: their scales times 2**118, BF16 pairs.
# Both decodes give e2m1 * block_scale / DECODED_WEIGHT_DIVISOR; the kernels' epilogues multiply it back.
DECODED_WEIGHT_DIVISOR = tl.constexpr(2.0 ** 8)
BLOCK_SCALE_TO_DECODE = tl.constexpr(2.0 ** 126 / DECODED_WEIGHT_DIVISOR)  # the PTX's e2m1 reads as e2m1 * 2**-126


def decode_e2m1_ptx(spreads: tuple[tuple[str, tuple[str, str], tuple[str, str]], ...]) -> str:
    """The decode of the four code bytes in $4: per (byte selector, (low-nibble output, high-nibble output), (their
    scale registers)), two bytes spread to a register's halves and each of their nibbles decoded into a BF16 pair."""
    lines = [".reg .b32 spread, magnitude, sign, negative_zero;", "mov.b32 negative_zero, 0x80008000;"]
    for selector, outputs, scales in spreads:
        lines.append(f"prmt.b32 spread, $4, 0, {selector};")  # bytes 0, 1 (or 2, 3) to bits 0-7 and 16-23
        for output, scale, shift in zip(outputs, scales, (6, 2)):  # the low nibble's bits 0-3, then the high's 4-7
            lines += [f"shl.b32 magnitude, spread, {shift}; and.b32 magnitude, magnitude, 0x01C001C0;",
                      f"shl.b32 sign, spread, {shift + 6}; and.b32 sign, sign, 0x80008000;",
                      "or.b32 magnitude, magnitude, sign;",
                      f"fma.rn.bf16x2 {output}, magnitude, {scale}, negative_zero;"]
    return "{\n" + "\n".join(lines) + "\n}"


DECODE_E2M1_PTX = tl.constexpr(decode_e2m1_ptx((("0x4140", ("$0", "$2"), ("$5", "$5")),
                                                ("0x4342", ("$1", "$3"), ("$6", "$6")))))


@triton.jit
def _decode_packed_weights(codes, block_scales, INTERPRETED: tl.constexpr):
    """Packed codes uint8 [N, C/2] and each byte's block scale (fp32 [N, C/2]) -> the weights of the low nibbles (even
    columns) and of the high nibbles (odd columns), BF16 [N, C/2] each, as e2m1 * block_scale * 2**-8, exactly."""
    if INTERPRETED:
        block_scales = block_scales * (2.0 ** 14 / DECODED_WEIGHT_DIVISOR)  # its e2m1 reads as e2m1 * 2**-14
        return _e2m1_times_block_scale(codes & 0xF, block_scales), _e2m1_times_block_scale(codes >> 4, block_scales)
    block_scales = (block_scales * BLOCK_SCALE_TO_DECODE).to(tl.bfloat16)  # exact
    return tl.inline_asm_elementwise(DECODE_E2M1_PTX, "=r,=r,=r,=r,r,r,r", [codes, block_scales],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


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
def nvfp4_round_activations_kernel(
    activations_ptr, input_scales_ptr, experts_ptr, out_ptr, rows_per_input, columns,
    BLOCK_C: tl.constexpr, PER_EXPERT: tl.constexpr,
):
    """One block of BLOCK_C columns of one output row per program: row `row // rows_per_input` of BF16 activations
    [., columns], rounded to NVFP4 with the static input scale (PER_EXPERT: the scale of expert experts[row], else the
    one at input_scales_ptr). Each 16-value block is rounded on its own, so splitting a row into column blocks changes
    nothing."""
    row = tl.program_id(0).to(tl.int64)
    columns_here = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [1, C]
    x = tl.load(activations_ptr + (row // rows_per_input) * columns + columns_here).to(tl.float32)
    if PER_EXPERT:
        input_scale = tl.load(input_scales_ptr + tl.load(experts_ptr + row))
    else:
        input_scale = tl.load(input_scales_ptr)
    tl.store(out_ptr + row * columns + columns_here, _round_activations_to_nvfp4(x, input_scale, 1, BLOCK_C))


def round_activations_to_nvfp4(
    activations: torch.Tensor, input_scale: torch.Tensor, top_k_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """BF16 activations rounded to NVFP4 by the kernels' helper: the W4A4 replay of an expert input outside the
    packed kernels. input_scale: one (0-d or [1]), or each expert's [E].

    activations [T, H] and no index: once per token with one input scale -> [T, H] (the gate_up input).
    With top_k_index [T, K]: once per (token, expert) pair with each expert's own input scale -> [S, H], the rows in
    pair order (token * K + k) (the gate_up input of a layer whose experts have scales of their own).
    """
    activations = activations.contiguous()
    columns = activations.shape[1]
    # The widest power-of-two column block that divides the row (768 -> 256): Triton's ranges are powers of two.
    block_columns = min(columns & -columns, 1024)
    assert block_columns >= 16, f"NVFP4 rounds blocks of 16 values, a row of {columns} cannot be split into them"
    input_scale = input_scale.float().reshape(-1)
    # the output, each output row's expert (read only PER_EXPERT) and input rows per output row
    if top_k_index is None:  # a row per token, one scale
        out = torch.empty_like(activations)  # [T, H]
        experts, rows_per_input, per_expert = input_scale, 1, False
    else:  # a row per (token, expert) pair, its expert's scale
        out = activations.new_empty(top_k_index.numel(), columns)  # [S, H]
        experts, rows_per_input, per_expert = top_k_index.reshape(-1), top_k_index.shape[1], True
    nvfp4_round_activations_kernel[(out.shape[0], columns // block_columns)](
        activations, input_scale, experts, out, rows_per_input, columns, BLOCK_C=block_columns, PER_EXPERT=per_expert,
    )
    return out


@triton.jit
def _accumulate_packed_product(
    accumulator, a, codes_ptr, block_scales_ptr, weight_rows, reduced_size, c0, INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """accumulator [R, N] (fp32) plus a [R, BLOCK_C] (BF16) times the packed weight rows `weight_rows` [N] over
    columns c0..c0+BLOCK_C, with the weights' block scales but not their global scale, times 2**-8.

    The even and odd columns are multiplied apart, because the low and high nibbles of a byte hold them: the codes
    are never interleaved back into order (a sum does not care about the order of its terms).
    """
    half_columns = tl.arange(0, BLOCK_C // 2)
    blocks = tl.arange(0, BLOCK_C // 16)
    # [N, C/2]
    codes = tl.load(codes_ptr + weight_rows[:, None] * (reduced_size // 2) + c0 // 2 + half_columns[None, :])
    block_scales = tl.load(block_scales_ptr + weight_rows[:, None] * (reduced_size // 16) + c0 // 16 + blocks[None, :])
    block_scales = block_scales.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [N, C/16]
    # one scale per 8 bytes (16 values, 8 of them even, 8 odd)
    block_scales = tl.reshape(tl.broadcast_to(block_scales[:, :, None], (BLOCK_N, BLOCK_C // 16, 8)),
                              (BLOCK_N, BLOCK_C // 2))
    weights_even, weights_odd = _decode_packed_weights(codes, block_scales, INTERPRETED)  # [N, C/2] each
    a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], BLOCK_C // 2, 2)))  # [R, C/2] each
    if INTERPRETED:
        a_even, a_odd = a_even.to(tl.float32), a_odd.to(tl.float32)
        weights_even, weights_odd = weights_even.to(tl.float32), weights_odd.to(tl.float32)
    accumulator = tl.dot(a_even, tl.trans(weights_even), accumulator)
    return tl.dot(a_odd, tl.trans(weights_odd), accumulator)


@triton.jit
def nvfp4_gate_up_kernel(
    hidden_states_ptr,  # BF16 [T, H], or [S, H] (one row per pair) when pairs_per_row is 1
    slot_pairs_ptr,  # int32 [P]: the pair (token * K + k) in each padded slot, -1 for padding
    tile_experts_ptr,  # int32 [P / BLOCK_R]: the expert of each row tile, E for tiles past the last
    packed_codes_ptr,  # uint8 [E, 2I, H/2]: gate rows, then up rows
    block_scales_ptr,  # e4m3 as uint8 [E, 2I, H/16]
    global_scale_ptr,  # fp32 [E, 2]: each expert's gate and up global scales
    down_input_scale_ptr, down_input_scale_stride,  # fp32, the expert's at down_input_scale_ptr + expert * stride
    intermediate_ptr,  # BF16 [P, I]: SiLU(gate) * up of each slot, rounded to NVFP4 under SIMULATE_FP4
    num_experts, hidden, width,
    pairs_per_row,  # K when hidden_states has a row per token, 1 when it has a row per pair
    SIMULATE_FP4: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    tile, column_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= num_experts:
        return
    slots = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.load(slot_pairs_ptr + slots)
    tokens = tl.where(pairs >= 0, pairs // pairs_per_row, 0).to(tl.int64)  # [R]: rows of hidden_states
    columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    gate_rows = expert.to(tl.int64) * 2 * width + columns
    gate = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, hidden, BLOCK_C):
        a = tl.load(hidden_states_ptr + tokens[:, None] * hidden + c0 + tl.arange(0, BLOCK_C)[None, :],
                    mask=(pairs >= 0)[:, None], other=0.0)  # [R, C]
        gate = _accumulate_packed_product(gate, a, packed_codes_ptr, block_scales_ptr, gate_rows, hidden, c0,
                                          INTERPRETED, BLOCK_N, BLOCK_C)
        up = _accumulate_packed_product(up, a, packed_codes_ptr, block_scales_ptr, gate_rows + width, hidden, c0,
                                        INTERPRETED, BLOCK_N, BLOCK_C)
    # the global scales, and DECODED_WEIGHT_DIVISOR back from the decode (a power of two: exact)
    gate = _round_to_bf16(gate * (tl.load(global_scale_ptr + 2 * expert) * DECODED_WEIGHT_DIVISOR)).to(tl.float32)
    up = _round_to_bf16(up * (tl.load(global_scale_ptr + 2 * expert + 1) * DECODED_WEIGHT_DIVISOR)).to(tl.float32)
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
    INTERPRETED: tl.constexpr,
    ROUTED_ROWS: tl.constexpr,  # the routing's rows per tile, a multiple of BLOCK_R
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    tile, column_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile // (ROUTED_ROWS // BLOCK_R))  # the routed tile this one lies in
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
        out = _accumulate_packed_product(out, a, packed_codes_ptr, block_scales_ptr, weight_rows, width, c0,
                                         INTERPRETED, BLOCK_N, BLOCK_C)
    out = _round_to_bf16(out * (tl.load(global_scale_ptr + expert) * DECODED_WEIGHT_DIVISOR)).to(tl.float32)
    routing_weights = tl.load(routing_weights_ptr + pair_rows).to(tl.float32)  # [R]
    tl.store(pair_outputs_ptr + pair_rows[:, None] * hidden + columns[None, :],
             _round_to_bf16(out * routing_weights[:, None]), mask=(pairs >= 0)[:, None])


# The router's choice, in one launch. transformers computes it as the router's softmax in fp32, torch.topk (two
# kernels on CUDA: a selection and a sort of the K chosen), the chosen probabilities' renormalisation and the cast
# back to BF16, which Inductor cannot fuse around torch.topk (about 0.9 ms of a 517-token forward's GPU work on an
# H200, 3.3 ms of a 16-record one). The kernel reads each token's E logits once and does all of it in registers:
# K rounds of "the largest probability left, the lowest expert among equal ones". BF16 logits are often equal, and
# torch.topk leaves unspecified which of equal values it returns (CPU and CUDA differ): the lowest is a fixed rule,
# so a request gets the same experts every time. Triton's fp32 exp on CUDA (ex2.approx after a scaling) may differ
# from torch's softmax in a probability's last bits, and the K chosen are summed in another order, so the weights
# may differ from transformers' by one BF16 unit in the last place, and experts a few fp32 ulps apart may swap
# (bench/check_engine_gpu.py counts both on the GPU).
# Eight tokens a program: the launch is short of programs, not of work (a 576-token bucket gave 32 tokens a program
# 18 programs on 132 SMs); on an H100 48 layers' launches took 0.13 instead of 0.24 ms at 512 rows, the same or less
# from 64 to 8,192 rows, with the same bits (docs/benchmarks.md, 2026-12-07 22:37).
ROUTER_TOKENS = 8  # tokens a program


@triton.jit(do_not_specialize=["num_tokens"])
def route_top_k_kernel(
    router_logits_ptr,  # BF16 [T, E] the router's logits
    top_k_weights_ptr,  # BF16 [T, K] out: the chosen experts' probabilities, renormalised to sum 1 if NORMALIZE
    top_k_index_ptr,  # int64 [T, K] out: the chosen experts, the most probable first
    num_tokens, num_experts,
    EXPERTS: tl.constexpr, PICKS: tl.constexpr,  # num_experts and TOP_K rounded up to powers of two
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    experts = tl.arange(0, EXPERTS)
    picks = tl.arange(0, PICKS)
    token_in_range = tokens[:, None] < num_tokens
    real_expert = (experts < num_experts)[None, :]
    logits = tl.load(router_logits_ptr + tokens[:, None] * num_experts + experts[None, :],
                     mask=token_in_range & real_expert, other=0.0).to(tl.float32)  # [BT, E]
    logits = tl.where(real_expert, logits, float("-inf"))
    exponentials = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probabilities = exponentials / tl.sum(exponentials, axis=1)[:, None]  # [BT, E], as softmax(dtype=float)
    probabilities = tl.where(real_expert, probabilities, -1.0)  # below any probability: never chosen
    chosen = tl.zeros((BLOCK_T, PICKS), dtype=tl.float32)  # zero past TOP_K
    chosen_experts = tl.zeros((BLOCK_T, PICKS), dtype=tl.int64)
    for pick in tl.static_range(TOP_K):
        largest = tl.max(probabilities, axis=1)  # [BT]
        expert = tl.min(tl.where(probabilities == largest[:, None], experts[None, :], EXPERTS), axis=1)  # [BT]
        chosen = tl.where(picks[None, :] == pick, largest[:, None], chosen)
        chosen_experts = tl.where(picks[None, :] == pick, expert[:, None].to(tl.int64), chosen_experts)
        probabilities = tl.where(experts[None, :] == expert[:, None], -1.0, probabilities)
    if NORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=1)[:, None]
    outputs = tokens[:, None] * TOP_K + picks[None, :]  # [BT, K]
    stored = token_in_range & (picks < TOP_K)[None, :]
    tl.store(top_k_weights_ptr + outputs, _round_to_bf16(chosen), mask=stored)
    tl.store(top_k_index_ptr + outputs, chosen_experts, mask=stored)


# A custom op, so that torch.compile calls it as one opaque operation inside the compiled decoder layers (no graph
# break) and never traces the launch itself, which it cannot under Triton's interpreter.
@torch.library.custom_op("serve_clef::route_top_k", mutates_args=())
def route_top_k(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits BF16 [T, E] -> (top_k_weights BF16 [T, K], top_k_index int64 [T, K]): what transformers'
    Qwen3-Omni router computes from its logits, in one launch (route_top_k_kernel)."""
    num_tokens, num_experts = router_logits.shape
    top_k_weights, top_k_index = route_top_k_outputs(router_logits, top_k, normalize)
    route_top_k_kernel[(triton.cdiv(num_tokens, ROUTER_TOKENS),)](
        router_logits.contiguous(), top_k_weights, top_k_index, num_tokens, num_experts,
        EXPERTS=triton.next_power_of_2(num_experts), PICKS=triton.next_power_of_2(top_k), TOP_K=top_k,
        NORMALIZE=normalize, BLOCK_T=ROUTER_TOKENS, num_warps=4,
    )
    return top_k_weights, top_k_index


@route_top_k.register_fake
def route_top_k_outputs(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route_top_k's outputs, empty: what torch.compile needs to know of them (shapes, dtypes, device)."""
    num_tokens = router_logits.shape[0]
    return (router_logits.new_empty(num_tokens, top_k),  # [T, K]
            router_logits.new_empty(num_tokens, top_k, dtype=torch.int64))  # [T, K]


# Routing: a counting sort in two launches whose grids depend on T alone. The first counts, for every block of
# pairs, the pairs of each expert; the second reads those counts back and places each block's pairs (its first
# programs) or fills the tiles' experts and padding slots (the rest). No program reads what another program of its
# own launch writes, and nothing is atomic: a routing gives the same bytes every time. Chunks of pairs are compared
# as [C, E] and [C, C] masks. The sizes that change with T are not specialised on (as Triton would on 1 and multiples
# of 16), so no token count compiles anew after the warm-up. Every program sums the counts of all blocks, so more
# blocks cost more than they spread: on an H200 chunks of 64 pairs routed 512 tokens in 15.7 us against 28.9 us with
# chunks of 32, and 8,192 tokens in 56 us against 68 us. Swept on an H100 (2026-12-05, docs/benchmarks.md; every
# setting's slots equal to the others'), 48 routings took 0.37 / 0.40 / 0.85 ms at 576 / 2,048 / 8,192 tokens with
# chunks of 128, 128 count rows read at once and 4 warps a program, against 0.66 / 1.39 / 2.40 ms with 64, 32 and 8.
# In the engine's packed decoder a forward runs a whole bucket, the real tokens first and padding after them. Its
# pairs are routed nowhere (and the top-k sum writes zeros for its tokens), so the padding costs the experts
# nothing: a padding token's hidden state is the zeros it starts from, or, in a one-record batch, whatever causal
# attention over the record makes of it, and either way it would take tiles (a 517-token record in the 576-token
# bucket: 17% more slot rows, 2,050 tokens in the 2,176 bucket: 18% more tiles, in simulations of random routings).
ROUTING_MOST_BLOCKS = 128  # blocks of pairs: about one counting program per SM of an H200
ROUTING_CHUNK = 128  # pairs compared at once
ROUTING_TILES = 16  # tiles per tile-filling program
ROUTING_COUNT_ROWS = 128  # rows of block_counts read at once
ROUTING_WARPS = 4  # a program's warps, in both launches


@triton.jit(do_not_specialize=["num_pairs", "block_pairs"])
def count_pairs_per_expert_kernel(
    expert_of_pair_ptr,  # int [S]: top_k_index flattened, pair token * K + k
    real_tokens_ptr,  # int32 [1]: the tokens before the padding (read when PADDED)
    routed_expert_ptr,  # int32 [S]: out, each pair's expert, -1 for a padding token's pair (routed nowhere)
    block_counts_ptr,  # int32 [B, EXPERTS]: out, how many pairs of each block go to each expert
    num_pairs, block_pairs,  # block_pairs: pairs per block, a multiple of CHUNK
    EXPERTS: tl.constexpr,  # the number of experts rounded up to a power of two
    CHUNK: tl.constexpr,
    TOP_K: tl.constexpr,
    PADDED: tl.constexpr,  # whether real_tokens_ptr is given
):
    block = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    real_pairs = num_pairs
    if PADDED:
        real_pairs = tl.minimum(tl.load(real_tokens_ptr) * TOP_K, num_pairs)
    one_hot_sums = tl.zeros((CHUNK, EXPERTS), dtype=tl.int32)  # reduced once, after the loop
    for c0 in range(0, block_pairs, CHUNK):
        pairs = block * block_pairs + c0 + tl.arange(0, CHUNK)  # [C]
        # -1 matches no expert: past the last pair, and for the padding's pairs
        pair_experts = tl.load(expert_of_pair_ptr + pairs, mask=pairs < real_pairs, other=-1).to(tl.int32)
        tl.store(routed_expert_ptr + pairs, pair_experts, mask=pairs < num_pairs)
        one_hot_sums += (pair_experts[:, None] == experts[None, :]).to(tl.int32)  # [C, E]
    tl.store(block_counts_ptr + block * EXPERTS + experts, tl.sum(one_hot_sums, axis=0))


@triton.jit(do_not_specialize=["num_pairs", "block_pairs", "num_blocks", "max_tiles"])
def place_pairs_in_row_tiles_kernel(
    routed_expert_ptr, block_counts_ptr, num_pairs, block_pairs,  # as count_pairs_per_expert_kernel wrote them
    slot_pairs_ptr,  # int32 [P]: out, the pair in each slot, -1 in padding
    tile_experts_ptr,  # int32 [P / BLOCK_R]: out, the expert of each tile, num_experts past the last
    tile_columns_done_ptr,  # int32 [P / BLOCK_R]: out, zeros (the gluon gate_up kernel counts its columns there)
    num_blocks, num_experts, max_tiles,
    EXPERTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
    COUNT_ROWS: tl.constexpr,  # rows of block_counts read at once
    TILES: tl.constexpr,  # tiles per tile-filling program
):
    program = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    # Every program sums the counts itself: each expert's pairs, and those in the blocks before this program's.
    pairs_per_expert = tl.zeros((EXPERTS,), dtype=tl.int32)
    pairs_in_earlier_blocks = tl.zeros((EXPERTS,), dtype=tl.int32)
    for b0 in range(0, num_blocks, COUNT_ROWS):
        blocks = b0 + tl.arange(0, COUNT_ROWS)
        counts = tl.load(block_counts_ptr + blocks[:, None] * EXPERTS + experts[None, :],
                         mask=(blocks < num_blocks)[:, None], other=0)  # [COUNT_ROWS, E]
        pairs_per_expert += tl.sum(counts, axis=0)
        pairs_in_earlier_blocks += tl.sum(tl.where((blocks < program)[:, None], counts, 0), axis=0)
    tiles_per_expert = (pairs_per_expert + BLOCK_R - 1) // BLOCK_R
    tile_ends = tl.cumsum(tiles_per_expert, axis=0)  # [E]
    tile_starts = tile_ends - tiles_per_expert
    if program < num_blocks:
        # A pair's slot: its expert's first slot + the expert's pairs before it (in earlier blocks, in earlier chunks
        # of this block, earlier in its chunk), which keeps each expert's pairs in pair order.
        next_slots = tile_starts * BLOCK_R + pairs_in_earlier_blocks  # [E]
        in_chunk = tl.arange(0, CHUNK)
        for c0 in range(0, block_pairs, CHUNK):
            pairs = program * block_pairs + c0 + in_chunk  # [C]
            pair_experts = tl.load(routed_expert_ptr + pairs, mask=pairs < num_pairs, other=-1)
            one_hot = pair_experts[:, None] == experts[None, :]  # [C, E]
            earlier = in_chunk[None, :] < in_chunk[:, None]  # [C, C]
            same_expert_before = (pair_experts[:, None] == pair_experts[None, :]) & earlier
            slots = (tl.sum(tl.where(one_hot, next_slots[None, :], 0), axis=1)
                     + tl.sum(same_expert_before.to(tl.int32), axis=1))  # [C]
            tl.store(slot_pairs_ptr + slots, pairs, mask=pair_experts >= 0)  # -1: past the end, or routed nowhere
            next_slots += tl.sum(one_hot.to(tl.int32), axis=0)
    else:
        # A tile's expert is the number of experts whose tiles end at or before it (num_experts past the last tile);
        # its slots past the expert's pairs are padding.
        tiles = (program - num_blocks) * TILES + tl.arange(0, TILES)  # [TILES]
        ended = (tile_ends[None, :] <= tiles[:, None]) & (experts[None, :] < num_experts)  # [TILES, E]
        tile_expert = tl.sum(ended.to(tl.int32), axis=1)  # [TILES]
        pairs_from_tile_on = pairs_per_expert[None, :] - (tiles[:, None] - tile_starts[None, :]) * BLOCK_R  # [TILES, E]
        filled = tl.sum(tl.where(tile_expert[:, None] == experts[None, :], pairs_from_tile_on, 0), axis=1)
        filled = tl.minimum(tl.maximum(filled, 0), BLOCK_R)  # [TILES]: 0 past the last tile
        rows = tl.arange(0, BLOCK_R)
        in_grid = tiles < max_tiles
        tl.store(tile_experts_ptr + tiles, tile_expert, mask=in_grid)
        tl.store(tile_columns_done_ptr + tiles, tl.zeros((TILES,), tl.int32), mask=in_grid)
        tl.store(slot_pairs_ptr + tiles[:, None] * BLOCK_R + rows[None, :], tl.full((TILES, BLOCK_R), -1, tl.int32),
                 mask=in_grid[:, None] & (rows[None, :] >= filled[:, None]))


def route_to_row_tiles(top_k_index: torch.Tensor, num_experts: int, block_rows: int,
                       real_tokens: torch.Tensor | None = None):
    """Pairs sorted by expert, each expert's run padded to a multiple of `block_rows`, with no host synchronisation.

    top_k_index [T, K] -> slot_pairs int32 [P] (the pair token * K + k in each slot, -1 in padding), tile_experts
    int32 [P / block_rows] (the expert of each tile; num_experts for the tiles past the last, which do nothing) and
    tile_columns_done int32 [P / block_rows], zeros, where the gluon gate_up kernel counts each tile's finished
    columns for the down kernel (nvfp4_down_fragment_kernel). P is
    the most any routing can need, so the launch grid depends on T alone. Each expert's pairs keep their order, as a
    stable sort by expert would leave them. real_tokens (int32 [1] on the device, or None: every token is real): the
    tokens past it are the engine's padding, whose pairs take no slot (so the down kernel writes no output for them).

    A counting sort in two launches (the comment above ROUTING_MOST_BLOCKS): per-block counts of each expert's
    pairs, then from their sums each expert's first tile and each pair's rank among its expert's pairs, which give
    its slot.
    """
    expert_of_pair = top_k_index.reshape(-1)  # [S]
    num_pairs = expert_of_pair.numel()
    max_tiles = -(-num_pairs // block_rows) + min(num_experts, num_pairs)
    padded_experts = triton.next_power_of_2(num_experts)
    # the fewest chunks per block that keep to ROUTING_MOST_BLOCKS blocks; a runtime argument, so no recompile per T
    block_pairs = ROUTING_CHUNK * max(1, triton.cdiv(num_pairs, ROUTING_MOST_BLOCKS * ROUTING_CHUNK))
    num_blocks = triton.cdiv(num_pairs, block_pairs)
    routed_expert = expert_of_pair.new_empty(num_pairs, dtype=torch.int32)  # [S]
    block_counts = expert_of_pair.new_empty(num_blocks, padded_experts, dtype=torch.int32)  # [B, E padded]
    slot_pairs = expert_of_pair.new_empty(max_tiles * block_rows, dtype=torch.int32)  # [P]
    tile_experts = expert_of_pair.new_empty(max_tiles, dtype=torch.int32)  # [P / R]
    tile_columns_done = expert_of_pair.new_empty(max_tiles, dtype=torch.int32)  # [P / R]
    common = dict(EXPERTS=padded_experts, CHUNK=ROUTING_CHUNK, num_warps=ROUTING_WARPS)
    count_pairs_per_expert_kernel[(num_blocks,)](
        expert_of_pair, expert_of_pair if real_tokens is None else real_tokens, routed_expert, block_counts,
        num_pairs, block_pairs, TOP_K=top_k_index.shape[1], PADDED=real_tokens is not None, **common,
    )
    place_pairs_in_row_tiles_kernel[(num_blocks + triton.cdiv(max_tiles, ROUTING_TILES),)](
        routed_expert, block_counts, num_pairs, block_pairs, slot_pairs, tile_experts, tile_columns_done, num_blocks,
        num_experts, max_tiles, BLOCK_R=block_rows, COUNT_ROWS=ROUTING_COUNT_ROWS, TILES=ROUTING_TILES, **common,
    )
    return slot_pairs, tile_experts, tile_columns_done


# The top-k sum: each token's K pair outputs added in fp32 in pair order, rounded once to BF16 (as torch sums BF16).
# One kernel of our own rather than torch's sum over the middle dimension of [T, K, H], which read the pair outputs
# at about 1.5 TB/s at 516 tokens on an H200 (0.53 ms of the decision's GPU work), and because it knows the
# padding: its tokens' outputs are zeros, read from nowhere, so the down kernel never has to write their pairs.
# On an H100 it took 0.40 ms of a 517-token forward and 4.97 ms of a 16-record one (about 2.5 TB/s of pair rows read).
# In the engine's decoder it also adds the layer's residual stream (ResidualInTopKSumLayer), rounded as torch adds two
# BF16 tensors: one more row read a token, instead of a launch that reads two rows and writes one (0.16 ms of a
# 517-token forward's GPU work and 1.8 ms of a 16-record one on an H100, 2026-12-07).
TOP_K_SUM_TOKENS = 8  # tokens per program
TOP_K_SUM_COLUMNS = 256  # hidden columns per program


@triton.jit(do_not_specialize=["num_tokens"])  # hidden is the model's, specialised on: rows 16-byte aligned
def sum_top_k_kernel(
    pair_outputs_ptr,  # BF16 [S, H]: the down kernel's output, pair token * K + k
    real_tokens_ptr,  # int32 [1]: the tokens before the padding (read when PADDED)
    residual_ptr,  # BF16 [T, H]: added to each token's sum (read when RESIDUAL)
    token_outputs_ptr,  # BF16 [T, H]: out
    num_tokens, hidden,
    TOP_K: tl.constexpr, PADDED: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    columns = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    in_range = (tokens < num_tokens)[:, None] & (columns < hidden)[None, :]
    real = in_range
    if PADDED:
        real = real & (tokens < tl.load(real_tokens_ptr))[:, None]
    total = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pair_rows = tokens.to(tl.int64) * TOP_K + k
        total += tl.load(pair_outputs_ptr + pair_rows[:, None] * hidden + columns[None, :], mask=real,
                         other=0.0).to(tl.float32)
    token_rows = tokens.to(tl.int64)[:, None] * hidden + columns[None, :]  # [BT, BH]
    token_outputs = _round_to_bf16(total)
    if RESIDUAL:  # the residual plus the rounded sum, rounded again: torch's BF16 add of the two
        residual = tl.load(residual_ptr + token_rows, mask=in_range, other=0.0).to(tl.float32)
        token_outputs = _round_to_bf16(residual + token_outputs.to(tl.float32))
    tl.store(token_outputs_ptr + token_rows, token_outputs, mask=in_range)


def sum_top_k(pair_outputs: torch.Tensor, top_k: int, real_tokens: torch.Tensor | None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """pair_outputs [S, H] -> each token's sum of its K pair outputs [T, H]; zeros for the tokens from real_tokens on
    (int32 [1] on the device, or None: every token is real), whose pair outputs are never read. residual [T, H] (or
    None): added to the sums, as the decoder layer adds its residual stream to the MoE block's output."""
    num_pairs, hidden = pair_outputs.shape
    num_tokens = num_pairs // top_k
    token_outputs = pair_outputs.new_empty(num_tokens, hidden)  # [T, H]
    sum_top_k_kernel[(triton.cdiv(num_tokens, TOP_K_SUM_TOKENS), triton.cdiv(hidden, TOP_K_SUM_COLUMNS))](
        pair_outputs, pair_outputs if real_tokens is None else real_tokens,
        pair_outputs if residual is None else residual.contiguous(), token_outputs, num_tokens, hidden,
        TOP_K=top_k, PADDED=real_tokens is not None, RESIDUAL=residual is not None, BLOCK_T=TOP_K_SUM_TOKENS,
        BLOCK_H=min(TOP_K_SUM_COLUMNS, triton.next_power_of_2(hidden)), num_warps=4,
    )
    return token_outputs


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """Tile sizes of the packed-expert kernels: rows (pairs) per tile, output columns per program, reduced columns
    per step, and Triton's warps and pipeline stages. Routing pads each expert's pairs to whole tiles of `rows`. The
    down kernel may take other rows and columns (down_rows must divide rows: each of its tiles then lies within one
    routed tile, so within one expert); None: the same as gate_up's. The gluon kernels take rows, num_stages,
    smallest_rows and down_slab_pairs only, each program one warp group (4 warps): gate_up multiplies a column slab of
    gate and up, down one 64-column output slab, or two adjacent ones where down_slab_pairs says so."""

    rows: int
    columns: int
    reduced: int
    num_warps: int
    num_stages: int
    down_rows: int | None = None
    down_columns: int | None = None
    # gluon only: the fewest of a routed tile's first slots that its products may take (rows/2 or rows/4, a power of
    # two: Triton's shapes are), when the tile's pairs fit in them; None: always all `rows`
    smallest_rows: int | None = None
    # gluon only: a down program multiplies two adjacent output slabs, their products issued in turn, so it reads its
    # tile's rows once for 128 output columns (where the hidden size has an even number of slabs)
    down_slab_pairs: bool = False


# By mean pairs per expert (T * K / E): few rows per tile while each expert sees few tokens, so that little of each
# tile is padding. The fastest of 24 candidates at 64, 512, 2,048 and 8,192 tokens on an H200, swept again once the
# decode got cheaper (docs/benchmarks.md); where a row ends between those counts is a judgement, not a measurement.
# Timed per kernel at 8,192 tokens, the down kernel took 0.868 ms with 64 x 128 tiles against 1.048 ms with
# gate_up's 128 x 64, which stays gate_up's fastest (1.465 ms).
EXPERT_TILES = (
    (8, ExpertTiles(16, 64, 128, 4, 3)),
    (24, ExpertTiles(32, 128, 64, 4, 3)),
    (64, ExpertTiles(64, 128, 64, 4, 3)),
    (None, ExpertTiles(128, 64, 64, 4, 3, down_rows=64, down_columns=128)),
)


def expert_tiles(num_pairs: int, num_experts: int, table: tuple) -> ExpertTiles:
    """The row of `table` (EXPERT_TILES or FRAGMENT_TILES, read when called, so tests and sweeps may replace them)
    for this many pairs: the first whose bound they fit."""
    for most_pairs_per_expert, tiles in table:
        if most_pairs_per_expert is None or num_pairs <= most_pairs_per_expert * num_experts:
            return tiles
    raise AssertionError("a tile table ends with a catch-all row")


def fitted_block(block: int, size: int) -> int:
    """The largest power of two up to `block` that divides `size` (tiny test models have 32-wide experts)."""
    while size % block:
        block //= 2
    return block


# ==== packed-expert kernels for Hopper (Gluon) ========================================================================
# The same two grouped GEMMs for Hopper GPUs (compute capability 9.0), in Gluon, Triton's lower-level dialect, where a
# kernel states its register layouts. The decoded weights are the tensor cores' left operand straight from registers:
# out^T = W x^T, 64 weight rows of a projection (a slab) as the products' M and the routed rows as their N, so no
# decoded tile goes through shared memory (where the Triton kernels' time goes: docs/expert-kernels.md). For that the
# codes are rewritten once, at load, in fragment order: each 32-bit word holds the eight weights that one thread holds
# in its operand registers for one k16 slice, so a thread reads its four words of a step in one 16-byte load and hands
# each word whole to the decode PTX; the block scales stay in the checkpoint's order, four (a row's step) read as one
# word, each byte rewritten so that two become BF16 in two instructions (fragment_scales). The activations (gate_up:
# gathered by token; down: the intermediate rows) go through a ring of cp.async copies in shared memory, the tensor
# cores' right operand, which one warp group a program multiplies by one slab or two, their products in turn. The
# W4A4 replay rounds the gate_up input before the gate_up kernel (round_activations_to_nvfp4) and the down input in
# gate_up's epilogue, both with the Triton kernels' rounding helper. Gluon has no interpreter, so these kernels run on
# the GPU only: bench/check_expert_kernels.py compares them there with the unpack reference, and the tests check on CPU
# the fragment order and the decode PTX, instruction by instruction, and the launches' grids.
FRAGMENT_ROWS = gl.constexpr(64)  # weight rows per slab: one warp group's M
FRAGMENT_STEP = gl.constexpr(64)  # reduced columns per step: four k16 slices
FRAGMENT_STEP_WORDS = gl.constexpr(64 * 64 // 8)  # 512 words a step, eight weights each
# The operand's register layout (Hopper's wgmma A fragment, BF16): thread (warp w, lane 4 rl + q) holds, of k16 slice
# s, the weights at rows r = 16 w + rl + 8 e and reduced columns 16 s + 8 h + 2 q + p, for e, h, p in {0, 1}, in its
# registers in the order j = p + 2 e + 4 h: BF16 pair k = e + 2 h holds weights 2k (low half) and 2k + 1 (high half).
# Its word for slice s keeps weight j in half p (bits 16p to 16p + 15), where the decode wants it rather than as a
# nibble: within the half, pair k's magnitude bits (e1 e0 m, code & 7) start at bit FRAGMENT_PLACES[k][0] and its sign
# bit (code >> 3) sits at bit FRAGMENT_PLACES[k][1]. A BF16 reading e2m1 * 2**-126 keeps the magnitude at bits 6-8 and
# the sign at 15, so pair 0 is one mask, pair 1 a shift and a mask, pairs 2 and 3 two shifts and two masks: 11 integer
# instructions for eight weights, the fewest any placement allows, against 18 for nibbles (docs/expert-kernels.md).
FRAGMENT_PLACES = ((6, 15), (3, 12), (0, 13), (9, 14))  # pair k: (lowest magnitude bit, sign bit) in each half
# The block scales are kept in the checkpoint's order, one byte each, but as what the kernels need: scale * 2**118 in
# BF16 is a normal number whose exponent lies in [FRAGMENT_SCALE_EXPONENT, +17] and whose 4 low mantissa bits are 0,
# so (its bits - FRAGMENT_SCALE_EXPONENT << 7) >> 4 fits a byte, and one multiply-add gives two BF16 scales back.
FRAGMENT_SCALE_EXPONENT = 236  # of 2**-9 * 2**118, the smallest positive e4m3 value
FRAGMENT_SCALE_OFFSET = FRAGMENT_SCALE_EXPONENT << 7 | FRAGMENT_SCALE_EXPONENT << 23  # both halves


def decode_fragment_word_ptx(places: tuple[tuple[int, int], ...]) -> str:
    """The decode of one fragment word ($4; $5-$11 its unused copies) into four BF16 pairs $0-$3, pair k multiplied by
    its block scales $12 + k (scale * 2**118, BF16 pairs): each half's magnitude bits moved to 6-8 and sign to 15, read
    as e2m1 * 2**-126, times the scale: e2m1 * block_scale * 2**-8, exactly."""
    lines = [".reg .b32 magnitude, sign, negative_zero;", "mov.b32 negative_zero, 0x80008000;"]

    def shifted(target: str, shift: int) -> str:  # the word moved left by `shift` bits (right when negative)
        if shift == 0:
            return "$4"
        lines.append(f"{'shl' if shift > 0 else 'shr'}.b32 {target}, $4, {abs(shift)};")
        return target

    for pair, (magnitude_bit, sign_bit) in enumerate(places):
        magnitude_shift, sign_shift = 6 - magnitude_bit, 15 - sign_bit
        if magnitude_shift == sign_shift:
            lines.append(f"and.b32 ${pair}, {shifted('magnitude', magnitude_shift)}, 0x81C081C0;")
        else:
            lines += [f"and.b32 magnitude, {shifted('magnitude', magnitude_shift)}, 0x01C001C0;",
                      f"and.b32 sign, {shifted('sign', sign_shift)}, 0x80008000;",
                      f"or.b32 ${pair}, magnitude, sign;"]
        lines.append(f"fma.rn.bf16x2 ${pair}, ${pair}, ${12 + pair}, negative_zero;")  # a product, exactly
    return "{\n" + "\n".join(lines) + "\n}"


FRAGMENT_WORD_PTX = gl.constexpr(decode_fragment_word_ptx(FRAGMENT_PLACES))
# A row's four scale bytes of a step ($2; $3-$5 its unused copies) -> the BF16 scales of slices 0, 1 ($0) and 2, 3 ($1)
FRAGMENT_SCALES_PTX = gl.constexpr(
    "{\n.reg .b32 spread;\n" + "\n".join(
        f"prmt.b32 spread, $2, 0, {selector};\nmad.lo.u32 ${pair}, spread, 16, {FRAGMENT_SCALE_OFFSET:#x};"
        for pair, selector in enumerate(("0x4140", "0x4342"))) + "\n}")
# Rows R per routed tile, pipeline stages and down's slab pairs, by mean pairs per expert (T * K / E). On an H200
# (2026-12-04, docs/benchmarks.md), one layer as served: R = 32 was the fastest at 64 tokens, 64 at 512-2,048 and 128
# from 3,072 tokens on, where the rows of 64 lose by 10-20% (at 2,048 tokens they were within 1-3%). With R = 128 the
# down kernel then ran four warp groups a program, one output slab each, which beat one or two warp groups of one or
# two slabs by 3-15% (8,192 tokens: 1.821 against 1.881-2.123 ms). On an H100 (2026-12-05) one warp group on a pair of
# slabs whose products go in turn beat those four by 3-7% from 4,096 to 16,384 tokens and lost 5% at 512 tokens, so
# only the rows of 128 take pairs; since then every gluon program is one warp group. Rows of 32 give way to 64 past 28
# pairs per expert: one layer on an H100 (2026-12-05) took 10-11% less with them at 12-20 pairs (192-320 tokens;
# 256: 0.186 against 0.208 ms), 5% and 3% less at 24 and 28 and 6% more at 32 (512 tokens), the same at 8. Where the
# other rows give way is a judgement between the counts timed. `columns` and `reduced` are the fixed slab and step.
# smallest_rows: a tile at most half or a quarter full multiplies only its first R/2 or R/4 slots (R/4 from R = 64
# on). One layer, the same run and GPU (2026-12-05): 4-7% faster from 64 to 6,144 tokens (512: 0.244 against 0.258
# ms), 3.6% slower at 8,192 (1.907 against 1.840 ms), so rows past 384 pairs per expert multiply whole tiles.
FRAGMENT_TILES = (
    (28, ExpertTiles(32, FRAGMENT_ROWS.value, FRAGMENT_STEP.value, 4, 3, smallest_rows=16)),
    (128, ExpertTiles(64, FRAGMENT_ROWS.value, FRAGMENT_STEP.value, 4, 4, smallest_rows=16)),
    (384, ExpertTiles(128, FRAGMENT_ROWS.value, FRAGMENT_STEP.value, 4, 3, smallest_rows=32, down_slab_pairs=True)),
    (None, ExpertTiles(128, FRAGMENT_ROWS.value, FRAGMENT_STEP.value, 4, 3, down_slab_pairs=True)),
)


def fragment_words(packed_codes: torch.Tensor) -> torch.Tensor:
    """Packed codes uint8 [E, O, C/2] (two E2M1 codes a byte, column 2i in the low nibble) -> int32 words
    [E, O/64 slabs, C/64 steps, 512] in fragment order: word (w, rl, q, s) of a slab's step, its weights placed as
    FRAGMENT_PLACES says. Eight experts at a time, so the load needs little memory beside the codes."""
    num_experts, rows, half_columns = packed_codes.shape
    slabs, steps = rows // 64, half_columns * 2 // 64
    words = torch.empty(num_experts, slabs, steps, 512, dtype=torch.int32, device=packed_codes.device)
    for first in range(0, num_experts, 8):
        chunk = packed_codes[first:first + 8]
        codes = torch.stack((chunk & 0xF, chunk >> 4), dim=-1).int()  # [8, O, C/2, 2]: one code an int
        # row = 64 slab + 16 w + 8 e + rl; column = 64 step + 16 s + 8 h + 2 q + p; pair k = e + 2 h
        codes = codes.view(-1, slabs, 4, 2, 8, steps, 4, 2, 4, 2)  # e slab w e rl step s h q p
        codes = codes.permute(0, 1, 5, 2, 4, 8, 6, 7, 3, 9).reshape(-1, slabs, steps, 512, 4, 2)  # [..., k, p]
        word = torch.zeros(codes.shape[:4], dtype=torch.int32, device=codes.device)
        for pair, (magnitude_bit, sign_bit) in enumerate(FRAGMENT_PLACES):
            for half in (0, 1):
                code = codes[..., pair, half]
                word |= (code & 7) << (magnitude_bit + 16 * half) | (code >> 3) << (sign_bit + 16 * half)
        words[first:first + 8] = word
    return words  # [E, O/64, C/64, 512]


def packed_codes_from_fragment_words(words: torch.Tensor) -> torch.Tensor:
    """fragment_words undone: int32 [E, O/64, C/64, 512] -> the packed codes uint8 [E, O, C/2]."""
    num_experts, slabs, steps, _ = words.shape
    codes = torch.empty(*words.shape, 4, 2, dtype=torch.int32, device=words.device)  # [E, slab, step, 512, k, p]
    for pair, (magnitude_bit, sign_bit) in enumerate(FRAGMENT_PLACES):
        for half in (0, 1):
            magnitude, sign = words >> (magnitude_bit + 16 * half) & 7, words >> (sign_bit + 16 * half) & 1
            codes[..., pair, half] = magnitude | sign << 3
    codes = codes.view(num_experts, slabs, steps, 4, 8, 4, 4, 2, 2, 2)  # E slab step w rl q s h e p
    codes = codes.permute(0, 1, 3, 8, 4, 2, 6, 7, 5, 9).reshape(num_experts, slabs * 64, steps * 32, 2)
    return (codes[..., 0] | codes[..., 1] << 4).to(torch.uint8)  # [E, O, C/2]: column 2i in the low nibble


def with_positive_block_scales(packed_codes: torch.Tensor, block_scales: torch.Tensor):
    """The same weights, every block scale positive (what fragment_scales can keep): a block whose scale is negative
    gets its codes' signs flipped and the scale's magnitude; one whose scale is zero keeps only its codes' signs (zeros
    of the same sign) and gets the smallest e4m3 scale. Codes uint8 [E, O, C/2], scales float8_e4m3fn [E, O, C/16] ->
    the same two."""
    scale_bytes = block_scales.view(torch.uint8)
    blocks = packed_codes.view(*scale_bytes.shape, 8)  # [E, O, C/16, 8]: a block's 16 codes in 8 bytes
    negative, zero = (scale_bytes & 0x80) != 0, (scale_bytes & 0x7F) == 0
    blocks = torch.where(negative[..., None], blocks ^ 0x88, blocks)
    blocks = torch.where(zero[..., None], blocks & 0x88, blocks)
    scale_bytes = torch.where(zero, 1, scale_bytes & 0x7F).to(torch.uint8)  # 0x01: 2**-9
    return blocks.view(packed_codes.shape), scale_bytes.view(torch.float8_e4m3fn)


def fragment_scales(block_scales: torch.Tensor) -> torch.Tensor:
    """Positive e4m3 block scales -> the byte the gluon kernels read for each (FRAGMENT_SCALE_EXPONENT's comment):
    (BF16 bits of scale * 2**118 - FRAGMENT_SCALE_EXPONENT << 7) >> 4, uint8 of the same shape."""
    bits = (block_scales.float() * 2.0**118).to(torch.bfloat16).view(torch.int16).int()  # exact, all positive
    return ((bits - (FRAGMENT_SCALE_EXPONENT << 7)) >> 4).to(torch.uint8)


def block_scales_from_fragment_scales(scale_bytes: torch.Tensor) -> torch.Tensor:
    """fragment_scales undone: uint8 -> float8_e4m3fn of the same shape."""
    bits = (scale_bytes.int() << 4) + (FRAGMENT_SCALE_EXPONENT << 7)
    return (bits.to(torch.int16).view(torch.bfloat16).float() * 2.0**-118).to(torch.float8_e4m3fn)


@gluon.jit
def _repeat_eight(x):
    """[...] -> [..., 2, 2, 2]: each element repeated in its own thread's registers (no instruction)."""
    x = gl.join(x, x)
    x = gl.join(x, x)
    return gl.join(x, x)


@gluon.jit
def _fragment_scales(scale_words, slices):
    """int32 [w, rl, q]: a row's four block scale bytes of a step (fragment_scales) -> BF16 [w, rl, q, s], the scales
    times 2**118 (exact); `slices` [1, 1, 1, s] only gives the result its shape and layout."""
    scale_words = gl.expand_dims(scale_words, 3) + slices * 0
    return gl.inline_asm_elementwise(FRAGMENT_SCALES_PTX, "=r,=r,r,r,r,r", [scale_words], dtype=gl.bfloat16,
                                     is_pure=True, pack=4)


@gluon.jit
def _decode_fragment_step(words, scale_words, scale_words_8, slices, DOT_A: gl.constexpr):
    """One step of a slab: words int32 [w, rl, q, s] and the scale words of rows r and r + 8 -> the weights BF16
    [64 rows, 64 columns] as e2m1 * block_scale * 2**-8, in DOT_A (the operand's register layout; asserted, so no data
    moves between threads)."""
    scales, scales_8 = _fragment_scales(scale_words, slices), _fragment_scales(scale_words_8, slices)
    scales = gl.join(gl.join(scales, scales), gl.join(scales_8, scales_8))  # [w, rl, q, s, h, e]
    scales = gl.join(scales, scales)  # [w, rl, q, s, h, e, p]
    # not pure: the compiler keeps the decode where it is written, between the products it overlaps and their wait
    weights = gl.inline_asm_elementwise(FRAGMENT_WORD_PTX, "=r,=r,=r,=r" + ",r" * 12, [_repeat_eight(words), scales],
                                        dtype=gl.bfloat16, is_pure=False, pack=8)  # [w, rl, q, s, h, e, p]
    weights = gl.permute(weights, (0, 5, 1, 3, 4, 2, 6))  # [w, e, rl, s, h, q, p]: row, then column order
    weights = gl.reshape(weights, [FRAGMENT_ROWS, FRAGMENT_STEP])
    return gl.convert_layout(weights, DOT_A, assert_trivial=True)


@gluon.constexpr_function
def fragment_accumulator_layout(rows):
    """The products' accumulator [64 slab rows, `rows` routed rows]: Hopper's wgmma on the program's warp group."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, rows, 16])


# words [w, rl, q, s]: lanes (rl, q), warps w, a thread's four words of a step in its registers (one 16-byte load)
FRAGMENT_WORDS_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [4, 1, 1, 1], [3, 2, 1, 0]))
# 16-byte copies of a tile's activation rows [R, 64], every warp taking part
FRAGMENT_ROWS_COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _fragment_step_pointers(fragment_words_ptr, block_scales_ptr, slab, num_steps, reduced):
    """Pointers to step 0 of slab `slab`: its words [w, rl, q, s] and row r's scale word [w, rl, q] (row r + 8's lie
    8 * reduced / 64 further), and the slices [1, 1, 1, s] that give a step's scales their layout."""
    WORDS: gl.constexpr = FRAGMENT_WORDS_LAYOUT
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WORDS))))
    rl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, WORDS))))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, WORDS))))
    s = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WORDS))))
    w = gl.expand_dims(gl.expand_dims(gl.expand_dims(w, 1), 2), 3)
    rl = gl.expand_dims(gl.expand_dims(gl.expand_dims(rl, 0), 2), 3)
    q = gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 3)
    s = gl.expand_dims(gl.expand_dims(gl.expand_dims(s, 0), 1), 2)
    first_word = slab.to(gl.int64) * num_steps * FRAGMENT_STEP_WORDS
    words_ptr = fragment_words_ptr + first_word + ((w * 8 + rl) * 4 + q) * 4 + s  # [w, rl, q, s]
    rows = gl.sum(w * 16 + rl + q * 0, axis=3)  # [w, rl, q]: row r of the slab
    scales_ptr = block_scales_ptr + (slab.to(gl.int64) * FRAGMENT_ROWS + rows) * (reduced // 64)
    return words_ptr, scales_ptr, s


@gluon.jit
def _load_fragment_step(words_ptr, scales_ptr, reduced, step):
    """A slab's codes and block scales of one step, as _decode_fragment_step takes them."""
    return (gl.load(words_ptr + step * FRAGMENT_STEP_WORDS), gl.load(scales_ptr + step),
            gl.load(scales_ptr + 8 * (reduced // 64) + step))


# The activations go through a ring of STAGES slots of cp.async copies in shared memory: the first STAGES - 1 steps'
# rows are copied before the loop, and each step's slot is refilled with the rows STAGES - 1 steps ahead once the
# products that read it are done. Rows read `rows_mask` [R, 64], or whole when None.

@gluon.jit
def _start_fragment_ring(rows_ptr, rows_mask, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    """The ring of activation rows, the products' right operand, shared memory [STAGES, R, 64] BF16, its first
    STAGES - 1 steps' copies issued."""
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, FRAGMENT_STEP],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_R, FRAGMENT_STEP], gl.bfloat16))
    for first_step in gl.static_range(STAGES - 1):
        async_copy.async_copy_global_to_shared(ring.index(first_step), rows_ptr + first_step * FRAGMENT_STEP,
                                               mask=rows_mask)
        async_copy.commit_group()
    return ring


@gluon.jit
def _refill_fragment_ring(ring, rows_ptr, rows_mask, step, num_steps, STAGES: gl.constexpr):
    """Step `step`'s products are done: its slot takes the rows of step + STAGES - 1 (the last step's again past the
    end, so that every step commits one group)."""
    async_copy.async_copy_global_to_shared(ring.index((step + STAGES - 1) % STAGES),
                                           rows_ptr + gl.minimum(step + STAGES - 1, num_steps - 1) * FRAGMENT_STEP,
                                           mask=rows_mask)
    async_copy.commit_group()


@gluon.jit
def _ring_step(ring, step, STAGES: gl.constexpr):
    """Step `step`'s rows [64, R] once every thread's copies of them are in."""
    async_copy.wait_group(STAGES - 2)
    gl.thread_barrier()
    fence_async_shared()
    return ring.index(step % STAGES).permute((1, 0))


@gluon.jit
def _fragment_products(words_ptr, scales_ptr, slices, rows_ptr, rows_ready, num_steps, reduced, BLOCK_R: gl.constexpr,
                       STAGES: gl.constexpr):
    """A slab's weights (pointers to step 0, from _fragment_step_pointers) times a tile's R rows of activations
    (rows_ptr [R, 64] at step 0) over `num_steps` steps -> the fp32 products [64 slab rows, R]. rows_ready: the
    (tile_columns_done_ptr, tile, columns) to wait on (_wait_for_tile_columns) before the rows are read, once the
    first steps' codes are on their way, which do not depend on them.

    Step 0 is decoded and step 1's codes are in registers before the loop; each step loads step + 2's codes, issues
    its products, decodes step + 1's codes and then waits for the products, keeping their weights until then, since
    the tensor cores read them from registers. (ptxas moves that wait before the decode: docs/expert-kernels.md,
    "Pipeline"; _paired_fragment_products overlaps them.)"""
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
    first_codes = _load_fragment_step(words_ptr, scales_ptr, reduced, 0)
    codes = _load_fragment_step(words_ptr, scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    _wait_for_tile_columns(*rows_ready)
    ring = _start_fragment_ring(rows_ptr, None, BLOCK_R, STAGES)
    out = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)  # [64 slab rows, R slots]
    weights = _decode_fragment_step(*first_codes, slices, DOT_A)
    for step in range(num_steps):
        next_codes = _load_fragment_step(words_ptr, scales_ptr, reduced, gl.minimum(step + 2, num_steps - 1))
        out = warpgroup_mma(weights, _ring_step(ring, step, STAGES), out, is_async=True)
        next_weights = _decode_fragment_step(*codes, slices, DOT_A)
        out, weights = warpgroup_mma_wait(num_outstanding=0, deps=(out, weights))
        _refill_fragment_ring(ring, rows_ptr, None, step, num_steps, STAGES)
        weights, codes = next_weights, next_codes
    async_copy.wait_group(0)
    return out


@gluon.jit
def _paired_fragment_products(first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr, slices,
                              rows_ptr, rows_mask, rows_ready, num_steps, reduced, BLOCK_R: gl.constexpr,
                              STAGES: gl.constexpr):
    """Two slabs' weights times the same R rows of activations -> their fp32 products [64 slab rows, R] each, the
    products issued in turn so that each slab's weights are decoded while the other slab's products run: step s's
    second-slab weights during the first slab's step s, step s + 1's first-slab weights during the second slab's step
    s. Each wait leaves the other slab's products in flight (WARPGROUP.DEPBAR.LE gsb0, 0x1 before each decode, in the
    SASS triton 3.6 builds for sm_90a), and each slab's weights live in registers of their own (154-155 registers at
    R = 64, as two slabs issued together take). Issued together, ptxas waits for both before decoding (one layer's
    experts 1-5% slower from 512 to 8,192 tokens on an H100, docs/benchmarks.md).

    The first slab runs one half-step ahead: its step 0 is issued before the loop, the loop runs steps 0 to n - 2 (the
    second slab's s, the first slab's s + 1) and the second slab's last step follows it. A slot is refilled once both
    slabs' products of its step are done (the waits retire products in order). rows_ready: as for _fragment_products,
    or None when the rows are ready already (gate_up's hidden states)."""
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACCUMULATOR, k_width=2)
    first_step_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, 0)
    second_codes = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, 0)
    first_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced, gl.minimum(1, num_steps - 1))
    if rows_ready is not None:
        _wait_for_tile_columns(*rows_ready)
    ring = _start_fragment_ring(rows_ptr, rows_mask, BLOCK_R, STAGES)
    first = gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR)  # [64 slab rows, R slots]
    # an accumulator as the loop carries it (an asynchronous product's), though no product is in flight yet
    second = warpgroup_mma_init(gl.zeros([FRAGMENT_ROWS, BLOCK_R], gl.float32, ACCUMULATOR))
    first_weights = _decode_fragment_step(*first_step_codes, slices, DOT_A)
    second_weights = gl.zeros([FRAGMENT_ROWS, FRAGMENT_STEP], gl.bfloat16, DOT_A)  # no second-slab product yet
    first = warpgroup_mma(first_weights, _ring_step(ring, 0, STAGES), first, is_async=True)
    for step in range(num_steps - 1):
        next_second_codes = _load_fragment_step(second_words_ptr, second_scales_ptr, reduced, step + 1)
        next_first_codes = _load_fragment_step(first_words_ptr, first_scales_ptr, reduced,
                                               gl.minimum(step + 2, num_steps - 1))
        rows = ring.index(step % STAGES).permute((1, 0))  # [64, R]
        # the second slab's step s - 1 done (so step s - 1's slot is free), the first slab's step s may still run
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


@gluon.jit
def _tile_pairs(slot_pairs_ptr, tile, BLOCK_R: gl.constexpr):
    """How many of routed tile `tile`'s BLOCK_R slots hold a pair: routing fills a tile's slots from its first, so
    a tile at most half or a quarter full (an expert's last tile, or a lightly routed expert's only one) has its pairs
    in its first half or quarter."""
    SLOTS: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    pairs = gl.load(slot_pairs_ptr + tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=SLOTS))
    return gl.sum((pairs >= 0).to(gl.int32), axis=0)


@gluon.jit
def _tile_fill(slot_pairs_ptr, tile, BLOCK_R: gl.constexpr, SMALLEST_ROWS: gl.constexpr):
    """_tile_pairs where _run_tile needs it (tiles that may multiply fewer slots), else BLOCK_R; loaded beside the
    tile's expert at a program's start, so that the two loads wait together rather than one after the other."""
    if SMALLEST_ROWS == BLOCK_R:
        return BLOCK_R
    return _tile_pairs(slot_pairs_ptr, tile, BLOCK_R)


@gluon.jit
def _run_tile(tile_work: gl.constexpr, args, filled, BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
              SMALLEST_ROWS: gl.constexpr):
    """tile_work(*args, BLOCK_R, N, STAGES) on the fewest first slots of a routed tile that hold its `filled` pairs
    (_tile_fill), N = BLOCK_R, BLOCK_R/2 or BLOCK_R/4, down to SMALLEST_ROWS: the products' cost grows with their N.
    Gate_up and down count the same pairs, so down reads exactly the slots gate_up wrote."""
    if SMALLEST_ROWS == BLOCK_R:
        tile_work(*args, BLOCK_R, BLOCK_R, STAGES)
    else:
        if filled * 2 > BLOCK_R:
            tile_work(*args, BLOCK_R, BLOCK_R, STAGES)
        elif SMALLEST_ROWS == BLOCK_R // 2:
            tile_work(*args, BLOCK_R, BLOCK_R // 2, STAGES)
        elif filled * 4 > BLOCK_R:
            tile_work(*args, BLOCK_R, BLOCK_R // 2, STAGES)
        else:
            tile_work(*args, BLOCK_R, BLOCK_R // 4, STAGES)


# [64 columns, R slots] of the intermediate as the W4A4 replay rounds them: a thread's 16 columns are one NVFP4 block
# (permuted, [R, 64] as the rounding helper takes them)
FRAGMENT_ROUNDING_LAYOUT = gl.constexpr(gl.BlockedLayout([16, 1], [4, 8], [1, 4], [0, 1]))


@gluon.jit
def _gate_up_tile(hidden_states_ptr, slot_pairs_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
                  down_input_scale_ptr, intermediate_ptr, expert, tile, slab_column, hidden, width, pairs_per_row,
                  TILE_ROWS: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    """nvfp4_gate_up_fragment_kernel's work on the first BLOCK_R slots of routed tile `tile` (TILE_ROWS slots)."""
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    ROWS_COPY: gl.constexpr = FRAGMENT_ROWS_COPY_LAYOUT
    num_steps = hidden // FRAGMENT_STEP
    gate_slab = expert * (2 * width // FRAGMENT_ROWS) + slab_column
    gate_words_ptr, gate_scales_ptr, slices = _fragment_step_pointers(
        fragment_words_ptr, block_scales_ptr, gate_slab, num_steps, hidden)
    up_words_ptr, up_scales_ptr, _ = _fragment_step_pointers(
        fragment_words_ptr, block_scales_ptr, gate_slab + width // FRAGMENT_ROWS, num_steps, hidden)
    # the tile's token rows, gathered (padding slots read zeros)
    copy_columns = gl.arange(0, FRAGMENT_STEP, layout=gl.SliceLayout(0, ROWS_COPY))
    pairs = gl.load(slot_pairs_ptr + tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ROWS_COPY)))
    tokens = gl.where(pairs >= 0, pairs // pairs_per_row, 0).to(gl.int64)
    rows_ptr = hidden_states_ptr + tokens[:, None] * hidden + copy_columns[None, :]  # [R, 64]
    rows_mask = gl.broadcast((pairs >= 0)[:, None], copy_columns[None, :] >= 0)
    gate, up = _paired_fragment_products(gate_words_ptr, gate_scales_ptr, up_words_ptr, up_scales_ptr, slices,
                                         rows_ptr, rows_mask[0] & rows_mask[1], None, num_steps, hidden, BLOCK_R,
                                         STAGES)
    # the epilogue of nvfp4_gate_up_kernel: BF16 where transformers rounds, on [64 columns, R slots]
    gate = (gate * (gl.load(global_scale_ptr + 2 * expert) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
    up = (up * (gl.load(global_scale_ptr + 2 * expert + 1) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16)
    gate, up = gate.to(gl.float32), up.to(gl.float32)
    activated = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
    intermediate = (activated * up).to(gl.bfloat16)  # [64 columns, R slots]
    # W4A4: the down input rounded here, by nvfp4_gate_up_kernel's helper. Otherwise the pointer is None, which stays
    # a constexpr inside _run_tile's args (a constexpr flag there would become a runtime value, both branches compiled)
    if down_input_scale_ptr is not None:
        rows = gl.permute(gl.convert_layout(intermediate, FRAGMENT_ROUNDING_LAYOUT), (1, 0))  # [R slots, 64 columns]
        rounded = _round_activations_to_nvfp4(rows.to(gl.float32), gl.load(down_input_scale_ptr + expert), BLOCK_R,
                                              FRAGMENT_ROWS)
        ROUNDED: gl.constexpr = rounded.type.layout
        row_columns = slab_column * FRAGMENT_ROWS + gl.arange(0, FRAGMENT_ROWS, layout=gl.SliceLayout(0, ROUNDED))
        row_slots = tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ROUNDED))
        gl.store(intermediate_ptr + row_slots.to(gl.int64)[:, None] * width + row_columns[None, :], rounded)
    else:
        columns = slab_column * FRAGMENT_ROWS + gl.arange(0, FRAGMENT_ROWS, layout=gl.SliceLayout(1, ACCUMULATOR))
        slots = tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, ACCUMULATOR))
        gl.store(intermediate_ptr + slots.to(gl.int64)[None, :] * width + columns[:, None], intermediate)


# The down kernel starts on a routed tile as soon as gate_up has written that tile's intermediate rows, not after the
# whole gate_up kernel: each gate_up program counts its finished slab column in the tile's slot of tile_columns_done
# (zeroed by the routing), and down's programs of the tile wait there until every column is in. Down is launched with
# programmatic stream serialization, which lets its programs start once every gate_up program has started (gate_up
# says so at its start), so they take the SMs that gate_up's last, partly filled wave leaves idle. No program waits
# for one that has not started, so none can wait forever. The counts are released and acquired at GPU scope, one
# thread a program, behind a barrier of the warp group (the pattern of CUTLASS's split-K semaphores); the outputs are
# the same bits whenever each program runs.

@gluon.jit
def _allow_dependent_launch():
    """The next kernel, if launched with programmatic stream serialization, may start once every program of this one
    has run this (PTX griddepcontrol.launch_dependents)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _count_tile_column_done(tile_columns_done_ptr, tile):
    """Every thread's stores of this program's columns of routed tile `tile` made, one more column counted."""
    gl.thread_barrier()
    gl.atomic_add(tile_columns_done_ptr + tile, 1, sem="release", scope="gpu")


@gluon.jit
def _wait_for_tile_columns(tile_columns_done_ptr, tile, columns):
    """Return once `columns` slab columns of routed tile `tile` are counted, their stores visible to every thread."""
    done = gl.atomic_add(tile_columns_done_ptr + tile, 0, sem="acquire", scope="gpu")
    while done < columns:
        gl.inline_asm_elementwise("nanosleep.u32 200; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        done = gl.atomic_add(tile_columns_done_ptr + tile, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def nvfp4_gate_up_fragment_kernel(
    hidden_states_ptr,  # BF16 [T, H], or [S, H] (one row per pair) when pairs_per_row is 1
    slot_pairs_ptr, tile_experts_ptr,  # as for nvfp4_gate_up_kernel
    fragment_words_ptr,  # int32 [E, 2I/64, H/64, 512]: gate slabs, then up slabs, in fragment order
    block_scales_ptr,  # int32 [E, 2I, H/64]: the block scales as fragment_scales keeps them, four to a word
    global_scale_ptr,  # fp32 [E, 2]
    down_input_scale_ptr,  # fp32 [E]: each expert's down input scale under W4A4, or None
    intermediate_ptr,  # BF16 [P, I]: SiLU(gate) * up of each slot multiplied (a tile's first R, R/2 or R/4 slots),
    # rounded to NVFP4 under W4A4
    tile_columns_done_ptr,  # int32 [P / R]: zeros; each program adds one for its tile once its columns are stored
    num_experts, hidden, width, pairs_per_row,  # as for nvfp4_gate_up_kernel
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
    SMALLEST_ROWS: gl.constexpr,  # ExpertTiles.smallest_rows, or BLOCK_R
):
    # slab_column: 64 columns of gate and of up. The columns vary fastest, so that a tile's columns are done together
    # and the down kernel can start on it while later tiles are still multiplied.
    slab_column, tile = gl.program_id(0), gl.program_id(1)
    _allow_dependent_launch()
    expert = gl.load(tile_experts_ptr + tile)
    filled = _tile_fill(slot_pairs_ptr, tile, BLOCK_R, SMALLEST_ROWS)
    if expert < num_experts:
        args = (hidden_states_ptr, slot_pairs_ptr, fragment_words_ptr, block_scales_ptr, global_scale_ptr,
                down_input_scale_ptr, intermediate_ptr, expert, tile, slab_column, hidden, width, pairs_per_row)
        _run_tile(_gate_up_tile, args, filled, BLOCK_R, STAGES, SMALLEST_ROWS)
        _count_tile_column_done(tile_columns_done_ptr, tile)


@gluon.jit
def _store_pair_outputs(out, slab, pairs, expert, routing_weights_ptr, global_scale_ptr, pair_outputs_ptr, hidden,
                        BLOCK_R: gl.constexpr):
    """The epilogue of nvfp4_down_kernel for the products out [64 output columns of slab `slab`, R slots]: global
    scale, BF16, routing weight, BF16, stored in each pair's row."""
    ACCUMULATOR: gl.constexpr = fragment_accumulator_layout(BLOCK_R)
    out = (out * (gl.load(global_scale_ptr + expert) * DECODED_WEIGHT_DIVISOR)).to(gl.bfloat16).to(gl.float32)
    columns = slab * FRAGMENT_ROWS + gl.arange(0, FRAGMENT_ROWS, layout=gl.SliceLayout(1, ACCUMULATOR))
    pair_rows = gl.where(pairs >= 0, pairs, 0).to(gl.int64)
    out = (out * gl.load(routing_weights_ptr + pair_rows).to(gl.float32)[None, :]).to(gl.bfloat16)
    mask = gl.broadcast((pairs >= 0)[None, :], columns[:, None] >= 0)
    gl.store(pair_outputs_ptr + pair_rows[None, :] * hidden + columns[:, None], out, mask=mask[0] & mask[1])


@gluon.jit
def _down_tile_rows(intermediate_ptr, tile, width, TILE_ROWS: gl.constexpr, BLOCK_R: gl.constexpr):
    """Routed tile `tile`'s first BLOCK_R intermediate rows [R, 64] at step 0 (gate_up wrote zeros in the padding
    slots it multiplied)."""
    ROWS_COPY: gl.constexpr = FRAGMENT_ROWS_COPY_LAYOUT
    copy_columns = gl.arange(0, FRAGMENT_STEP, layout=gl.SliceLayout(0, ROWS_COPY))
    copy_slots = tile * TILE_ROWS + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ROWS_COPY))
    return intermediate_ptr + copy_slots.to(gl.int64)[:, None] * width + copy_columns[None, :]  # [R, 64]


@gluon.jit
def _down_tile_pairs(slot_pairs_ptr, tile, TILE_ROWS: gl.constexpr, BLOCK_R: gl.constexpr):
    """The pairs [R] of the tile's first BLOCK_R slots, as the products' columns lie (read after the products, so
    that they take no registers during them)."""
    slots = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, fragment_accumulator_layout(BLOCK_R)))
    return gl.load(slot_pairs_ptr + tile * TILE_ROWS + slots)


@gluon.jit
def _down_tile(intermediate_ptr, slot_pairs_ptr, routing_weights_ptr, fragment_words_ptr, block_scales_ptr,
               global_scale_ptr, pair_outputs_ptr, tile_columns_done_ptr, expert, tile, slab, hidden, width,
               TILE_ROWS: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    """nvfp4_down_fragment_kernel's work on output slab `slab` and the first BLOCK_R slots of routed tile `tile`
    (TILE_ROWS slots), its rows read once gate_up has written them all (tile_columns_done)."""
    num_steps = width // FRAGMENT_STEP
    words_ptr, scales_ptr, slices = _fragment_step_pointers(
        fragment_words_ptr, block_scales_ptr, expert * (hidden // FRAGMENT_ROWS) + slab, num_steps, width)
    rows_ptr = _down_tile_rows(intermediate_ptr, tile, width, TILE_ROWS, BLOCK_R)
    rows_ready = (tile_columns_done_ptr, tile, width // FRAGMENT_ROWS)
    out = _fragment_products(words_ptr, scales_ptr, slices, rows_ptr, rows_ready, num_steps, width, BLOCK_R, STAGES)
    pairs = _down_tile_pairs(slot_pairs_ptr, tile, TILE_ROWS, BLOCK_R)
    _store_pair_outputs(out, slab, pairs, expert, routing_weights_ptr, global_scale_ptr, pair_outputs_ptr, hidden,
                        BLOCK_R)


@gluon.jit
def _paired_down_tile(intermediate_ptr, slot_pairs_ptr, routing_weights_ptr, fragment_words_ptr, block_scales_ptr,
                      global_scale_ptr, pair_outputs_ptr, tile_columns_done_ptr, expert, tile, slab_pair, hidden,
                      width, TILE_ROWS: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    """_down_tile on output slabs 2 slab_pair and 2 slab_pair + 1, their products in turn."""
    num_steps = width // FRAGMENT_STEP
    slab = 2 * slab_pair
    first_words_ptr, first_scales_ptr, slices = _fragment_step_pointers(
        fragment_words_ptr, block_scales_ptr, expert * (hidden // FRAGMENT_ROWS) + slab, num_steps, width)
    second_words_ptr, second_scales_ptr, _ = _fragment_step_pointers(
        fragment_words_ptr, block_scales_ptr, expert * (hidden // FRAGMENT_ROWS) + slab + 1, num_steps, width)
    rows_ptr = _down_tile_rows(intermediate_ptr, tile, width, TILE_ROWS, BLOCK_R)
    rows_ready = (tile_columns_done_ptr, tile, width // FRAGMENT_ROWS)
    first, second = _paired_fragment_products(first_words_ptr, first_scales_ptr, second_words_ptr, second_scales_ptr,
                                              slices, rows_ptr, None, rows_ready, num_steps, width, BLOCK_R, STAGES)
    pairs = _down_tile_pairs(slot_pairs_ptr, tile, TILE_ROWS, BLOCK_R)
    _store_pair_outputs(first, slab, pairs, expert, routing_weights_ptr, global_scale_ptr, pair_outputs_ptr, hidden,
                        BLOCK_R)
    _store_pair_outputs(second, slab + 1, pairs, expert, routing_weights_ptr, global_scale_ptr, pair_outputs_ptr,
                        hidden, BLOCK_R)


@gluon.jit
def nvfp4_down_fragment_kernel(
    intermediate_ptr,  # BF16 [P, I]
    slot_pairs_ptr, tile_experts_ptr,  # as for nvfp4_gate_up_kernel
    routing_weights_ptr,  # BF16 [S]
    fragment_words_ptr,  # int32 [E, H/64, I/64, 512]
    block_scales_ptr,  # int32 [E, H, I/64]: as for nvfp4_gate_up_fragment_kernel
    global_scale_ptr,  # fp32 [E]
    pair_outputs_ptr,  # BF16 [S, H]: routing weight * down projection of each pair
    tile_columns_done_ptr,  # int32 [P / R]: gate_up's finished columns of each tile
    num_experts, hidden, width,
    BLOCK_R: gl.constexpr, STAGES: gl.constexpr,
    SMALLEST_ROWS: gl.constexpr,  # as for nvfp4_gate_up_fragment_kernel: the same count, so the same slots
    SLAB_PAIRS: gl.constexpr,  # ExpertTiles.down_slab_pairs: two adjacent output slabs a program
):
    # slab_group: one output slab of 64 columns, or a pair. The slab groups vary fastest, so a routed tile's programs
    # run side by side and read its input rows from L2 once fetched: at 2,048 tokens and more the input outgrows L2
    # and, with the tiles first, a tile's groups ran hundreds of tiles apart (one layer's experts 5-9% faster,
    # docs/benchmarks.md)
    slab_group, tile = gl.program_id(0), gl.program_id(1)
    expert = gl.load(tile_experts_ptr + tile)
    filled = _tile_fill(slot_pairs_ptr, tile, BLOCK_R, SMALLEST_ROWS)
    if expert < num_experts:
        # launched while gate_up may still run (programmatic dependent launch): the tile work waits for the tile's
        # columns, once its fill is counted and its first codes are on their way (neither depends on gate_up)
        args = (intermediate_ptr, slot_pairs_ptr, routing_weights_ptr, fragment_words_ptr, block_scales_ptr,
                global_scale_ptr, pair_outputs_ptr, tile_columns_done_ptr, expert, tile, slab_group, hidden, width)
        tile_work: gl.constexpr = _paired_down_tile if SLAB_PAIRS else _down_tile
        _run_tile(tile_work, args, filled, BLOCK_R, STAGES, SMALLEST_ROWS)


# ==== packed experts on FP4 tensor cores (Blackwell) ==================================================================
# GPUs of compute capability 10.x and later multiply NVFP4 by NVFP4 in their tensor cores. torch's grouped scaled matmul
# (torch.nn.functional.scaled_grouped_mm; in torch's CUDA wheels it runs FBGEMM's CUTLASS kernels) takes a layer's
# experts as they sit in memory: the codes viewed as float4_e2m1fn_x2 (two codes a byte, element 2i in the low nibble,
# as ModelOpt packs them), each expert's block scales in the tiled order the tensor cores read (blocked_scales, once at
# load) and an fp32 scale per expert, which multiplies the product. The activations are quantized on the fly with the
# calibrated input scales, to the very values the W4A4 replay rounds them to (nvfp4_activation_blocks): this path
# computes the W4A4 model that was calibrated. The pairs are sorted by expert, unpadded; each expert's run of
# activation block scales starts on a whole tile of 128 rows (grouped_activation_scales), where the matmul looks for
# it. Nothing reads a GPU value on the host, so the layers go into CUDA graphs. torch 2.11 runs this matmul on compute
# capability 10.x only (B200, GB200, B300) and refuses 12.x, which the check at load then reports (check_native_fp4).
# S pairs, C block-scale columns (K/16), E experts.

SCALE_TILE_ROWS, SCALE_TILE_COLUMNS = 128, 4  # a tile of block scales: 512 bytes the tensor cores read together


def blocked_scales(block_scales: torch.Tensor) -> torch.Tensor:
    """Block scales float8_e4m3fn [..., R, C] in the tiled order FP4 tensor cores read them (torch's SWIZZLE_32_4_4)
    -> [..., R' * C'], where R' and C' are R and C padded with zero bytes to whole tiles of 128 rows by 4 columns.

    The tiles follow each other along a row of tiles, then row of tiles after row of tiles; in a tile's 512 bytes,
    row r and column c of the tile sit at (r % 32) * 16 + (r // 32) * 4 + c.
    """
    *batch, rows, columns = block_scales.shape
    padded = torch.nn.functional.pad(block_scales.view(torch.uint8),
                                     (0, -columns % SCALE_TILE_COLUMNS, 0, -rows % SCALE_TILE_ROWS))  # [..., R', C']
    tiles = padded.unflatten(-1, (-1, SCALE_TILE_COLUMNS)).unflatten(-3, (-1, 4, 32))  # [..., R'/128, 4, 32, C'/4, 4]
    ordered = tiles.movedim(-2, -4).transpose(-3, -2)  # [..., R'/128, C'/4, 32, 4, 4]
    return ordered.flatten(len(batch)).view(torch.float8_e4m3fn)


def block_scales_from_blocked(blocked: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """blocked_scales undone: [..., R' * C'] -> float8_e4m3fn [..., R, C]."""
    padded_rows, padded_columns = rows + -rows % SCALE_TILE_ROWS, columns + -columns % SCALE_TILE_COLUMNS
    tiles = blocked.view(torch.uint8).unflatten(
        -1, (padded_rows // SCALE_TILE_ROWS, padded_columns // SCALE_TILE_COLUMNS, 32, 4, SCALE_TILE_COLUMNS))
    natural = tiles.transpose(-3, -2).movedim(-4, -2)  # [..., R'/128, 4, 32, C'/4, 4]
    padded = natural.reshape(*blocked.shape[:-1], padded_rows, padded_columns)
    return padded[..., :rows, :columns].contiguous().view(torch.float8_e4m3fn)


def quantize_nvfp4_activations(activations: torch.Tensor, input_scale: torch.Tensor):
    """Activations [..., K] as the tensor cores' NVFP4 operand: packed codes uint8 [..., K/2] (element 2i in the low
    nibble) and e4m3 block scales [..., K/16], which decode (code * block scale * input_scale) to the W4A4 replay's
    values (nvfp4_activation_blocks).

    One exception, in blocks whose e4m3 scale underflows to 0: the replay multiplies such a block's codes by 1, the
    tensor cores by 0, so their codes are set to 0. The two differ only if a value of the block exceeds 0.25, which
    takes an input scale above 42 (a calibrated input amax above ~115,000).
    """
    codes, e4m3_scales, _ = nvfp4_activation_blocks(activations, input_scale)  # [..., K/16, 16], [..., K/16, 1]
    codes = torch.where(e4m3_scales.float() > 0, codes, 0).flatten(-2)  # [..., K]
    return codes[..., 0::2] | (codes[..., 1::2] << 4), e4m3_scales.squeeze(-1)


# Eager, a dozen passes over every expert input; compiled, one kernel. Token counts vary per request.
quantize_nvfp4_activations_compiled = torch.compile(quantize_nvfp4_activations, dynamic=True)


def grouped_activation_scales(block_scales: torch.Tensor, pair_experts: torch.Tensor,
                              group_ends: torch.Tensor) -> torch.Tensor:
    """The activations' block scales [S, C], their rows sorted by expert (pair_experts [S]; expert e's rows end at
    group_ends[e]), laid out for torch's grouped FP4 matmul: each expert's rows padded to whole tiles of 128 rows, then
    in blocked_scales' order -> [S', C'], where S' depends on S and E only, so CUDA graphs can replay it."""
    num_pairs, columns = block_scales.shape
    group_sizes = torch.diff(group_ends, prepend=group_ends.new_zeros(1))  # [E]
    padded_sizes = (group_sizes + SCALE_TILE_ROWS - 1) // SCALE_TILE_ROWS * SCALE_TILE_ROWS
    padded_starts = padded_sizes.cumsum(0) - padded_sizes  # [E]
    scale_rows = (padded_starts - group_ends + group_sizes)[pair_experts] + torch.arange(
        num_pairs, device=pair_experts.device)  # [S]: the row's place in its expert's padded run
    most_rows = num_pairs + (SCALE_TILE_ROWS - 1) * min(group_ends.numel(), num_pairs)
    scale_bytes = block_scales.view(torch.uint8)
    padded = scale_bytes.new_zeros(most_rows + -most_rows % SCALE_TILE_ROWS, columns)  # [S', C]
    padded.index_copy_(0, scale_rows, scale_bytes)
    blocked = blocked_scales(padded.view(torch.float8_e4m3fn))
    return blocked.view(padded.shape[0], -1)  # [S', C'], two-dimensional as the matmul checks


def nvfp4_grouped_mm(activation_codes: torch.Tensor, activation_scales: torch.Tensor, input_scale: torch.Tensor,
                     weight_codes: torch.Tensor, weight_scales: torch.Tensor, global_scale: torch.Tensor,
                     group_ends: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of the activations times its weights, transposed, on FP4 tensor cores -> BF16 [S, O].

    activation_codes uint8 [S, K/2] sorted by expert, activation_scales from grouped_activation_scales, input_scale
    fp32 [E]; weight_codes uint8 [E, O, K/2], weight_scales [E, O' * C'] (blocked_scales), global_scale fp32 [E];
    group_ends int32 [E], where each expert's rows end.
    """
    functional = torch.nn.functional
    recipe = [functional.ScalingType.BlockWise1x16, functional.ScalingType.TensorWise]
    swizzle = [functional.SwizzleType.SWIZZLE_32_4_4, functional.SwizzleType.NO_SWIZZLE]
    return functional.scaled_grouped_mm(
        activation_codes.view(torch.float4_e2m1fn_x2), weight_codes.view(torch.float4_e2m1fn_x2).transpose(-2, -1),
        scale_a=[activation_scales, input_scale], scale_recipe_a=recipe, swizzle_a=swizzle,
        scale_b=[weight_scales, global_scale], scale_recipe_b=recipe, swizzle_b=swizzle,
        offs=group_ends, output_dtype=torch.bfloat16,
    )


# ==== the packed experts module =======================================================================================

class PackedNVFP4Experts(torch.nn.Module):
    """One layer's experts kept NVFP4-packed in device memory as on disk, in transformers' fused order (for the gluon
    kernels the codes' bytes reordered, `to_fragment_order`; for the native ones the block scales, `to_native_order`).

    Stands in for transformers' Qwen3OmniMoeThinkerTextExperts, with the same forward signature. `kernels` says how
    it computes: "triton", the packed-expert kernels above on the packed bytes; "gluon", the Hopper kernels on the
    codes rewritten in fragment order (`to_fragment_order`, which replaces each `*_packed_codes` by
    `*_fragment_words`); "native", FP4 tensor cores through torch's grouped scaled matmul, W4A4 (`to_native_order`,
    which replaces each `*_block_scales` by `*_blocked_scales`); "unpack", this layer unpacked to BF16 scratch tensors,
    transformers' grouped_mm experts function on them, then freed (the reference).
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
        # int32 [1] on the device while the engine's packed decoder runs a padded bucket: its tokens before the
        # padding, whose pairs the packed kernels' routing skips (PackedTextDecoder.run_padded); None otherwise
        self.real_tokens = None
        uint8, e4m3, fp32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        # gate rows [0, I) then up rows [I, 2I), as transformers fuses them
        self.register_buffer("gate_up_packed_codes", torch.zeros(num_experts, 2 * width, hidden // 2, dtype=uint8))
        self.register_buffer("gate_up_block_scales", torch.zeros(num_experts, 2 * width, hidden // 16, dtype=e4m3))
        # gate's and up's own weight_scale_2: ModelOpt >= 0.43 writes them equal, older exports and compressed-tensors
        # ones need not (docs/nvfp4-format.md §3.2)
        self.register_buffer("gate_up_global_scale", torch.zeros(num_experts, 2, dtype=fp32))
        self.register_buffer("down_packed_codes", torch.zeros(num_experts, hidden, width // 2, dtype=uint8))
        self.register_buffer("down_block_scales", torch.zeros(num_experts, hidden, width // 16, dtype=e4m3))
        self.register_buffer("down_global_scale", torch.zeros(num_experts, dtype=fp32))
        # Each expert's calibrated activation scales (W4A4). ModelOpt >= 0.43 gives every expert of a layer the same
        # one per projection type; older ModelOpt and compressed-tensors exports give each expert its own (§3.2).
        self.register_buffer("gate_up_input_scale", torch.zeros(num_experts, dtype=fp32))
        self.register_buffer("down_input_scale", torch.zeros(num_experts, dtype=fp32))
        self.repair_nan_scales = False  # --repair-nan-scales
        self.repaired_nan_blocks = 0
        self.stored = set()  # (expert, projection, field) received so far
        self.input_scale_values = {"gate_up": set(), "down": set()}  # the distinct input scales stored, per group
        self.unequal_gate_up_input_scale = None  # checkpoint name of an input scale that differs from its partner's

    @property
    def gate_up_input_scales_shared(self) -> bool:
        """All experts round the gate_up input with one scale, so it is rounded once per token, not per pair."""
        return len(self.input_scale_values["gate_up"]) <= 1

    @property
    def down_input_scales_shared(self) -> bool:
        return len(self.input_scale_values["down"]) <= 1

    @property
    def expected_tensor_count(self) -> int:
        return self.num_experts * 3 * (3 + self.has_input_scales)

    @torch.no_grad()
    def store(self, expert: int, projection: str, field: str, tensor: torch.Tensor, checkpoint_name: str) -> None:
        """Put one tensor of one expert in place (ModelOpt's names and convention, docs/nvfp4-format.md §2), checking
        dtype, shape, NaN bytes and scale values."""
        group = "down" if projection == "down_proj" else "gate_up"
        rows = slice(0, None)
        if projection == "gate_proj":
            rows = slice(0, self.width)
        elif projection == "up_proj":
            rows = slice(self.width, 2 * self.width)
        in_features = self.width if group == "down" else self.hidden
        out_features = self.hidden if group == "down" else self.width
        tensor, repaired = checked_nvfp4_tensor(field, tensor, out_features, in_features, checkpoint_name,
                                                self.repair_nan_scales)
        self.repaired_nan_blocks += repaired
        if field == "weight":
            getattr(self, f"{group}_packed_codes")[expert, rows].copy_(tensor)
        elif field == "weight_scale":
            getattr(self, f"{group}_block_scales")[expert, rows].copy_(tensor)
        elif field == "weight_scale_2":
            if group == "down":
                self.down_global_scale[expert] = tensor
            else:
                self.gate_up_global_scale[expert, int(projection == "up_proj")] = tensor
        else:
            input_scale = getattr(self, f"{group}_input_scale")
            partner = {"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(projection)
            if (expert, partner, field) in self.stored and input_scale[expert] != tensor:
                self.unequal_gate_up_input_scale = checkpoint_name
            input_scale[expert] = tensor
            self.input_scale_values[group].add(tensor.item())
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

    @torch.no_grad()
    def to_fragment_order(self) -> None:
        """For the gluon kernels: each projection's codes rewritten in fragment order and its block scales as the
        bytes the kernels read (fragment_scales), in place of the checkpoint's (the same number of bytes, so the same
        memory once the old ones are freed). A block with a zero or negative scale is first rewritten as the same
        weights with a positive one (with_positive_block_scales)."""
        for group in ("gate_up", "down"):
            packed_codes, block_scales = with_positive_block_scales(getattr(self, f"{group}_packed_codes"),
                                                                    getattr(self, f"{group}_block_scales"))
            delattr(self, f"{group}_packed_codes")
            delattr(self, f"{group}_block_scales")
            self.register_buffer(f"{group}_fragment_words", fragment_words(packed_codes))
            self.register_buffer(f"{group}_fragment_scales", fragment_scales(block_scales))

    @torch.no_grad()
    def to_native_order(self) -> None:
        """For the native kernels: each projection's block scales in the tiled order the tensor cores read
        (blocked_scales) in place of the checkpoint's (the same bytes at full size, where rows and columns fill whole
        tiles). The tensor cores read scales unsigned, so a block with a zero or negative scale is first rewritten as
        the same weights with a positive one (with_positive_block_scales). The gate_up product is scaled by each
        expert's gate global scale; where up's differs (exports before ModelOpt 0.43), up's rows are rescaled after."""
        for group in ("gate_up", "down"):
            packed_codes, block_scales = with_positive_block_scales(getattr(self, f"{group}_packed_codes"),
                                                                    getattr(self, f"{group}_block_scales"))
            delattr(self, f"{group}_block_scales")
            setattr(self, f"{group}_packed_codes", packed_codes)
            self.register_buffer(f"{group}_blocked_scales", blocked_scales(block_scales))
        gate_scale, up_scale = self.gate_up_global_scale.unbind(1)
        self.register_buffer("up_over_gate_scale", None if torch.equal(gate_scale, up_scale) else up_scale / gate_scale)

    def use_kernels(self, kernels: str) -> None:
        """Compute with `kernels` ("gluon", "triton", "native" or "unpack": resolve_expert_kernels) from now on, with
        this layer's weights laid out once, here, as those kernels read them."""
        self.kernels = kernels
        if kernels == "gluon":
            self.to_fragment_order()
        elif kernels == "native":
            self.to_native_order()

    def checkpoint_layout(self, group: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A projection's packed codes uint8 [E, O, C/2] and block scales float8_e4m3fn [E, O, C/16] as checkpoints
        lay them out, whichever way they are kept (after to_fragment_order or to_native_order, the same weights: a
        zero or negative scale's block may come back rewritten)."""
        if hasattr(self, f"{group}_fragment_words"):
            return (packed_codes_from_fragment_words(getattr(self, f"{group}_fragment_words")),
                    block_scales_from_fragment_scales(getattr(self, f"{group}_fragment_scales")))
        packed_codes = getattr(self, f"{group}_packed_codes")
        if hasattr(self, f"{group}_blocked_scales"):
            _, rows, half_columns = packed_codes.shape
            return packed_codes, block_scales_from_blocked(getattr(self, f"{group}_blocked_scales"), rows,
                                                           half_columns // 8)
        return packed_codes, getattr(self, f"{group}_block_scales")

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's experts in BF16: gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
        unpack = unpack_nvfp4_compiled if self.gate_up_global_scale.is_cuda else unpack_nvfp4
        gate_up_proj = unpack(*self.checkpoint_layout("gate_up"), self.gate_up_global_scale)
        down_proj = unpack(*self.checkpoint_layout("down"), self.down_global_scale)
        return gate_up_proj, down_proj

    @torch.no_grad()
    def unpack_into(self, experts: torch.nn.Module) -> None:
        """--no-packed-nvfp4: write the dequantised weights into transformers' stock experts module."""
        gate_up_proj, down_proj = self.unpacked()
        experts.gate_up_proj.copy_(gate_up_proj)
        experts.down_proj.copy_(down_proj)

    def apply_gate(self, gate_up_out: torch.Tensor, down_input_scale: torch.Tensor) -> torch.Tensor:
        # gate_up_out [S, 2I] -> [S, I]; down_input_scale 0-d, or [S, 1, 1] for the expert of each row
        gate, up = gate_up_out.chunk(2, dim=-1)
        intermediate = self.act_fn(gate) * up
        if self.simulate_fp4_activations:
            intermediate = fake_quant(intermediate, down_input_scale)
        return intermediate

    # The engine compiles the decoder layers around this module (PackedTextDecoder.compile_layers); these kernels are
    # launched by hand with tiles chosen from the token count, so torch.compile leaves them out of its graphs.
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                residual: torch.Tensor | None = None):
        # hidden_states [T, H], top_k_index / top_k_weights [T, K] -> [T, H]; plus residual [T, H] where given (the
        # decoder layer's residual add, which the packed kernels' top-k sum does: ResidualInTopKSumLayer)
        if self.kernels == "gluon":
            return self.forward_fragments(hidden_states, top_k_index, top_k_weights, residual)
        if self.kernels == "triton":
            return self.forward_packed(hidden_states, top_k_index, top_k_weights, residual)
        if self.kernels == "native":
            out = self.forward_native(hidden_states, top_k_index, top_k_weights)
        else:
            out = self.forward_unpacked(hidden_states, top_k_index, top_k_weights)
        return out if residual is None else residual + out

    def kernels_gate_up_input(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor):
        """The gate_up kernels' input and its pairs per row: the hidden states [T, H] (K pairs a row); under W4A4
        rounded to NVFP4 once per token, or once per pair [S, H] (one pair a row) when each expert has its own input
        scale."""
        if not self.simulate_fp4_activations:
            return hidden_states, top_k_index.shape[1]
        if self.gate_up_input_scales_shared:
            return round_activations_to_nvfp4(hidden_states, self.gate_up_input_scale[:1]), top_k_index.shape[1]
        return round_activations_to_nvfp4(hidden_states, self.gate_up_input_scale, top_k_index), 1

    def forward_packed(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       residual: torch.Tensor | None = None):
        """The packed-expert kernels: route, gate_up with SiLU * up fused, down with the routing weight, top-k sum
        (plus residual, where given)."""
        num_tokens, top_k = top_k_index.shape
        tiles = expert_tiles(top_k_index.numel(), self.num_experts, EXPERT_TILES)
        pair_outputs = hidden_states.new_empty(num_tokens * top_k, self.hidden)  # [S, H]
        slot_pairs, tile_experts, _ = route_to_row_tiles(top_k_index, self.num_experts, tiles.rows, self.real_tokens)
        num_tiles = tile_experts.numel()
        common = dict(INTERPRETED=not hidden_states.is_cuda, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        gate_up_input, pairs_per_row = self.kernels_gate_up_input(hidden_states, top_k_index)
        gate_up_columns = fitted_block(tiles.columns, self.width)
        intermediate = hidden_states.new_empty(num_tiles * tiles.rows, self.width)  # [P, I]
        nvfp4_gate_up_kernel[(num_tiles, self.width // gate_up_columns)](
            gate_up_input.contiguous(), slot_pairs, tile_experts,
            self.gate_up_packed_codes, self.gate_up_block_scales.view(torch.uint8), self.gate_up_global_scale,
            self.down_input_scale, 1, intermediate, self.num_experts, self.hidden, self.width, pairs_per_row,
            SIMULATE_FP4=self.simulate_fp4_activations, BLOCK_R=tiles.rows, BLOCK_N=gate_up_columns,
            BLOCK_C=fitted_block(tiles.reduced, self.hidden), **common,
        )
        down_rows = tiles.down_rows or tiles.rows
        down_columns = fitted_block(tiles.down_columns or tiles.columns, self.hidden)
        nvfp4_down_kernel[(num_tiles * tiles.rows // down_rows, self.hidden // down_columns)](
            intermediate, slot_pairs, tile_experts, top_k_weights.to(hidden_states.dtype).reshape(-1),
            self.down_packed_codes, self.down_block_scales.view(torch.uint8), self.down_global_scale,
            pair_outputs, self.num_experts, self.hidden, self.width, ROUTED_ROWS=tiles.rows,
            BLOCK_R=down_rows, BLOCK_N=down_columns, BLOCK_C=fitted_block(tiles.reduced, self.width), **common,
        )
        return sum_top_k(pair_outputs, top_k, self.real_tokens, residual)

    def forward_fragments(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          residual: torch.Tensor | None = None):
        """The gluon kernels: route, gate_up with SiLU * up fused (under W4A4 also the down input's rounding), down
        with the routing weight, top-k sum (plus residual, where given)."""
        num_tokens, top_k = top_k_index.shape
        tiles = expert_tiles(top_k_index.numel(), self.num_experts, FRAGMENT_TILES)
        pair_outputs = hidden_states.new_empty(num_tokens * top_k, self.hidden)  # [S, H]
        slot_pairs, tile_experts, tile_columns_done = route_to_row_tiles(
            top_k_index, self.num_experts, tiles.rows, self.real_tokens)
        num_tiles = tile_experts.numel()
        # every program one warp group; down on pairs of output slabs where the table asks and the slabs pair up
        common = dict(BLOCK_R=tiles.rows, STAGES=tiles.num_stages, SMALLEST_ROWS=tiles.smallest_rows or tiles.rows,
                      num_warps=4)
        slab_pairs = tiles.down_slab_pairs and (self.hidden // FRAGMENT_ROWS.value) % 2 == 0
        gate_up_input, pairs_per_row = self.kernels_gate_up_input(hidden_states, top_k_index)
        intermediate = hidden_states.new_empty(num_tiles * tiles.rows, self.width)  # [P, I]
        nvfp4_gate_up_fragment_kernel[(self.width // FRAGMENT_ROWS.value, num_tiles)](
            gate_up_input.contiguous(), slot_pairs, tile_experts, self.gate_up_fragment_words,
            self.gate_up_fragment_scales.view(torch.int32), self.gate_up_global_scale,
            self.down_input_scale if self.simulate_fp4_activations else None, intermediate, tile_columns_done,
            self.num_experts, self.hidden, self.width, pairs_per_row, **common,
        )
        nvfp4_down_fragment_kernel[(self.hidden // (FRAGMENT_ROWS.value * (2 if slab_pairs else 1)), num_tiles)](
            intermediate, slot_pairs, tile_experts, top_k_weights.to(hidden_states.dtype).reshape(-1),
            self.down_fragment_words, self.down_fragment_scales.view(torch.int32), self.down_global_scale, pair_outputs,
            tile_columns_done, self.num_experts, self.hidden, self.width, SLAB_PAIRS=slab_pairs, launch_pdl=True,
            **common,
        )
        return sum_top_k(pair_outputs, top_k, self.real_tokens, residual)

    def forward_native(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """FP4 tensor cores, W4A4: the pairs sorted by expert, the gate_up input quantized with the calibrated input
        scales, gate_up, SiLU * up, the down input quantized, down, the routing weight, the top-k sum."""
        num_tokens, top_k = top_k_index.shape
        pair_experts, pair_order = top_k_index.reshape(-1).sort(stable=True)  # [S], [S]: pairs by expert
        group_ends = torch.searchsorted(pair_experts, torch.arange(self.num_experts, device=pair_experts.device),
                                        right=True, out_int32=True)  # [E]
        pair_tokens = pair_order // top_k  # [S]
        quantize = quantize_nvfp4_activations_compiled if hidden_states.is_cuda else quantize_nvfp4_activations
        if self.gate_up_input_scales_shared:  # each token quantized once, its codes gathered for each of its pairs
            codes, scales = quantize(hidden_states, self.gate_up_input_scale[0])  # [T, H/2], [T, H/16]
            codes, scales = codes[pair_tokens], scales[pair_tokens]  # [S, H/2], [S, H/16]
        else:
            codes, scales = quantize(hidden_states[pair_tokens], self.gate_up_input_scale[pair_experts][:, None, None])
        gate_up = nvfp4_grouped_mm(codes, grouped_activation_scales(scales, pair_experts, group_ends),
                                   self.gate_up_input_scale, self.gate_up_packed_codes, self.gate_up_blocked_scales,
                                   self.gate_up_global_scale[:, 0], group_ends)  # [S, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        if self.up_over_gate_scale is not None:
            up = (up.float() * self.up_over_gate_scale[pair_experts][:, None]).to(up.dtype)
        intermediate = self.act_fn(gate) * up  # [S, I]
        down_input_scale = (self.down_input_scale[0] if self.down_input_scales_shared
                            else self.down_input_scale[pair_experts][:, None, None])
        codes, scales = quantize(intermediate, down_input_scale)  # [S, I/2], [S, I/16]
        down = nvfp4_grouped_mm(codes, grouped_activation_scales(scales, pair_experts, group_ends),
                                self.down_input_scale, self.down_packed_codes, self.down_blocked_scales,
                                self.down_global_scale, group_ends)  # [S, H]
        weighted = down * top_k_weights.reshape(-1)[pair_order, None].to(down.dtype)
        pair_outputs = torch.empty_like(weighted).index_copy_(0, pair_order, weighted)  # [S, H] in (token, k) order
        return pair_outputs.view(num_tokens, top_k, self.hidden).sum(dim=1).to(hidden_states.dtype)  # fp32 sum

    @torch.no_grad()
    def compile_kernels(self) -> None:
        """Run this layer's kernels once per tile configuration, so that no request pays Triton's compile (seconds).
        The unpack path and the native kernels (torch's own matmul) have nothing of ours to compile."""
        if self.kernels not in ("gluon", "triton"):
            return
        forward, table = ((self.forward_fragments, FRAGMENT_TILES) if self.kernels == "gluon"
                          else (self.forward_packed, EXPERT_TILES))
        generator = torch.Generator(self.gate_up_global_scale.device).manual_seed(0)
        for most_pairs_per_expert, _ in table:
            pairs_per_expert = most_pairs_per_expert or 2 * table[-2][0]  # the catch-all row: twice the last bound
            num_tokens = max(1, pairs_per_expert * self.num_experts // self.top_k)
            hidden_states = torch.randn(num_tokens, self.hidden, generator=generator, device=generator.device)
            router_logits = torch.randn(num_tokens, self.num_experts, generator=generator, device=generator.device)
            top_k_weights, top_k_index = router_logits.softmax(-1).topk(self.top_k, dim=-1)
            forward(hidden_states.to(torch.bfloat16), top_k_index, top_k_weights.to(torch.bfloat16))

    def forward_unpacked(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        num_tokens, top_k = top_k_index.shape
        gate_up_input, experts_index, routing_weights = hidden_states, top_k_index, top_k_weights
        down_input_scale = self.down_input_scale[0]
        row_per_pair = self.simulate_fp4_activations and not self.gate_up_input_scales_shared
        if self.simulate_fp4_activations and not row_per_pair:
            gate_up_input = fake_quant(hidden_states, self.gate_up_input_scale[0])
        elif row_per_pair:
            # Each expert rounds its input with its own scale: one row per (token, expert) pair, which the grouped_mm
            # function below sees as S tokens routed to one expert each.
            pair_experts = top_k_index.reshape(-1)  # [S]
            gate_up_input = fake_quant(hidden_states.repeat_interleave(top_k, dim=0),
                                       self.gate_up_input_scale[pair_experts][:, None, None])  # [S, H]
            experts_index, routing_weights = top_k_index.reshape(-1, 1), top_k_weights.reshape(-1, 1)  # [S, 1]
        if self.simulate_fp4_activations and not self.down_input_scales_shared:
            # the function applies the gate to the pairs sorted by expert
            down_input_scale = self.down_input_scale[top_k_index.reshape(-1).sort().values][:, None, None]  # [S, 1, 1]
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
            _apply_gate=lambda gate_up_out: self.apply_gate(gate_up_out, down_input_scale),
            gate_up_proj=gate_up_proj,
            down_proj=down_proj,
        )
        out = grouped_mm_experts_forward(stock_experts_view, gate_up_input, experts_index, routing_weights)
        if row_per_pair:  # sum each token's K rows, as the function does
            out = out.view(num_tokens, top_k, self.hidden).sum(dim=1)
        return out


# ==== checkpoint loading ==============================================================================================

SIBLING_FILES = "joint_schema_model.py and synthetic_release.py, beside serve_clef.py in the serve_clef repository"
SYNTHETIC_MODELS = ("synthetic", "synthetic:full")


class CheckpointError(ValueError):
    """A checkpoint or flag combination that cannot be served; the message says what is wrong and how to fix it."""


class CheckpointFormat(enum.StrEnum):
    """The format of a checkpoint's thinker, read from its files (never from a flag); its value is what the console
    and /healthz show. The formats served are listed in docs/nvfp4-format.md §9."""

    BF16 = "bf16"  # a BF16 release
    MODELOPT_NVFP4 = "modelopt:NVFP4"  # ModelOpt W4A4: packed weights and their calibrated input scales
    MODELOPT_W4A16_NVFP4 = "modelopt:W4A16_NVFP4"  # ModelOpt weight-only: packed weights
    MODELOPT_MIXED_PRECISION = "modelopt:MIXED_PRECISION"  # ModelOpt, a quant_algo per layer (quantized_layers)
    COMPRESSED_TENSORS_NVFP4 = "compressed-tensors:NVFP4"  # llm-compressor nvfp4-pack-quantized, W4A4
    COMPRESSED_TENSORS_NVFP4A16 = "compressed-tensors:NVFP4A16"  # llm-compressor nvfp4-pack-quantized, weight-only

    @property
    def quantized(self) -> bool:
        return self is not CheckpointFormat.BF16

    @property
    def compressed_tensors(self) -> bool:
        """compressed-tensors' tensor names, and global scales that are the reciprocals of ModelOpt's (§7)."""
        return self in (CheckpointFormat.COMPRESSED_TENSORS_NVFP4, CheckpointFormat.COMPRESSED_TENSORS_NVFP4A16)


def module_matches(pattern: str, module: str) -> bool:
    """An exclude/ignore/target entry against a module name: compressed-tensors' "re:" regular expressions (matched
    from the start), else an exact name or a ModelOpt wildcard such as `name*` or `name.*`."""
    if pattern.startswith("re:"):
        return re.match(pattern.removeprefix("re:"), module) is not None
    return fnmatch.fnmatchcase(module, pattern)


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's quantization metadata says (docs/nvfp4-format.md §1, §7), read once at load.

    Which modules are quantized, and how, is given by quant_algo names of ModelOpt (upper case): "NVFP4" (W4A4:
    weights and, through the calibrated input scale, activations) or "W4A16_NVFP4" (weights only).
    """

    kind: CheckpointFormat
    source: str = ""  # the file the metadata was read from, for messages
    producer: str = ""  # the tool and version that wrote the checkpoint, when the files say
    excluded: tuple[str, ...] = ()  # modules left unquantized (exclude_modules / ignore entries)
    target_algos: tuple[tuple[tuple[str, ...], str], ...] = ()  # (targets, quant_algo) per group; "Linear": every one
    layer_algos: dict[str, str] | None = None  # MIXED_PRECISION: each quantized module's quant_algo
    experts_algo: str | None = None  # the quant_algo of the MoE experts (one for all of them)

    @property
    def experts_w4a4(self) -> bool:
        """The experts carry calibrated input scales, which --simulate-fp4-activations replays."""
        return self.experts_algo == "NVFP4"

    def algo_of(self, module: str) -> str | None:
        """The quant_algo the metadata gives a module (its name on disk), None when it says the module is not
        quantized."""
        if any(module_matches(pattern, module) for pattern in self.excluded):
            return None
        if self.layer_algos is not None:
            return self.layer_algos.get(module)
        for targets, algo in self.target_algos:
            if any(target == "Linear" or module_matches(target, module) for target in targets):
                return algo
        return None


@dataclasses.dataclass
class LoadedClef:
    model: torch.nn.Module  # schema.ClefModel, eval, on device
    processor: Any
    schema: types.ModuleType  # the joint_schema_model module in use
    kind: CheckpointFormat
    expert_kernels: str  # "native", "gluon", "triton" or "unpack" for packed experts, "bf16" for stock BF16 experts
    model_id: str  # what --model said
    checkpoint_dir: Path
    load_s: float
    notice: str | None  # e.g. the synthetic warning


SYNTHETIC_NOTICE = "synthetic checkpoint: random weights, every answer is meaningless (for testing the server only)"
SYNTHETIC_MARKER = "synthetic_release.json"  # synthetic_release.py writes it into every release; exports copy it
# Nothing is calibrated in a synthetic checkpoint, so every expert input gets the input_scale that max calibration
# gives activations whose absolute max is 6: 6 / (6 * 448).
SYNTHETIC_INPUT_SCALE = 6.0 / (6 * 448)
SERVED_QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4")  # ModelOpt's quant_algo names served, compared upper-cased
SERVED_FORMATS = ("BF16 releases, ModelOpt NVFP4 / W4A16_NVFP4 / MIXED_PRECISION (of those) exports and "
                  "compressed-tensors nvfp4-pack-quantized ones (see docs/nvfp4-format.md §9)")
# With the model on a GPU the CPU only prepares requests (media decoding, the processor, the tokenizer), on small
# tensors: on the H200's 16-CPU host, torch's default of one thread per CPU prepared an image 1.6x, a sound 2.1x and a
# video 1.1x slower than 8 threads did, with the same tensors out (docs/benchmarks.md, 2026-12-03 19:27 UTC).
PREPARATION_CPU_THREADS = 8

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


# One expert projection as a module name, as MIXED_PRECISION's quantized_layers lists it.
EXPERT_MODULE = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")
# The tensors of one NVFP4 linear as compressed-tensors names them, and ModelOpt's names for them (§7): the loader
# reads every layout in ModelOpt's names and convention. compressed-tensors' global scales are the reciprocals.
COMPRESSED_TENSORS_FIELDS = {
    "weight_packed": "weight",
    "weight_global_scale": "weight_scale_2",
    "input_global_scale": "input_scale",
}
NVFP4_SCALE_FIELDS = ("weight_scale", "weight_scale_2", "input_scale")
# FP8 KV-cache scales (ModelOpt's kv_cache_quant_algo FP8 on k_proj / v_proj, compressed-tensors' kv_cache_scheme on
# the attention module): serve_clef keeps its KV cache in BF16 and never reads them.
KV_CACHE_SCALE_FIELDS = ("k_scale", "v_scale")


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


def read_checkpoint_json(path: Path) -> dict:
    """A checkpoint's JSON metadata file, which must hold an object; a damaged download or a hand edit gets a one-line
    refusal naming the file, not the parser's traceback."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # unreadable, not UTF-8, or not JSON
        raise CheckpointError(f"{path} cannot be read as JSON ({error}): download or export it again") from None
    return metadata_object(value, str(path))


def metadata_object(value: Any, where: str) -> dict:
    """`value` if it is a JSON object, else a one-line refusal naming where it was read."""
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} holds {type(value).__name__} {str(value)[:80]!r} where a JSON object belongs: "
                              "download or export the checkpoint again")
    return value


def served_algo(algo: Any, group_size: Any, where: str) -> str:
    """A ModelOpt quant_algo (any case) that serve_clef serves, upper-cased; else a one-line refusal."""
    if str(algo).upper() not in SERVED_QUANT_ALGOS or group_size not in (None, 16):
        raise CheckpointError(
            f"{where}: quant_algo {algo!r} (group size {group_size}) is not served; serve_clef serves NVFP4 and "
            "W4A16_NVFP4 with group size 16: export the thinker with ModelOpt in one of them"
        )
    return str(algo).upper()


def modelopt_quantization(quantization: dict, producer: dict | None, source: str) -> CheckpointQuantization:
    """hf_quant_config.json's "quantization", or config.json's quantization_config with quant_method modelopt."""
    producer_name = f"{producer.get('name', 'modelopt')} {producer.get('version', '')}".strip() if producer else ""
    excluded = tuple(quantization.get("exclude_modules", quantization.get("ignore")) or ())
    algo = str(quantization.get("quant_algo")).upper()
    if algo == "MIXED_PRECISION":
        layer_algos = {}
        layers = metadata_object(quantization.get("quantized_layers") or {}, f"{source}: quantized_layers")
        for module, layer in layers.items():
            layer = metadata_object(layer, f"{source}: quantized_layers.{module}")
            layer_algos[module] = served_algo(layer.get("quant_algo"), layer.get("group_size"), f"{source}: {module}")
        expert_algos = {algo for module, algo in layer_algos.items() if EXPERT_MODULE.search(module)}
        if len(expert_algos) > 1:
            raise CheckpointError(f"{source}: its experts mix {' and '.join(sorted(expert_algos))}, which is not "
                                  "served; export every expert in one of them")
        return CheckpointQuantization(CheckpointFormat.MODELOPT_MIXED_PRECISION, source, producer_name, excluded,
                                      layer_algos=layer_algos, experts_algo=next(iter(expert_algos), None))
    group_size = quantization.get("group_size")
    groups = metadata_object(quantization.get("config_groups") or {}, f"{source}: config_groups")
    for group_name, group in groups.items():
        group = metadata_object(group, f"{source}: config_groups.{group_name}")
        weights = metadata_object(group.get("weights") or {}, f"{source}: config_groups.{group_name}.weights")
        group_size = weights.get("group_size", group_size)
    algo = served_algo(quantization.get("quant_algo"), group_size, source)
    return CheckpointQuantization(CheckpointFormat("modelopt:" + algo), source, producer_name, excluded,
                                  target_algos=((("Linear",), algo),), experts_algo=algo)


def compressed_tensors_quantization(quantization: dict, source: str) -> CheckpointQuantization:
    """config.json's quantization_config with quant_method compressed-tensors: NVFP4 (W4A4, activations `dynamic:
    local`) and NVFP4A16 groups of the nvfp4-pack-quantized format (docs/nvfp4-format.md §7)."""
    if quantization.get("quantization_status", "compressed") != "compressed":
        raise CheckpointError(f"{source}: quantization_status {quantization['quantization_status']!r}, the weights "
                              "are not packed; serve a compressed (saved with save_compressed) checkpoint")
    target_algos = []
    groups = metadata_object(quantization.get("config_groups") or {}, f"{source}: config_groups")
    for group_name, group in groups.items():
        group = metadata_object(group, f"{source}: config_groups.{group_name}")
        weights = metadata_object(group.get("weights") or {}, f"{source}: config_groups.{group_name}.weights")
        activations = group.get("input_activations")
        group_format = group.get("format") or quantization.get("format")
        nvfp4 = {"num_bits": 4, "type": "float", "group_size": 16}
        # NVFP4's scheme: a global scale over the group scales (strategy tensor_group), symmetric, weights static
        nvfp4_scheme = {"strategy": "tensor_group", "symmetric": True}
        served = (
            group_format == "nvfp4-pack-quantized"
            and nvfp4.items() <= weights.items()
            and all(weights.get(key, value) == value for key, value in (nvfp4_scheme | {"dynamic": False}).items())
            and (activations is None or (isinstance(activations, dict)
                                         and (nvfp4 | {"dynamic": "local"}).items() <= activations.items()
                                         and all(activations.get(key, value) == value
                                                 for key, value in nvfp4_scheme.items())))
        )
        if not served:
            raise CheckpointError(
                f"{source}: config group {group_name} (format {group_format!r}, weights {weights.get('num_bits')}-bit "
                f"{weights.get('type')} strategy {weights.get('strategy')!r}, input activations "
                f"{'none' if activations is None else activations}) is not served; serve_clef serves "
                "nvfp4-pack-quantized NVFP4 (W4A4, dynamic local activations) and NVFP4A16, strategy tensor_group"
            )
        target_algos.append((tuple(group.get("targets") or ()), "W4A16_NVFP4" if activations is None else "NVFP4"))
    algos = {algo for _, algo in target_algos}
    if len(algos) != 1:
        raise CheckpointError(f"{source}: config groups {'mix W4A4 and W4A16' if algos else 'are missing'}, which is "
                              "not served; quantize the thinker with one NVFP4 or NVFP4A16 scheme")
    algo = algos.pop()
    kind = (CheckpointFormat.COMPRESSED_TENSORS_NVFP4 if algo == "NVFP4"
            else CheckpointFormat.COMPRESSED_TENSORS_NVFP4A16)
    version = quantization.get("version")
    return CheckpointQuantization(kind, source, f"compressed-tensors {version}" if version else "",
                                  tuple(quantization.get("ignore") or ()), tuple(target_algos), experts_algo=algo)


def checkpoint_quantization(checkpoint_dir: Path) -> CheckpointQuantization:
    """The checkpoint's format and quantization metadata: hf_quant_config.json where there is one, else config.json's
    quantization_config (on the model, the thinker or its text config), else a BF16 release."""
    for required in ("config.json", "joint_head_config.json", "joint_head.safetensors"):
        if not (checkpoint_dir / required).exists():
            raise CheckpointError(
                f"{checkpoint_dir} has no {required}: not a Clef-Omni model directory (a quantized export needs the "
                "release's joint_head*, tokenizer and processor files copied beside it)"
            )
    config = read_checkpoint_json(checkpoint_dir / "config.json")  # read here first: transformers' reader would crash
    quant_config_path = checkpoint_dir / "hf_quant_config.json"
    if quant_config_path.exists():
        hf_quant_config = read_checkpoint_json(quant_config_path)
        producer = hf_quant_config.get("producer")
        return modelopt_quantization(
            metadata_object(hf_quant_config.get("quantization"), f"{quant_config_path}: quantization"),
            None if producer is None else metadata_object(producer, f"{quant_config_path}: producer"),
            str(quant_config_path))
    thinker_config = config.get("thinker_config") or {}
    quantization = (config.get("quantization_config") or thinker_config.get("quantization_config")
                    or (thinker_config.get("text_config") or {}).get("quantization_config"))
    source = f"{checkpoint_dir / 'config.json'} quantization_config"
    if quantization is None:
        return CheckpointQuantization(CheckpointFormat.BF16)
    quantization = metadata_object(quantization, source)
    if quantization.get("quant_method") == "modelopt":
        return modelopt_quantization(quantization, quantization.get("producer"), source)
    if quantization.get("quant_method") == "compressed-tensors":
        return compressed_tensors_quantization(quantization, source)
    raise CheckpointError(f"{source}: quant_method {quantization.get('quant_method')!r} is not served; serve_clef "
                          f"serves {SERVED_FORMATS}")


def resolve_expert_kernels(choice: str, device: torch.device, text_config: transformers.PretrainedConfig | None = None,
                           experts_w4a4: bool = True) -> str:
    """What --expert-kernels means on `device`: "native", "gluon", "triton" or "unpack" (see PackedNVFP4Experts). The
    native kernels need FP4 tensor cores (compute capability 10.x and later), torch's grouped scaled matmul, an export
    with calibrated input scales (experts_w4a4) and hidden size and width in multiples of 32; the gluon kernels a
    Hopper GPU and multiples of 64 (text_config; None: not known yet, taken as fitting). load_clef then checks the
    native kernels on the GPU (check_native_fp4), and where they fail there `auto` takes the triton kernels."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    hopper = capability == (9, 0)
    fits = text_config is None or (text_config.hidden_size % 64 == 0 and text_config.moe_intermediate_size % 64 == 0)
    native_refusal = None  # why the native kernels cannot run here
    if capability is None or capability[0] < 10:
        where = "a CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
        native_refusal = f"needs FP4 tensor cores (a GPU of compute capability 10.x or later); {device} is {where}"
    elif not hasattr(torch.nn.functional, "scaled_grouped_mm"):
        native_refusal = ("needs torch's grouped scaled matmul (torch.nn.functional.scaled_grouped_mm), which torch "
                          f"{torch.__version__} lacks")
    elif not experts_w4a4:
        native_refusal = ("computes W4A4 and needs an NVFP4 (W4A4) export whose experts carry calibrated input "
                          "scales; this one is W4A16")
    elif text_config is not None and (text_config.hidden_size % 32 or text_config.moe_intermediate_size % 32):
        native_refusal = (f"needs hidden size and expert width in multiples of 32, this model has "
                          f"{text_config.hidden_size} and {text_config.moe_intermediate_size}")
    if choice == "native" and native_refusal:
        raise CheckpointError(f"--expert-kernels native {native_refusal}: use --expert-kernels triton, which runs on "
                              "any CUDA GPU")
    if choice == "native" or (choice == "auto" and native_refusal is None):
        return "native"
    if choice == "auto" and device.type == "cuda":
        return "gluon" if hopper and fits else "triton"
    if choice == "auto":
        return "unpack"
    if choice == "gluon" and not hopper:
        raise CheckpointError(f"--expert-kernels gluon needs a Hopper GPU (compute capability 9.0), not {device}: use "
                              "--expert-kernels triton, which runs on any CUDA GPU")
    if choice == "gluon" and not fits:
        raise CheckpointError(f"--expert-kernels gluon needs hidden size and expert width in multiples of 64, this "
                              f"model has {text_config.hidden_size} and {text_config.moe_intermediate_size}: use "
                              "--expert-kernels triton")
    if choice == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise CheckpointError(
            "--expert-kernels triton on CPU runs only under Triton's interpreter (slow, for tests): set "
            "TRITON_INTERPRET=1, or use --expert-kernels unpack"
        )
    return choice


NATIVE_CHECK_MEAN_ERROR = 0.05  # of the mean |output|: a misread layout gives ~1, FP4 rounding flips about 0.02


@torch.no_grad()
def check_native_fp4(expert_stores: dict[str, PackedNVFP4Experts], text_config: transformers.PretrainedConfig,
                     device: torch.device) -> float:
    """Whether the native kernels can serve these experts on `device`: the mean error, relative to the mean output,
    of a random layer of the model's sizes (8 experts, 2 a token, gate and up with different global scales) through
    them against the unpack path's W4A4 replay. Raises CheckpointError where they cannot: an expert whose gate and up
    input scales differ (the fused gate_up input is quantized with one), torch's matmul failing on this GPU, an error
    beyond NATIVE_CHECK_MEAN_ERROR, or, on a GPU, a CUDA graph of the layer that cannot be captured or replays to
    other bits. No GPU with FP4 tensor cores has run this check for serve_clef's developers."""
    for store in expert_stores.values():
        if store.unequal_gate_up_input_scale is not None:
            raise CheckpointError(f"--expert-kernels native quantizes each expert's gate_up input with one scale, and "
                                  f"checkpoint tensor {store.unequal_gate_up_input_scale} differs from its expert's "
                                  "other gate/up input scale")
    sizes = types.SimpleNamespace(num_experts=8, num_experts_per_tok=2, hidden_size=text_config.hidden_size,
                                  moe_intermediate_size=text_config.moe_intermediate_size)
    generator = torch.Generator(device).manual_seed(0)

    def uniform(shape: torch.Size, low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator, device=device) * (high - low) + low

    with torch.device(device):
        layer = PackedNVFP4Experts(sizes, torch.nn.functional.silu, has_input_scales=True)
    for group in ("gate_up", "down"):
        codes, block_scales = getattr(layer, f"{group}_packed_codes"), getattr(layer, f"{group}_block_scales")
        codes.copy_(torch.randint(0, 256, codes.shape, generator=generator, device=device, dtype=torch.int16))
        block_scales.copy_(uniform(block_scales.shape, 20, 120))  # with the global scales, weights of std ~0.02
        global_scale = getattr(layer, f"{group}_global_scale")
        global_scale.copy_(uniform(global_scale.shape, 5e-5, 1.5e-4))
    layer.gate_up_input_scale.fill_(3.0 / (6 * 448))
    layer.down_input_scale.fill_(0.05 / (6 * 448))
    layer.simulate_fp4_activations = True
    hidden_states = torch.randn(61, sizes.hidden_size, generator=generator, device=device).to(torch.bfloat16)  # [T, H]
    top_k_weights, top_k_index = torch.randn(61, 8, generator=generator, device=device).softmax(-1).topk(2, dim=-1)
    inputs = (hidden_states, top_k_index, top_k_weights.to(torch.bfloat16))  # [T, H], [T, 2], [T, 2]
    reference = layer.forward_unpacked(*inputs).float()
    layer.to_native_order()
    try:
        output = layer.forward_native(*inputs).float()
    except (RuntimeError, ValueError) as error:  # torch's checks raise both
        raise CheckpointError(f"--expert-kernels native: torch {torch.__version__}'s grouped FP4 matmul failed on "
                              f"{device}: {' '.join(str(error).split())[:300]}") from error
    mean_error = ((output - reference).abs().mean() / reference.abs().mean()).item()
    if not mean_error <= NATIVE_CHECK_MEAN_ERROR:
        raise CheckpointError(f"--expert-kernels native: on a random layer torch's grouped FP4 matmul differs from the "
                              f"unpack path's W4A4 replay by {mean_error:.3f} of the mean output on {device} (expected "
                              f"under {NATIVE_CHECK_MEAN_ERROR})")
    if device.type == "cuda":  # the engine replays the layers in CUDA graphs: the layer must replay to the same bits
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = layer.forward_native(*inputs)
            graph.replay()
        except RuntimeError as error:
            raise CheckpointError(f"--expert-kernels native: torch's grouped FP4 matmul cannot be captured in a CUDA "
                                  f"graph on {device}: {' '.join(str(error).split())[:300]}") from error
        if not torch.equal(replayed.float(), output):
            raise CheckpointError("--expert-kernels native: replayed in a CUDA graph, the layer's outputs differ from "
                                  f"its eager ones on {device}")
    return mean_error


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
        try:
            processor = transformers.AutoProcessor.from_pretrained(checkpoint_dir)
        except ImportError as error:  # Qwen3-Omni's video processor imports torchvision
            first_sentence = " ".join(str(error).split()).split(". ")[0]
            raise CheckpointError(
                f"{checkpoint_dir}'s processor cannot be built here ({first_sentence}): install torchvision, the "
                "build matching your torch; the release's Qwen3-Omni processor needs it"
            ) from None
    # A state is tokenised whole, then cut to --max-length by encode_record, so the tokenizer's own limit (65,536 in
    # the release's tokenizer_config.json) would only warn, misleadingly, of "indexing errors" on every long state.
    processor.tokenizer.model_max_length = transformers.tokenization_utils_base.VERY_LARGE_INTEGER
    return processor


def checkpoint_tensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every thinker tensor of a safetensors checkpoint as (name on disk, tensor on CPU), one shard at a time."""
    index_path = checkpoint_dir / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = metadata_object(read_checkpoint_json(index_path).get("weight_map"), f"{index_path}: weight_map")
        shards = sorted(set(weight_map.values()))
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
    quantization: CheckpointQuantization,
    expert_stores: dict[str, "PackedNVFP4Experts"],
    repair_nan_scales: bool,
    progress: Callable[[str], None],
) -> dict[str, torch.Tensor]:
    """Fill the thinker from a stream of (checkpoint name, tensor) in any on-disk layout and format.

    Every tensor is read in ModelOpt's names and convention (compressed-tensors' are renamed, their global scales
    inverted). Experts go to `expert_stores` (quantized formats: packed, as on disk) or into the stock fused BF16
    parameters (bf16). Other NVFP4 linears (attention, towers) are unpacked to BF16 once all their tensors are in.
    Fails naming any checkpoint tensor that maps to nothing and any parameter or expert tensor left unfilled.
    Returns the calibrated input scale of each W4A4 linear outside the experts, by module name.
    """
    kind = quantization.kind
    experts = experts_modules(thinker)
    targets = {
        name: tensor
        for name, tensor in thinker.state_dict(keep_vars=True).items()
        if not name.startswith(tuple(experts_name + "." for experts_name in experts))
    }
    live_names, experts_names = set(targets), set(experts)
    filled, bf16_experts_filled = set(), set()
    linear_parts = {}  # weight name -> {field: tensor}: NVFP4 linears outside the experts, until complete
    linear_input_scales = {}  # module name -> input scale of the W4A4 ones
    expert_tensors_per_layer = {name: 0 for name in experts}
    num_experts = thinker.config.text_config.num_experts
    unused_kv_cache_scales, unused_input_scales = 0, 0
    repaired_nan_blocks, unpacked_linears = 0, 0
    w4a4_linears = set()  # NVFP4 modules outside the experts whose metadata says W4A4
    tensor_count, byte_count, layers_done, start = 0, 0, 0, time.perf_counter()
    for checkpoint_name, tensor in tensors:
        if is_talker_tensor(checkpoint_name):
            continue
        tensor_count += 1
        byte_count += tensor.nbytes
        module_on_disk, _, field = checkpoint_name.rpartition(".")
        if field in KV_CACHE_SCALE_FIELDS:
            unused_kv_cache_scales += 1
            continue
        if kind.compressed_tensors and field in COMPRESSED_TENSORS_FIELDS:
            if field != "weight_packed":
                tensor = 1.0 / tensor  # compressed-tensors divides by its global scales, ModelOpt multiplies
            field = COMPRESSED_TENSORS_FIELDS[field]
        nvfp4_part = field in NVFP4_SCALE_FIELDS or (field == "weight" and tensor.dtype == torch.uint8)
        if nvfp4_part:
            algo = quantization.algo_of(module_on_disk)
            if algo is None and not kind.quantized:
                raise CheckpointError(
                    f"checkpoint tensor {checkpoint_name} is part of an NVFP4 linear, but the checkpoint has no "
                    "quantization metadata: a quantized export needs its hf_quant_config.json or config.json's "
                    "quantization_config"
                )
            if algo is None:
                raise CheckpointError(
                    f"checkpoint tensor {checkpoint_name} is part of an NVFP4 linear, but {quantization.source} says "
                    f"{module_on_disk} is not quantized; fix its exclude/ignore list (or quantized_layers)"
                )
            if field == "input_scale" and algo != "NVFP4":
                unused_input_scales += 1
                continue
        name = thinker_tensor_name(f"{module_on_disk}.weight" if nvfp4_part else checkpoint_name, live_names,
                                   experts_names)
        if name is None:
            raise CheckpointError(
                f"checkpoint tensor {checkpoint_name} maps to no parameter of the Qwen3-Omni thinker of transformers "
                f"{transformers.__version__} (in neither the hub nor the transformers-internal name layout); is this "
                "a Clef-Omni checkpoint?"
            )
        expert_match = EXPERT_TENSOR.fullmatch(name)
        if expert_match is not None:
            experts_name, expert = expert_match["experts"], int(expert_match["expert"])
            projection = expert_match["projection"]
            if expert >= num_experts:
                raise CheckpointError(f"checkpoint tensor {checkpoint_name}: the model has only {num_experts} experts")
            if kind.quantized and not nvfp4_part and quantization.algo_of(module_on_disk) is None:
                raise CheckpointError(
                    f"checkpoint tensor {checkpoint_name}: {tensor.dtype} expert weights in a quantized export, "
                    f"whose {quantization.source} leaves {module_on_disk} unquantized; "
                    "serve_clef serves quantized exports whose experts are all NVFP4: quantize every layer's experts, "
                    "or serve the BF16 release"
                )
            if not kind.quantized:
                store_bf16_expert(experts[experts_name], expert, projection, field, tensor, checkpoint_name)
                bf16_experts_filled.add((experts_name, expert, projection))
                expected = 3 * num_experts
            else:
                expert_stores[experts_name].store(expert, projection, field, tensor, checkpoint_name)
                expected = expert_stores[experts_name].expected_tensor_count
            expert_tensors_per_layer[experts_name] += 1
            if expert_tensors_per_layer[experts_name] == expected:
                layers_done += 1
                progress(f"experts of {layers_done}/{len(experts)} layers loaded "
                         f"({tensor_count} tensors, {byte_count / 2**30:.2f} GiB read)")
        elif nvfp4_part:
            out_features, in_features = targets[name].shape
            checked, repaired = checked_nvfp4_tensor(field, tensor, out_features, in_features, checkpoint_name,
                                                     repair_nan_scales)
            repaired_nan_blocks += repaired
            if field == "input_scale":
                linear_input_scales[name.removesuffix(".weight")] = checked.to(targets[name].device)
                continue
            if algo == "NVFP4":
                w4a4_linears.add(name.removesuffix(".weight"))
            parts = linear_parts.setdefault(name, dict.fromkeys(("weight", "weight_scale", "weight_scale_2")))
            parts[field] = checked
            if all(part is not None for part in parts.values()):  # all in: unpack once, to BF16
                weight = unpack_nvfp4(parts["weight"][None], parts["weight_scale"][None], parts["weight_scale_2"][None])
                targets[name].copy_(weight[0])  # [out, in]
                filled.add(name)
                unpacked_linears += 1
                del linear_parts[name]
        else:
            if tuple(tensor.shape) != tuple(targets[name].shape) or not tensor.dtype.is_floating_point:
                raise CheckpointError(
                    f"checkpoint tensor {checkpoint_name}: {tensor.dtype} {list(tensor.shape)}, the thinker expects "
                    f"a floating point {list(targets[name].shape)}"
                )
            targets[name].copy_(tensor)
            filled.add(name)

    missing = sorted(set(targets) - filled - set(linear_parts))
    missing += [
        f"{name.removesuffix('.weight')}.{field}"
        for name, parts in linear_parts.items()
        for field, part in parts.items()
        if part is None
    ]
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
            repaired_nan_blocks += store.repaired_nan_blocks
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} thinker tensors, first {missing[:3]} (transformers-internal names); "
            "the download or export is incomplete"
        )
    load_s = time.perf_counter() - start
    progress(f"thinker loaded: {tensor_count} tensors, {byte_count / 2**30:.2f} GiB in {load_s:.1f} s")
    if unpacked_linears:
        progress(f"{unpacked_linears} NVFP4 linears outside the experts unpacked to BF16")
    uncalibrated = w4a4_linears - set(linear_input_scales)
    if uncalibrated:
        progress(f"{len(uncalibrated)} W4A4 linears outside the experts have no input_scale (their input quantizer "
                 f"was never calibrated, e.g. {min(uncalibrated)}): --simulate-fp4-activations leaves their inputs "
                 "in BF16")
    if repaired_nan_blocks:
        progress(f"--repair-nan-scales: {repaired_nan_blocks} NaN block scales (0x7F/0xFF) loaded as 448")
    if unused_kv_cache_scales:
        progress(f"{unused_kv_cache_scales} KV-cache scales (k_scale/v_scale) skipped: unused, serve_clef keeps its "
                 "KV cache in BF16")
    if unused_input_scales:
        progress(f"{unused_input_scales} input_scale tensors of weight-only (W4A16) layers ignored: weight-only "
                 "serving never uses them")
    return linear_input_scales


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
            f"quantization metadata, expected a BF16 {list(target.shape)} weight; a quantized export needs its "
            "hf_quant_config.json or config.json's quantization_config"
        )
    target.copy_(weight)


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
    writes them for the thinker experts (docs/nvfp4-format.md §1): every unquantized module by name, or by a
    wildcard at the end of a name."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    num_layers = config["thinker_config"]["text_config"]["num_hidden_layers"]
    exclude_modules = sorted([
        "thinker.audio_tower*",
        "thinker.lm_head",
        "thinker.model.embed_tokens",
        *(f"thinker.model.layers.{layer}.mlp.gate" for layer in range(num_layers)),
        *(f"thinker.model.layers.{layer}.self_attn*" for layer in range(num_layers)),
        "thinker.visual*",
    ])
    producer = {"name": "modelopt", "version": "0.47.0"}
    quantization = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16}
    hf_quant_config = {"producer": producer, "quantization": quantization | {"exclude_modules": exclude_modules}}
    (checkpoint_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=4))
    nvfp4 = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
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
    repair_nan_scales: bool = False,
    progress: Callable[[str], None] = print,
) -> LoadedClef:
    """Load a Clef-Omni checkpoint for `decide`: the Python API behind the command line's flags.

    model: a hub id, a local model directory, "synthetic" or "synthetic:full" (--model). device: a torch device,
    default cuda when available, else cpu (--device). revision: the hub revision (--revision). expert_kernels:
    "auto", "gluon", "triton", "unpack" or "native" (--expert-kernels). simulate_fp4_activations: faithful W4A4 replay
    (--simulate-fp4-activations). packed_nvfp4: False unpacks NVFP4 experts to BF16 at load (--no-packed-nvfp4).
    repair_nan_scales: load NaN block scales as 448 instead of refusing them (--repair-nan-scales). progress:
    receives one line per loading step. Raises CheckpointError with a one-line fix. On a GPU it also caps torch's CPU
    threads for the process at PREPARATION_CPU_THREADS, which prepare requests faster than one per CPU.
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
    quantization = checkpoint_quantization(checkpoint_dir)
    kind = quantization.kind
    if simulate_fp4_activations and not quantization.experts_w4a4:
        raise CheckpointError(
            f"--simulate-fp4-activations replays W4A4 activations and needs an NVFP4 (W4A4) export whose experts have "
            f"calibrated input scales; {checkpoint_dir} is {kind}: drop the flag"
        )
    if simulate_fp4_activations and not packed_nvfp4:
        raise CheckpointError("--simulate-fp4-activations runs inside the packed experts: drop --no-packed-nvfp4")
    packed = kind.quantized and packed_nvfp4
    schema = import_joint_schema_model(checkpoint_dir, progress)

    config = transformers.AutoConfig.from_pretrained(checkpoint_dir)
    text_config = config.thinker_config.text_config
    asked_kernels = expert_kernels
    expert_kernels = (resolve_expert_kernels(asked_kernels, device, text_config, quantization.experts_w4a4) if packed
                      else "bf16")
    experts_form = f"packed NVFP4 experts, {expert_kernels} kernels" if packed else "BF16 experts"
    written_by = f", written by {quantization.producer}" if quantization.producer else ""
    progress(f"loading {kind} checkpoint {checkpoint_dir} onto {device} ({experts_form}{written_by})")
    if expert_kernels == "triton" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10:
        progress("this GPU has FP4 tensor cores, which serve_clef's native kernels use with W4A4 exports only "
                 "(--expert-kernels native says why not here): the experts run W4A16 (or the W4A4 replay) through the "
                 "Triton kernels")
    thinker = build_backbone(config, device, zero_width_experts=packed).thinker
    expert_stores = {}
    if kind.quantized:
        with torch.device(device):
            expert_stores = {
                name: PackedNVFP4Experts(text_config, experts.act_fn, has_input_scales=quantization.experts_w4a4)
                for name, experts in experts_modules(thinker).items()
            }
        for store in expert_stores.values():
            store.repair_nan_scales = repair_nan_scales
    if packed:
        for experts_name, store in expert_stores.items():
            parent_name, _, attribute = experts_name.rpartition(".")
            setattr(thinker.get_submodule(parent_name), attribute, store)
    if tensors is None:
        tensors = checkpoint_tensors(checkpoint_dir)
    linear_input_scales = load_thinker_weights(thinker, tensors, quantization, expert_stores, repair_nan_scales,
                                               progress)
    if expert_kernels == "native":
        try:
            mean_error = check_native_fp4(expert_stores, text_config, device)
        except CheckpointError as refusal:
            if asked_kernels == "native":
                raise
            progress(f"{refusal}; the experts run the triton kernels instead")
            expert_kernels = "triton"
        else:
            progress(f"native FP4 kernels (W4A4: each expert input quantized to NVFP4 with its calibrated scale) agree "
                     f"with the unpack path on this GPU: mean error {mean_error:.4f} of the mean output on a random "
                     "layer. serve_clef's developers have not run them on a GPU with FP4 tensor cores themselves, "
                     "hence this check at every load")
    if expert_kernels in ("gluon", "triton") and text_config.hidden_act != "silu":
        raise CheckpointError(f"--expert-kernels {expert_kernels} fuses SiLU; this model's experts use "
                              f"{text_config.hidden_act}: use --expert-kernels unpack")
    if simulate_fp4_activations:
        for experts_name, store in expert_stores.items():
            if store.unequal_gate_up_input_scale is not None:
                raise CheckpointError(
                    f"--simulate-fp4-activations: checkpoint tensor {store.unequal_gate_up_input_scale} differs from "
                    "its expert's other gate/up input scale, and the fused gate_up input is rounded with one scale: "
                    "drop the flag (the experts then run W4A16)"
                )
        for module_name, input_scale in linear_input_scales.items():
            replay_nvfp4_input_rounding(thinker.get_submodule(module_name), input_scale)
    if kind.quantized and not packed:
        for experts_name, store in expert_stores.items():
            store.unpack_into(thinker.get_submodule(experts_name))
    del expert_stores  # --no-packed-nvfp4: the packed copies are no longer needed
    for experts in experts_modules(thinker).values():
        if isinstance(experts, PackedNVFP4Experts):
            experts.simulate_fp4_activations = simulate_fp4_activations
            experts.use_kernels(expert_kernels)

    head_config_path = checkpoint_dir / "joint_head_config.json"
    head_config = read_checkpoint_json(head_config_path)
    head_signature = inspect.signature(schema.JointSchemaHead)
    try:
        head_signature.bind(**head_config)
    except TypeError as error:  # a key the constructor does not take, or one it needs missing
        raise CheckpointError(f"{head_config_path}: {error}; its keys are the joint head's arguments "
                              f"({', '.join(head_signature.parameters)}): copy it from the release") from None
    if head_config["hidden_size"] != text_config.hidden_size:
        raise CheckpointError(
            f"{head_config_path}: hidden_size {head_config['hidden_size']} differs from the thinker's text hidden size "
            f"{text_config.hidden_size}; the joint head belongs to another model"
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
    packed_decoder = install_packed_decoder(thinker)
    install_rope_index_from_host(thinker, progress)
    install_placeholder_masks_checked_on_host(thinker, progress)
    tied_embeddings = packed_decoder.decoder.embed_tokens.weight is clef_model.output_embeddings.weight
    if device.type == "cuda" and not tied_embeddings:  # a table tied to the lm_head stays on the device
        packed_decoder.decoder.embed_tokens = HostEmbedding(packed_decoder.decoder.embed_tokens)
    if device.type == "cuda":
        torch.set_num_threads(min(torch.get_num_threads(), PREPARATION_CPU_THREADS))
    # before the warm-up, which captures the batched head's graphs (its check runs the decoder op by op)
    install_batched_head(clef_model, schema, processor, progress)
    if device.type == "cuda" and not tied_embeddings and isinstance(clef_model.head, BatchedJointSchemaHead):
        # the batched head looks up just its option tokens' rows (the decision module's head indexes the table on
        # the device), so the output embeddings can live on the host too
        clef_model.output_embeddings = HostEmbedding(clef_model.output_embeddings)
    if device.type == "cuda":
        warm_up_engine(clef_model, schema, processor, packed_decoder, progress)
    loaded = LoadedClef(clef_model, processor, schema, kind, expert_kernels, model, checkpoint_dir, 0.0, notice)
    if device.type == "cuda":
        # The warm-ups above ran the decision module's path and the check batch; the server's own walk (the batch
        # collated on the host, its copies from pinned memory, the host tables' gathers, the logits' one copy back)
        # first runs here, not in the first request, which would pay for its first pinned blocks and the like.
        decide(loaded, {**HEAD_CHECK_REQUEST, "model": WARM_UP_REQUEST["model"]})
    loaded.load_s = time.perf_counter() - start
    progress(f"Clef model ready ({kind}) in {loaded.load_s:.1f} s")
    return loaded


def load_from_args(args: argparse.Namespace, progress: Callable[[str], None] = print) -> LoadedClef:
    """load_clef with the command line's flags (see parse_args)."""
    return load_clef(
        args.model, device=args.device, revision=args.revision, expert_kernels=args.expert_kernels,
        simulate_fp4_activations=args.simulate_fp4_activations, packed_nvfp4=not args.no_packed_nvfp4,
        repair_nan_scales=args.repair_nan_scales, progress=progress,
    )


# ==== engine: batches of records, packed, in CUDA graphs ==============================================================
# A decision is one prefill of a few hundred to a few thousand tokens, and many arrive at once. The engine scores a
# batch of B records in one forward of the thinker: the thinker embeds them as a right-padded batch, as transformers
# does, and its text decoder (where nearly all the work is) runs them packed into one sequence of their real tokens,
# T = the sum of their lengths, with attention kept within each record (a Triton kernel of our own on CUDA; cuDNN's
# causal attention for a batch of one record, which nothing but padding follows). Every record keeps its own rotary
# positions, and MoE routing is per token, so no record sees another or the padding.
#
# Launched op by op, a forward is bound by the host (5,559 kernel launches for ~42 ms of GPU work at 516 tokens on an
# H200). So the decoder's layers are compiled (torch.compile fuses their small elementwise kernels) and the packed
# decoder runs from CUDA graphs captured at load, two per bucket of packed lengths (several records, one): the packed
# embeddings, positions and record boundaries are copied into the bucket's static inputs, padded at the end with one
# more "record" of zeros, the graph is replayed and the real rows are copied out. The vision and audio towers replay
# graphs of their layers (TowerLayerStep, below); their code around those layers and the embedding merge stay eager,
# and so does the packed decoder for batches longer than the largest bucket. Nothing in the graphed part reads a GPU
# value on the host.

# Steps of 64 tokens up to 1,024, then 128 up to 2,048 and 256 up to 8,192: a batch pays at most ~12% padding past
# 512 tokens (coarser buckets, up to 50%, measured 66 ms at 516 tokens and 203 ms at 2,050 on an H200). Past 4,096,
# steps of 256 rather than 512 served 16 clients of ~512 tokens over HTTP 1.2% faster on an H100 (their forwards of 8
# records, ~4,160 tokens, had padded to 4,608; docs/benchmarks.md), for 8 more buckets' graphs at load (~6 s).
# One more bucket of 544 tokens: a lone record of 513-544 tokens would pad to 576, where cuBLAS picks slower tiles for
# the attention's output projection (48 layers' 1.17-1.21 against 0.97 ms of a 516-token forward on an H100, the same
# bits; docs/benchmarks.md).
DECODER_BUCKETS = (  # tokens
    *range(64, 512 + 1, 64), 544, *range(576, 1024 + 1, 64), *range(1152, 2048 + 1, 128), *range(2304, 8192 + 1, 256)
)
MAX_RECORDS_PER_FORWARD = 32  # records in one forward (the graphs' attention chunks are counted for them)
# The text decoder's attention over a batch of several records runs in chunks of at most QUERY_CHUNK queries of one
# record, each seeing its record's keys up to its own last query (packed_causal_attention_kernel, below). A graph's
# grid is fixed before it knows the batch, and in chunks it covers about the real queries whatever the records'
# lengths (flash attention's varlen kernel, served until 2026-12-06 and given the records whole, had launched (longest
# record / 128) x records x heads programs, the longest being the bucket: chunks took a 16-record forward's attention
# from 14.7 to 12.6 ms on an H100, docs/benchmarks.md).
QUERY_CHUNK = 128
# chunks of the largest bucket: each record, and the padding after them, may end one chunk early
MAX_QUERY_CHUNKS = DECODER_BUCKETS[-1] // QUERY_CHUNK + MAX_RECORDS_PER_FORWARD + 1
# The attention implementation of the text decoder and of the vision and audio towers, registered below. transformers
# hands an implementation whose name contains "flash" the boundaries of the sequences packed in a tower's input (each
# image, frame or audio window), so a tower layer's attention is one call; under any other name each sequence is a
# call of its own, after a host read of their lengths in every layer.
PACKED_ATTENTION = "serve_clef_flash_varlen"


def query_chunks(boundaries: list[int], chunks: int) -> np.ndarray:
    """Boundaries of the records packed in a sequence ([0, ..., T], record i the tokens [b[i], b[i+1])) -> the text
    decoder's attention chunks (QUERY_CHUNK's comment), int32 [2, chunks + 1]: the chunks' query boundaries (chunk c:
    queries [q[c], q[c+1])) and each chunk's first key (its record's first token). The chunks past the records' are
    empty, at T."""
    starts, first_keys = [], []
    for record_start, record_end in itertools.pairwise(boundaries):
        for start in range(record_start, record_end, QUERY_CHUNK):
            starts.append(start)
            first_keys.append(record_start)
    if len(starts) > chunks:
        raise ValueError(f"{len(starts)} attention chunks in a packed sequence sized for {chunks}")
    total = boundaries[-1]
    table = np.full((2, chunks + 1), total, dtype=np.int32)  # [2, C + 1]
    table[0, :len(starts)] = starts
    table[1, :len(starts)] = first_keys
    return table


# The decoder's attention over several records (Triton, on the tensor cores through tl.dot). Flash attention's varlen
# kernel, served until 2026-12-06, is FlashAttention-2, built on Ampere's mma.sync: it ran a 16-record forward's
# attention at ~125 TFLOP/s on an H100. cuDNN's Hopper kernel (a lone record's, packed_records_attention) takes one
# record per plan. A program takes Q queries of one chunk for G query heads that share a key-value head: M = G x Q rows
# of its products, so each key and value row it reads serves G heads (Clef-Omni's 32 query heads share 4 key-value
# heads). Its queries see every key of their record before their first (no mask) and the rest up to themselves
# (causal): two loops. Online softmax in fp32 with base-2 exponentials, the probabilities rounded to BF16 for their
# product with the values, as flash attention does. On an H100 a 16-record layer's attention took 131 instead of
# flash's 245 us, its error against fp32 the same (docs/benchmarks.md).
# Q queries of a chunk, G heads together, M = G x Q rows, K keys a step, D head dimension.

@dataclasses.dataclass(frozen=True)
class AttentionTiles:
    queries: int  # Q: QUERY_CHUNK or a part of it
    heads: int  # G: query heads of one key-value head together
    keys: int  # K
    num_warps: int
    num_stages: int


# Swept on an H100 (26 settings, 1-16 records of ~500 tokens, docs/benchmarks.md): at 16 records several heads a
# program beat one (131-139 against 156-158 us), steps of 32 keys beat 16 and 64 (by 15-25%), and the best settings
# lie within 2% of each other.
PACKED_ATTENTION_TILES = AttentionTiles(queries=16, heads=8, keys=32, num_warps=8, num_stages=3)


@triton.jit
def _attend_block(query, key_ptr, value_ptr, key_rows, key_stride, value_stride, head_dims, allowed, best, total,
                  accumulator, scale_log2, INTERPRETED: tl.constexpr):
    """One step of online softmax: the query rows [M, D] against keys `key_rows` [K] (allowed [M, K] or None) ->
    running max [M], running sum [M], accumulator [M, D]."""
    keys = tl.load(key_ptr + key_rows[None, :] * key_stride + head_dims[:, None])  # [D, K]
    values = tl.load(value_ptr + key_rows[:, None] * value_stride + head_dims[None, :])  # [K, D]
    if INTERPRETED:  # the interpreter's BF16 dots are wrong (the expert kernels' numerics note); fp32 gives the same
        query, keys, values = query.to(tl.float32), keys.to(tl.float32), values.to(tl.float32)
    scores = tl.dot(query, keys) * scale_log2  # [M, K]
    if allowed is not None:
        scores = tl.where(allowed, scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, axis=1))  # [M]
    probabilities = tl.exp2(scores - new_best[:, None])  # [M, K]
    correction = tl.exp2(best - new_best)  # [M]
    total = total * correction + tl.sum(probabilities, axis=1)
    probabilities = probabilities.to(tl.bfloat16).to(values.dtype)  # BF16 values, as the tensor cores take them
    update = tl.dot(probabilities, values)  # [M, D]
    return new_best, total, accumulator * correction[:, None] + update


@triton.jit
def packed_causal_attention_kernel(
    query_ptr, key_ptr, value_ptr,  # BF16 [T, Hq, D], [T, Hkv, D], [T, Hkv, D]; the head dimension contiguous
    out_ptr,  # BF16 [T, Hq, D], contiguous
    chunks_ptr,  # int32 [2, C + 1]: query_chunks' table (query boundaries, first keys)
    chunk_row,  # C + 1
    query_stride, query_head_stride, key_stride, key_head_stride, value_stride, value_head_stride,
    num_heads,  # Hq
    # the softmax scale times log2(e): a constant, as torch.compile's launcher would pass a float argument as fp64
    SCALE_LOG2: tl.constexpr,
    HEADS_PER_KEY: tl.constexpr,  # Hq / Hkv
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, HEADS: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # head_group: G query heads; the head groups of a chunk side by side, so its keys stay in L2; part: which Q
    # queries of the chunk
    head_group, chunk, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_start = tl.load(chunks_ptr + chunk) + part * BLOCK_Q
    query_end = tl.minimum(tl.load(chunks_ptr + chunk + 1), query_start + BLOCK_Q)
    first_key = tl.load(chunks_ptr + chunk_row + chunk)
    if query_end > query_start:
        head_dims = tl.arange(0, HEAD_DIM)  # [D]
        row = tl.arange(0, HEADS * BLOCK_Q)  # [M]: head after head, each its Q queries
        heads = head_group * HEADS + row // BLOCK_Q  # [M]
        query_rows = query_start + row % BLOCK_Q  # [M]
        query = tl.load(query_ptr + query_rows[:, None] * query_stride + heads[:, None] * query_head_stride
                        + head_dims[None, :], mask=(query_rows < query_end)[:, None], other=0.0)  # [M, D]
        key_ptr += (head_group * HEADS // HEADS_PER_KEY) * key_head_stride
        value_ptr += (head_group * HEADS // HEADS_PER_KEY) * value_head_stride
        best = tl.full([HEADS * BLOCK_Q], float("-inf"), tl.float32)  # [M]
        total = tl.zeros([HEADS * BLOCK_Q], tl.float32)  # [M]
        accumulator = tl.zeros([HEADS * BLOCK_Q, HEAD_DIM], tl.float32)  # [M, D]
        # whole steps of the record's keys before these queries: every query sees them
        unmasked_end = first_key + (query_start - first_key) // BLOCK_K * BLOCK_K
        for key_start in range(first_key, unmasked_end, BLOCK_K):
            key_rows = key_start + tl.arange(0, BLOCK_K)  # [K]
            best, total, accumulator = _attend_block(
                query, key_ptr, value_ptr, key_rows, key_stride, value_stride, head_dims, None, best, total,
                accumulator, SCALE_LOG2, INTERPRETED)
        # the rest up to the last query, each query up to itself
        for key_start in range(unmasked_end, query_end, BLOCK_K):
            key_rows = key_start + tl.arange(0, BLOCK_K)  # [K]
            allowed = (key_rows[None, :] <= query_rows[:, None]) & (key_rows < query_end)[None, :]  # [M, K]
            safe_rows = tl.minimum(key_rows, query_end - 1)  # past the last query: read its key, masked out
            best, total, accumulator = _attend_block(
                query, key_ptr, value_ptr, safe_rows, key_stride, value_stride, head_dims, allowed, best, total,
                accumulator, SCALE_LOG2, INTERPRETED)
        out = accumulator / total[:, None]
        tl.store(out_ptr + (query_rows[:, None] * num_heads + heads[:, None]) * HEAD_DIM + head_dims[None, :],
                 out.to(tl.bfloat16), mask=(query_rows < query_end)[:, None])


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunks: torch.Tensor,
                            scaling: float) -> torch.Tensor:
    """Causal attention within each record of a packed sequence, in the chunks of query_chunks' table (int32
    [2, C + 1]): query [T, Hq, D], key and value [T, Hkv, D] (grouped-query heads, Hq a multiple of Hkv) -> [T, Hq, D].
    Runs on CUDA and, under TRITON_INTERPRET=1, on CPU tensors."""
    total, num_heads, head_dim = query.shape
    tiles = PACKED_ATTENTION_TILES
    heads_per_key = num_heads // key.shape[1]
    heads = math.gcd(tiles.heads, heads_per_key)  # a program's heads share their key-value head
    out = torch.empty(total, num_heads, head_dim, dtype=torch.bfloat16, device=query.device)  # [T, Hq, D]
    packed_causal_attention_kernel[(num_heads // heads, chunks.shape[1] - 1, QUERY_CHUNK // tiles.queries)](
        query, key, value, out, chunks, chunks.shape[1], query.stride(0), query.stride(1), key.stride(0),
        key.stride(1), value.stride(0), value.stride(1), num_heads, SCALE_LOG2=scaling * math.log2(math.e),
        HEADS_PER_KEY=heads_per_key, HEAD_DIM=head_dim, BLOCK_Q=tiles.queries, HEADS=heads, BLOCK_K=tiles.keys,
        INTERPRETED=not query.is_cuda, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def packed_records_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, *, is_causal: bool = True,
    attention_chunks: torch.Tensor | None = None, one_record: bool = False,
    cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each record of a packed sequence, transformers' attention-function signature. The text
    decoder passes its chunks (attention_chunks, int32 [2, C + 1], as `query_chunks` makes them; causal);
    the towers pass their sequences' boundaries (cu_seq_lens_q [B + 1], repeats being empty sequences, and
    max_length_q, the longest or more) and is_causal=False.

    query [1, Hq, T, D], key and value [1, Hkv, T, D] (grouped-query: Hq a multiple of Hkv) -> [1, T, Hq, D]. On CUDA,
    neither builds a plan per length: the decoder's chunks take packed_causal_attention, the towers flash attention's
    varlen kernel, which takes the grouped heads as they are (aten's op, as torch.nn.attention.varlen calls it: that
    wrapper's signature differs across torch 2.10-2.12 and 2.9 lacks it). Elsewhere: the same attention spelled out as
    SDPA with a mask (how CPU tests check the packing).

    one_record (the text decoder's graphs of a one-record batch, PackedTextDecoder): the sequence is one record
    followed by padding, so plain causal attention keeps the record to itself, and cuDNN's fused attention runs it in
    about half flash varlen's time on an H200 (22 against 45 us at 576 tokens, 94 against 201 us at 2,176; it takes
    the grouped heads as they are), and in less than packed_causal_attention's on an H100 (22.5 against 27 us at 576
    tokens, where one record's chunks give the kernel too few programs to fill the GPU). cuDNN builds a plan per
    length (~150 ms), which the graphs build once, at load.
    """
    if query.is_cuda and one_record:
        attention = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, False, 0.0, True, False, scale=scaling)[0]  # [1, Hq, T, D]
        return attention.transpose(1, 2), None
    if query.is_cuda:
        packed_query, packed_key, packed_value = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
        if attention_chunks is not None:
            attention = packed_causal_attention(packed_query, packed_key, packed_value, attention_chunks, scaling)
        else:
            boundaries = cu_seq_lens_q.to(torch.int32)  # flash attention's type (the towers' already)
            attention = torch.ops.aten._flash_attention_forward(
                packed_query, packed_key, packed_value, boundaries, boundaries, max_length_q, max_length_q, 0.0,
                is_causal, False, scale=scaling,
            )[0]  # [T, Hq, D]
        return attention[None], None
    positions = torch.arange(query.shape[2], device=query.device)  # [T]
    if attention_chunks is not None:  # each query sees its chunk's keys up to itself
        chunk_of_token = torch.searchsorted(attention_chunks[0, 1:].long(), positions, right=True)  # [T]
        first_key = attention_chunks[1].long()[chunk_of_token]  # [T]
        allowed = (positions[None, :] >= first_key[:, None]) & (positions[None, :] <= positions[:, None])  # [T, T]
    else:
        record_of_token = torch.searchsorted(cu_seq_lens_q[1:].long(), positions, right=True)  # [T]
        allowed = record_of_token[:, None] == record_of_token[None, :]  # [T, T]
        if is_causal:
            allowed &= positions[:, None] >= positions
    attention = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=True
    )  # [1, Hq, T, D]
    return attention.transpose(1, 2), None


transformers.AttentionInterface.register(PACKED_ATTENTION, packed_records_attention)


def add_dense_deepstack_features(hidden_states: torch.Tensor, visual_pos_masks: None, dense_features: torch.Tensor):
    """Stands in for the text decoder's `_deepstack_process`. After each of its first D layers the decoder adds the
    vision tower's deepstack features to the image and video tokens' hidden states through a boolean mask, a shape
    that changes with every batch. PackedTextDecoder hands it one [1, L, H] tensor per layer instead, zero off the
    visual tokens, added to every token: the same shapes for every batch, so images and videos run in the graphs,
    and x + 0 is x exactly."""
    return hidden_states + dense_features


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` without waiting: on CUDA from pinned memory. A copy from pageable memory
    first waits for all the work queued on the device, so one inside a forward would hold the host until the GPU
    catches up, instead of letting it queue the next kernels while the GPU runs the last (the joint head's ~1,300
    launches behind the decoder's graph)."""
    on_device = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    if on_device is not host:
        on_device.host_copy = host  # what host_values reads instead of the device
    return on_device


def host_to_static(static: torch.Tensor, host: torch.Tensor) -> None:
    """A host tensor copied into the start of a device buffer that CUDA graphs read, without waiting: on CUDA from
    pinned memory (see host_to_device), straight into the buffer, so one copy on the device's queue."""
    static[:host.numel()].copy_(host.pin_memory() if static.is_cuda else host, non_blocking=True)


def host_values(tensor: torch.Tensor) -> torch.Tensor:
    """The values of `tensor` on the host: the host tensor it was copied from when host_to_device made it, else read
    back from the device. A read-back waits for everything queued on the device before it; in a batch queued while
    the device still runs the last one, it would hold the host until that forward ends, and the device would then
    idle while the host queues this one. (A batch's tensors are never written in place, so the copy stays true.)"""
    host_copy = getattr(tensor, "host_copy", None)
    return tensor.cpu() if host_copy is None else host_copy


# The images' and videos' grids [N, 3] (patches in time, height and width) and the sounds' frame masks [A, F] stay on
# the host: everything that reads them reads them there, and a read of device values right after a tower is queued
# waits for the tower to run. The grids: the vision encoder's pre-hook (vision_inputs_from_host_grids), the thinker's
# split of the vision features by image (a `.tolist()`) and its 3-D positions (rope_index_from_host). The masks: the
# thinker sums them into the sounds' lengths, which the audio encoder's pre-hook (audio_inputs_from_host_lengths) and
# the 3-D positions read, and selects the sounds' real frames by them (torch copies the mask to the features' device).
HOST_KEPT = frozenset(("image_grid_thw", "video_grid_thw", "feature_attention_mask"))


def batch_to_device(value: Any, device: torch.device) -> Any:
    """A batch the decision module collated on the host (dicts and lists of tensors and other values) with every
    tensor copied to `device` without waiting (host_to_device), but the grids and masks of HOST_KEPT. Collated
    straight onto the device, each of its tensors, the media's among them, is a copy from pageable memory that holds
    the host until it is done."""
    if isinstance(value, torch.Tensor):
        return host_to_device(value, device) if value.device.type == "cpu" else value
    if type(value) is dict:
        return {key: item if key in HOST_KEPT else batch_to_device(item, device) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(batch_to_device(item, device) for item in value)
    return value


# Triton compiles a kernel anew for each alignment of its pointers (16 bytes or less) and each row count it has not
# seen. The joint head's row ids are a view into its packed index (HeadIndex.to), 16-byte aligned or not as the
# request's spans fall: the load's warm-up compiled one variant, and the first request with the other paid ~220 ms for
# the second (an H100, 2026-12-05, docs/benchmarks.md). One variant serves every alignment and count.
@triton.jit(do_not_specialize=["num_rows"], do_not_specialize_on_alignment=["row_ids_ptr", "real_rows_ptr"])
def gather_host_rows_kernel(
    table_ptr,  # [V, D]: in pinned host memory, which CUDA maps into the device's address space
    row_ids_ptr,  # int64 [N]: on the device, 8-byte aligned
    real_rows_ptr,  # int64 [1] on the device (read when COUNTED): the rows from it on are padding
    rows_ptr,  # [N, D]: out, on the device; the padding's rows zeros, read from nowhere
    num_rows, width, BLOCK_D: tl.constexpr, COUNTED: tl.constexpr,
):
    rows = tl.program_id(0) * 4 + tl.arange(0, 4)  # [4]
    columns = tl.arange(0, BLOCK_D)  # [BD]
    inside = (rows < num_rows)[:, None] & (columns < width)[None, :]
    read = inside
    if COUNTED:
        read = read & (rows < tl.load(real_rows_ptr))[:, None]
    row_ids = tl.load(row_ids_ptr + rows, mask=rows < num_rows, other=0)  # [4]
    values = tl.load(table_ptr + row_ids[:, None] * width + columns[None, :], mask=read, other=0.0)  # over the bus
    tl.store(rows_ptr + rows.to(tl.int64)[:, None] * width + columns[None, :], values, mask=inside)


def host_rows_to_device(table: torch.Tensor, row_ids: torch.Tensor, device: torch.device,
                        real_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of a host table [V, D] on `device` -> [N, D]. On CUDA the table is in pinned memory (HostEmbedding pins
    it) and the device reads the rows it needs over the bus itself (gather_host_rows_kernel, row_ids [N] on the
    device): the host spends a launch, not a gather and a copy (5.5 ms of host time for the ~8,300 rows of a
    16-record forward's token embeddings on an H100's host, docs/benchmarks.md). real_rows (int64 [1] on the device,
    or None: all are real): the rows from it on are padding, zeros on CUDA, not read over the bus (the joint head's
    padded option tokens, most of its 1,024 slots for one request). Elsewhere row_ids are on the host and the rows a
    plain index_select, the padding's included."""
    if device.type != "cuda":
        return torch.index_select(table, 0, row_ids).to(device)  # [N, D]
    row_ids = row_ids.reshape(-1)  # [N]
    rows = torch.empty(row_ids.numel(), table.shape[1], dtype=table.dtype, device=device)  # [N, D]
    gather_host_rows_kernel[(triton.cdiv(row_ids.numel(), 4),)](
        table, row_ids, row_ids if real_rows is None else real_rows, rows, row_ids.numel(), table.shape[1],
        BLOCK_D=triton.next_power_of_2(table.shape[1]), COUNTED=real_rows is not None)
    return rows


def real_token_rows(lengths: list[int], padded_length: int, device: torch.device) -> torch.Tensor:
    """The rows of a right-padded batch [B, L] flattened to [B*L] that hold real tokens (record b's first lengths[b]),
    record after record -> [T] on `device`, made on the host."""
    rows = np.concatenate([np.arange(b * padded_length, b * padded_length + n) for b, n in enumerate(lengths)])
    return host_to_device(torch.from_numpy(rows), device)


class PackedTextDecoder(torch.nn.Module):
    """Stands in for the thinker's text decoder (transformers' Qwen3OmniMoeThinkerTextModel), with its forward
    signature: takes the thinker's right-padded batch [B, L], runs the real tokens packed (padded to the next bucket,
    from the bucket's CUDA graph once `capture_graphs` has run, else eagerly on the padded inputs, which is how CPU
    tests check the padding) and hands back the batch [B, L, H] with zeros in its padding."""

    def __init__(self, decoder: torch.nn.Module, deepstack_layers: int, buckets: tuple[int, ...] = DECODER_BUCKETS):
        super().__init__()
        self.decoder = decoder
        decoder.config._attn_implementation = PACKED_ATTENTION
        decoder._deepstack_process = add_dense_deepstack_features
        self.deepstack_layers = deepstack_layers  # D
        self.buckets = buckets
        self.position_rows = None  # 3 or 4 rows of rotary positions, as the thinker of this transformers builds them
        # (bucket, one record) -> its CUDAGraph, reading and writing views of the static buffers; the graphs of
        # one-record batches take cuDNN's attention (packed_records_attention)
        self.graphs = {}
        # inputs_embeds [1, L, H], position_ids [P, 1, L], the real tokens' count and then the attention's chunks
        # [1 + 2 (C + 1)], deepstack features [D, 1, L, H], hidden [1, L, H] at the largest bucket, shared by every
        # bucket (as views of their first L tokens): the graphs never run at the same time, and the 49 buckets' own
        # copies would hold ~2.8 GiB at full size (20 KiB a token: embeddings, hidden, three deepstack rows)
        self.static_buffers = None
        # the packed experts' routing skips the padding's pairs while run_padded runs (PackedNVFP4Experts.real_tokens)
        self.packed_experts = [module for module in decoder.modules() if isinstance(module, PackedNVFP4Experts)]
        self.deepstack_tokens = 0  # the static deepstack features are zero past this many tokens
        self.tower_graphs = []  # the vision and audio towers' TowerGraphs, captured in the same pool as the decoder
        self.packed_output = None  # the last [B, L, H] returned, and its packed rows [T, H], until the head takes them

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # the thinker reads the decoder's own attributes (embed_tokens, config, ...)
            decoder = self.__dict__["_modules"].get("decoder")
            if decoder is None:
                raise
            return getattr(decoder, name)

    def forward(
        self, *, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        visual_pos_masks: torch.Tensor | None = None, deepstack_visual_embeds: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> transformers.modeling_outputs.MoeModelOutputWithPast:
        # inputs_embeds [B, L, H], position_ids [P, B, L], attention_mask [B, L] (1 on real tokens, right-padded)
        self.position_rows = position_ids.shape[0]
        batch, length, hidden = inputs_embeds.shape
        # each record's real tokens, from the host copy of the mask (its read-back would wait for the device)
        record_lengths = [length] * batch if attention_mask is None else host_values(attention_mask).sum(-1).tolist()
        if batch > MAX_RECORDS_PER_FORWARD:
            raise ValueError(f"{batch} records in one forward; the engine takes at most {MAX_RECORDS_PER_FORWARD}")
        packed_embeds, packed_positions = inputs_embeds.flatten(0, 1), position_ids.flatten(1, 2)  # [T, H], [P, T]
        # No record padded (one alone, or all of one length): the batch's rows already are the packed rows, and the
        # index, its upload and two gathers would cost 0.2 ms of host time before the graph (H100, docs/benchmarks.md)
        real_rows = None
        if sum(record_lengths) < batch * length:
            # an index made on the host, because a boolean mask makes torch read the number of rows back from the
            # device, which after the graph would keep the host from queueing the joint head while the decoder runs
            real_rows = real_token_rows(record_lengths, length, inputs_embeds.device)  # [T]
            packed_embeds, packed_positions = packed_embeds[real_rows], packed_positions[:, real_rows]
        # [D, V, H]: the features of the V visual tokens, in the packed order (padding is never visual)
        visual_features = None if deepstack_visual_embeds is None else torch.stack(deepstack_visual_embeds)
        # the visual tokens' packed rows [V]: their count is the features', so no read-back finds it out (a boolean
        # mask would wait here for the towers to run before the decoder could be queued)
        visual_rows = None if visual_features is None else torch.nonzero_static(
            visual_pos_masks.flatten() if real_rows is None else visual_pos_masks.flatten()[real_rows],
            size=visual_features.shape[1]).squeeze(1)
        total = packed_embeds.shape[0]
        bucket = next((bucket for bucket in self.buckets if bucket >= total), None)
        # boundaries: the records, then the padding up to the bucket as one more
        boundaries = [0, *itertools.accumulate(record_lengths), *([bucket] if bucket and bucket > total else [])]
        if bucket is None:  # longer than the largest graph: eagerly, unpadded
            chunks = host_to_device(torch.from_numpy(query_chunks(
                boundaries, total // QUERY_CHUNK + batch)), inputs_embeds.device)  # [2, C + 1]
            deepstack = None
            if visual_features is not None:
                deepstack = inputs_embeds.new_zeros(self.deepstack_layers, 1, total, hidden)  # [D, 1, T, H]
                deepstack[:, 0, visual_rows] = visual_features
            packed_hidden = self.run_padded(packed_embeds[None], packed_positions[:, None], chunks, deepstack)[0]
        else:
            static_embeds, static_positions, static_chunks, static_deepstack, static_real_tokens, static_hidden = (
                self.static_views(bucket, inputs_embeds))
            static_embeds[0, :total].copy_(packed_embeds)
            static_embeds[0, total:].zero_()
            static_positions[:, 0, :total].copy_(packed_positions)
            static_positions[:, 0, total:].zero_()
            self.write_counts(total, boundaries)
            if self.deepstack_tokens:  # an earlier batch's features, perhaps past this bucket: back to zeros
                _, _, _, all_deepstack, _ = self.static_buffers  # [D, 1, Lmax, H], not just this bucket's view
                all_deepstack[:, :, :self.deepstack_tokens].zero_()
            self.deepstack_tokens = 0
            if visual_features is not None:
                static_deepstack[:, 0, visual_rows] = visual_features
                self.deepstack_tokens = total
            # a one-record batch's own graph, or where cuDNN's attention could not be captured, the bucket's other one
            graph = self.graphs.get((bucket, batch == 1)) or self.graphs.get((bucket, False))
            if graph is not None:
                graph.replay()
            else:  # into the static buffer too, where the joint head's graphs read a bucket's rows
                static_hidden.copy_(self.run_padded(static_embeds, static_positions, static_chunks, static_deepstack,
                                                    static_real_tokens))
            packed_hidden = static_hidden[0, :total]  # [T, H]
        if real_rows is None:
            hidden_states = packed_hidden.view(batch, length, hidden).clone()  # [B, L, H], out of the graph's buffer
        else:
            hidden_states = inputs_embeds.new_zeros(batch, length, hidden)  # [B, L, H], zeros on the padding
            hidden_states.view(batch * length, hidden).index_copy_(0, real_rows, packed_hidden)
        # the packed rows, padding included, for the batched joint head (packed_rows_behind); hidden_states held, so
        # that no other tensor can be given its memory (and so its address) while these rows are on offer
        self.packed_output = (hidden_states, packed_hidden if bucket is None else static_hidden[0])
        return transformers.modeling_outputs.MoeModelOutputWithPast(last_hidden_state=hidden_states)

    def packed_rows_behind(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The packed rows [T, H] of this decoder's last forward (its records' tokens in order, then the bucket's
        padding; a view of the static buffer for a bucketed batch) if hidden_states [B, L, H] is what it returned, else
        None. Handed out once, so that an unbucketed batch's rows are not held after it."""
        if self.packed_output is None:
            return None
        returned, rows = self.packed_output
        self.packed_output = None
        same = hidden_states.data_ptr() == returned.data_ptr() and hidden_states.shape == returned.shape
        return rows if same else None

    def static_views(self, bucket: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The static buffers' views for `bucket`: inputs_embeds [1, L, H], position_ids [P, 1, L], the attention's
        chunks [2, C + 1], the deepstack features [D, 1, L, H], the real tokens' count [1], and the hidden states
        [1, L, H] a graph writes. `like`: a device tensor of the decoder's dtype and hidden size."""
        if self.static_buffers is None:
            longest, hidden, dtype, device = self.buckets[-1], like.shape[-1], like.dtype, like.device
            self.static_buffers = (
                torch.zeros(1, longest, hidden, dtype=dtype, device=device),  # [1, Lmax, H]
                torch.zeros(self.position_rows, 1, longest, dtype=torch.long, device=device),  # [P, 1, Lmax]
                torch.zeros(1 + 2 * (MAX_QUERY_CHUNKS + 1), dtype=torch.int32, device=device),  # [1 + 2 (C + 1)]
                torch.zeros(self.deepstack_layers, 1, longest, hidden, dtype=dtype, device=device),  # [D, 1, Lmax, H]
                torch.zeros(1, longest, hidden, dtype=dtype, device=device),  # [1, Lmax, H]
            )
        inputs_embeds, position_ids, counts, deepstack, hidden = self.static_buffers
        return (inputs_embeds[:, :bucket], position_ids[..., :bucket], counts[1:].view(2, -1), deepstack[:, :, :bucket],
                counts[:1], hidden[:, :bucket])

    def write_counts(self, real_tokens: int, boundaries: list[int]) -> None:
        """The static real tokens' count and attention chunks of the records packed with these boundaries, in one
        copy from the host."""
        counts = np.concatenate([[real_tokens], query_chunks(boundaries, MAX_QUERY_CHUNKS).ravel()])  # [1 + 2 (C + 1)]
        host_to_static(self.static_buffers[2], torch.from_numpy(counts.astype(np.int32)))

    def run_padded(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, chunks: torch.Tensor,
                   deepstack: torch.Tensor | None, real_tokens: torch.Tensor | None = None,
                   one_record: bool = False) -> torch.Tensor:
        """The decoder on packed inputs [1, L, H] (with deepstack features [D, 1, L, H], or None: none to add), its
        attention in `chunks` (as `query_chunks` makes them, int32 [2, C + 1] on the device), so that nothing depends
        on the batch but the tensors' contents. real_tokens (int32 [1] on the device, or None: no padding): the
        tokens past it are padding, whose MoE pairs the packed experts skip. one_record: the inputs are one record and
        padding (packed_records_attention)."""
        for experts in self.packed_experts:
            experts.real_tokens = real_tokens
        try:
            return self.decoder(
                inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False, attention_chunks=chunks,
                one_record=one_record,
                deepstack_visual_embeds=None if deepstack is None else list(deepstack),
            ).last_hidden_state
        finally:
            for experts in self.packed_experts:
                experts.real_tokens = None

    def compile_layers(self) -> None:
        """torch.compile every decoder layer, for any number of tokens (dynamic shapes: one compile serves every
        bucket and the eager batches). Inductor fuses what transformers runs as many small kernels: the RMSNorms, the
        q/k norms and rotary embedding, the residual adds. The router's softmax, top-k and renormalisation, which it
        cannot fuse around torch.topk, become one kernel (FusedTopKRouter), the attention's q, k and v
        projections, which it leaves as three, one matrix product (FusedQKVAttention), and the residual add after
        the MoE block, which it would launch on its own, part of the experts' top-k sum (ResidualInTopKSumLayer). The
        packed experts' own kernels stay outside its graphs (PackedNVFP4Experts.forward). The compile happens in the
        first forward, which `capture_graphs` runs before capturing."""
        for index, layer in enumerate(self.decoder.layers):
            if ResidualInTopKSumLayer.fusable(layer):
                layer = self.decoder.layers[index] = ResidualInTopKSumLayer(layer)
            router = getattr(layer.mlp, "gate", None)
            if type(router).__name__ == "Qwen3OmniMoeThinkerTextTopKRouter" and router.weight.is_cuda:
                layer.mlp.gate = FusedTopKRouter(router)  # on CUDA: on CPU the kernel would run interpreted
            if FusedQKVAttention.fusable(layer.self_attn):
                layer.self_attn = FusedQKVAttention(layer.self_attn)
            # Inductor keeps fused intermediates in fp32 unless told to round them where eager BF16 rounds them:
            # emulate eager, so the compiled layers compute what the checkpoint was calibrated and evaluated with
            layer.compile(dynamic=True, options={"emulate_precision_casts": True})

    @torch.inference_mode()
    def capture_graphs(self, like: torch.Tensor, pool: tuple, side_stream: torch.cuda.Stream,
                       progress: Callable[[str], None]) -> None:
        """Capture two graphs per bucket, for batches of several records and of one, largest first, and the towers'
        layers, all in `pool` (they never run at the same time), each after a first run on `side_stream`. Needs
        `position_rows`, known after one decision has gone through the decoder (load's warm-up)."""
        if self.position_rows is None:
            progress("the thinker passed the text decoder no rotary positions: it stays eager (no CUDA graphs)")
            return
        start = time.perf_counter()
        cudnn_attention = True  # until it fails to run here
        for bucket in sorted(self.buckets, reverse=True):
            *static_inputs, static_hidden = self.static_views(bucket, like)
            self.write_counts(bucket, [0, bucket])  # one record filling the bucket, every token real
            for one_record in (False, True) if cudnn_attention else (False,):
                side_stream.wait_stream(torch.cuda.current_stream())
                try:
                    with torch.cuda.stream(side_stream):  # a first run outside the graph: kernels, plans, workspaces
                        self.run_padded(*static_inputs, one_record=one_record)
                except RuntimeError as error:
                    if not one_record:
                        raise
                    # cuDNN's attention is missing here or refuses this GPU: batches of one record replay the
                    # graphs of several (flash varlen)
                    progress(f"cuDNN's attention does not run here ({error}); a record alone takes flash attention")
                    cudnn_attention = False
                    continue
                torch.cuda.current_stream().wait_stream(side_stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    # into the shared buffer, so that the pool's own output is free again for the next capture
                    static_hidden.copy_(self.run_padded(*static_inputs, one_record=one_record))
                graph.replay()  # a graph's first launch uploads it to the device: here, not in a request
                self.graphs[bucket, one_record] = graph
        captured_tower_layers = sum(tower.capture(pool, side_stream) for tower in self.tower_graphs)
        progress(f"text decoder compiled and captured in CUDA graphs for {len(self.buckets)} lengths up to "
                 f"{self.buckets[-1]} tokens, and the towers' layers in {captured_tower_layers}, in "
                 f"{time.perf_counter() - start:.1f} s")


class FusedTopKRouter(torch.nn.Module):
    """Stands in for transformers' Qwen3-Omni text router (Qwen3OmniMoeThinkerTextTopKRouter) in the compiled decoder
    layers, with its forward signature, its weight (the same parameter) and its maths: the same linear gives the
    logits, then the softmax, top-k and renormalisation run in one launch (route_top_k). Among equal probabilities
    the lower expert is chosen (torch.topk leaves it unspecified)."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.router = router  # transformers' own: its weight [E, H], top_k and norm_topk_prob

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # hidden_states [T, H] -> router_logits [T, E], top_k_weights [T, K], top_k_index [T, K]
        router = self.router
        router_logits = torch.nn.functional.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)
        return router_logits, *route_top_k(router_logits, router.top_k, router.norm_topk_prob)


# The q and k norms (transformers' RMSNorm over each head's D values) and the rotary embedding, for every head of the
# fused q, k, v product's output, in one launch that reads each row once. Inductor's two kernels for them took 0.45 ms
# of a 517-token forward's GPU work and 4.5 ms of a 16-record one on an H100, this one 0.31 and 3.69 ms with a head a
# program (2026-12-07, docs/benchmarks.md). In a forward of many tokens a program takes two heads of its tokens, both
# queries' or both keys', so that it reads their cos and sin once for both: alone on an H100 (2026-12-07,
# bench/sweep_norm_rotate_heads.py) that took 5-8% off from 1,024 to 7,957 tokens, and two heads were within 2% of
# four; below 1,024 tokens fewer programs left the GPU emptier and cost 2-10% (four heads: 22% at 517 tokens). It
# rounds to BF16 where transformers' eager BF16 maths rounds (the norm's product by its weight, each rotary product
# and their sum), and gives the same bits whatever the heads a program.
NORM_ROTATE_TOKENS = 16  # tokens a program
NORM_ROTATE_HEADS = ((1024, 2), (0, 1))  # (from this many tokens, heads a program), the first that applies


@triton.jit(do_not_specialize=["num_tokens", "qkv_stride"])
def norm_rotate_query_key_kernel(
    qkv_ptr,  # BF16 [N, W] rows of stride qkv_stride: the Hq query heads' D columns, then the Hkv key heads' (then v)
    query_norm_weight_ptr, key_norm_weight_ptr,  # BF16 [D]: transformers' q_norm and k_norm weights
    cos_ptr, sin_ptr,  # BF16 [N, D]: the rotary embedding of each token
    query_ptr, key_ptr,  # BF16 [N, Hq, D], [N, Hkv, D] out: normed and rotated
    num_tokens, qkv_stride, eps,
    QUERY_HEADS: tl.constexpr, KEY_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,  # heads a program, dividing both QUERY_HEADS and KEY_HEADS
):
    # program (tokens block, group of HEADS heads): heads 0..Hq-1 are the queries', Hq.. the keys' (adjacent in the
    # fused product), so a group is all queries or all keys
    first_head = tl.program_id(1) * HEADS
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT]
    HALF: tl.constexpr = HEAD_DIM // 2
    halves = tl.arange(0, HALF)  # [D/2]: rotate_half pairs column d with d + D/2
    in_range = tokens[:, None] < num_tokens
    if first_head < QUERY_HEADS:
        weight_ptr = query_norm_weight_ptr
        out = query_ptr + (tokens[:, None] * QUERY_HEADS + first_head) * HEAD_DIM + halves[None, :]  # [BT, D/2]
    else:
        weight_ptr = key_norm_weight_ptr
        out = key_ptr + (tokens[:, None] * KEY_HEADS + first_head - QUERY_HEADS) * HEAD_DIM + halves[None, :]
    first_weight = tl.load(weight_ptr + halves).to(tl.float32)[None, :]
    second_weight = tl.load(weight_ptr + HALF + halves).to(tl.float32)[None, :]
    angles = tokens[:, None] * HEAD_DIM + halves[None, :]  # [BT, D/2]
    cos_first = tl.load(cos_ptr + angles, mask=in_range, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + angles + HALF, mask=in_range, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + angles, mask=in_range, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_ptr + angles + HALF, mask=in_range, other=0.0).to(tl.float32)
    for head in tl.static_range(HEADS):
        row = qkv_ptr + tokens[:, None] * qkv_stride + (first_head + head) * HEAD_DIM + halves[None, :]  # [BT, D/2]
        first = tl.load(row, mask=in_range, other=0.0).to(tl.float32)
        second = tl.load(row + HALF, mask=in_range, other=0.0).to(tl.float32)
        # RMSNorm as transformers computes it: fp32 mean of squares, times its reciprocal root, to BF16, times the
        # weight
        variance = (tl.sum(first * first, axis=1) + tl.sum(second * second, axis=1)) / HEAD_DIM  # [BT]
        inverse_root = tl.math.rsqrt(variance + eps)[:, None]
        first = _round_to_bf16(first_weight * _round_to_bf16(first * inverse_root).to(tl.float32)).to(tl.float32)
        second = _round_to_bf16(second_weight * _round_to_bf16(second * inverse_root).to(tl.float32)).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-second, first), each product and the sum rounded to BF16
        rotated_first = (_round_to_bf16(first * cos_first).to(tl.float32)
                         - _round_to_bf16(second * sin_first).to(tl.float32))
        rotated_second = (_round_to_bf16(second * cos_second).to(tl.float32)
                          + _round_to_bf16(first * sin_second).to(tl.float32))
        tl.store(out + head * HEAD_DIM, _round_to_bf16(rotated_first), mask=in_range)
        tl.store(out + head * HEAD_DIM + HALF, _round_to_bf16(rotated_second), mask=in_range)


# A custom op, as route_top_k: one opaque call inside the compiled decoder layers
@torch.library.custom_op("serve_clef::norm_rotate_query_key", mutates_args=())
def norm_rotate_query_key(qkv: torch.Tensor, query_norm_weight: torch.Tensor, key_norm_weight: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, eps: float, query_heads: int,
                          key_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv BF16 [N, W] (the fused q, k, v product, q's heads first, then k's), cos and sin [N, D] -> query
    [N, Hq, D] and key [N, Hkv, D]: transformers' q_norm and k_norm, then apply_rotary_pos_emb, in one launch."""
    query, key = norm_rotate_query_key_outputs(qkv, query_norm_weight, key_norm_weight, cos, sin, eps, query_heads,
                                               key_heads)
    num_tokens, head_dim = qkv.shape[0], query_norm_weight.shape[0]
    heads_wanted = next(heads for least_tokens, heads in NORM_ROTATE_HEADS if num_tokens >= least_tokens)
    heads = math.gcd(query_heads, key_heads, heads_wanted)  # a program's heads: all queries' or all keys'
    norm_rotate_query_key_kernel[(triton.cdiv(num_tokens, NORM_ROTATE_TOKENS), (query_heads + key_heads) // heads)](
        qkv, query_norm_weight, key_norm_weight, cos.contiguous(), sin.contiguous(), query, key, num_tokens,
        qkv.stride(0), eps, QUERY_HEADS=query_heads, KEY_HEADS=key_heads, HEAD_DIM=head_dim,
        BLOCK_T=NORM_ROTATE_TOKENS, HEADS=heads, num_warps=4,
    )
    return query, key


@norm_rotate_query_key.register_fake
def norm_rotate_query_key_outputs(qkv: torch.Tensor, query_norm_weight: torch.Tensor, key_norm_weight: torch.Tensor,
                                  cos: torch.Tensor, sin: torch.Tensor, eps: float, query_heads: int,
                                  key_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_rotate_query_key's outputs, empty (for torch.compile)."""
    num_tokens, head_dim = qkv.shape[0], query_norm_weight.shape[0]
    return (qkv.new_empty(num_tokens, query_heads, head_dim),  # [N, Hq, D]
            qkv.new_empty(num_tokens, key_heads, head_dim))  # [N, Hkv, D]


class FusedQKVAttention(torch.nn.Module):
    """Stands in for transformers' Qwen3-Omni text attention (Qwen3OmniMoeThinkerTextAttention) in the compiled
    decoder layers, with its forward signature and its maths, but its q, k and v projections as one matrix product:
    their weights become views of one [Hq D + 2 Hkv D, H] matrix (no copy stays behind), so cuBLAS runs one launch
    instead of three, two of them narrow (N = Hkv D = 512 at full size). Each output column is the same dot product
    either way: on an H100 the fused product equalled the three bit for bit at 64 to 8,192 tokens and took 48 layers
    0.95 instead of 1.40 ms at 576 tokens (docs/benchmarks.md). The engine prefills once, so there is no KV cache."""

    def __init__(self, attention: torch.nn.Module):
        super().__init__()
        self.attention = attention  # transformers' own: its q/k norms, o_proj, config and scaling serve as they are
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        self.widths = [projection.out_features for projection in projections]  # Hq D, Hkv D, Hkv D
        # plain attributes (the parameters below are views of them, so the model's state holds each weight once)
        self.qkv_weight = torch.cat([projection.weight.detach() for projection in projections])  # [Hq D + 2 Hkv D, H]
        self.qkv_bias = None
        if attention.q_proj.bias is not None:
            self.qkv_bias = torch.cat([projection.bias.detach() for projection in projections])  # [Hq D + 2 Hkv D]
        rows = self.qkv_weight.split(self.widths)
        biases = self.qkv_bias.split(self.widths) if self.qkv_bias is not None else (None,) * 3
        for projection, weight, bias in zip(projections, rows, biases):
            projection.weight = torch.nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                projection.bias = torch.nn.Parameter(bias, requires_grad=False)
        # transformers' module of the attention: its rotary embedding, attention registry and eager attention
        self.modeling = sys.modules[type(attention).__module__]
        # the q and k norms and the rotary embedding in one launch (norm_rotate_query_key): on CUDA (on CPU it would run
        # interpreted), in BF16 (where it rounds as eager BF16 does), for heads of a power-of-two size (Triton's
        # shapes), as the model's 128 are, and with one epsilon for both norms (the kernel takes one)
        head_dim, weight = attention.head_dim, attention.q_proj.weight
        self.norms_in_one_launch = (weight.is_cuda and weight.dtype == torch.bfloat16 and head_dim >= 2
                                    and head_dim & (head_dim - 1) == 0
                                    and attention.q_norm.variance_epsilon == attention.k_norm.variance_epsilon)

    @staticmethod
    def fusable(attention: torch.nn.Module) -> bool:
        """Whether `attention` is transformers' Qwen3-Omni text attention with plain projections: one with forward
        hooks on q, k or v (the W4A4 replay of NVFP4 attention projections rounds each one's input) or with biases on
        some of them only keeps its own forward."""
        if type(attention).__name__ != "Qwen3OmniMoeThinkerTextAttention":
            return False
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        hooked = any(projection._forward_pre_hooks or projection._forward_hooks for projection in projections)
        return not hooked and len({projection.bias is None for projection in projections}) == 1

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        # hidden_states [B, T, H] -> [B, T, H] and the attention function's weights (None for the engine's)
        if cache is not None:
            raise ValueError("FusedQKVAttention prefills only: it keeps no KV cache")
        attention = self.attention
        tokens_shape = hidden_states.shape[:-1]
        heads_shape = (*tokens_shape, -1, attention.head_dim)
        qkv = torch.nn.functional.linear(hidden_states, self.qkv_weight, self.qkv_bias)  # [B, T, Hq D + 2 Hkv D]
        query, key, value = qkv.split(self.widths, dim=-1)  # [B, T, Hq D], [B, T, Hkv D], [B, T, Hkv D]
        value = value.view(heads_shape).transpose(1, 2)  # [B, Hkv, T, D]
        cos, sin = position_embeddings  # [B, T, D] each
        if self.norms_in_one_launch:
            query, key = norm_rotate_query_key(
                qkv.view(-1, qkv.shape[-1]), attention.q_norm.weight, attention.k_norm.weight,
                cos.reshape(-1, attention.head_dim), sin.reshape(-1, attention.head_dim),
                attention.q_norm.variance_epsilon, self.widths[0] // attention.head_dim,
                self.widths[1] // attention.head_dim)  # [B T, Hq, D], [B T, Hkv, D]
            query = query.view(heads_shape).transpose(1, 2)  # [B, Hq, T, D]
            key = key.view(heads_shape).transpose(1, 2)  # [B, Hkv, T, D]
        else:
            query = attention.q_norm(query.view(heads_shape)).transpose(1, 2)  # [B, Hq, T, D]
            key = attention.k_norm(key.view(heads_shape)).transpose(1, 2)  # [B, Hkv, T, D]
            query, key = self.modeling.apply_rotary_pos_emb(query, key, cos, sin)
        attend = self.modeling.ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation,
                                                                     self.modeling.eager_attention_forward)
        output, weights = attend(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling,
                                 sliding_window=attention.sliding_window, **kwargs)  # [B, T, Hq, D]
        return attention.o_proj(output.reshape(*tokens_shape, -1).contiguous()), weights


class ResidualInTopKSumLayer(torch.nn.Module):
    """Stands in for transformers' Qwen3-Omni text decoder layer (Qwen3OmniMoeThinkerTextDecoderLayer) whose MoE block
    has packed experts, in the compiled decoder, with its forward signature, its modules (under the same names, so the
    model's state is named as before) and its maths, but the residual add after the MoE block done by the experts
    (PackedNVFP4Experts.forward's residual; the packed kernels' top-k sum adds it in the same launch). transformers'
    layer adds it after the MoE block returns, in a launch of its own outside the compiled graphs."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp

    @staticmethod
    def fusable(layer: torch.nn.Module) -> bool:
        """Whether `layer` is transformers' Qwen3-Omni text decoder layer with a sparse MoE block of packed experts."""
        return (type(layer).__name__ == "Qwen3OmniMoeThinkerTextDecoderLayer"
                and type(layer.mlp).__name__ == "Qwen3OmniMoeThinkerTextSparseMoeBlock"
                and isinstance(layer.mlp.experts, PackedNVFP4Experts))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
        # hidden_states [B, T, H] -> [B, T, H]
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
            **kwargs)
        hidden_states = residual + hidden_states
        # the sparse MoE block's forward, on the tokens' rows [B T, H], with the residual add after it
        residual = hidden_states.view(-1, hidden_states.shape[-1])  # [B T, H]
        normed = self.post_attention_layernorm(hidden_states).view(residual.shape)  # [B T, H]
        _, top_k_weights, top_k_index = self.mlp.gate(normed)  # [B T, K] each
        return self.mlp.experts(normed, top_k_index, top_k_weights, residual=residual).view(hidden_states.shape)


class HostEmbedding(torch.nn.Module):
    """Stands in for a table that is only looked up, never multiplied, with the table in host memory: the text
    decoder's token embedding (nn.Embedding), whose lookups run before the graphed decoder; and the output
    embeddings (the lm_head's weight), of which the batched joint head gathers its option tokens' rows. On CUDA the
    table is pinned and the device reads just the rows it needs over the bus (host_rows_to_device; T x H, 2 MiB at
    512 tokens), and the GPU keeps 0.58 GiB (152,064 x 2,048 in BF16) free per table."""

    def __init__(self, embedding: torch.nn.Module):  # an nn.Embedding or nn.Linear: its weight [V, H] is the table
        super().__init__()
        self.device = embedding.weight.device
        # [V, H]; a plain attribute: .to() leaves it here. Pinned on CUDA, where the device reads its rows itself.
        self.weight = embedding.weight.detach().cpu()
        if self.device.type == "cuda":
            self.weight = self.weight.pin_memory()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, L, H]
        row_ids = input_ids if self.device.type == "cuda" else host_values(input_ids)
        return host_rows_to_device(self.weight, row_ids.reshape(-1), self.device).view(*input_ids.shape, -1)


def install_packed_decoder(thinker: torch.nn.Module) -> PackedTextDecoder:
    """Put a PackedTextDecoder in place of the thinker's text decoder (found by class, as transformers versions nest
    it differently), give the vision and audio towers the packed attention too, and return the decoder."""
    name = next(name for name, module in thinker.named_modules()
                if type(module).__name__ == "Qwen3OmniMoeThinkerTextModel")
    parent_name, _, attribute = name.rpartition(".")
    parent = thinker.get_submodule(parent_name) if parent_name else thinker
    packed = PackedTextDecoder(getattr(parent, attribute), len(thinker.config.vision_config.deepstack_visual_indexes))
    setattr(parent, attribute, packed)
    for tower in thinker_towers(thinker):
        tower.config._attn_implementation = PACKED_ATTENTION  # not causal: they pass is_causal=False
        if type(tower).__name__ == "Qwen3OmniMoeVisionEncoder":
            tower.register_forward_pre_hook(vision_inputs_from_host_grids, with_kwargs=True)
        elif all(hasattr(sys.modules[type(tower).__module__], helper) for helper in AUDIO_WINDOW_HELPERS):
            tower.register_forward_pre_hook(audio_inputs_from_host_lengths, with_kwargs=True)
        packed.tower_graphs.append(install_tower_steps(tower))
    return packed


def vision_inputs_from_host_grids(tower: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of the vision encoder: its position-embedding interpolation, rotary positions and sequence
    boundaries, computed by transformers' own helpers from a host copy of the grids and handed to it as the
    precomputed inputs transformers accepts. Computed inside the encoder from grids on the device, they read values
    back about a dozen times per video, and each read makes the host wait until the GPU has run everything queued
    before it, so the encoder's kernels go at the host's pace. Here the grids are read once, before any of the
    encoder's work is queued."""
    grid_thw = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]  # [N, 3]: N images or videos, t/h/w patches
    if "cu_seqlens" in kwargs:  # the caller computed them already
        return args, kwargs
    host_grid = host_values(grid_thw)  # [N, 3] (the engine's batches keep them on the host: HOST_KEPT)
    interp_indices, interp_weights = vision_utils.get_vision_interpolation_indices_and_weights(
        host_grid, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size)
    position_ids = vision_utils.get_vision_position_ids(host_grid, tower.spatial_merge_size)
    cu_seqlens, max_seqlen = vision_utils.get_vision_attention_seqlens(host_grid, tower.config)
    device = (args[0] if args else kwargs["hidden_states"]).device  # the pixels
    return args, {**kwargs, "interp_indices": host_to_device(interp_indices, device),
                  "interp_weights": host_to_device(interp_weights, device),
                  "position_ids": host_to_device(position_ids, device),
                  "cu_seqlens": host_to_device(cu_seqlens, device), "max_seqlen": max_seqlen}


# transformers' helpers that cut the audio encoder's input into chunks and attention windows (in the encoder's module),
# each of which takes its value precomputed from the encoder's keyword arguments
AUDIO_WINDOW_HELPERS = ("chunk_and_pad_features", "get_valid_indices", "get_audio_cu_seqlens", "get_max_seqlen")


def audio_inputs_from_host_lengths(tower: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of the audio encoder: its features cut into chunks, the frames of those chunks that its
    convolutions keep, its attention windows' boundaries and their longest, computed by transformers' own helpers
    from a host copy of the clips' lengths and handed to it as the precomputed inputs transformers accepts. Computed
    inside the encoder from lengths on the device, they read values back ten times per forward with sound (a video's
    soundtrack too), and each read makes the host wait until the GPU has run everything queued before it. Here the
    lengths are read once, and the chunks are cut on the device at lengths known on the host."""
    if "cu_seqlens" in kwargs:  # the caller computed them already
        return args, kwargs
    input_features = args[0] if args else kwargs["input_features"]  # [mel bins, frames of every clip]
    feature_lens = args[1] if len(args) > 1 else kwargs["feature_lens"]  # [clips]: frames of each
    helpers = sys.modules[type(tower).__module__]
    host_lengths = host_values(feature_lens)  # [clips]
    padded_feature, chunk_lengths = helpers.chunk_and_pad_features(input_features, host_lengths, tower.n_window)
    valid_indices = helpers.get_valid_indices(chunk_lengths, tower.n_window)  # [kept frames]
    cu_seqlens = helpers.get_audio_cu_seqlens(chunk_lengths, host_lengths, tower.n_window_infer, tower.n_window)
    device = input_features.device
    return args, {**kwargs, "padded_feature": padded_feature, "chunk_lengths": chunk_lengths,
                  "valid_indices": host_to_device(valid_indices, device),
                  "cu_seqlens": host_to_device(cu_seqlens, device),
                  "max_seqlen": helpers.get_max_seqlen(cu_seqlens, tower.config)}


# ---- the thinker's 3-D positions and placeholder masks, from host copies ---------------------------------------------
# transformers' Qwen3-Omni `get_rope_index` walks each record's media on the host. A video heard with its soundtrack
# takes positions by time, its frames' and its sound's interleaved, and transformers interleaves them with a Python
# loop of tensor indexing over their tokens: on a 2-core CPU machine 6.5 ms of a 4 s video's forward and 92 ms of a
# 60 s one (docs/benchmarks.md), while the device waits for the decoder's positions. rope_index_from_host walks the
# records as transformers does, with transformers' own helpers, but interleaves by one stable sort; it serves only
# once it has given transformers' positions bit for bit on made-up batches at load (install_rope_index_from_host).
# Its placeholder masks come with a count checked on the device; placeholder_masks_checked_on_host checks it on the
# host, and likewise serves only once its masks have equalled transformers' on those batches.

def interleaved_by_time(video_positions: torch.Tensor, audio_positions: torch.Tensor) -> list[torch.Tensor]:
    """transformers' interleaving of a video's positions [3, V] and its soundtrack's [3, A], both sorted by time (row
    0): column by column, the video's first at equal times, until one runs out, then the rest of the other, which it
    keeps as a piece of its own (the next position follows that piece's largest). Here one stable sort, and the rest
    of the other as a piece: [the interleaved columns [3, C], the rest [3, V + A - C]], or the pieces as they are
    when one is empty."""
    videos, sounds = video_positions.shape[1], audio_positions.shape[1]
    if not videos or not sounds:
        return [pieces for pieces in (video_positions, audio_positions) if pieces.shape[1]]
    times = torch.cat([video_positions[0].float(), audio_positions[0].float()])  # [V + A]
    order = torch.sort(times, stable=True).indices  # [V + A]: video columns first at equal times
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    last_video, last_sound = rank[videos - 1].item(), rank[-1].item()
    interleaved = torch.cat([video_positions, audio_positions], dim=1)[:, order[:min(last_video, last_sound) + 1]]
    rest = videos + sounds - interleaved.shape[1]  # what is left of the one that runs out last
    return [interleaved, (audio_positions if last_video < last_sound else video_positions)[:, -rest:]]


def rope_index_from_host(thinker: torch.nn.Module, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
                         video_grid_thw: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                         use_audio_in_video: bool = False, audio_seqlens: torch.Tensor | None = None,
                         second_per_grids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for transformers' `get_rope_index` of the Qwen3-Omni thinker (`thinker`: the module it is a method
    of), with its signature and values: (positions float [3, B, L], their offsets past each record's length [B, 1]).
    Batches with images or videos are walked as transformers walks them, from host copies of the ids, mask and grids
    (the sounds' lengths, which the thinker sums on the device, are read back once), the video and soundtrack
    interleaving by interleaved_by_time; others (text, and sounds without images or videos, whose tokens transformers
    numbers as text) by transformers' count of the mask, made on the host too, both tensors in one upload."""
    if input_ids is None or attention_mask is None:  # nothing the thinker passes the engine: transformers' own
        return type(thinker).get_rope_index(thinker, input_ids, image_grid_thw, video_grid_thw, attention_mask,
                                            use_audio_in_video, audio_seqlens, second_per_grids)
    if image_grid_thw is None and video_grid_thw is None:
        mask = host_values(attention_mask)  # [B, L]
        running = mask.float().cumsum(-1) - 1  # [B, L]: each record's real tokens from 0, as transformers counts
        running.masked_fill_(mask == 0, 1)
        offsets = running.max(-1, keepdim=True).values + 1 - mask.sum(-1, keepdim=True)  # [B, 1], float
        uploaded = host_to_device(torch.cat([running, offsets], dim=1), input_ids.device)  # [B, L + 1]
        return uploaded[:, :-1].expand(3, -1, -1), uploaded[:, -1:]
    config, merge = thinker.config, thinker.spatial_merge_size
    image_id, video_id, audio_id = config.image_token_id, config.video_token_id, config.audio_token_id
    vision_start_id, audio_start_id = config.vision_start_token_id, config.audio_start_token_id
    feature_lengths = sys.modules[type(thinker).__module__]._get_feat_extract_output_lengths  # transformers' own
    host_ids = host_values(input_ids)  # [B, L]
    real = (torch.ones_like(host_ids, dtype=torch.bool) if attention_mask is None
            else host_values(attention_mask) == 1)  # [B, L]
    image_grids, video_grids, audio_lengths, seconds = (
        None if value is None else host_values(value)
        for value in (image_grid_thw, video_grid_thw, audio_seqlens, second_per_grids))

    def running(length: int, start) -> torch.Tensor:  # [3, length]: text, markers, sound
        return torch.arange(length).view(1, -1).expand(3, -1) + start

    def vision(start, index: int, grids: torch.Tensor, seconds_per_grid) -> torch.Tensor:  # [3, t h w / merge**2]
        times = (torch.arange(grids[index][0]) * seconds_per_grid * config.position_id_per_seconds).float()
        return thinker.get_llm_pos_ids_for_vision(start, index, merge, times, grids[:, 1], grids[:, 2])

    position_ids = torch.zeros(3, *host_ids.shape)  # [3, B, L], float as transformers makes it
    offsets = []
    image_index = video_index = audio_index = 0  # across the batch, as the grids are
    for record in range(host_ids.shape[0]):
        tokens = host_ids[record][real[record]].tolist()
        after_vision_starts = [tokens[i + 1] for i, token in enumerate(tokens) if token == vision_start_id]
        images, audios = after_vision_starts.count(image_id), tokens.count(audio_start_id)
        videos = after_vision_starts.count(audio_start_id if use_audio_in_video else video_id)
        pieces, cursor = [], 0  # positions [3, n] of the tokens walked, and the next token to walk
        for _ in range(images + audios + (0 if use_audio_in_video else videos)):
            start = pieces[-1].max() + 1 if pieces else 0
            vision_start = (tokens.index(vision_start_id, cursor)
                            if (image_id in tokens or video_id in tokens) and (videos > 0 or images > 0)
                            else len(tokens) + 1)
            audio_start = (tokens.index(audio_start_id, cursor) if audio_id in tokens and audios > 0
                           else len(tokens) + 1)
            media_start = min(vision_start, audio_start)
            text = media_start - cursor
            if text:
                pieces.append(running(text, start))
                start += text
            markers = 2 if media_start == vision_start and vision_start + 1 == audio_start else 1
            pieces.append(running(markers, start))
            start += markers
            if media_start == audio_start:  # a sound
                sound = feature_lengths(audio_lengths[audio_index], config.audio_config.n_window)
                pieces.append(running(sound, start))
                cursor += int(text + markers + sound + markers)
                audio_index, audios = audio_index + 1, audios - 1
            elif tokens[vision_start + 1] == image_id:
                pieces.append(vision(start, image_index, image_grids, 1))
                cursor += int(text + markers + image_grids[image_index].prod() // merge**2 + markers)
                image_index, images = image_index + 1, images - 1
            elif tokens[vision_start + 1] == video_id:  # a video without its soundtrack
                pieces.append(vision(start, video_index, video_grids, seconds[video_index].float()))
                cursor += int(text + markers + video_grids[video_index].prod() // merge**2 + markers)
                video_index, videos = video_index + 1, videos - 1
            elif vision_start + 1 == audio_start:  # a video heard with its soundtrack
                sound = feature_lengths(audio_lengths[audio_index], config.audio_config.n_window)
                pieces += interleaved_by_time(vision(start, video_index, video_grids, seconds[video_index].float()),
                                              running(sound, start))
                cursor += int(text + markers + sound + video_grids[video_index].prod() // merge**2 + markers)
                audio_index, video_index, audios, videos = audio_index + 1, video_index + 1, audios - 1, videos - 1
            pieces.append(running(markers, pieces[-1].max() + 1))
        if cursor < len(tokens):
            pieces.append(running(len(tokens) - cursor, pieces[-1].max() + 1 if pieces else 0))
        positions = torch.cat([piece.float() for piece in pieces], dim=1)  # [3, n]
        position_ids[:, record, real[record]] = positions
        offsets.append(positions.max() + 1 - len(tokens))
    return (host_to_device(position_ids, input_ids.device),
            host_to_device(torch.stack(offsets), input_ids.device).unsqueeze(1))


def rope_index_check_batches(config: transformers.PretrainedConfig) -> list[dict]:
    """Made-up batches (get_rope_index's keyword arguments, host tensors) with every kind of media piece: text, an
    image, a sound, a video alone, and a video with its soundtrack whose times meet the sound's (ties), in two records
    right-padded, the second with less; the first batch's videos silent, the second's heard; and a third batch of
    text and a sound, without images or videos."""
    image_id, video_id, audio_id = config.image_token_id, config.video_token_id, config.audio_token_id
    vision_start, vision_end = config.vision_start_token_id, config.vision_end_token_id
    audio_start, audio_end = config.audio_start_token_id, config.audio_end_token_id
    text = [0] * 3
    image = [vision_start, *[image_id] * 6, vision_end]  # grid (1, 4, 6) / 2**2
    sound = [audio_start, *[audio_id] * 104, audio_end]  # 800 feature frames -> 104 tokens
    silent_video = [vision_start, *[video_id] * 12, vision_end]  # grid (3, 4, 4) / 2**2
    heard_video = [vision_start, audio_start, *[video_id] * 12, *[audio_id] * 104, audio_end, vision_end]

    def right_padded(records: list[list[int]]) -> dict:  # input_ids and attention_mask [B, L]
        length = max(len(record) for record in records)
        return {"input_ids": torch.tensor([record + [0] * (length - len(record)) for record in records]),
                "attention_mask": torch.tensor([[1] * len(record) + [0] * (length - len(record))
                                                for record in records])}

    batches = []
    for video, heard in ((silent_video, False), (heard_video, True)):
        batches.append({
            **right_padded([text + image + text + sound + text + video + text, text + video]),
            "image_grid_thw": torch.tensor([[1, 4, 6]]), "video_grid_thw": torch.tensor([[3, 4, 4], [3, 4, 4]]),
            "audio_seqlens": torch.tensor([800] * (3 if heard else 1)),  # the sound, then each heard video's
            "second_per_grids": torch.tensor([2.0, 0.5]), "use_audio_in_video": heard,
        })
    # no image or video: the count of the mask, sounds included
    batches.append({**right_padded([text + sound + text, text]), "audio_seqlens": torch.tensor([800])})
    return batches


def agrees_with_transformers(what: str, ours: Callable, library: Callable, module: torch.nn.Module,
                             check_calls: list[dict], progress: Callable[[str], None]) -> bool:
    """Whether `ours` gives the tensors of transformers' method `library` bit for bit, both called on `module` with
    each keyword set of `check_calls`; otherwise a progress line says that transformers' own serves `what`, and why."""
    for arguments in check_calls:
        try:
            mine, theirs = ours(module, **arguments), library(module, **arguments)
        except Exception as error:  # a transformers whose method takes other arguments, or walks or checks otherwise
            progress(f"{what}: transformers' own ({ours.__name__} fails on a check batch: {type(error).__name__}: "
                     f"{error})")
            return False
        if len(mine) != len(theirs) or not all(torch.equal(a, b) for a, b in zip(mine, theirs)):
            progress(f"{what}: transformers' own ({ours.__name__} differs from it on a check batch)")
            return False
    return True


def install_rope_index_from_host(thinker: torch.nn.Module, progress: Callable[[str], None]) -> None:
    """Give each module of the thinker that computes its 3-D positions (which one varies across transformers
    versions) rope_index_from_host, once it has given transformers' positions and offsets bit for bit on
    rope_index_check_batches; otherwise transformers' own stays, and a progress line says why."""
    for module in thinker.modules():
        library = getattr(type(module), "get_rope_index", None)
        if library is None or not hasattr(module, "get_llm_pos_ids_for_vision"):
            continue
        if not agrees_with_transformers("3-D positions", rope_index_from_host, library, module,
                                        rope_index_check_batches(module.config), progress):
            return
        module.get_rope_index = functools.partial(rope_index_from_host, module)


def placeholder_masks_checked_on_host(thinker: torch.nn.Module, input_ids: torch.Tensor | None,
                                      inputs_embeds: torch.Tensor, image_features: torch.Tensor | None = None,
                                      video_features: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Stands in for transformers' `get_placeholder_mask` of the Qwen3-Omni thinker (`thinker`: the module it is a
    method of): the image, video and audio tokens' masks bool [B, L, 1], made on the device as transformers makes
    them, and its check that the image and video tokens are as many as their features, made on the host copy of the
    ids. transformers sums the mask on the device and reads the sum, which right after the vision tower is queued
    waits for the tower to run (with the grids on the host, HOST_KEPT, an image's forward then waits for nothing
    until its decoder: 34.8 -> 33.4 ms on an H100, docs/benchmarks.md). Without ids, transformers' own."""
    if input_ids is None:
        return type(thinker).get_placeholder_mask(thinker, input_ids, inputs_embeds, image_features, video_features)
    config, host_ids = thinker.config, host_values(input_ids)
    for kind, token_id, features in (("Image", config.image_token_id, image_features),
                                     ("Video", config.video_token_id, video_features)):
        tokens = int((host_ids == token_id).sum())
        if features is not None and tokens * inputs_embeds.shape[-1] != features.numel():
            raise ValueError(f"{kind} features and {kind.lower()} tokens do not match, tokens: {tokens}, features: "
                             f"{features.shape[0]}")
    return tuple((input_ids == token_id).unsqueeze(-1).to(inputs_embeds.device)
                 for token_id in (config.image_token_id, config.video_token_id, config.audio_token_id))


def install_placeholder_masks_checked_on_host(thinker: torch.nn.Module, progress: Callable[[str], None]) -> None:
    """Give each module of the thinker that makes its placeholder masks (which one varies across transformers
    versions) placeholder_masks_checked_on_host, once it has given transformers' three masks bit for bit on the ids of
    rope_index_check_batches, with and without features; otherwise transformers' own stays, and a progress line says
    why."""
    for module in thinker.modules():
        library = getattr(type(module), "get_placeholder_mask", None)
        if library is None:
            continue
        check_calls = []
        for batch in rope_index_check_batches(module.config):
            input_ids = batch["input_ids"]
            inputs_embeds = torch.zeros(*input_ids.shape, 4)  # B, L, H: only its width and device are read
            image_features, video_features = (torch.zeros(int((input_ids == token_id).sum()), 4)  # [tokens, H]
                                              for token_id in (module.config.image_token_id,
                                                               module.config.video_token_id))
            without_features = {"input_ids": input_ids, "inputs_embeds": inputs_embeds}
            check_calls += [{**without_features, "image_features": image_features, "video_features": video_features},
                            without_features]
        if not agrees_with_transformers("placeholder masks", placeholder_masks_checked_on_host, library, module,
                                        check_calls, progress):
            return
        module.get_placeholder_mask = functools.partial(placeholder_masks_checked_on_host, module)


def thinker_towers(thinker: torch.nn.Module) -> list[torch.nn.Module]:
    """The thinker's vision and audio encoders (found by class, as transformers versions nest them differently)."""
    return [module for module in thinker.modules()
            if type(module).__name__ in ("Qwen3OmniMoeVisionEncoder", "Qwen3OmniMoeAudioEncoder")]


# ---- the towers' layers, from CUDA graphs ----------------------------------------------------------------------------
# The vision and audio towers run transformers' own forward. Op by op, their layers cost the host about 14 ms per image
# or sound on an H200 for a few ms of GPU work. So each entry of a tower's layer list is a TowerLayerStep, which runs
# its layer on static buffers padded to a bucket of the tower's packed length: from the layer's CUDA graph for that
# bucket once captured, else eagerly on the same buffers (CPU, and the tests). The padding is one more sequence of the
# packed attention, so no real token attends to it, and everything else in a layer is per token. Layer i reads
# hidden[i % 2] and writes hidden[(i + 1) % 2], so consecutive layers need no copy, and the deepstack mergers, which
# read a layer's output right after it, see it before it is overwritten two layers later. L the tower's packed length
# (patches, or audio frames after its convolutions), C its width, D its rotary width, S its sequences (images, frame
# pairs or audio windows).
TOWER_BUCKETS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)  # L
# A second of sound is 13 frames after the audio tower's convolutions, so one clip of the longest (300 s) is 3,900:
# longer buckets would hold memory and capture time for requests with several long clips only.
AUDIO_TOWER_BUCKETS = tuple(bucket for bucket in TOWER_BUCKETS if bucket <= 4096)
TOWER_MOST_SEQUENCES = 64  # S in one graphed forward: flash attention launches blocks for every one, empty or not


class TowerGraphs:
    """One tower's layers, their static buffers and their graphs, shared by the tower's TowerLayerSteps."""

    def __init__(self, config: transformers.PretrainedConfig, layers: list[torch.nn.Module], returns_tuple: bool,
                 buckets: tuple[int, ...] = TOWER_BUCKETS):
        self.config = config  # the tower's: which attention its layers call
        self.layers = layers
        self.returns_tuple = returns_tuple  # audio layers return (hidden_states,), vision blocks a tensor
        self.buckets = buckets
        self.graphs = {}  # (bucket, layer index) -> its CUDAGraph
        self.hidden = None  # [2, Lmax, C]: layer i reads hidden[i % 2], writes hidden[(i + 1) % 2]
        self.cu_seqlens = None  # [S + 2] int32: the sequences' boundaries, the padding's, then empty sequences
        self.rotary = None  # (cos, sin) [Lmax, D] each for the vision tower, None for the audio tower

    def bucket_for(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor) -> int | None:
        """The bucket of a forward, or None where the graphs cannot take it (it runs as transformers runs it). The
        padding and the empty sequences need the packed attention (SDPA's path calls attention once per sequence)."""
        if cu_seqlens.numel() - 1 > TOWER_MOST_SEQUENCES or self.config._attn_implementation != PACKED_ATTENTION:
            return None
        return next((bucket for bucket in self.buckets if bucket >= hidden_states.shape[0]), None)

    def load(self, bucket: int, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """A forward's inputs into the static buffers (made at the first, with its widths and dtypes); padding zero."""
        if self.hidden is None:
            longest = self.buckets[-1]
            self.hidden = hidden_states.new_zeros(2, longest, hidden_states.shape[-1])  # [2, Lmax, C]
            self.cu_seqlens = cu_seqlens.new_zeros(TOWER_MOST_SEQUENCES + 2, dtype=torch.int32)  # [S + 2]
            if position_embeddings is not None:
                self.rotary = tuple(x.new_zeros(longest, x.shape[-1]) for x in position_embeddings)  # [Lmax, D]
        tokens, boundaries = hidden_states.shape[0], cu_seqlens.numel()
        self.hidden[0, :tokens].copy_(hidden_states)
        self.hidden[0, tokens:bucket].zero_()
        self.cu_seqlens[:boundaries].copy_(cu_seqlens)
        self.cu_seqlens[boundaries:].fill_(bucket)
        for static, given in zip(self.rotary or (), position_embeddings or ()):
            static[:tokens].copy_(given)
            static[tokens:bucket].zero_()

    def run_layer(self, index: int, bucket: int) -> None:
        """Layer `index` on the static buffers of `bucket`: what its graph holds."""
        options = {"max_seqlen": bucket}  # an upper bound is all flash attention needs
        if self.rotary is not None:
            options["position_embeddings"] = tuple(x[:bucket] for x in self.rotary)
        out = self.layers[index](self.hidden[index % 2, :bucket], self.cu_seqlens, **options)
        self.hidden[(index + 1) % 2, :bucket].copy_(out[0] if self.returns_tuple else out)

    @torch.inference_mode()
    def capture(self, pool: tuple, stream: torch.cuda.Stream) -> int:
        """Capture every layer for every bucket, largest first, in `pool` (the text decoder's: the towers run before
        it, and hand it only copies). Needs the static buffers, made by one forward (load's warm-up). Returns the
        graphs captured."""
        if self.hidden is None:
            return 0
        for bucket in sorted(self.buckets, reverse=True):
            self.cu_seqlens.copy_(torch.tensor([0] + [bucket] * (TOWER_MOST_SEQUENCES + 1)))  # padding only
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # a first run outside the graphs sets up kernels and workspaces
                for index in range(len(self.layers)):
                    self.run_layer(index, bucket)
            torch.cuda.current_stream().wait_stream(stream)
            for index in range(len(self.layers)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.run_layer(index, bucket)
                graph.replay()  # a graph's first launch uploads it to the device: here, not in a request
                self.graphs[bucket, index] = graph
        return len(self.graphs)


class TowerLayerStep(torch.nn.Module):
    """Stands in for one layer of a tower, with its forward signature: hidden_states [L, C], cu_seqlens [S + 1], and
    the rotary position_embeddings (vision) and max_seqlen as keywords. Calls with anything else, or that the graphs
    cannot take, run the layer itself."""

    TAKEN = frozenset(("position_embeddings", "max_seqlen"))

    def __init__(self, layer: torch.nn.Module, index: int, tower_graphs: TowerGraphs):
        super().__init__()
        self.layer = layer
        self.index = index
        self.tower_graphs = tower_graphs

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, **kwargs: Any):
        graphs = self.tower_graphs
        bucket = graphs.bucket_for(hidden_states, cu_seqlens)
        if bucket is None or not kwargs.keys() <= self.TAKEN:
            return self.layer(hidden_states, cu_seqlens, **kwargs)
        tokens = hidden_states.shape[0]
        if self.index == 0:
            graphs.load(bucket, hidden_states, cu_seqlens, kwargs.get("position_embeddings"))
        elif hidden_states.data_ptr() != graphs.hidden[self.index % 2].data_ptr():
            # not the previous step's output (transformers' loop changed something in between): take it as given
            graphs.hidden[self.index % 2, :tokens].copy_(hidden_states)
        graph = graphs.graphs.get((bucket, self.index))
        if graph is None:
            graphs.run_layer(self.index, bucket)
        else:
            graph.replay()
        out = graphs.hidden[(self.index + 1) % 2, :tokens]  # [L, C]
        return (out,) if graphs.returns_tuple else out


def install_tower_steps(tower: torch.nn.Module) -> TowerGraphs:
    """Put a TowerLayerStep in place of each layer of a vision or audio tower; return their shared TowerGraphs."""
    is_audio = type(tower).__name__ == "Qwen3OmniMoeAudioEncoder"
    layers = tower.layers if is_audio else tower.blocks
    tower_graphs = TowerGraphs(tower.config, list(layers), returns_tuple=is_audio,
                               buckets=AUDIO_TOWER_BUCKETS if is_audio else TOWER_BUCKETS)
    for index, layer in enumerate(tower_graphs.layers):
        layers[index] = TowerLayerStep(layer, index, tower_graphs)
    return tower_graphs


# ---- the joint head, batched -----------------------------------------------------------------------------------------
# The decision module's JointSchemaHead loops in Python over the records, questions and options of a batch: a mean per
# span, a lookup per option, attention per record, and a host read of each record's length. Its GPU work is tiny, but
# its ~4,000 kernel launches for 16 records made it 121 ms of a 16-record forward on an H200 (6.7 ms at one 516-token
# record), against 230-295 ms for the 48-layer text decoder. BatchedJointSchemaHead computes the same maths for the
# whole batch at once, in a fixed number of launches, from index tensors built on the host from the records' spans.
#
WARM_UP_REQUEST = {"model": "warm-up", "state": "warm up", "questions": {"ready": {"type": "noul"}}}
# A small image and a second of silence, decoded: the first forward through each tower makes the static buffers that
# the capture of its layers' graphs needs.
WARM_UP_MEDIA = {"images": [PIL.Image.new("RGB", (64, 64))], "audio": [np.zeros(16_000, dtype=np.float32)]}


def warm_up_engine(clef_model: torch.nn.Module, schema: types.ModuleType, processor: Any,
                   packed_decoder: PackedTextDecoder, progress: Callable[[str], None]) -> None:
    """The engine's compile and graph policy, run once at load on a GPU, so that no request pays for a first time:
    cuDNN's attention off (it builds a plan per new sequence length, ~150 ms each on an H200; the towers' SDPA then
    takes flash or memory-efficient attention, which need none); a text and a media decision through the decision
    module (the GPU's libraries set up, seconds, and the towers' static buffers made); the packed-expert kernels
    compiled for every tile configuration; the text decoder's layers compiled and its graphs, and the towers', captured
    (PackedTextDecoder.capture_graphs), then the batched joint head's (BatchedJointSchemaHead.capture_graphs), all in
    one memory pool."""
    packed_layers = [module for module in clef_model.modules() if isinstance(module, PackedNVFP4Experts)]
    torch.backends.cuda.enable_cudnn_sdp(False)
    progress("warming up: one decision" + (" and compiling the packed-expert kernels" if packed_layers else ""))
    schema.systemone(clef_model, processor, WARM_UP_REQUEST)
    schema.systemone(clef_model, processor, {**WARM_UP_REQUEST, **WARM_UP_MEDIA})
    # a layer of each W4A4 replay mode (one rounding per token, or per pair), so that both are compiled
    for packed_layer in {layer.gate_up_input_scales_shared: layer for layer in packed_layers}.values():
        packed_layer.compile_kernels()
    progress("compiling the text decoder's layers (torch.compile) and capturing its CUDA graphs")
    packed_decoder.compile_layers()
    pool = torch.cuda.graph_pool_handle()
    # One stream for every graph's first run: torch keeps a cuBLAS workspace (32 MiB on Hopper) for each stream a
    # matmul has run on, for the life of the process, and a new stream per bucket (up to 32 distinct ones, torch's
    # stream pool) would keep one each.
    side_stream = torch.cuda.Stream()
    packed_decoder.capture_graphs(packed_decoder.decoder.norm.weight, pool, side_stream, progress)  # like: [H]
    if packed_decoder.graphs and isinstance(clef_model.head, BatchedJointSchemaHead):
        start = time.perf_counter()
        try:
            captured = clef_model.head.capture_graphs(clef_model.output_embeddings.weight, pool, side_stream)
        except RuntimeError as error:  # an attention kernel of this torch or GPU that a graph cannot hold
            clef_model.head.graphs.clear()
            progress(f"the joint head runs op by op: it could not be captured in CUDA graphs ({error})")
        else:
            if head_graphs_agree(clef_model, schema, processor):
                progress(f"joint head captured in {captured} CUDA graphs ({len(HEAD_GRAPH_SLOTS)} index sizes per "
                         f"decoder length) in {time.perf_counter() - start:.1f} s")
            else:
                clef_model.head.graphs.clear()
                progress("the joint head runs op by op: on the load's check batch its CUDA graphs gave other logits "
                         "than it gives op by op")


# Dimension letters: T packed tokens (the batch's records' real tokens, record after record, then the decoder bucket's
# padding), H thinker hidden, W head width, and the slots of a head index (HeadSlots): R records, Q questions, N
# options, S span tokens, O option tokens. Questions are numbered 0..Q-1 and options 0..N-1 across the batch, record
# after record, question after question; the slots past the batch's own are padding.

# A batched head serves only once its logits on the load's check batch are the release head's to within this fraction
# of their largest magnitude (at least 1). BF16 carries 8 significant bits (0.4% per rounding) and the batch changes
# the shapes, so the summation order, of the head's matrix products and attention: that noise moves a logit by about
# 1% of the largest (the tests measure it), where a different formula moves it by tens of percent.
BATCHED_HEAD_TOLERANCE = 0.03
# The load checks the batched head on the warm-up record together with this longer one, which has every question type
# and questions of 2 to 4 options: the check batch is padded, and its records differ in questions and options.
HEAD_CHECK_REQUEST = {
    "state": {"ticket": "The parcel arrived two weeks late and the box was crushed. " * 4, "orders": 3},
    "questions": {
        "team": {"type": "choice", "criteria": {"billing": None, "shipping": "late or damaged parcels",
                                                 "support": "everything else"}},
        "anger": {"type": "score", "criteria": ["calm", "annoyed", "angry", "furious"]},
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    },
}


class HeadSlots(NamedTuple):
    """How many records, questions, options, question and option span tokens, and option tokens a head index holds."""

    records: int  # R
    questions: int  # Q
    options: int  # N
    span_tokens: int  # S
    option_tokens: int  # O

    def holds(self, needed: "HeadSlots") -> bool:
        return all(slots >= count for slots, count in zip(self, needed, strict=True))


# The joint head replays from CUDA graphs captured at load, one per decoder bucket and per row of this table; a batch
# takes the first row that holds it and runs op by op past the last. Op by op the head costs the host 3.6-5.0 ms a
# forward (~320 launches) on an H100's host for 0.7-2.4 ms of GPU work (docs/benchmarks.md). One ~500-token request
# of bench_serve's three questions fills (1, 3, 11, 189, 156) slots, sixteen of them (16, 48, 176, 3,024, 2,496),
# 32 (32, 96, 352, 6,048, 4,992); a request of 64 choices of 8 options each (1, 64, 512, 17,078, 16,896), which runs
# op by op: the largest row's span tokens are gathered as [S, H] rows in FP32 (64 MiB at 8,192), and its working
# memory stays in the graphs' pool.
HEAD_GRAPH_SLOTS = (HeadSlots(MAX_RECORDS_PER_FORWARD, 16, 64, 1024, 1024),
                    HeadSlots(MAX_RECORDS_PER_FORWARD, 64, 256, 4096, 4096),
                    HeadSlots(MAX_RECORDS_PER_FORWARD, 256, 1024, 8192, 8192))


class HeadIndex(NamedTuple):
    """Where a batch's records, questions, options and span tokens lie, for BatchedJointSchemaHead: int64 tensors
    built on the host from the records (`head_index`), padded to its HeadSlots, and copied to the device in one piece.
    Rows are rows of the packed tokens [T]; padding question and option slots hold -1 as their record and question."""

    record_ends: torch.Tensor  # [R] where each record's tokens end (padding slots: the last record's end)
    last_token_rows: torch.Tensor  # [R] each record's last token (the end of "DECISIONS:"); padding 0
    span_token_rows: torch.Tensor  # [S] the tokens of every question span, then of every option span; padding 0
    span_offsets: torch.Tensor  # [Q + N + 1] where each span starts in span_token_rows: the Q question slots (padding
    # slots empty), the N option slots, then one more span; the padding option slots and that one share the padding
    # tokens (padding_spans)
    option_token_ids: torch.Tensor  # [O] the token ids of every option span, span by span; padding 0
    option_offsets: torch.Tensor  # [N + 1] where each option's span starts in option_token_ids, then one more span;
    # the padding option slots and that one share the padding tokens
    question_records: torch.Tensor  # [Q] the record of each question; padding -1
    question_types: torch.Tensor  # [Q] rows of the head's type_embedding; padding 0
    option_questions: torch.Tensor  # [N] the question of each option; padding -1
    option_token_count: torch.Tensor  # [1] the real ones of option_token_ids (the rest padding)

    def flat(self) -> torch.Tensor:
        """The parts laid end to end -> int64 [the index's size]."""
        return torch.cat(self)

    def to(self, device: torch.device) -> "HeadIndex":
        """The same index on `device`, in one copy (host_to_device)."""
        return self.unflattened(host_to_device(self.flat(), device))

    def unflattened(self, flat: torch.Tensor) -> "HeadIndex":
        """The index of these slots as views into the first elements of `flat`, laid out as `flat()` lays them."""
        sizes = [part.numel() for part in self]
        return HeadIndex(*flat[:sum(sizes)].split(sizes))


def expand_spans(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every row of spans [starts[s], starts[s] + lengths[s]), span after span, and where each span starts in them."""
    offsets = np.cumsum(lengths) - lengths  # [S]
    return np.repeat(starts - offsets, lengths) + np.arange(lengths.sum()), offsets


def head_slots_needed(records: list) -> HeadSlots:
    """The HeadSlots that records (EncodedRecord-like) fill exactly."""
    questions = [question for record in records for question in record.questions]
    spans = [question.question_span for question in questions] + [span for question in questions
                                                                   for span in question.option_spans]
    option_spans = spans[len(questions):]
    return HeadSlots(len(records), len(questions), len(option_spans), sum(end - start for start, end in spans),
                     sum(end - start for start, end in option_spans))


def padding_spans(real_starts: np.ndarray, slots: int, real_tokens: int, token_slots: int) -> np.ndarray:
    """Where spans start [slots + 1]: the real spans' starts, then the padding slots and one more span, which share the
    padding tokens [real_tokens, token_slots) evenly. The head averages spans with embedding_bag, which sums a span
    with one thread a column, one row after another: the padding in one span (835 rows for one request in the first
    HEAD_GRAPH_SLOTS row) made each of its two calls take 0.12 ms on an H100 (docs/benchmarks.md)."""
    shares = slots - len(real_starts) + 1  # the padding slots and the span after them
    padding = token_slots - real_tokens
    return np.concatenate([real_starts, real_tokens + padding * np.arange(shares) // shares]).astype(np.int64)


def head_index(records: list, slots: HeadSlots) -> HeadIndex:
    """The HeadIndex of records (EncodedRecord-like) packed record after record, padded to `slots` (which must hold
    them), from their spans and lengths alone: nothing is read from the device."""
    lengths = np.array([len(record.input_ids) for record in records], dtype=np.int64)  # [B]
    ends = np.cumsum(lengths)  # [B]
    record_of_question = np.array([b for b, record in enumerate(records) for _ in record.questions], dtype=np.int64)
    question_spans = np.array([question.question_span for record in records for question in record.questions],
                              dtype=np.int64).reshape(-1, 2) + (ends - lengths)[record_of_question][:, None]  # [Q, 2]
    options_per_question = np.array([len(question.option_spans) for record in records
                                     for question in record.questions], dtype=np.int64)
    option_spans = np.array([span for record in records for question in record.questions
                             for span in question.option_spans], dtype=np.int64).reshape(-1, 2)
    option_spans += np.repeat((ends - lengths)[record_of_question], options_per_question)[:, None]  # [N, 2]
    spans = np.concatenate([question_spans, option_spans])  # [Q + N, 2], rows of the packed tokens
    span_rows, span_starts = expand_spans(spans[:, 0], spans[:, 1] - spans[:, 0])
    option_lengths = option_spans[:, 1] - option_spans[:, 0]  # [N]
    questions, span_tokens, option_tokens = len(question_spans), len(span_rows), int(option_lengths.sum())
    question_tokens = int(span_starts[questions]) if len(option_spans) else span_tokens  # where option spans start

    def padded(values: Any, size: int, fill: int) -> np.ndarray:
        row = np.full(size, fill, dtype=np.int64)
        row[:len(values)] = values
        return row

    span_offsets = np.concatenate([
        padded(span_starts[:questions], slots.questions, question_tokens),
        padding_spans(span_starts[questions:], slots.options, span_tokens, slots.span_tokens)])
    parts = (
        padded(ends, slots.records, ends[-1] if len(ends) else 0),
        padded(ends - 1, slots.records, 0),
        padded(span_rows, slots.span_tokens, 0),
        span_offsets,
        padded(np.concatenate([np.asarray(record.input_ids[start:end], dtype=np.int64) for record in records
                               for question in record.questions for start, end in question.option_spans]
                              or [np.zeros(0, dtype=np.int64)]), slots.option_tokens, 0),
        padding_spans(np.cumsum(option_lengths) - option_lengths, slots.options, option_tokens, slots.option_tokens),
        padded(record_of_question, slots.questions, -1),
        padded([question.question_type for record in records for question in record.questions], slots.questions, 0),
        padded(np.repeat(np.arange(questions), options_per_question), slots.options, -1),
        np.array([option_tokens], dtype=np.int64),
    )
    return HeadIndex(*(torch.from_numpy(part) for part in parts))


def blocked_attention(query_owners: torch.Tensor, key_owners: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask [Nq, Nk] (0 or -inf) that keeps each query to the keys of its own owner (a record):
    query_owners [Nq] (padding slots -1: they see every key, so that no row is all -inf, which would give NaN where
    softmax has nothing to weigh) and key_owners [Nk]."""
    blocked = (query_owners[:, None] != key_owners[None, :]) & (query_owners[:, None] >= 0)  # [Nq, Nk]
    return torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill_(blocked, -math.inf)


# The head's attention (each option and field over its own record's tokens, by an additive mask over the batch's) on
# CUDA: cuDNN's kernel first, then the others in torch's order. torch's own first choice for these masks, the
# memory-efficient kernel, runs a program per 64 queries and head, each over every key: an 8-record head took 2.64 ms
# with it and 1.60 ms with cuDNN's, a lone record's 0.89 and 0.80 ms, logits within 1.5 BF16 steps (an H100,
# docs/benchmarks.md).
HEAD_ATTENTION_BACKENDS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                           SDPBackend.MATH)


@contextlib.contextmanager
def head_attention_kernels(device: torch.device) -> Iterator[None]:
    """The head's attention calls take HEAD_ATTENTION_BACKENDS in that order on CUDA (torch's choice elsewhere). torch
    keeps its order of preference for the whole process, and sdpa_kernel puts back only the order of the kernels
    enabled when it was entered, so the order as a whole is put back here: left changed, it changed the kernel of
    other attention calls in the process (bench/check_engine_gpu.py's two runs of transformers' decoder, with
    and without cuDNN's attention, then gave the same answers)."""
    if device.type != "cuda":
        yield
        return
    order = torch._C._get_sdp_priority_order()
    try:
        with sdpa_kernel(list(HEAD_ATTENTION_BACKENDS), set_priority=True):
            yield
    finally:
        torch._C._set_sdp_priority_order(order)


def capped_logit_scale(parameter: torch.Tensor) -> torch.Tensor:
    return parameter.clamp(max=math.log(100.0)).exp()  # the head's learned logit scales: capped at 100, no lower bound


def span_means(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Means of spans laid end to end in rows [T, D] (each starting at its offset, [S]) -> [S, D] in rows' dtype,
    summed in fp32 as `.mean(0)` of a BF16 span is (and without atomic additions, whose order varies between runs);
    an empty span's mean is zeros."""
    positions = torch.arange(rows.shape[0], device=rows.device)  # [T]
    return torch.nn.functional.embedding_bag(positions, rows.float(), offsets, mode="mean").to(rows.dtype)


class BatchedJointSchemaHead(torch.nn.Module):
    """Stands in for the decision module's JointSchemaHead, with its forward signature and its maths, computed for all
    records, questions and options of a batch together (see the comment above), on the records' tokens packed as the
    text decoder packs them. It reads the wrapped head's own modules and parameters (no copies), calling its
    LayerNorms, Linears, nn.MultiheadAttention and nn.TransformerDecoderLayer with attention masks: each record's
    options attend only to its own tokens, its fields to its own tokens and fields. For inference: the head's dropouts
    are called and are identity in eval mode.

    With a PackedTextDecoder (`decoder`), the head reads the packed rows the decoder wrote, and once `capture_graphs`
    has run it replays a CUDA graph per decoder bucket and HEAD_GRAPH_SLOTS row, on a static index; otherwise it runs
    op by op, on index slots of the same rows (so CPU tests check the padding the graphs replay)."""

    def __init__(self, head: torch.nn.Module, decoder: "PackedTextDecoder | None" = None):
        super().__init__()
        self.head = head
        self.decoder = decoder
        self.graphs = {}  # (decoder bucket, HeadSlots) -> its CUDAGraph
        self.static_index = None  # int64 [the largest HEAD_GRAPH_SLOTS row's index, flattened]
        self.static_logits = None  # [N of the largest row]

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, records: list,
        output_embedding_weight: torch.Tensor,
    ) -> list[list[torch.Tensor]]:
        # hidden_states [B, L, H] (the thinker's, after its final norm), input_ids and attention_mask [B, L]
        # (right-padded), output_embedding_weight [V, H] -> per record, per question, its option logits [n].
        # input_ids and attention_mask are taken for the release head's signature: the records give the ids and
        # lengths.
        packed = None if self.decoder is None else self.decoder.packed_rows_behind(hidden_states)  # [T, H]
        if packed is None:  # not the packed decoder's output: pack the real tokens here
            real_rows = real_token_rows([len(record.input_ids) for record in records], hidden_states.shape[1],
                                        hidden_states.device)  # [T]
            packed = hidden_states.flatten(0, 1)[real_rows]  # [T, H]
        needed = head_slots_needed(records)
        slots = next((slots for slots in HEAD_GRAPH_SLOTS if slots.holds(needed)), needed)
        host_index = head_index(records, slots)
        graph = self.graphs.get((packed.shape[0], slots))
        if graph is not None:
            host_to_static(self.static_index, host_index.flat())
            graph.replay()
            # a copy: the next replay rewrites the static logits, and a caller may hold these past it
            logits = self.static_logits.clone()  # [N of the largest row]
        else:
            logits = self.option_logits(packed, host_index.to(packed.device), output_embedding_weight,
                                        host_index.option_token_ids)  # [N]
        per_question = iter(logits[:needed.options].split(
            [len(question.option_spans) for record in records for question in record.questions]))
        return [[next(per_question) for _ in record.questions] for record in records]

    def option_logits(self, packed: torch.Tensor, index: HeadIndex, output_embedding_weight: torch.Tensor,
                      host_option_token_ids: torch.Tensor) -> torch.Tensor:
        """packed [T, H]: the records' final hidden states, packed (then padding rows, owned by no record) -> the
        logits of the index's option slots [N]. A fixed sequence of launches for given T and slots: a graph's."""
        head = self.head
        questions, options = index.question_records.shape[0], index.option_questions.shape[0]  # Q, N
        normalized = head.hidden_norm(packed)  # [T, H]
        memory = head.memory_projection(normalized)[None]  # [1, T, W]
        token_positions = torch.arange(packed.shape[0], device=packed.device)  # [T]
        token_records = torch.searchsorted(index.record_ends, token_positions, right=True)  # [T]; padding: R
        last_tokens = normalized[index.last_token_rows]  # [R, H]
        span_vectors = span_means(normalized[index.span_token_rows], index.span_offsets)  # [Q + N + 1, H]
        question_vectors, contexts = span_vectors[:questions], span_vectors[questions:questions + options]
        # the output embeddings may be on the host (HostEmbedding): gather there, copy just the rows
        if output_embedding_weight.device == packed.device:
            option_rows = output_embedding_weight[index.option_token_ids]  # [O, H]
        else:
            option_rows = host_rows_to_device(  # [O, H]; the padding slots' zeros on CUDA
                output_embedding_weight, index.option_token_ids if packed.is_cuda else host_option_token_ids,
                packed.device, real_rows=index.option_token_count)
        lexicals = span_means(option_rows, index.option_offsets)[:options]  # [N, H]
        option_questions = index.option_questions.clamp(min=0)  # [N]: padding slots read question 0
        question_records = index.question_records.clamp(min=0)  # [Q]: padding slots read record 0
        option_records = torch.where(index.option_questions >= 0, question_records[option_questions], -1)  # [N]

        queries = (head.option_context_projection(contexts) + head.option_lexical_projection(lexicals)
                   + head.option_question_projection(question_vectors)[option_questions])  # [N, W]
        routed = queries[None]  # [1, N, W]
        evidence_mask = blocked_attention(option_records, token_records, memory.dtype)  # [N, T]
        with head_attention_kernels(packed.device):
            for layer in head.evidence_layers:
                normed_memory = layer.memory_norm(memory)
                attended = layer.attention(layer.query_norm(routed), normed_memory, normed_memory,
                                           attn_mask=evidence_mask, need_weights=False)[0]
                routed = routed + layer.attention_dropout(attended)
                routed = routed + layer.feedforward(layer.feedforward_norm(routed))
        routed = routed[0]  # [N, W]

        # each question's summary of its routed options, weighted by a softmax over its own options
        base = head.question_projection(question_vectors)  # [Q, W]
        owned = index.option_questions[None, :] == torch.arange(questions, device=packed.device)[:, None]  # [Q, N]
        scores = (base @ routed.T) / math.sqrt(head.width)  # [Q, N]
        # a padding question owns no option: its row is all -inf, NaN after softmax, and zeros after the fill
        weights = torch.softmax(scores.masked_fill(~owned, -math.inf), dim=-1).masked_fill(~owned, 0)  # [Q, N]
        summaries = weights @ routed  # [Q, W]
        fields = (base + head.option_summary_norm(summaries) + head.global_projection(last_tokens)[question_records]
                  + head.type_embedding(index.question_types))  # [Q, W]
        decoded = fields[None]  # [1, Q, W]
        field_mask = blocked_attention(index.question_records, index.question_records, memory.dtype)  # [Q, Q]
        memory_mask = blocked_attention(index.question_records, token_records, memory.dtype)  # [Q, T]
        with head_attention_kernels(packed.device):
            for layer in head.layers:
                decoded = layer(decoded, memory, tgt_mask=field_mask, memory_mask=memory_mask)
        fields = head.field_norm(decoded[0])  # [Q, W]

        # each option's logit: a lexical prior plus the gated agreement of its question's field with the option
        anchors = question_vectors + last_tokens[question_records]  # [Q, H]
        anchors = torch.nn.functional.normalize(anchors, dim=-1)
        lexical_directions = torch.nn.functional.normalize(lexicals, dim=-1)  # [N, H]
        priors = (lexical_directions[:, None, :] @ anchors[option_questions, :, None]).view(options)  # [N]
        priors = capped_logit_scale(head.prior_logit_scale) * priors
        option_vectors = head.option_norm(routed)  # [N, W]
        field_vectors = fields[option_questions]  # [N, W]
        cosines = torch.nn.functional.cosine_similarity(field_vectors, option_vectors, dim=-1)  # [N]
        pairs = torch.cat([field_vectors, option_vectors, field_vectors * option_vectors,
                           (field_vectors - option_vectors).abs()], dim=-1)  # [N, 4W]
        residuals = head.residual_scorer(pairs).squeeze(-1)  # [N]
        return priors + torch.sigmoid(head.residual_gate) * (
            capped_logit_scale(head.joint_logit_scale) * cosines + residuals)  # [N]

    def run_static(self, bucket: int, slots: HeadSlots, output_embedding_weight: torch.Tensor) -> None:
        """The head on the decoder's static rows of `bucket` and the static index of `slots`, into the static logits:
        what the graph of (bucket, slots) holds."""
        index = head_index([], slots).unflattened(self.static_index)  # views: the layout of `slots`
        packed = self.decoder.static_buffers[-1][0, :bucket]  # [T, H], the decoder's static hidden states
        self.static_logits[:slots.options].copy_(
            self.option_logits(packed, index, output_embedding_weight, index.option_token_ids))

    @torch.inference_mode()
    def capture_graphs(self, output_embedding_weight: torch.Tensor, pool: tuple, stream: torch.cuda.Stream) -> int:
        """Capture a graph per decoder bucket and HEAD_GRAPH_SLOTS row (`run_static`, every index slot padding while
        capturing) in `pool`, the decoder's: the head runs after the decoder, and its logits are copied out before
        the next forward. Returns the graphs captured."""
        like = self.decoder.static_buffers[-1]  # [1, Lmax, H]
        self.static_index = torch.zeros(head_index([], HEAD_GRAPH_SLOTS[-1]).flat().numel(), dtype=torch.long,
                                        device=like.device)
        self.static_logits = torch.zeros(HEAD_GRAPH_SLOTS[-1].options, dtype=like.dtype, device=like.device)
        for bucket in sorted(self.decoder.buckets, reverse=True):
            for slots in HEAD_GRAPH_SLOTS:
                padding_only = head_index([], slots).flat()
                self.static_index[:padding_only.numel()].copy_(padding_only)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # a first run outside the graph sets up kernels and workspaces
                    self.run_static(bucket, slots, output_embedding_weight)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.run_static(bucket, slots, output_embedding_weight)
                graph.replay()  # a graph's first launch uploads it to the device: here, not in a request
                self.graphs[bucket, slots] = graph
        return len(self.graphs)


def head_check_batch(model: torch.nn.Module, schema: types.ModuleType, processor: Any) -> dict:
    """The load's check batch for the batched head, collated on the model's device: the warm-up record and
    HEAD_CHECK_REQUEST's."""
    records = [schema.encode_record(processor.tokenizer, request) for request in (WARM_UP_REQUEST, HEAD_CHECK_REQUEST)]
    return schema.collate_records(records, processor.tokenizer.pad_token_id, next(model.parameters()).device)


@torch.inference_mode()
def head_graphs_agree(model: torch.nn.Module, schema: types.ModuleType, processor: Any) -> bool:
    """Whether the batched head's graphs give the logits it gives op by op, bit for bit, on the check batch run
    through the whole model: a replay runs the same kernels on the same inputs, so anything else is a fault of the
    graphs (an input that is not where they read it), and the head then serves op by op."""
    batch = head_check_batch(model, schema, processor)
    model.head.static_logits.fill_(math.nan)  # so that a graph which does not write them shows
    replayed = model._forward_unpadded(batch)
    graphs, model.head.graphs = model.head.graphs, {}
    try:
        op_by_op = model._forward_unpadded(batch)
    finally:
        model.head.graphs = graphs
    return all(torch.equal(got, expected) for got_record, expected_record in zip(replayed, op_by_op, strict=True)
               for got, expected in zip(got_record, expected_record, strict=True))


def install_batched_head(model: torch.nn.Module, schema: types.ModuleType, processor: Any,
                         progress: Callable[[str], None]) -> None:
    """Put a BatchedJointSchemaHead in place of the decision module's head (`model.head`), once it has given that
    head's logits (to within BATCHED_HEAD_TOLERANCE) on a check batch run through the whole model as the engine runs
    it: the warm-up record and HEAD_CHECK_REQUEST's. A head whose maths differ (a release's own
    joint_schema_model.py may carry another) keeps serving, and one progress line says which head serves and why."""
    batch = head_check_batch(model, schema, processor)
    head_calls = []  # (args, kwargs, logits) of each call of the release's head
    hook = model.head.register_forward_hook(
        lambda module, args, kwargs, logits: head_calls.append((args, kwargs, logits)), with_kwargs=True)
    try:
        with torch.inference_mode():
            model._forward_unpadded(batch)
    finally:
        hook.remove()
    if len(head_calls) != 1:
        progress(f"joint head: the release's own (the model called its head {len(head_calls)} times on one batch, "
                 "so the batched head could not be checked against it)")
        return
    (args, kwargs, expected), = head_calls
    batched = BatchedJointSchemaHead(model.head, next(
        (module for module in model.modules() if isinstance(module, PackedTextDecoder)), None))
    try:
        with torch.inference_mode():
            got = batched(*args, **kwargs)
        got_shapes, expected_shapes = ([[tuple(question.shape) for question in record] for record in logits]
                                       for logits in (got, expected))
    except Exception as error:  # a head unlike JointSchemaHead: its modules, shapes or records fail our maths somehow
        progress(f"joint head: the release's own (the batched head cannot run it: {type(error).__name__}: {error})")
        return
    if got_shapes != expected_shapes:
        progress("joint head: the release's own (the batched head's logits have other shapes than the release "
                 "head's on the load's check batch)")
        return
    got, expected = (torch.cat([question.float().flatten() for record in logits for question in record])
                     for logits in (got, expected))
    difference = (got - expected).abs().max().item()
    allowed = BATCHED_HEAD_TOLERANCE * max(1.0, expected.abs().max().item())
    if not difference <= allowed:  # NaN differs too
        progress(f"joint head: the release's own (on the load's check batch the batched head's logits differ from "
                 f"the release head's by up to {difference:.3g}, over the {allowed:.3g} allowed: its maths differ)")
        return
    model.head = batched
    progress(f"joint head: batched (its logits on the load's check batch are the release head's to within "
             f"{difference:.3g})")


def batch_compatible(encoded_records: list) -> bool:
    """Whether records can share one forward: the thinker takes one use_audio_in_video flag per batch, so videos
    with and without their soundtrack go to separate forwards."""
    flags = {bool(record.media.get("use_audio_in_video", False)) for record in encoded_records
             if record.media and "pixel_values_videos" in record.media}
    return len(flags) <= 1


def logits_to_host(batch_logits: list[list[torch.Tensor]]) -> tuple[list[list[torch.Tensor]], Any]:
    """Each record's option logits per question (a few values each), copied to host memory in one transfer for the
    whole batch, queued without waiting: (the host tensors, a CUDA event that has passed once they hold the values,
    or None on CPU). Answering reads every question's logits; read from the device, that is a transfer and a wait
    per question."""
    questions = [question_logits for record_logits in batch_logits for question_logits in record_logits]  # [n] each
    if not questions:
        return batch_logits, None
    # [sum of the options]; a head of other shapes (a release's own) is flattened, and its shapes kept below
    flat = torch.cat([logits if logits.dim() == 1 else logits.reshape(-1) for logits in questions])
    copied = None
    if flat.is_cuda:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        flat = host
    host_questions = iter(flat.split([question_logits.numel() for question_logits in questions]))
    host_logits = [[next(host_questions) if logits.dim() == 1 else next(host_questions).view(logits.shape)
                    for logits in record_logits] for record_logits in batch_logits]
    return host_logits, copied


@dataclasses.dataclass
class ForwardInFlight:
    """A forward queue_forward queued on the device: its records' option logits, per question, once it has run."""

    host_logits: list  # per record, per question [n] in host memory (None: a record that did not fit the device)
    end_event: torch.cuda.Event | None  # passed once the logits are in; None: it ran on the host

    def wait(self) -> list[list[torch.Tensor] | None]:
        """Block until the forward has run (an asynchronous fault of the device surfaces here, with this batch)."""
        if self.end_event is not None:
            self.end_event.synchronize()
        return self.host_logits


@torch.inference_mode()
def queue_forward(loaded: LoadedClef, encoded_records: list) -> ForwardInFlight:
    """Queue one forward of a batch of encoded records on the device, without waiting for it. The host is free in
    between: when more is waiting than one forward takes, the server queues the next batch's forward before it
    answers this one's records, so that the device has work while the host answers.

    The batch is the decision module's own collation (right-padded, media concatenated) through its own
    `ClefModel._forward_unpadded`: the thinker embeds it and the PackedTextDecoder runs it packed. When the device
    runs out of memory, each record is scored alone (before this returns); a record that does not fit even alone
    gets None.
    """
    device = next(loaded.model.parameters()).device
    try:
        batch = loaded.schema.collate_records(encoded_records, loaded.processor.tokenizer.pad_token_id, "cpu")
        host_logits, copied = logits_to_host(loaded.model._forward_unpadded(batch_to_device(batch, device)))
    except torch.OutOfMemoryError:
        pass  # retried below, once the exception (and the frames it holds) has let go of the batch's memory
    else:
        return ForwardInFlight(host_logits, copied)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    alone = [None] if len(encoded_records) == 1 else [score_records(loaded, [record])[0] for record in encoded_records]
    return ForwardInFlight(alone, None)


def score_records(loaded: LoadedClef, encoded_records: list) -> list[list[torch.Tensor] | None]:
    """The joint head's option logits of each encoded record (per question, in host memory), from one forward of the
    batch, waited for (queue_forward)."""
    return queue_forward(loaded, encoded_records).wait()


# ==== decisions =======================================================================================================
# A request is checked field by field (docs/api.md §2) before anything is decoded; then its media are decoded and
# measured, its record is encoded once by the decision module's own `encode_record`, the engine scores it (in the
# server, in a batch with others) and the module's own answer code answers it. The server prepares requests on
# PREPARING_THREADS threads, each with its own copy of the processor (the fast tokenizer refuses a call that changes
# its settings while another thread's call is inside it), and scores and answers them on another.

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
MAX_IMAGE_PIXELS = 16_000_000  # per image, and per video frame
MAX_ASPECT_RATIO = 200  # the Qwen vision processors refuse images and frames longer than 200:1 (smart_resize)
MAX_AUDIO_SECONDS = 300  # per clip, and per video soundtrack
# The audio feature extractor reflect-pads each clip by half its 400-sample FFT window, which needs more than 200
# samples at 16 kHz; 13 ms (208 samples) leaves room for the resampler's rounding of clips recorded at other rates.
MIN_AUDIO_SECONDS = 0.013
# A video's soundtrack whose packets last this long or more decodes to more than MIN_AUDIO_SECONDS whatever its codec's
# priming drops (AAC's 2,112 samples, Opus's 80 ms), so only a shorter one is decoded to be measured (_check_video)
SOUNDTRACK_PACKETS_SURELY_LONG_S = 1.0
AUDIO_SAMPLE_RATE = 16_000  # the decision module's load_audio gives samples at this rate
# FFmpeg reads up to 5 MB of a clip when it opens it, to find what the WAV or MP3 header states already (about 5 ms
# per open of a 10 s WAV on the H200's host); the length checks read the headers and frames only.
AUDIO_OPEN_OPTIONS = {"probesize": "32"}
MAX_VIDEO_SECONDS = 60
MAX_VIDEO_FRAMES = 3_600  # 60 s at 60 frames per second
MAX_VIDEO_DECODED_PIXELS = MAX_VIDEO_FRAMES * 1920 * 1080  # what decoding a video may cost: 60 s of 1080p at 60 fps
# The TypeSafe form of an image: an entry of `assets`, its format named without the "image/" prefix.
ASSET_FORMATS = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg", "webp": "image/webp"}
# data:<type>[;<parameter>...];base64,<data>; parameters such as charset=utf-8 or name=photo.png are ignored
MEDIA_DATA_URL = re.compile(r"^data:(?P<content_type>[\w.+-]+/[\w.+-]+)(?:;[^;,]*)*;base64,(?P<data>.*)$", re.DOTALL)
RAW_BASE64 = re.compile(r"^[A-Za-z0-9+/\s]{16,}={0,2}\s*$")
INLINE_MEDIA = "send it inline as a data URL (data:<type>;base64,<data>) or as {\"content_type\": ..., \"base64\": ...}"


class RequestError(Exception):
    """A refused request: HTTP status, the path of the offending field (FastAPI style), a message and an error type."""

    def __init__(self, status: int, loc: tuple, message: str, error_type: str = "value_error"):
        super().__init__(message)
        self.status = status
        self.loc = loc
        self.message = message
        self.error_type = error_type


class MediaItem(NamedTuple):
    """One medium of a request, checked for shape but not decoded: where the request holds it, and its base64 text."""

    loc: tuple  # ("images", 0), ("assets", "<placeholder>"), ...
    base64_text: str

    @property
    def name(self) -> str:
        """The item as messages name it: images[0], assets["photo"]."""
        field_name, key = self.loc
        return f"{field_name}[{json.dumps(key, ensure_ascii=False)}]"


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string" if value else "an empty string"
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


def _media_item(field_name: str, index: int, item: Any) -> MediaItem:
    """The base64 text of one item of images, audio or videos, refusing anything that is not inline data of a content
    type the field accepts (the format itself is read from the decoded bytes, whatever the declared type says)."""
    media = MediaItem((field_name, index), "")
    if isinstance(item, dict):
        content_type, data = item.get("content_type"), item.get("base64")
        if not isinstance(content_type, str) or not isinstance(data, str):
            raise _invalid(media.loc, f"{media.name}: a media object needs the string fields content_type and base64")
    elif isinstance(item, str):
        match = MEDIA_DATA_URL.match(item)
        if match is None:
            if "://" in item[:16]:
                raise _invalid(media.loc, f"{media.name} is a remote URL: the server never fetches URLs; "
                               f"{INLINE_MEDIA}")
            if item.startswith("data:"):
                raise _invalid(media.loc, f"{media.name} is not a base64 data URL; {INLINE_MEDIA}")
            if RAW_BASE64.fullmatch("".join(item.split())):
                raise _invalid(media.loc, f"{media.name} looks like base64 without the data URL around it: prefix "
                               f"it with data:<type>;base64, (e.g. data:{MEDIA_LIMITS[field_name][1][0]};base64,) "
                               "or send {\"content_type\": ..., \"base64\": ...}")
            raise _invalid(media.loc, f"{media.name} looks like a file path: the server never reads files; "
                           f"{INLINE_MEDIA}")
        content_type, data = match["content_type"], match["data"]
    else:
        raise _invalid(media.loc, f"{media.name} must be a data URL or a {{content_type, base64}} object, "
                       f"not {json_type(item)}")
    accepted = MEDIA_LIMITS[field_name][1]
    content_type = content_type.strip().lower()
    if content_type not in accepted:
        raise _invalid(media.loc, f"{media.name} has content type {content_type!r}; {field_name} accept "
                       f"{', '.join(accepted)}")
    return media._replace(base64_text=data)


def _asset_item(placeholder: str, asset: Any) -> MediaItem:
    """The base64 text of one entry of `assets`, the TypeSafe clients' form of an image (docs/api.md §2.5):
    {"type": "image", "format": "png" | "jpg" | "jpeg" | "webp", "data_base64": ...}. A multipart body's image parts
    arrive here already turned into data_base64 (read_json_body); an entry that still names a part had no such body."""
    media = MediaItem(("assets", placeholder), "")
    if not isinstance(asset, dict):
        raise _invalid(media.loc, f"{media.name} must be an object {{\"type\": \"image\", \"format\": ..., "
                       f"\"data_base64\": ...}}, not {json_type(asset)}")
    if asset.get("type", "image") != "image":
        raise _invalid((*media.loc, "type"), f"{media.name}: type must be \"image\", the only asset type served")
    asset_format = asset.get("format")
    if asset_format is not None and asset_format not in ASSET_FORMATS:
        raise _invalid((*media.loc, "format"), f"{media.name}: format must be one of {', '.join(ASSET_FORMATS)}")
    if "part" in asset:
        raise _invalid((*media.loc, "part"), f"{media.name} names a multipart part, but the body is not "
                       "multipart/form-data: send the image as that part of a multipart body, or as data_base64")
    if not isinstance(asset.get("data_base64"), str):
        raise _invalid((*media.loc, "data_base64"), f"{media.name} needs the image as a base64 string in data_base64")
    return media._replace(base64_text=asset["data_base64"])


FLOAT_MAX_DIGITS = len(str(int(sys.float_info.max)))  # 309: an integer of more digits overflows a 64-bit float


def parse_request_json(text: str | bytes) -> Any:
    """A request's JSON text parsed as Python's json parses it, except that an integer beyond a 64-bit float's range
    (more than 1.8e308 in magnitude) becomes ±infinity, as it does in clients that read JSON numbers as floats, and is
    refused with 400 naming its field (refuse_unrepresentable_values) like 1e999; Python alone would keep one of up to
    4,300 digits and fail the whole body on a longer one, with a message about its own digit limit."""

    def integer(digits: str) -> int | float:
        if len(digits.lstrip("-")) <= FLOAT_MAX_DIGITS:
            value = int(digits)
            if abs(value) <= sys.float_info.max:
                return value
        return -math.inf if digits.startswith("-") else math.inf

    return json.loads(text, parse_int=integer)


def refuse_unrepresentable_values(value: Any, loc: tuple) -> None:
    """400 for a value JSON parses but nothing downstream can represent: a NaN or ±Infinity literal, a number that
    overflowed to infinity (1e999), or text with a lone UTF-16 surrogate (an unpaired \\ud800 escape), keys
    included; the message names the field, its own surrogates written as escapes. Walked with a stack, not
    recursion: a body nested as deep as the JSON parser allows must not exhaust Python's recursion limit here."""
    pending = [(value, loc)]
    while pending:
        value, loc = pending.pop()
        problem = None
        if isinstance(value, float) and math.isnan(value):
            problem = "NaN is not a JSON number"
        elif isinstance(value, float) and math.isinf(value):
            problem = "Infinity, or a number too large for a 64-bit float, is not a JSON number"
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


def validate_request(request: Any) -> tuple[dict, bool]:
    """Check a SystemOne request field by field, decoding nothing; return (the record for systemone, truncate). Values
    nothing downstream can represent anywhere in it are refused first, with 400 (refuse_unrepresentable_values).

    The record keeps only the fields systemone reads (unknown fields are ignored, `media_kwargs` is refused), and its
    media items become MediaItems for `decode_media`. The TypeSafe clients' `assets` (placeholder -> image) join the
    images, after those of `images`, in the order the object lists them; the placeholders stay in the text as written.
    """
    if not isinstance(request, dict):
        raise RequestError(422, ("body",), f"the body must be a JSON object, not {json_type(request)}", "dict_type")
    refuse_unrepresentable_values(request, ("body",))
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
    assets = request.get("assets")
    if assets is not None:
        if not isinstance(assets, dict):
            raise _invalid(("assets",), f"assets must be an object mapping each placeholder to an image, not "
                           f"{json_type(assets)}")
        max_images = MEDIA_LIMITS["images"][0]
        if len(record.get("images", [])) + len(assets) > max_images:
            raise _invalid(("assets",), f"images and assets hold at most {max_images} images together; got "
                           f"{len(record.get('images', [])) + len(assets)}")
        record["images"] = record.get("images", []) + [_asset_item(placeholder, asset) for placeholder, asset in
                                                       assets.items()]
    return record, truncate


def _decode_base64(media: MediaItem) -> bytes:
    try:
        return base64.b64decode("".join(media.base64_text.split()), validate=True)
    except ValueError as error:  # invalid base64 (binascii's Error is a ValueError), or text that is not ASCII
        raise _invalid(media.loc, f"{media.name} is not valid base64: {error}") from None


def _undecodable(media: MediaItem, what: str, error: Exception) -> RequestError:
    """422 for a medium its decoder refused, in the decoder's words without its internals (FFmpeg's error number and
    file name, Pillow's file object)."""
    if isinstance(error, av.FFmpegError):
        reason = error.strerror or type(error).__name__
    elif isinstance(error, PIL.UnidentifiedImageError):
        reason = "not a PNG, JPEG or WebP image"
    else:
        reason = str(error)
    return _invalid(media.loc, f"{media.name} could not be decoded as {what}: {reason}")


def _refuse_picture_size(media: MediaItem, width: int, height: int, unit: str) -> None:
    """422 for an image or a video frame over 16 megapixels, or longer than the vision processor's 200:1."""
    if width * height > MAX_IMAGE_PIXELS:
        raise _invalid(media.loc, f"{media.name} has {width}x{height} pixels; at most 16 megapixels per {unit}")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise _invalid(media.loc, f"{media.name} is {width}x{height} pixels; the longer side may be at most "
                       f"{MAX_ASPECT_RATIO} times the shorter one")


def _decode_image(media: MediaItem, data: bytes) -> PIL.Image.Image:
    """The decoded image: PNG, JPEG or WebP (whichever the bytes are), its size checked before its pixels are
    decoded."""
    try:
        image = PIL.Image.open(io.BytesIO(data))
        if image.format not in ("PNG", "JPEG", "WEBP"):
            raise _invalid(media.loc, f"{media.name} is {image.format}; images must be PNG, JPEG or WebP")
        _refuse_picture_size(media, *image.size, "image")
        image.load()
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as error:
        raise _undecodable(media, "an image", error) from None
    return image


def _declared_seconds(container: av.container.InputContainer, stream: av.stream.Stream) -> float:
    """The duration a stream's header (or else its container's) declares, 0 when neither does."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return container.duration / av.time_base if container.duration is not None else 0.0


def _decoded_seconds(frames: Iterable[av.AudioFrame], seconds: float, media: MediaItem, what: str) -> float:
    """`seconds` plus the length of the decoded audio `frames`, counted before any resampling (which is what would
    multiply a lying sample rate into gigabytes), and refused as soon as the total passes MAX_AUDIO_SECONDS. `what`
    says whose length it is: "lasts" for a clip, "has a soundtrack of" for a video."""
    for frame in frames:
        seconds += frame.samples / frame.sample_rate
        if seconds > MAX_AUDIO_SECONDS:
            raise _invalid(media.loc, f"{media.name} {what} over {MAX_AUDIO_SECONDS} s; audio may last at most "
                           f"{MAX_AUDIO_SECONDS} s per clip or soundtrack")
    return seconds


def _refuse_short_sound(media: MediaItem, seconds: float, what: str) -> None:
    if seconds < MIN_AUDIO_SECONDS:
        raise _invalid(media.loc, f"{media.name} {what} {seconds * 1000:.1f} ms; audio must last at least "
                       f"{MIN_AUDIO_SECONDS * 1000:.0f} ms (the audio encoder's window)")


def _packet_seconds(container: av.container.InputContainer, stream: av.audio.stream.AudioStream) -> float | None:
    """A stream's length from its packets' durations, demuxed, nothing decoded; None where a packet states none.
    Decoding gives at most this much: an MP3's packets also count the encoder's delay and padding, which the decoder
    drops (10.031 s of packets for 10.000 s of sound at 44.1 kHz), and a WAV's packets are exactly its samples.
    Summed in the stream's time base and converted once (a Fraction product per packet took 1.2 ms for a 10 s WAV)."""
    if stream.time_base is None:
        return None
    duration = 0
    for packet in container.demux(stream):
        if packet.size == 0:  # the demuxer's end-of-stream marker
            continue
        if not packet.duration:
            return None
        duration += packet.duration
    return float(duration * stream.time_base)


def _decode_audio_clip(media: MediaItem, data: bytes, schema: types.ModuleType) -> np.ndarray:
    """16 kHz mono samples of a WAV or MP3 clip of 13 ms to 300 s, decoded once (by the decision module). The length is
    bounded before that decoding resamples the clip: from the header (except MP3's, which FFmpeg only estimates), then
    from the packets, which decode to at most their durations; only a clip whose packets pass the limit, or state no
    duration, is decoded here to count its frames exactly, stopping at the limit."""
    try:
        with av.open(io.BytesIO(data), options=AUDIO_OPEN_OPTIONS) as container:
            container_format = container.format.name
            if container_format not in ("wav", "mp3"):
                raise _invalid(media.loc, f"{media.name} is {container_format}; audio must be WAV or MP3")
            if not container.streams.audio:
                raise _invalid(media.loc, f"{media.name} has no audio stream")
            stream = container.streams.audio[0]
            declared = _declared_seconds(container, stream)
            if container_format != "mp3" and declared > MAX_AUDIO_SECONDS:
                raise _invalid(media.loc, f"{media.name} lasts {declared:.1f} s by its header; at most "
                               f"{MAX_AUDIO_SECONDS} s per clip")
            seconds = _packet_seconds(container, stream)
        if seconds is None or seconds > MAX_AUDIO_SECONDS:
            with av.open(io.BytesIO(data), options=AUDIO_OPEN_OPTIONS) as container:
                seconds = _decoded_seconds(container.decode(container.streams.audio[0]), 0.0, media, "lasts")
        _refuse_short_sound(media, seconds, "lasts")
        samples = schema.load_audio(data)
    except (av.FFmpegError, ValueError) as error:
        raise _undecodable(media, "audio", error) from None
    # the packets counted an MP3's encoder delay and padding too: the samples themselves must reach the minimum
    _refuse_short_sound(media, len(samples) / AUDIO_SAMPLE_RATE, "lasts")
    return samples


def _check_video(media: MediaItem, data: bytes) -> None:
    """Refuse a video that is not MP4 or WebM or that breaks a limit, without decoding it: the frame size, aspect
    ratio and durations come from the headers, the frame count, timestamps and the soundtrack's length from its
    packets, and only its first frame is decoded (to see that one decodes, at the size declared). The decision module
    decodes the frames it samples, and the soundtrack, when it encodes the record. Packets decode to at most their
    durations, less the codec's priming (tens of ms), so a soundtrack is decoded here, and counted exactly against the
    audio limit before resampling, only when its packets pass that limit, state no duration, or come to less than
    SOUNDTRACK_PACKETS_SURELY_LONG_S (where the priming could leave less than the audio encoder's window)."""
    try:
        with av.open(io.BytesIO(data)) as container:
            container_formats = container.format.name.split(",")
            if "mp4" not in container_formats and "webm" not in container_formats:
                raise _invalid(media.loc, f"{media.name} is {container.format.name}; videos must be MP4 or WebM")
            if not container.streams.video:
                raise _invalid(media.loc, f"{media.name} has no video stream")
            video = container.streams.video[0]
            width, height = video.codec_context.width, video.codec_context.height
            _refuse_picture_size(media, width, height, "frame")
            declared = _declared_seconds(container, video)
            if declared > MAX_VIDEO_SECONDS:
                raise _invalid(media.loc, f"{media.name} lasts {declared:.1f} s by its header; at most "
                               f"{MAX_VIDEO_SECONDS} s per video")
            soundtrack = container.streams.audio[0] if container.streams.audio else None
            declared = 0.0 if soundtrack is None else _declared_seconds(container, soundtrack)
            if declared > MAX_AUDIO_SECONDS:
                raise _invalid(media.loc, f"{media.name} has a soundtrack of {declared:.1f} s by its header; "
                               f"soundtracks count against the audio limit of {MAX_AUDIO_SECONDS} s per clip")
            frames, first_frame = 0, None
            sound_duration = 0 if soundtrack is not None and soundtrack.time_base is not None else None  # time base
            for packet in container.demux([video] + ([soundtrack] if soundtrack is not None else [])):
                if packet.stream is soundtrack:
                    if packet.size and sound_duration is not None:  # size 0: the demuxer's end-of-stream marker
                        sound_duration = sound_duration + packet.duration if packet.duration else None
                    continue
                if packet.size == 0:  # the demuxer's end-of-stream marker
                    continue
                frames += 1
                if frames > MAX_VIDEO_FRAMES or frames * width * height > MAX_VIDEO_DECODED_PIXELS:
                    raise _invalid(media.loc, f"{media.name} holds over {frames - 1} frames of {width}x{height} "
                                   f"pixels, more than a video may cost to decode: at most {MAX_VIDEO_FRAMES} "
                                   f"frames and {MAX_VIDEO_DECODED_PIXELS / 1e9:.1f} gigapixels in all")
                seconds = float(packet.pts * packet.time_base) if packet.pts is not None and packet.time_base else 0.0
                if seconds > MAX_VIDEO_SECONDS:
                    raise _invalid(media.loc, f"{media.name} lasts over {MAX_VIDEO_SECONDS} s; at most "
                                   f"{MAX_VIDEO_SECONDS} s per video")
                if first_frame is None and (first_frame := next(iter(packet.decode()), None)) is not None:
                    # frames larger than the header said are refused, and counted at their own size from here on
                    _refuse_picture_size(media, first_frame.width, first_frame.height, "frame")
                    width, height = max(width, first_frame.width), max(height, first_frame.height)
            if first_frame is None and frames:  # a decoder that holds frames back gives them up when flushed
                first_frame = next(iter(video.codec_context.decode(None)), None)
                if first_frame is not None:
                    _refuse_picture_size(media, first_frame.width, first_frame.height, "frame")
            sound_seconds = None if sound_duration is None else float(sound_duration * soundtrack.time_base)
        if soundtrack is not None and not (
                sound_seconds is not None and SOUNDTRACK_PACKETS_SURELY_LONG_S <= sound_seconds <= MAX_AUDIO_SECONDS):
            with av.open(io.BytesIO(data)) as container:
                sound_seconds = _decoded_seconds(container.decode(container.streams.audio[0]), 0.0, media,
                                                 "has a soundtrack of")
    except (av.FFmpegError, ValueError) as error:
        raise _undecodable(media, "a video", error) from None
    if first_frame is None:
        raise _invalid(media.loc, f"{media.name} has no decodable frames")
    if sound_seconds:
        _refuse_short_sound(media, sound_seconds, "has a soundtrack of")


def decode_media(record: dict, schema: types.ModuleType) -> dict:
    """The record with its media decoded and measured against the limits of docs/api.md §2.4.

    Every size is checked before any medium is decoded, and every duration, frame size and frame count before the
    costly decoding. Images (`assets` among them) become PIL images and audio clips 16 kHz samples, which systemone
    takes as they are; videos stay bytes, checked here, because systemone reads their frames and soundtrack itself.
    """
    data = {}  # field -> (item, its decoded base64 bytes) of each item
    for field_name, (_, _, max_item_bytes) in MEDIA_LIMITS.items():
        data[field_name] = [(media, _decode_base64(media)) for media in record.get(field_name, [])]
        for media, item in data[field_name]:
            if len(item) > max_item_bytes:
                raise _invalid(media.loc, f"{media.name} is {len(item) / MiB:.1f} MiB decoded; at most "
                               f"{max_item_bytes // MiB} MiB each")
    image_bytes = sum(len(item) for _, item in data["images"])
    if image_bytes > MAX_IMAGE_BYTES_TOTAL:
        raise _invalid(("images",), f"images total {image_bytes / MiB:.1f} MiB decoded; at most "
                       f"{MAX_IMAGE_BYTES_TOTAL // MiB} MiB per request")
    audio_video_bytes = sum(len(item) for _, item in data["audio"] + data["videos"])
    if audio_video_bytes > MAX_AUDIO_VIDEO_BYTES_TOTAL:
        raise _invalid(("audio",), f"audio and videos total {audio_video_bytes / MiB:.1f} MiB decoded; at most "
                       f"{MAX_AUDIO_VIDEO_BYTES_TOTAL // MiB} MiB per request")

    decoded = dict(record)
    if data["images"]:
        decoded["images"] = [_decode_image(media, item) for media, item in data["images"]]
    if data["audio"]:
        decoded["audio"] = [_decode_audio_clip(media, item, schema) for media, item in data["audio"]]
    if data["videos"]:
        for media, item in data["videos"]:
            _check_video(media, item)
        decoded["videos"] = [item for _, item in data["videos"]]
    return decoded


@functools.cache
def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token of `tokenizer` can stand for: its longest vocabulary entry. Byte-level
    BPE vocabularies (Qwen's) spell each byte of UTF-8 as one character, so this counts bytes, which are never fewer
    than the characters they encode. Cached: a vocabulary of 151,000 entries takes a while to list."""
    return max(len(token) for token in tokenizer.get_vocab())


STATE_CUT_MARGIN_TOKENS = 64  # beyond the tokens kept, so that where the text is cut cannot change them


def cap_state_text(loaded: LoadedClef, record: dict, max_length: int, truncate: bool) -> dict:
    """The record with its state, as the prompt renders it, cut to what `max_length` tokens can possibly cover, before
    anything tokenizes it: a 13 MiB state is not tokenized whole to keep its first 64,000 tokens.

    No token stands for more than `longest_token_chars` characters, so the tokens kept from the whole state all lie in
    its first max_length × that many characters. The cut falls STATE_CUT_MARGIN_TOKENS tokens' worth of characters
    further on: the text's split into words and BPE merges reach only a token or so across a cut, so the tokens kept
    are exactly those of the whole state. With truncate false, a state of more characters cannot fit: 413 at once.
    """
    longest = longest_token_chars(loaded.processor.tokenizer)
    limit = (max_length + STATE_CUT_MARGIN_TOKENS) * longest
    state = record["state"]
    if isinstance(state, str) and len(state) <= limit:
        return record
    text = loaded.schema.render(state)
    if len(text) <= limit:
        return record
    if not truncate:
        raise RequestError(413, ("body", "state"), f"maximum context length: the state has {len(text)} characters, "
                           f"more than {max_length} tokens of at most {longest} characters each can hold, and "
                           "truncate is false", "context_too_long")
    return {**record, "state": text[:limit]}


def encode(loaded: LoadedClef, record: dict, max_length: int, truncate: bool):
    """(the record encoded by the decision module's own encode_record, how many state tokens were cut to fit), or a
    RequestError: 413 when it cannot fit `max_length` tokens (truncate false: at all; truncate true: not even with
    its state cut), 422 for other refusals. Only a record cut to fit is encoded a second time, to count the cut."""
    record = cap_state_text(loaded, record, max_length, truncate)
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


@dataclasses.dataclass
class PreparedRecord:
    """A request validated, its media decoded and its record encoded: what a forward needs, and what its answers
    need (the questions, the token counts, the stage timings so far)."""

    record: dict  # the validated record, media decoded
    encoded: Any  # the decision module's EncodedRecord
    state_tokens_dropped: int  # state tokens cut to fit max_length (truncate: true)
    timings: dict[str, float]  # seconds per stage: decode, encode (forward and answer added later)

    @property
    def tokens(self) -> int:
        return len(self.encoded.input_ids)


def prepare(loaded: LoadedClef, request: Any, max_length: int, timings: dict[str, float] | None = None
            ) -> PreparedRecord:
    """Validate a SystemOne request, decode each medium once and encode the record once; RequestError if refused."""
    started = time.perf_counter()
    timings = {} if timings is None else timings
    record, truncate = validate_request(request)
    record = decode_media(record, loaded.schema)
    decoded = time.perf_counter()
    timings["decode"] = decoded - started
    encoded, state_tokens_dropped = encode(loaded, record, max_length, truncate)
    timings["encode"] = time.perf_counter() - decoded
    return PreparedRecord(record, encoded, state_tokens_dropped, timings)


def answer(loaded: LoadedClef, prepared: PreparedRecord, logits: list[torch.Tensor] | None) -> dict:
    """The SystemOne response for one scored record, from the decision module's own answer code; 413 for a record
    that did not fit in device memory (logits None)."""
    answer_started = time.perf_counter()
    if logits is None:
        raise RequestError(413, ("body",), "too many tokens: the device ran out of memory scoring this request; send "
                           "a shorter state or fewer or smaller media", "too_many_tokens")
    answers = {}
    for (question_id, question), encoded_question, question_logits in zip(
        prepared.record["questions"].items(), prepared.encoded.questions, logits
    ):
        probabilities = dict(zip(encoded_question.option_ids, question_logits.float().softmax(-1).tolist()))
        answers[question_id] = loaded.schema.systemone_answer(question, probabilities)
        if "legend" in answers[question_id]:  # the SystemOne clients refuse null legend values: a level's own index
            legend = answers[question_id]["legend"]
            answers[question_id]["legend"] = {level: level if text is None else text for level, text in legend.items()}
    prepared.timings["answer"] = time.perf_counter() - answer_started
    usage = {"input_tokens": prepared.tokens, "output_tokens": 0}
    if prepared.state_tokens_dropped:  # the state was cut to fit the context (truncate: true, the default)
        usage["state_tokens_dropped"] = prepared.state_tokens_dropped
    working = sum(prepared.timings.get(stage, 0.0) for stage in ("decode", "encode", "forward", "answer"))
    usage["latency_ms"] = round(working * 1000, 1)
    return {"model": prepared.record["model"], "answers": answers, "usage": usage}


def decide(
    loaded: LoadedClef, request: Any, max_length: int = DEFAULT_MAX_LENGTH, timings: dict[str, float] | None = None
) -> dict:
    """Answer one SystemOne request (docs/decision-api.md), or raise RequestError saying why it is refused.

    The server's own walk, which the decision module's `systemone()` does in one call: validate, decode each medium,
    encode once, one forward, then the module's own answer code. `timings`, when given, receives the seconds each
    stage took (decode, encode, forward, answer). Not thread safe: call it from one thread at a time. The HTTP server
    runs the same steps, with records of several requests sharing each forward.
    """
    prepared = prepare(loaded, request, max_length, timings)
    forward_started = time.perf_counter()
    (logits,) = score_records(loaded, [prepared.encoded])
    prepared.timings["forward"] = time.perf_counter() - forward_started
    return answer(loaded, prepared, logits)


# ==== HTTP ============================================================================================================
# FastAPI app over `decide`: the port opens at once and the model loads on the scoring thread; until it is ready the
# decision and health endpoints answer 503. Every error body has the shapes of docs/api.md §6.1.

MAX_BODY_BYTES = 13 * MiB
MULTIPART_REQUEST_PART = "request"  # the part holding the JSON request in the TypeSafe clients' multipart bodies
BODY_READ_TIMEOUT_S = 60  # from the first byte of a request body to its last: 13 MiB takes under 60 s at 2 Mbit/s
KEEP_ALIVE_TIMEOUT_S = 5  # an idle keep-alive connection is closed after this long
SHUTDOWN_DRAIN_S = 10  # on SIGTERM or SIGINT, requests in flight get this long to finish; then they are cancelled
RETRY_AFTER_S = 10
DISCONNECT_CHECK_S = 0.5  # how often a waiting request checks that its client is still there
SERVER_SWITCH_INTERVAL_S = 0.001  # Python's lock handed between the server's threads this often (default 5 ms)
# After answering a forward's records while less than a forward's worth waits, the scorer gives their clients this
# long to send their next requests, so that those join the next forward instead of waiting a whole forward behind it
# (a lone client, whose next request finds nothing else waiting, never waits for it); when two groups take turns
# (below), as long for the group just answered to be back before it is queued. About three times what a lone
# client's next request took to arrive and be prepared on the H200's host (5 ms); docs/benchmarks.md.
REJOIN_WAIT_S = 0.015
# Two groups of at least this many records take turns on the device instead of waiting for each other: while one
# group's forward runs, the other's clients are answered and send their next requests (the scorer queues them as soon
# as they are all back, or REJOIN_WAIT_S has passed), so the device does not idle through their way back (15-23 ms
# between forwards of 8-15 records on an H100's host); each turn costs a forward's fixed work (8.6 ms of an H100's
# 8.6 ms + 15.2 us a token). On an H100 (docs/benchmarks.md) 4 took 8 clients from 45.4-45.5k to 49.0-49.4k tokens/s
# and 16 clients from 47.2k to 55.3-55.8k; 6 left 8 clients waiting for each other.
ALTERNATING_RECORDS = 4
# Requests are prepared by this many threads, each with its own processor: a text request behind a video's 27 ms of
# decoding and encoding no longer waits for it, and the tokenizer and the media decoders let go of Python's lock, so
# the requests a forward's answered clients send together are prepared side by side (on the H100's 16-CPU host, 1.37
# ms a ~512-token text request one at a time, 0.98 ms a request four at a time; docs/benchmarks.md).
PREPARING_THREADS = 4
SERVED_NAME = "clef-omni"
CLEF_OMNI_RELEASED = 1791504000  # 2026-10-09 00:00 UTC, the Cloudflare/clef-omni release date, as a unix time
ERROR_CATEGORY = {401: "authentication_error", 500: "server_error", 503: "service_unavailable"}


# The request body as pydantic models (docs/api.md §2), the one description of it: the OpenAPI document and /docs are
# generated from them. The endpoint still reads its body itself (compressed, multipart, with the 413 and 422 shapes of
# §6) and checks it with validate_request, whose messages and locations are the contract; tests/test_openapi_schema.py
# holds the two to accepting and refusing the same bodies. Strict, as validate_request is: a number is not a string,
# and "true" is not a boolean.


class _RequestModel(BaseModel):
    model_config = ConfigDict(strict=True)


Description = TypeAliasType("Description", Annotated[str | dict[str, Any] | list[Any] | None, Field(
    description="Text the model reads, or JSON (an object or an array), which it reads as compact JSON."
)])


def _refuse_any_value(value: Any, info: ValidationInfo) -> Any:
    raise ValueError(f"{info.field_name} must be left out")


# A field a body must not hold, not even as null: any value fails, and the schema admits none. The default is left
# out of the schema, where a null default would read as a value the field accepts.
LeftOut = Annotated[Any, PlainValidator(_refuse_any_value), WithJsonSchema({"not": {}})]


def _left_out(reason: str) -> Any:
    return Field(None, description=reason, json_schema_extra=lambda schema: schema.pop("default"))


class NoulCriteria(_RequestModel):
    """What true and false stand for. A side left out keeps its built-in description; other keys are ignored."""

    true: Description = None
    false: Description = None


class _Question(_RequestModel):
    instructions: Description = Field(None, description="The question put to the model. Missing, null or \"\": the "
                                      "model reads the question id instead.")


class NoulQuestion(_Question):
    """A yes-or-no question; its answer is the probability of true."""

    type: Literal["noul"]
    criteria: NoulCriteria | None = None


class ChoiceQuestion(_Question):
    """One option out of several. The model reads the options sorted by id; the answer lists them in request order."""

    type: Literal["choice"]
    criteria: dict[str, Description] = Field(
        min_length=2, max_length=MAX_CHOICE_OPTIONS, description="Option id -> what the option means."
    )


class ScoreQuestion(_Question):
    """A level on a scale; its answer is the expected level, counting from 0 for the first."""

    type: Literal["score"]
    criteria: list[Description] = Field(
        min_length=MIN_SCORE_LEVELS, max_length=MAX_SCORE_LEVELS, description="What each level means, lowest first."
    )


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


def _media_items(field_name: str) -> Any:
    """The type of `images`, `audio` or `videos` (MEDIA_LIMITS): up to its count of items, each a base64 data URL or a
    {content_type, base64} object of a content type the field accepts, in any letter case and, in the object, with
    spaces around it allowed (validate_request trims and lowercases it)."""
    max_items, content_types, max_bytes = MEDIA_LIMITS[field_name]
    accepted = "(?i:" + "|".join(content_type.replace(".", r"\.") for content_type in content_types) + ")"
    data_url = Annotated[str, Field(
        pattern=rf"^data:{accepted}(?:;[^;,]*)*;base64,",
        description="data:<content type>[;<ignored parameter>...];base64,<data>",
    )]
    media_object = create_model(
        f"Inline{field_name.capitalize().removesuffix('s')}",
        __base__=_RequestModel,
        __doc__=f"An item of {field_name} as an object.",
        content_type=(str, Field(pattern=rf"^\s*{accepted}\s*$", description=", ".join(content_types))),
        base64=(str, Field(description="The bytes in base64; whitespace is ignored.")),
    )
    return Annotated[Annotated[list[data_url | media_object], Field(max_length=max_items)] | None, Field(
        description=f"Up to {max_items}, each at most {max_bytes // MiB} MiB decoded, sent inline: the server reads "
        f"no file and fetches no URL. Content types: {', '.join(content_types)}. null: none."
    )]


class _Asset(_RequestModel):
    type: Literal["image"] = Field("image", description="The only kind of asset served.")
    format: Literal[tuple(ASSET_FORMATS)] | None = Field(None, description="Optional: the bytes decide the format.")


class ImageAsset(_Asset):
    """An image in the TypeSafe clients' form."""

    data_base64: str = Field(description="The image's bytes in base64.")
    part: LeftOut = _left_out("Only in the request part of a multipart body.")


class PartAsset(_Asset):
    """In the request part of a multipart body: an image sent as a part of its own."""

    part: str = Field(description="The name of the part holding the image's bytes.")


class SystemOneRequest(_RequestModel):
    """The body of POST /v1/systemone: one decision record. Fields not listed are ignored."""

    model: str = Field(min_length=1, description="Any name, copied into the answer; not matched against the model "
                       "served.")
    state: str | dict[str, Any] | list[Any] = Field(description="What the questions are about: text as written, or "
                                                    "JSON, which the model reads as compact JSON with sorted keys.")
    questions: dict[Annotated[str, Field(min_length=1)], Question] = Field(
        min_length=1, max_length=MAX_QUESTIONS, description="Question id -> question; the answers come back in this "
        "order."
    )
    images: _media_items("images") = None
    audio: _media_items("audio") = None
    videos: _media_items("videos") = None
    assets: Annotated[dict[str, ImageAsset], Field(max_length=MEDIA_LIMITS["images"][0])] | None = Field(
        None, description="Images by placeholder, as the TypeSafe clients send them. They follow `images`, and count "
        "toward its limits."
    )
    truncate: bool = Field(True, description="true: a state too long for the context loses its end; false: such a "
                           "request is refused.")
    id: Any = Field(None, description="Any JSON value, handed to the decision module as the record's id.")
    media_kwargs: LeftOut = _left_out("Never accepted over the network: the server sets the media processors' "
                                      "options itself.")

    @model_validator(mode="after")
    def _images_and_assets_within_the_image_count(self) -> "SystemOneRequest":
        max_images = MEDIA_LIMITS["images"][0]
        if len(self.images or ()) + len(self.assets or ()) > max_images:
            raise ValueError(f"images and assets hold at most {max_images} images together")
        return self


class SystemOneMultipartRequest(SystemOneRequest):
    """The request part of a multipart body, whose assets may name the parts holding their images."""

    assets: Annotated[dict[str, ImageAsset | PartAsset], Field(max_length=MEDIA_LIMITS["images"][0])] | None = Field(
        None, description="Images by placeholder, each inline or in the part it names; they follow `images`, and "
        "count toward its limits."
    )


class SystemOneMultipartBody(BaseModel):
    """A multipart/form-data body, as the TypeSafe clients upload images: the JSON request in a part named `request`,
    each image in a part that an entry of its `assets` names, at most 5 parts of each kind."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, bytes] = Field(init=False)

    request: SystemOneMultipartRequest


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


class JsonErrorsH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, whose answer to bytes it cannot parse as a request (a garbage request line, a
    Content-Length that is not a number) is the error shape of every other answer (docs/api.md §6.1), in JSON; uvicorn
    writes it as plain text, before any application sees the request."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(400, f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}): send a request "
                                          "line, headers and body as HTTP/1.1 frames them", "invalid_http")).encode()
        for event in (h11.Response(status_code=400, reason=b"Bad Request", headers=[
                          (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                          (b"connection", b"close")]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def error_response(error: RequestError, **fields: Any) -> JSONResponse:
    """The JSON response for a refusal, with `fields` placed before the error keys."""
    headers = {}
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if error.error_type in ("model_loading", "overloaded"):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if error.status == 408:  # the rest of the body may still be on its way: the connection cannot carry another request
        headers["Connection"] = "close"
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


@dataclasses.dataclass
class DecisionJob:
    """One request on its way through the scheduler. Its future is settled once, with the response or the error that
    refuses it; the HTTP handler cancels it when the client goes away, and every stage skips cancelled jobs."""

    payload: Any  # the parsed body
    future: concurrent.futures.Future
    enqueued: float  # time.perf_counter() when it was queued
    deadline: float  # time.perf_counter() past which it gets 503 instead of a forward
    timings: dict[str, float]  # seconds per stage, for Server-Timing
    prepared: PreparedRecord | None = None

    def settle(self, response: dict | None = None, error: BaseException | None = None) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled: nobody is waiting
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(response)


class ClefService:
    """What the endpoints share: the model once loaded (or why loading failed), the scheduler that answers decisions,
    and the metrics.

    The scheduler is a set of long-lived threads. PREPARING_THREADS preparing threads take requests in arrival order and
    validate, decode and encode them side by side (CPU work) while the scoring thread runs the previous batch on the
    device. The scoring thread loads the model first (CUDA's per-thread set-up is paid once, there), then takes every
    prepared record that has arrived, up to `max_batch_tokens` tokens and MAX_RECORDS_PER_FORWARD records in the order
    they were prepared (a record over the budget runs alone), and queues their forward on the device. When more is
    waiting than that forward takes, it is queued before the records of the forward before it are answered, so that the
    device runs it while the host answers. So it is when two groups of at least ALTERNATING_RECORDS records take turns
    (a batch of two groups' worth on an idle device is split in two to start them). Otherwise those records are
    answered first, and the requests their clients send next join it (the scorer waits up to REJOIN_WAIT_S for them).
    At most `max_queue` requests wait or run (503 with Retry-After beyond), and a request still unscored after
    `request_timeout` seconds gets 503.
    """

    def __init__(self, args: argparse.Namespace, load: Callable[..., LoadedClef]):
        self.args = args
        self.load = load
        self.loaded: LoadedClef | None = None
        self.preparers_loaded: list[LoadedClef] = []  # per preparing thread, the loaded model with its own processor
        self.load_error: str | None = None
        self.metrics = ServingMetrics()
        self.queue_slots = threading.BoundedSemaphore(args.max_queue)  # one per request waiting or in a forward
        self.arrived = queue.SimpleQueue()  # DecisionJob, to prepare
        self.prepared = queue.SimpleQueue()  # DecisionJob with .prepared, to score

    def start(self) -> None:
        # Daemon threads, so that stopping the server during a long load does not wait for the load to finish.
        threading.Thread(target=self.score_forever, name="serve_clef-scorer", daemon=True).start()
        for index in range(PREPARING_THREADS):
            threading.Thread(target=self.prepare_forever, args=(index,), name=f"serve_clef-preparer-{index}",
                             daemon=True).start()

    def submit(self, payload: Any) -> DecisionJob:
        """Queue a parsed request; 503 with Retry-After when the queue is full."""
        if not self.queue_slots.acquire(blocking=False):
            raise RequestError(503, ("body",), f"the server is overloaded: {self.args.max_queue} requests are already "
                               "queued (--max-queue); retry later", "overloaded")
        now = time.perf_counter()
        job = DecisionJob(payload, concurrent.futures.Future(), now, now + self.args.request_timeout, {})
        self.metrics.queue_depth.inc()

        def release(future: concurrent.futures.Future) -> None:
            self.queue_slots.release()
            self.metrics.queue_depth.dec()

        job.future.add_done_callback(release)
        self.arrived.put(job)
        return job

    def still_wanted(self, job: DecisionJob) -> bool:
        """False for a job whose client went away, or whose deadline has passed (answered 503 here)."""
        if job.future.cancelled():
            return False
        if time.perf_counter() > job.deadline:
            job.settle(error=RequestError(
                503, ("body",), f"the server is overloaded: the request waited {self.args.request_timeout:g} s "
                "(--request-timeout) without being scored; retry later", "overloaded",
            ))
            return False
        return True

    def prepare_forever(self, index: int) -> None:
        while True:
            job = self.arrived.get()  # only once loaded: the endpoint refuses requests before
            if not self.still_wanted(job):
                continue
            try:
                job.prepared = prepare(self.preparers_loaded[index], job.payload, self.args.max_length, job.timings)
            except BaseException as error:  # a refusal (RequestError) or a fault, handed to the waiting request
                job.settle(error=error)
                continue
            self.prepared.put(job)

    def score_forever(self) -> None:
        self.load_in_background()
        backlog: list[DecisionJob] = []  # prepared, not yet scored, in arrival order
        running = None  # (batch, when its forward was queued, its ForwardInFlight): queued last, not yet answered
        rejoin = None  # (records to wait for, until when): the clients just answered may send their next requests
        running_ended = False  # the running forward was waited for, not yet answered
        while self.loaded is not None:
            if not backlog and running is None:
                backlog.append(self.prepared.get())
            with contextlib.suppress(queue.Empty):
                while True:
                    backlog.append(self.prepared.get_nowait())
            while (rejoin is not None and len(backlog) < min(rejoin[0], MAX_RECORDS_PER_FORWARD)
                   and sum(job.prepared.tokens for job in backlog) < self.args.max_batch_tokens):
                try:
                    backlog.append(self.prepared.get(timeout=max(0.0, rejoin[1] - time.perf_counter())))
                except queue.Empty:  # the clients answered last did not all send again in time
                    break
            rejoin = None
            backlog = [job for job in backlog if self.still_wanted(job)]
            batch, tokens = [], 0
            for job in backlog:
                fits = not batch or (tokens + job.prepared.tokens <= self.args.max_batch_tokens
                                     and len(batch) < MAX_RECORDS_PER_FORWARD)
                if fits and batch_compatible([waiting.prepared.encoded for waiting in (*batch, job)]):
                    batch.append(job)
                    tokens += job.prepared.tokens
            taking_turns = running is not None and min(len(batch), len(running[0])) >= ALTERNATING_RECORDS
            if running is not None and len(batch) == len(backlog) and not taking_turns:
                if len(running[0]) >= ALTERNATING_RECORDS and not running_ended:
                    # The running forward's group could take turns with the clients answered before it, but fewer than
                    # a group of them sent again within REJOIN_WAIT_S: choose once it has ended, with what came by then.
                    with contextlib.suppress(Exception):  # a fault of the device: answering the forward reports it
                        running[2].wait()
                    running_ended = True
                    continue
                # Everything waiting fits in one forward, and it or the running forward is small: answer the running
                # one's records first, and give their clients REJOIN_WAIT_S to send their next requests, so that
                # those join this forward rather than wait a whole forward longer.
                self.answer_batch(*running)
                rejoin = (len(backlog) + len(running[0]), time.perf_counter() + REJOIN_WAIT_S)
                running = None
                continue
            if running is None and len(batch) >= 2 * ALTERNATING_RECORDS:
                # The device is idle and the batch holds two groups' worth: its first half now, the rest queued right
                # behind it (next turn of the loop), so that the first half's clients send their next requests while
                # the device runs the second, and the two groups take turns from then on.
                batch = batch[:len(batch) // 2]
            backlog = [job for job in backlog if job not in batch]
            # More is waiting than one forward takes, or two groups take turns: the next forward is queued before the
            # last one's records are answered, and the device runs it while the host answers (and the HTTP and
            # preparing threads, woken by the answers, take Python's lock).
            queued = self.queue_batch(batch) if batch else None  # none: every waiting request went away
            if running is not None:
                self.answer_batch(*running)
                if taking_turns:  # the group just answered takes the next turn, queued as soon as its clients are back
                    rejoin = (len(running[0]), time.perf_counter() + REJOIN_WAIT_S)
            running, running_ended = queued, False

    def queue_batch(self, batch: list[DecisionJob]) -> tuple[list[DecisionJob], float, ForwardInFlight] | None:
        forward_started = time.perf_counter()
        for job in batch:  # waiting time: everything before the forward that was not decoding or encoding
            job.timings["queue"] = forward_started - job.enqueued - job.timings["decode"] - job.timings["encode"]
        try:
            return batch, forward_started, queue_forward(self.loaded, [job.prepared.encoded for job in batch])
        except BaseException as error:  # a fault of the forward: every request of the batch gets it (a 500)
            for job in batch:
                job.settle(error=error)
            return None

    def answer_batch(self, batch: list[DecisionJob], forward_started: float, flight: ForwardInFlight) -> None:
        try:
            batch_logits = flight.wait()
        except BaseException as error:
            for job in batch:
                job.settle(error=error)
            return
        forward_s = time.perf_counter() - forward_started
        self.metrics.batch_records.observe(len(batch))
        for job, logits in zip(batch, batch_logits):
            job.timings["forward"] = forward_s
            try:
                job.settle(answer(self.loaded, job.prepared, logits))
            except RequestError as error:
                job.settle(error=error)

    async def decide(self, payload: Any, request: Request) -> tuple[dict, dict[str, float]]:
        """The response to a parsed request and its stage timings, once the scheduler has answered it. A client that
        disconnects while it waits has its job cancelled, so that nothing more is spent on it."""
        job = self.submit(payload)
        waiting = asyncio.wrap_future(job.future)
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=DISCONNECT_CHECK_S)
            if not waiting.done() and await request.is_disconnected():
                job.future.cancel()
                raise RequestError(499, ("body",), "the client closed the connection", "client_closed_request")
        return waiting.result(), job.timings

    def load_in_background(self) -> None:
        try:
            loaded = self.load(self.args, progress=console)
            # A processor per preparing thread: the tokenizer's Rust core refuses a call that changes its padding or
            # truncation while another thread's call is inside it (a release's own decision module may make such
            # calls). Each copy prepares the warm-up request here, so that what is computed on a processor's first
            # use (the longest token's length: 0.1 s for a vocabulary of 151,000 entries) is not left to a request.
            self.preparers_loaded = [dataclasses.replace(loaded, processor=copy.deepcopy(loaded.processor))
                                     for _ in range(PREPARING_THREADS)]
            for preparer_loaded in self.preparers_loaded:
                prepare(preparer_loaded, WARM_UP_REQUEST, self.args.max_length)
            # What the load made lives as long as the server. Python's full garbage collections walk every object
            # the process tracks, and they come unannounced while requests are answered: after loading the full
            # model on the H200's host, 806,000 objects and 458 ms a walk. Frozen, those objects are never walked.
            gc.collect()
            gc.freeze()
            self.loaded = loaded
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


async def read_multipart_body(content_type: str, body: bytes) -> tuple[str | bytes, dict[str, tuple[str, bytes]]]:
    """(the JSON request part, {part name: (content type, bytes)} of the other parts) of a multipart/form-data body,
    as the TypeSafe clients send images (docs/api.md §2.5): the JSON request in a part named `request`, each image as
    a part its entry of `assets` names. Parsed from memory (the body is in memory already), so no part is spooled to
    a temporary file."""
    if importlib.util.find_spec("python_multipart") is None:  # Starlette parses multipart bodies with it
        raise RequestError(415, ("header", "content-type"), "multipart bodies need the python-multipart package on "
                           "the server; send the images in a JSON body instead, as assets[...].data_base64",
                           "unsupported_media_type")

    async def chunks():
        yield body

    max_parts = MEDIA_LIMITS["images"][0]
    parser = MultiPartParser(Headers({"content-type": content_type}), chunks(), max_files=max_parts + 1,
                             max_fields=max_parts + 1, max_part_size=MAX_BODY_BYTES)
    parser.spool_max_size = MAX_BODY_BYTES
    try:
        form = await parser.parse()
    except MultiPartException as error:
        raise RequestError(422, ("body",), f"the multipart body could not be read: {error.message}",
                           "multipart_invalid") from None
    try:
        parts = {}
        for name, value in form.multi_items():
            if name in parts:
                raise RequestError(422, ("body", name), f"the multipart body holds two parts named {name!r}",
                                   "multipart_invalid")
            if isinstance(value, str):
                parts[name] = ("text/plain", value)
            else:
                parts[name] = (value.content_type or "application/octet-stream", await value.read())
    finally:
        await form.close()
    if MULTIPART_REQUEST_PART not in parts:
        raise RequestError(422, ("body", MULTIPART_REQUEST_PART), "a multipart body needs a part named "
                           f"{MULTIPART_REQUEST_PART!r} holding the JSON request; its parts: "
                           f"{', '.join(parts) or 'none'}", "missing")
    return parts.pop(MULTIPART_REQUEST_PART)[1], parts


def attach_multipart_images(payload: Any, parts: dict[str, tuple[str, bytes]]) -> None:
    """Put each image part into the entry of `assets` that names it, as that entry's data_base64, so that one check
    (`validate_request`) serves JSON and multipart bodies alike. A part no entry names gets 422."""
    assets = payload.get("assets") if isinstance(payload, dict) else None
    claimed = set()
    for placeholder, asset in (assets.items() if isinstance(assets, dict) else ()):
        if not isinstance(asset, dict) or not isinstance(asset.get("part"), str):
            continue
        if asset["part"] not in parts:
            raise RequestError(422, ("body", "assets", placeholder, "part"), f"assets[{json.dumps(placeholder)}] "
                               f"names the part {asset['part']!r}, which the multipart body does not hold; its "
                               f"parts: {', '.join(parts) or 'none besides the request'}", "missing")
        claimed.add(asset["part"])
        part_bytes = parts[asset["part"]][1]
        if isinstance(part_bytes, str):
            part_bytes = part_bytes.encode()
        assets[placeholder] = {key: value for key, value in asset.items() if key != "part"}
        assets[placeholder]["data_base64"] = base64.b64encode(part_bytes).decode()
    unclaimed = [name for name in parts if name not in claimed]
    if unclaimed:
        raise RequestError(422, ("body", unclaimed[0]), f"the multipart part {unclaimed[0]!r} is not named by any "
                           "entry of assets; name it there as {\"type\": \"image\", \"part\": ...} or leave it out")


async def read_json_body(request: Request) -> Any:
    """The parsed body: 415 if neither JSON nor multipart or in an unknown Content-Encoding, 413 over 13 MiB
    (declared, streamed or decompressed), 408 when it has not arrived within BODY_READ_TIMEOUT_S, 422 if it does not
    parse (values nothing can represent are refused by validate_request). A multipart body (the TypeSafe clients'
    image uploads) gives its JSON request part, with the image parts put into the `assets` entries that name them."""
    content_type = request.headers.get("content-type", "application/json")
    media_type = content_type.partition(";")[0].strip().lower()
    multipart = media_type == "multipart/form-data"
    if not multipart and media_type != "application/json" and not media_type.endswith("+json"):
        raise RequestError(415, ("header", "content-type"), f"the body must be application/json (or multipart/"
                           f"form-data with a JSON part named {MULTIPART_REQUEST_PART!r}), not {media_type}",
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
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):  # a client that sends half a body does not hold on forever
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise too_large
    except TimeoutError:
        raise RequestError(408, ("body",), f"the body did not arrive within {BODY_READ_TIMEOUT_S} s: send the whole "
                           f"body ({len(body)} bytes came)", "request_timeout") from None
    if encoding != "identity":
        body = decompress_body(bytes(body), encoding)
    parts = {}
    if multipart:
        body, parts = await read_multipart_body(content_type, bytes(body))

    try:
        parsed = parse_request_json(body)  # NaN, ±Infinity and overflowing numbers parse, to be refused with 400
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        # FastAPI's shape for a body that does not parse: 422, json_invalid, located at the character where it broke
        position = getattr(error, "pos", getattr(error, "start", None))
        loc = ("body",) if position is None else ("body", position)
        raise RequestError(422, loc, f"the body is not valid JSON: {error}", "json_invalid") from None
    if multipart:
        attach_multipart_images(parsed, parts)
    return parsed


class ObserveDecisions:
    """ASGI middleware for every decision request, answered or refused: a request id (X-Request-Id, and
    request.state.request_id for the handlers), the metrics and one console line. Plain ASGI rather than
    @app.middleware("http"): Starlette's BaseHTTPMiddleware hides the client's disconnect from the handler, which
    needs it to drop the request of a client that went away."""

    def __init__(self, app: Callable, metrics: ServingMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/systemone":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex[:16]
        state = scope.setdefault("state", {})  # what handlers read as request.state
        state.update(request_id=request_id, tokens=0)
        started = time.perf_counter()
        status = 500  # unless a response starts: an unhandled error (answered by the 500 handler, outside)

        async def send_with_request_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_request_id)
        except asyncio.CancelledError:  # the connection went away (or the server's shutdown drain ended): no response
            status = 499
            raise
        finally:
            seconds = time.perf_counter() - started
            self.metrics.requests.labels(status=str(status)).inc()
            self.metrics.request_seconds.observe(seconds)
            console(f"request {request_id} {status} {state['tokens']} tokens {seconds * 1000:.1f} ms")


def create_app(args: argparse.Namespace, load: Callable[..., LoadedClef] | None = None) -> FastAPI:
    """The HTTP app; its startup begins loading the model with `load(args, progress)` (default `load_from_args`) on
    the scoring thread."""
    service = ClefService(args, load or load_from_args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()  # the scoring thread loads (and warms up) the model, then scores
        yield

    # /docs is served below without a CDN; ReDoc would need one too
    app = FastAPI(title="serve_clef", lifespan=lifespan, docs_url=None, redoc_url=None)

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

    app.add_middleware(ObserveDecisions, metrics=service.metrics)

    @app.post("/v1/systemone")
    async def systemone(request: Request) -> JSONResponse:
        service.check_api_key(request)
        service.ready()
        payload = await read_json_body(request)
        response, timings = await service.decide(payload, request)
        request.state.tokens = response["usage"]["input_tokens"]
        service.metrics.tokens.inc(request.state.tokens)
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
                             "expert_kernels": loaded.expert_kernels,
                             "joint_head": "batched" if isinstance(loaded.model.head, BatchedJointSchemaHead)
                             else "release", "load_s": round(loaded.load_s, 3), "notice": loaded.notice})

    @app.get("/livez")
    async def livez() -> dict:
        return {"live": True}

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(app.openapi()))

    fastapi_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's OpenAPI document, with the request body of POST /v1/systemone generated from its models: the
        endpoint reads its body itself (compressed, multipart), so FastAPI has no model of it to describe."""
        if app.openapi_schema is None:
            document = fastapi_openapi()  # kept in app.openapi_schema: the additions below are made once
            bodies = [(SystemOneRequest, "validation"), (SystemOneMultipartBody, "validation")]
            refs, schemas = models_json_schema(bodies, ref_template="#/components/schemas/{model}")
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas["$defs"])
            document["paths"]["/v1/systemone"]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[SystemOneRequest, "validation"]},
                "multipart/form-data": {"schema": refs[SystemOneMultipartBody, "validation"],
                                        "encoding": {MULTIPART_REQUEST_PART: {"contentType": "application/json"}}},
            }}
        return app.openapi_schema

    app.openapi = openapi
    return app


def docs_page(openapi: dict) -> str:
    """GET /docs: the OpenAPI document as one self-contained HTML page, every endpoint with its request body, then
    every schema of components/schemas, each $ref a link to its schema. FastAPI's Swagger UI loads its scripts from a
    CDN, so it is blank on a machine without internet access."""

    def linked_json(value: Any) -> str:
        text = html.escape(json.dumps(value, indent=2, ensure_ascii=False))
        ref = r"&quot;#/components/schemas/([\w.-]+)&quot;"
        return re.sub(ref, r'<a href="#\1">\g<0></a>', text)

    sections = []
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            sections.append(f"<h2>{method.upper()} {html.escape(path)}</h2>")
            if "requestBody" in operation:
                sections.append("<p>Request body, by content type:</p>"
                                f"<pre>{linked_json(operation['requestBody']['content'])}</pre>")
    sections.append("<h2>Schemas</h2>")
    for name, schema in openapi["components"]["schemas"].items():
        sections.append(f"<h3 id=\"{html.escape(name)}\">{html.escape(name)}</h3><pre>{linked_json(schema)}</pre>")
    title = html.escape(openapi["info"]["title"])
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{title} API</title></head><body>"
            f"<h1>{title} API</h1><p>The OpenAPI document itself: <a href=\"/openapi.json\">/openapi.json</a>.</p>"
            f"{''.join(sections)}</body></html>")


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
            request = parse_request_json(Path(args.request).read_text(encoding="utf-8"))
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
    # On SIGTERM or SIGINT uvicorn stops accepting, drains for at most SHUTDOWN_DRAIN_S, then raises the signal again
    # under the handler it found. That handler ends the process normally: exit 0, after the atexit handlers (the
    # synthetic checkpoint's temporary folder), where Python's own would leave 143 or a KeyboardInterrupt traceback.
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, lambda signal_number, frame: sys.exit(0))
    # An address that cannot be listened on (a port taken, a privileged port, a host not of this machine) is said in
    # one line now; uvicorn would say it after starting the model's load, and exit 3. The probe binds as uvicorn does,
    # with SO_REUSEADDR, so a port left in TIME_WAIT by a server just stopped is not refused.
    try:
        family, _, _, _, address = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as error:  # socket.gaierror included
        console(f"serve_clef: cannot listen on {args.host}:{args.port} ({error.strerror or error}): pass another "
                "--port or --host, or stop the program that holds it")
        return 2
    # The scorer's forward is hundreds of short torch calls, each letting go of Python's lock; while the HTTP and
    # preparing threads run Python, each call may wait up to the switch interval to take it back (a thread making
    # 300 small torch calls beside a Python-busy one: 5.9 ms median, up to 88 ms, at the default 5 ms; 0.8 ms at
    # 1 ms). On the H100 at 1 ms: 16 clients 38.3k -> 41.0k tokens/s, one client's p50 26.3 -> 24.1 ms.
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    # uvicorn's access log off: ObserveDecisions logs each decision once, and the access line (written while the
    # answer is sent) took 0.14 ms of each one on a CPU machine (docs/benchmarks.md)
    uvicorn.run(create_app(args), host=args.host, port=args.port, http=JsonErrorsH11Protocol, access_log=False,
                timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S, timeout_graceful_shutdown=SHUTDOWN_DRAIN_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
