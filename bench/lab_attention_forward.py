"""Lab (branch lab/packed-attention, 2026-12-06): forwards of several ~500-token records as served by this tree, run
once per tree (main in base/, then the branch) on the same machine: each batch's wall time as a request runs it
(median of 7), its GPU busy time, kernel launches and largest kernels (torch.profiler), and its option logits, saved
so that the second tree's run prints how far its answers are from the first's (probabilities, the largest
difference), and how far each batch's answers are from each of its records scored alone.

Usage: python3 bench/lab_attention_forward.py NAME [OTHER_NAME]   (saves $OUT/NAME.pt; compares with OTHER_NAME.pt)
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import serve_clef  # noqa: E402
from bench_serve import text_request  # noqa: E402
from profile_forward import profiled, unsynchronised_milliseconds  # noqa: E402


def largest_difference(batch_a, batch_b) -> float:
    return max(float((torch.softmax(a.float(), -1) - torch.softmax(b.float(), -1)).abs().max())
               for record_a, record_b in zip(batch_a, batch_b) for a, b in zip(record_a, record_b))


def main() -> int:
    name, other = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    tiles_file = Path(os.environ.get("OUT", "."), "attention_tiles.json")
    if hasattr(serve_clef, "PACKED_ATTENTION_TILES") and tiles_file.exists():  # lab_packed_attention.py's fastest
        serve_clef.PACKED_ATTENTION_TILES = serve_clef.AttentionTiles(**json.loads(tiles_file.read_text()))
        print(f"{name}: {serve_clef.PACKED_ATTENTION_TILES}")
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: None)
    tokenizer = loaded.processor.tokenizer
    print(f"{name}: {torch.cuda.get_device_name()}", flush=True)
    logits = {}
    for records in (1, 4, 8, 16):
        encoded = [serve_clef.prepare(loaded, text_request(tokenizer, 480 + 5 * i, 700 + 31 * records + i),
                                      args.max_length).encoded for i in range(records)]
        tokens = sum(len(record.input_ids) for record in encoded)
        wall = unsynchronised_milliseconds(loaded, encoded, repeats=7)
        profile = profiled(lambda: serve_clef.score_records(loaded, encoded))
        logits[records] = serve_clef.score_records(loaded, encoded)
        if records > 1:  # against each record alone (its own graphs: cuDNN's attention, as served)
            alone = [serve_clef.score_records(loaded, [record])[0] for record in encoded]
            print(f"{records} records: batch against each record alone, largest probability difference "
                  f"{largest_difference(logits[records], alone):.4f}")
        attention = [kernel for kernel in profile["top_kernels"] if "attention" in kernel[0].lower()
                     or "flash" in kernel[0].lower() or "fmha" in kernel[0].lower()]
        print(f"{records} records ({tokens} tokens): wall {wall} ms, GPU busy {profile['gpu_busy_ms']} ms, "
              f"{profile['kernel_launches']} launches, {tokens / wall:.0f} tokens/s by wall; attention kernels "
              f"{attention}", flush=True)
    out = Path(os.environ.get("OUT", "."))
    torch.save(logits, out / f"{name}.pt")
    if other:
        theirs = torch.load(out / f"{other}.pt")
        for records, ours in logits.items():
            print(f"{records} records: answers against {other}: largest probability difference "
                  f"{largest_difference(ours, theirs[records]):.4f}")
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
