"""Lab (kept in history only): the gluon kernels with a register cap (maxnreg), so that more programs fit on an SM,
timed against the served launch on one random full-size layer, in CUDA graphs, outputs compared bit for bit."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_expert_kernels import graph_ms, random_layer, routed_inputs  # noqa: E402  (puts the repository on the path)
import serve_clef as sc  # noqa: E402

# (tokens, rows, stages, down slabs, gate_up caps, down caps)
CONFIGURATIONS = [(64, 32, 3, 1, (96,), (48,)), (512, 64, 4, 1, (128, 112), (80,)),
                  (2048, 64, 4, 1, (128,), (80,)), (8192, 128, 3, 2, (168, 200), (168, 200))]


def main():
    layer = random_layer(False, seed=3)
    layer.to_fragment_order()
    gate_up_words, gate_up_scales = layer.gate_up_fragment_words, layer.gate_up_block_scales.view(torch.int32)
    down_words, down_scales = layer.down_fragment_words, layer.down_block_scales.view(torch.int32)
    report = []
    for num_tokens, rows, stages, slabs, gate_up_caps, down_caps in CONFIGURATIONS:
        hidden_states, top_k_index, top_k_weights = routed_inputs(num_tokens, seed=num_tokens)
        slot_pairs, tile_experts = sc.route_to_row_tiles(top_k_index, 128, rows)
        num_tiles = tile_experts.numel()
        routing_weights = top_k_weights.reshape(-1)
        outputs = {}

        def gate_up(cap):
            out = outputs.setdefault(("gate_up", cap), hidden_states.new_zeros(num_tiles * rows, 768))
            extra = {"maxnreg": cap} if cap else {}
            sc.nvfp4_gate_up_fragment_kernel[(num_tiles, 12)](
                hidden_states, slot_pairs, tile_experts, gate_up_words, gate_up_scales, layer.gate_up_global_scale,
                out, 128, 2048, 768, 8, BLOCK_R=rows, STAGES=stages, num_warps=4, **extra)

        def down(cap):
            out = outputs.setdefault(("down", cap), hidden_states.new_zeros(num_tokens * 8, 2048))
            extra = {"maxnreg": cap} if cap else {}
            sc.nvfp4_down_fragment_kernel[(num_tiles, 2048 // (64 * slabs))](
                outputs["gate_up", None], slot_pairs, tile_experts, routing_weights, down_words, down_scales,
                layer.down_global_scale, out, 128, 2048, 768, BLOCK_R=rows, STAGES=stages, SLABS=slabs,
                num_warps=4, **extra)

        row = {"tokens": num_tokens, "rows": rows}
        for kernel, run, caps in (("gate_up", gate_up, gate_up_caps), ("down", down, down_caps)):
            for cap in (None, *caps):
                try:
                    row[f"{kernel} cap {cap} ms"] = graph_ms(lambda: run(cap))
                    outputs[kernel, cap].zero_()
                    run(cap)
                    if cap:
                        row[f"{kernel} cap {cap} identical"] = torch.equal(outputs[kernel, cap].view(torch.int16),
                                                                           outputs[kernel, None].view(torch.int16))
                except Exception as error:
                    row[f"{kernel} cap {cap} error"] = f"{type(error).__name__}: {str(error)[-400:]}"
        print(json.dumps(row), flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_maxnreg.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
