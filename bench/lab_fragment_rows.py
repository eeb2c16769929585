"""Lab (kept in history only): one layer's gluon experts (as served: routing, both kernels, top-k sum) with each
candidate row of FRAGMENT_TILES forced (several warp groups sharing a tile's activation rows), at token counts
around the rows' bounds."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_expert_kernels import graph_ms, random_layer, routed_inputs  # noqa: E402  (puts the repository on the path)
import serve_clef  # noqa: E402

CANDIDATES = {
    "R128, gate_up 2 warp groups": serve_clef.ExpertTiles(128, 64, 64, 8, 3, down_columns=256, down_num_warps=8),
    "R128, gate_up 2 warp groups, 4 stages": serve_clef.ExpertTiles(128, 64, 64, 8, 4, down_columns=256,
                                                                    down_num_warps=8),
    "R128, down 4 warp groups of one slab": serve_clef.ExpertTiles(128, 64, 64, 4, 3, down_columns=256,
                                                                   down_num_warps=16),
    "R128, as served, again": serve_clef.ExpertTiles(128, 64, 64, 4, 3, down_columns=256, down_num_warps=8),
}


def main():
    layer = random_layer(False, seed=3)
    layer.to_fragment_order()
    served = serve_clef.FRAGMENT_TILES
    report = []
    for num_tokens in (2048, 4096, 8192):
        inputs = routed_inputs(num_tokens, seed=20 + num_tokens)
        serve_clef.FRAGMENT_TILES = served
        reference = layer.forward_fragments(*inputs)
        row = {"tokens": num_tokens, "served": graph_ms(lambda: layer.forward_fragments(*inputs))}
        for name, tiles in CANDIDATES.items():
            serve_clef.FRAGMENT_TILES = ((None, tiles),)
            row[name] = graph_ms(lambda: layer.forward_fragments(*inputs))
            row[f"{name} identical"] = torch.equal(layer.forward_fragments(*inputs), reference)
        serve_clef.FRAGMENT_TILES = served
        print(json.dumps(row), flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_fragment_rows.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
