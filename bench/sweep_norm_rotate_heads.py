"""The q and k norm and rotary kernel's own device time by heads a program, at full size (32 query heads, 4 key
heads of 128), for several token counts: the data behind serve_clef.NORM_ROTATE_HEADS, the heads a program of a
forward of so many tokens.

Each setting's outputs are compared bit for bit with one head a program; times are torch.profiler's device time of
the kernel, mean of 20 launches.

Usage: python3 bench/sweep_norm_rotate_heads.py   (writes $OUT/sweep_norm_rotate_heads.json when OUT is set)
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402

QUERY_HEADS, KEY_HEADS, HEAD_DIM = 32, 4, 128
TOKEN_COUNTS = (64, 256, 517, 1024, 2048, 4096, 7957)
HEADS_A_PROGRAM = (1, 2, 4)
REPEATS = 20


def launch_milliseconds(run) -> float:
    run()  # compiled before it is timed
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(REPEATS):
            run()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in profile.key_averages()
               if "norm_rotate_query_key_kernel" in event.key) / REPEATS / 1000


def main() -> int:
    generator = torch.Generator("cuda").manual_seed(0)
    width = (QUERY_HEADS + 2 * KEY_HEADS) * HEAD_DIM
    query_norm_weight, key_norm_weight = (torch.rand(HEAD_DIM, generator=generator, device="cuda").bfloat16() + 0.5
                                          for _ in range(2))
    results = {"gpu": torch.cuda.get_device_name(), "ms": {}}
    for num_tokens in TOKEN_COUNTS:
        qkv = torch.randn(num_tokens, width, generator=generator, device="cuda").bfloat16()  # [N, W]
        angles = torch.rand(num_tokens, HEAD_DIM, generator=generator, device="cuda") * 100  # [N, D]
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
        run = lambda: serve_clef.norm_rotate_query_key(qkv, query_norm_weight, key_norm_weight, cos, sin,  # noqa: E731
                                                       1e-6, QUERY_HEADS, KEY_HEADS)
        row, reference = {}, None
        for heads in HEADS_A_PROGRAM:
            serve_clef.NORM_ROTATE_HEADS = ((0, heads),)  # at every token count
            outputs = run()
            reference = reference or outputs
            same = all(torch.equal(a, b) for a, b in zip(outputs, reference))
            row[heads] = round(launch_milliseconds(run), 4)
            print(f"{num_tokens} tokens, {heads} heads a program: {row[heads]:.4f} ms, outputs as with one: {same}",
                  flush=True)
        results["ms"][num_tokens] = row
    if "OUT" in os.environ:
        (Path(os.environ["OUT"]) / "sweep_norm_rotate_heads.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
