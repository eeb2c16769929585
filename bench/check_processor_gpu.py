"""Check the torchvision-free processor (`load_frame_processor`) against transformers' own Qwen3-Omni processor.

Run on a machine WITH torchvision (the GPU image) and PyAV (carried as a wheel), from the repository root:

    python bench/check_processor_gpu.py

It writes a tiny synthetic release (no weights needed), loads the real processor with `AutoProcessor` and ours with
`load_frame_processor`, encodes the same image / audio / video records through `joint_schema_model.encode_record`
with each, and prints per record whether the input ids and every grid / length / mask tensor are identical, plus the
max |difference| of the pixel and audio features. Exits 1 if any ids, grids or media keys differ, if the audio
features differ at all (both processors run the same feature extractor), or if pixel values differ by more than the
resize interpolation can explain: two levels of 0..255 after the processor's normalisation (a NaN fails).
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import joint_schema_model as jsm  # noqa: E402
import synthetic_release  # noqa: E402

# Tensors that decide token counts and positions: they must be equal, not close.
EXACT_KEYS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid", "feature_attention_mask")
FEATURE_KEYS = ("pixel_values", "pixel_values_videos", "input_features")
PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
RESIZE_LEVELS = 2  # how many 0..255 levels two resize implementations may put a pixel apart


def records() -> dict[str, dict]:
    png, wav = synthetic_release.synthetic_png(), synthetic_release.synthetic_wav()
    with_audio, silent = synthetic_release.synthetic_mp4(with_audio=True), synthetic_release.synthetic_mp4(with_audio=False)
    # 360x640 frames given as arrays are downscaled by smart_resize, so the two resize implementations really differ.
    large_frames = np.random.default_rng(0).integers(0, 256, (4, 360, 640, 3), dtype=np.uint8)  # [T,H,W,3]
    question = {"q": {"type": "noul", "instructions": "Is anything unusual happening?"}}
    media = {
        "image": {"images": [png]},
        "audio": {"audio": [wav]},
        "video_silent": {"videos": [silent]},
        "video_with_audio": {"videos": [with_audio]},
        "video_frames_downscaled": {"videos": [large_frames]},
        "image_audio_video": {"images": [png], "audio": [wav], "videos": [with_audio]},
    }
    return {name: {"id": name, "state": {"case": name}, "questions": question, **fields} for name, fields in media.items()}


def main() -> int:
    from transformers import AutoProcessor

    with tempfile.TemporaryDirectory() as directory:
        release = synthetic_release.write_release(directory, size="tiny", seed=0, weights=False)
        real = AutoProcessor.from_pretrained(release)
        ours = jsm.load_frame_processor(release)
    print(f"real: {type(real).__name__} with {type(real.video_processor).__name__}; "
          f"ours: {type(ours).__name__} with {type(ours.video_processor).__name__}")
    # a pixel's value is (level / 255 - mean) / std: one level is 1 / (255 * std), largest where std is smallest
    pixel_tolerance = RESIZE_LEVELS / (255 * min(real.image_processor.image_std))
    print(f"pixel values may differ by {pixel_tolerance:.4f} ({RESIZE_LEVELS} levels); audio features not at all")
    failures = []
    for name, record in records().items():
        expected = jsm.encode_record(real.tokenizer, record, processor=real)
        actual = jsm.encode_record(ours.tokenizer, record, processor=ours)
        same_ids = expected.input_ids == actual.input_ids
        same_keys = set(expected.media) == set(actual.media)
        exact = {key: torch.equal(torch.as_tensor(expected.media[key]), torch.as_tensor(actual.media[key]))
                 for key in EXACT_KEYS if key in expected.media and key in actual.media}
        features = {}
        for key in FEATURE_KEYS:
            if key in expected.media and key in actual.media:
                a, b = expected.media[key], actual.media[key]
                difference = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("nan")
                tolerance = pixel_tolerance if key in PIXEL_KEYS else 0.0
                features[key] = (a.shape == b.shape and a.dtype == b.dtype and difference <= tolerance, difference)
        ok = same_ids and same_keys and all(exact.values()) and all(within for within, _ in features.values())
        if not ok:
            failures.append(name)
        diffs = ", ".join(f"{key} max|diff| {diff:.3g}" for key, (_, diff) in features.items())
        print(f"{name:24s} {'OK  ' if ok else 'FAIL'} ids {'same' if same_ids else 'DIFFER'} ({len(actual.input_ids)} tokens), "
              f"keys {'same' if same_keys else sorted(set(expected.media) ^ set(actual.media))}, "
              f"exact {exact}, {diffs}")
    if failures:
        print(f"FAILED: {failures}")
        return 1
    print("all records: identical ids, grids, shapes and audio features; pixel values within the resize tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
