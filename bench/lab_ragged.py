"""Lab (kept in history only): cuDNN's ragged (THD) attention for batches of several records against flash varlen, as the
engine packs them (records, the padding as one more record, empty records up to 34 boundaries), in CUDA graphs whose
boundaries change between replays."""
import json
import os
from pathlib import Path

import torch
import triton.testing

SCALE = 0.088


def flash(q, k, v, boundaries, longest):  # q [T, Hq, D]
    return torch.ops.aten._flash_attention_forward(q, k, v, boundaries, boundaries, longest, longest, 0.0, True, False,
                                                   scale=SCALE)[0]


def ragged(q, k, v, boundaries, longest):  # q [T, Hq, D]
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, boundaries, boundaries, longest, longest, False, 0.0,
                                                   True, False, scale=SCALE)[0]


def boundaries_for(lengths, bucket):
    cuts = [0]
    for n in lengths:
        cuts.append(cuts[-1] + n)
    cuts += [bucket] * (34 - len(cuts))
    return torch.tensor(cuts, dtype=torch.int32, device="cuda")


def main():
    report = []
    generator = torch.Generator().manual_seed(0)
    for records, mean_length, bucket in ((16, 497, 8192), (4, 1000, 4096), (8, 500, 4096), (2, 517, 1152)):
        q = torch.randn(bucket, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(bucket, 4, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(bucket, 4, 128, device="cuda", dtype=torch.bfloat16)
        lengths = [mean_length + int(x) for x in torch.randint(-40, 40, (records,), generator=generator)]
        other = [mean_length + int(x) for x in torch.randint(-60, 20, (records,), generator=generator)]
        row = {"records": records, "tokens": sum(lengths), "bucket": bucket}
        static = boundaries_for(lengths, bucket)
        real = sum(lengths)
        reference = flash(q, k, v, static, bucket)
        row["flash_ms"] = triton.testing.do_bench(lambda: flash(q, k, v, static, bucket), return_mode="median")
        try:
            out = ragged(q, k, v, static, bucket)
            row["max_abs_diff"] = (out[:real].float() - reference[:real].float()).abs().max().item()
            row["ragged_ms"] = triton.testing.do_bench(lambda: ragged(q, k, v, static, bucket), return_mode="median")
            row["repeat_identical"] = torch.equal(out[:real], ragged(q, k, v, static, bucket)[:real])
            graph = torch.cuda.CUDAGraph()
            static_out = torch.empty_like(q)
            with torch.cuda.graph(graph):
                static_out.copy_(ragged(q, k, v, static, bucket))
            static.copy_(boundaries_for(other, bucket))  # new records, same graph
            graph.replay()
            torch.cuda.synchronize()
            other_real = sum(other)
            other_reference = flash(q, k, v, static, bucket)
            row["graph_new_boundaries_max_abs_diff"] = (
                static_out[:other_real].float() - other_reference[:other_real].float()).abs().max().item()
            row["graph_ms"] = triton.testing.do_bench(graph.replay, return_mode="median")
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error)[:600]}"
        print(json.dumps(row), flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_ragged.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
