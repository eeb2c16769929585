"""Lab (not committed): cuDNN causal attention for a one-record forward, its GQA spellings, numerics against flash
varlen, and inside torch.compile + a CUDA graph."""
import json
import os
from pathlib import Path

import torch
import triton.testing


def flash(q, k, v, boundaries, longest):  # q [T, Hq, D]
    return torch.ops.aten._flash_attention_forward(q, k, v, boundaries, boundaries, longest, longest, 0.0, True, False,
                                                   scale=0.088)[0]


def cudnn_expanded(q, k, v):  # q [1, Hq, T, D], k v [1, Hkv, T, D]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False, scale=0.088)[0]


def cudnn_native(q, k, v):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False, scale=0.088)[0]


def sdpa_gqa(q, k, v):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.088, enable_gqa=True)


def main():
    report = []
    for real, bucket in ((517, 576), (2050, 2176), (5000, 5120)):
        q = torch.randn(bucket, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(bucket, 4, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(bucket, 4, 128, device="cuda", dtype=torch.bfloat16)
        boundaries = torch.tensor([0, real] + [bucket] * 32, dtype=torch.int32, device="cuda")
        reference = flash(q, k, v, boundaries, bucket)[:real]  # [real, Hq, D]
        row = {"real": real, "bucket": bucket,
               "flash_varlen_ms": triton.testing.do_bench(lambda: flash(q, k, v, boundaries, bucket), return_mode="median")}
        qd, kd, vd = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D] views, as the decoder has them
        for name, function in (("cudnn_expanded", cudnn_expanded), ("cudnn_native", cudnn_native),
                               ("sdpa_gqa", sdpa_gqa)):
            try:
                out = function(qd, kd, vd)  # [1, Hq, T, D]
                row[f"{name}_max_abs_diff"] = (out[0].transpose(0, 1)[:real].float() - reference.float()).abs().max().item()
                row[f"{name}_ms"] = triton.testing.do_bench(lambda: function(qd, kd, vd), return_mode="median")
                again = function(qd, kd, vd)
                row[f"{name}_repeat_identical"] = torch.equal(out, again)
            except Exception as error:
                row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        try:
            compiled = torch.compile(cudnn_expanded, dynamic=True)
            compiled(qd, kd, vd)
            graph = torch.cuda.CUDAGraph()
            static_out = torch.empty_like(qd)
            with torch.cuda.graph(graph):
                static_out.copy_(compiled(qd, kd, vd))
            graph.replay()
            torch.cuda.synchronize()
            row["compiled_graph_max_abs_diff"] = (static_out[0].transpose(0, 1)[:real].float() - reference.float()).abs().max().item()
            row["compiled_graph_ms"] = triton.testing.do_bench(graph.replay, return_mode="median")
        except Exception as error:
            row["compiled_graph_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        print(row, flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_cudnn.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
