"""Lab (not committed): the text decoder's attention at serving shapes, as the engine calls it (flash varlen with
34 record boundaries, most of them empty) against fewer boundaries and dense causal SDPA."""
import json
import os
from pathlib import Path

import torch
import triton.testing


def flash(q, k, v, boundaries, longest):
    return torch.ops.aten._flash_attention_forward(q, k, v, boundaries, boundaries, longest, longest, 0.0, True, False,
                                                   scale=0.088)[0]


def main():
    report = []
    for real, bucket, records in ((517, 576, 1), (2050, 2176, 1), (7957, 8192, 16)):
        q = torch.randn(bucket, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(bucket, 4, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(bucket, 4, 128, device="cuda", dtype=torch.bfloat16)
        lengths = [real // records] * records
        lengths[-1] += real - sum(lengths)
        edges = [0]
        for length in lengths:
            edges.append(edges[-1] + length)
        edges.append(bucket)
        served = torch.tensor(edges + [bucket] * (34 - len(edges)), dtype=torch.int32, device="cuda")
        few = torch.tensor(edges, dtype=torch.int32, device="cuda")
        row = {"real": real, "bucket": bucket, "records": records}
        row["served_34_boundaries_ms"] = triton.testing.do_bench(lambda: flash(q, k, v, served, bucket), return_mode="median")
        row["exact_boundaries_ms"] = triton.testing.do_bench(lambda: flash(q, k, v, few, bucket), return_mode="median")
        row["34_boundaries_longest_real_ms"] = triton.testing.do_bench(
            lambda: flash(q, k, v, served, max(lengths)), return_mode="median")
        qd, kd, vd = (x.transpose(0, 1)[None] for x in (q, k, v))
        for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            try:
                with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
                    row[f"dense_causal_{backend.lower()}_ms"] = triton.testing.do_bench(
                        lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                                                 enable_gqa=True),
                        return_mode="median")
            except Exception as error:
                row[f"dense_causal_{backend.lower()}"] = f"{type(error).__name__}: {str(error)[:200]}"
        print(row, flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_attention.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
