"""Lab: the host time of the thinker's 3-D positions, transformers' `get_rope_index` against
serve_clef.rope_index_from_host, on records the server prepares (the tiny synthetic model's processor: the real
Qwen3-Omni token counts), one at a time and as a batch; every pair's outputs compared bit for bit.

Usage: python3 bench/lab_rope_index.py   (CPU is enough: both run on the host)
"""

import base64
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serve  # noqa: E402  (bench/: the media requests)

import serve_clef  # noqa: E402
import synthetic_release  # noqa: E402

REPEATS = 7


def main() -> int:
    loaded = serve_clef.load_clef("synthetic", device="cpu", progress=lambda line: None)
    module = next(module for module in loaded.model.thinker.modules() if "get_rope_index" in module.__dict__)
    requests = bench_serve.media_requests(3)
    video = requests["video 4 s 320x240 + sound"]
    for seconds in (20, 60):
        mp4 = synthetic_release.synthetic_mp4(True, seconds=seconds, size=(320, 240), shift=3)
        requests[f"video {seconds} s 320x240 + sound"] = {
            **video, "videos": ["data:video/mp4;base64," + base64.b64encode(mp4).decode()]}
    silent = synthetic_release.synthetic_mp4(False, seconds=4, size=(320, 240), shift=5)
    requests["video 4 s 320x240, silent"] = {
        **video, "videos": ["data:video/mp4;base64," + base64.b64encode(silent).decode()]}
    encoded = {name: serve_clef.prepare(loaded, request, 64_000).encoded for name, request in requests.items()
               if name != "audio 10 s"}  # a sound alone takes transformers' own path (no grids): nothing to time
    batches = {f"{name} ({len(record.input_ids)} tokens)": [record] for name, record in encoded.items()}
    batches["batch: image, 4 s video + sound, image"] = [
        encoded["image 640x480"], encoded["video 4 s 320x240 + sound"], encoded["image 640x480"]]
    failures = 0
    for name, records in batches.items():
        batch = loaded.schema.collate_records(records, loaded.processor.tokenizer.pad_token_id, "cpu")
        media = batch["media"]
        arguments = {
            "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "image_grid_thw": media.get("image_grid_thw"), "video_grid_thw": media.get("video_grid_thw"),
            "use_audio_in_video": bool(media.get("use_audio_in_video", False)),
            "audio_seqlens": media["feature_attention_mask"].sum(1) if "feature_attention_mask" in media else None,
            "second_per_grids": media.get("video_second_per_grid"),
        }
        times = {"transformers": [], "host walk": []}
        for _ in range(REPEATS):
            start = time.perf_counter()
            theirs = type(module).get_rope_index(module, **arguments)
            middle = time.perf_counter()
            ours = serve_clef.rope_index_from_host(module, **arguments)
            times["transformers"].append(middle - start)
            times["host walk"].append(time.perf_counter() - middle)
        equal = all(torch.equal(mine, reference) for mine, reference in zip(ours, theirs))
        failures += not equal
        print(f"{name}: transformers {statistics.median(times['transformers']) * 1000:.2f} ms, host walk "
              f"{statistics.median(times['host walk']) * 1000:.2f} ms (medians of {REPEATS}), bit-equal {equal}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
