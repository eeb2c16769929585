"""Each packed-expert kernel's own device time over candidate tiles, on one random full-size layer (H200).

check_expert_kernels.py --sweep times a whole layer per tile configuration, both kernels with the same tiles. This
script times each kernel apart (torch.profiler's device time per forward, mean of 10 eager runs), so that the down
kernel can be given tiles of its own: it runs on the slots that the routing padded to gate_up's rows, and may split
each routed tile into smaller ones (ExpertTiles.down_rows). For each token count it prints, per kernel, the served
tiles' time and the four fastest candidates (rows, columns, reduced, warps, stages). Each token count gets the row
tiles near its mean pairs per expert (T * 8 / 128).

Usage: python3 bench/sweep_expert_tiles.py [OTHER_SERVE_CLEF.py]   (writes $OUT/sweep_expert_tiles.json when OUT is
set; with a path, sweeps that version's kernels, e.g. `git show REV:serve_clef.py > bench/other_serve_clef.py`)
"""

import itertools
import json
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_expert_kernels  # noqa: E402
import serve_clef  # noqa: E402  (check_expert_kernels put the repository on the path)

ROWS_PER_TOKEN_COUNT = {64: (16, 32), 512: (32, 64), 2048: (64, 128), 8192: (128, 256)}
COLUMNS_REDUCED_WARPS_STAGES = ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3), (64, 128, 4, 3),
                                (128, 128, 8, 3))
MOST_TILE_VALUES = 128 * 128  # per accumulator: more spills registers
KERNELS = {"gate_up": "nvfp4_gate_up_kernel", "down": "nvfp4_down_kernel"}


def kernel_milliseconds(layer, inputs, repeats: int = 10) -> dict[str, float]:
    """Each kernel's device time per forward, mean of `repeats` eager forwards."""
    layer.forward_packed(*inputs)  # compiled before it is timed
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(repeats):
            layer.forward_packed(*inputs)
        torch.cuda.synchronize()
    return {kernel: round(event.self_device_time_total / repeats / 1000, 4)
            for event in profile.key_averages() for kernel, name in KERNELS.items()
            if name in event.key and event.self_device_time_total}


def main() -> int:
    version = check_expert_kernels.other_version(Path(sys.argv[1])) if len(sys.argv) > 1 else serve_clef
    layer = check_expert_kernels.random_layer(False, seed=3)
    layer.forward_packed = types.MethodType(version.PackedNVFP4Experts.forward_packed, layer)
    served_tables = version.EXPERT_TILES
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "version": sys.argv[1:]}
    for num_tokens, row_tiles in ROWS_PER_TOKEN_COUNT.items():
        inputs = check_expert_kernels.routed_inputs(num_tokens, seed=10 + num_tokens)
        timings = {"served": kernel_milliseconds(layer, inputs)}
        for rows, (columns, reduced, warps, stages) in itertools.product(row_tiles, COLUMNS_REDUCED_WARPS_STAGES):
            if rows * columns > MOST_TILE_VALUES:
                continue
            tiles = version.ExpertTiles(rows, columns, reduced, warps, stages)
            version.EXPERT_TILES = ((None, tiles),)
            name = ",".join(map(str, (tiles.rows, tiles.columns, tiles.reduced, tiles.num_warps, tiles.num_stages)))
            try:
                timings[name] = kernel_milliseconds(layer, inputs)
            except Exception as error:  # a configuration that does not fit this GPU (shared memory, registers)
                timings[name] = type(error).__name__
        version.EXPERT_TILES = served_tables
        report[num_tokens] = timings
        for kernel in KERNELS:
            fastest = sorted((times[kernel], name) for name, times in timings.items()
                             if name != "served" and isinstance(times, dict) and kernel in times)[:4]
            print(f"{num_tokens} tokens, {kernel}: served {timings['served'].get(kernel)} ms; fastest {fastest}",
                  flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "sweep_expert_tiles.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
