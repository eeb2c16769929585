"""Lab (kept in history only): flash varlen's time against the max_seqlen it is told, for the engine's multi-record batches."""
import json
import os
from pathlib import Path

import torch
import triton.testing

SCALE = 0.088


def flash(q, k, v, boundaries, longest):  # q [T, Hq, D]
    return torch.ops.aten._flash_attention_forward(q, k, v, boundaries, boundaries, longest, longest, 0.0, True, False,
                                                   scale=SCALE)[0]


def main():
    report = []
    generator = torch.Generator().manual_seed(0)
    for records, mean_length, bucket in ((16, 497, 8192), (10, 512, 6144), (4, 1000, 4096), (8, 500, 4096),
                                         (2, 517, 1152), (4, 2000, 8192)):
        q = torch.randn(bucket, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(bucket, 4, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(bucket, 4, 128, device="cuda", dtype=torch.bfloat16)
        lengths = [mean_length + int(x) for x in torch.randint(-40, 40, (records,), generator=generator)]
        cuts = [0]
        for n in lengths:
            cuts.append(cuts[-1] + n)
        cuts += [bucket] * (34 - len(cuts))
        boundaries = torch.tensor(cuts, dtype=torch.int32, device="cuda")
        longest = max(max(lengths), bucket - sum(lengths))
        reference = flash(q, k, v, boundaries, bucket)
        row = {"records": records, "tokens": sum(lengths), "bucket": bucket, "longest": longest}
        for told in (bucket, bucket // 2, 2048, 1024, longest):
            if told < longest:
                continue
            out = flash(q, k, v, boundaries, told)
            row[f"max_{told}_ms"] = triton.testing.do_bench(lambda: flash(q, k, v, boundaries, told),
                                                            return_mode="median")
            row[f"max_{told}_identical"] = torch.equal(out, reference)
        print(json.dumps(row), flush=True)
        report.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab_flash_max.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
