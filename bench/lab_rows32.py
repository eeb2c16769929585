"""Lab (GPU): where tiles of 32 rows should give way to 64 in the gluon kernels (FRAGMENT_TILES). On an H100
(2026-12-05, bench/lab_mma_sync.py) rows of 32 up to 128 pairs per expert made one layer's experts 11% faster at 256
tokens (16 pairs per expert: 0.186 against 0.208 ms) and 6% slower at 512 (32 pairs). Here one layer (route, gate_up,
down, top-k sum, CUDA graph) at 128-640 tokens with the served table and with rows of 32 up to each count, outputs
compared with the served ones.

Usage (GPU): python3 bench/lab_rows32.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import check_expert_kernels as check  # noqa: E402
import lab_mma_sync as lab  # noqa: E402

import serve_clef  # noqa: E402

TOKENS = (128, 192, 256, 320, 384, 448, 512, 640)


def main() -> int:
    layer = check.random_layer(False, seed=3)
    layer.to_fragment_order()
    rows_of_32 = ((10_000, serve_clef.FRAGMENT_TILES[0][1]),)  # every count here: rows of 32
    failures = 0
    for num_tokens in TOKENS:
        inputs = check.routed_inputs(num_tokens, seed=10 + num_tokens)
        served = lab.lab_forward(layer, *inputs, None, None)
        other = lab.lab_forward(layer, *inputs, None, None, rows_of_32)
        ok = torch.equal(served, other)
        failures += not ok
        times = {name: [check.graph_ms(lambda t=table: lab.lab_forward(layer, *inputs, None, None, t))
                        for _ in range(3)]
                 for name, table in (("served", serve_clef.FRAGMENT_TILES), ("rows of 32", rows_of_32))}
        rows = serve_clef.expert_tiles(8 * num_tokens, 128, serve_clef.FRAGMENT_TILES).rows
        print(f"{num_tokens:4} tokens ({8 * num_tokens / 128:.0f} pairs per expert; served rows {rows}): served "
              + " / ".join(f"{t:.4f}" for t in times["served"]) + " ms, rows of 32 "
              + " / ".join(f"{t:.4f}" for t in times["rows of 32"]) + f" ms, outputs equal {ok}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
