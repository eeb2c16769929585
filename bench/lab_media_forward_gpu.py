"""Lab (GPU): two host-side changes to a media forward, each against the tree as served, interleaved in one process on
`synthetic:full` (the model is loaded once for both):

1. The thinker's 3-D positions: rope_index_from_host (served since 2026-12-05) against transformers' own
   `get_rope_index`, on 4 s and 20 s videos with their soundtracks.
2. Two waits for the device that remain in an image's or a video's forward, both inside transformers' thinker, which
   read device values right after the vision tower is queued, so that the host finishes its work before the decoder
   only once the tower has run: the vision features split by sizes read from the device grids
   (`get_image_features` / `get_video_features`), and the placeholder-token count checked against the features
   (`get_placeholder_mask`). Tried here as patches, not served: the grids stay in host memory (every consumer reads
   them on the host; the vision encoder's pre-hook then puts what it computes on the pixels' device), and the count
   is checked on the host copy of the token ids, the masks still made on the device. On an image and a 4 s video
   with its soundtrack (whose sounds' lengths the positions still read back once).

Per setting: forwards (`score_records`, the server's) timed to their end, in turn, each with new media; the
host-device synchronisations of one forward counted by torch's sync debug mode; logits compared bit for bit between
the two settings (the maths are the same).

3. While the model is loaded: how much of a decoder graph's replay lies between its kernels. The graphs of a record
   alone at 576 tokens and of several records at 8,192, each replayed alone: its time between CUDA events (median of
   20) against the summed time of its kernels (torch.profiler), and their count.

Usage (GPU, the wheels the server needs installed): python3 bench/lab_media_forward_gpu.py
"""

import base64
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serve  # noqa: E402
import serve_clef  # noqa: E402
import synthetic_release  # noqa: E402

FORWARDS = 9
GRID_KEYS = ("image_grid_thw", "video_grid_thw")


@contextlib.contextmanager
def transformers_positions(loaded):
    """transformers' own get_rope_index in place of rope_index_from_host."""
    modules = [module for module in loaded.model.thinker.modules() if "get_rope_index" in module.__dict__]
    saved = [module.__dict__.pop("get_rope_index") for module in modules]
    try:
        yield
    finally:
        for module, function in zip(modules, saved):
            module.get_rope_index = function


def placeholder_masks_checked_on_host(module, input_ids, inputs_embeds, image_features=None, video_features=None):
    """transformers' get_placeholder_mask, its count check on the host copy of the ids instead of the device's."""
    if input_ids is None:
        return type(module).get_placeholder_mask(module, input_ids, inputs_embeds, image_features, video_features)
    config, host_ids = module.config, serve_clef.host_values(input_ids)
    for token_id, features in ((config.image_token_id, image_features), (config.video_token_id, video_features)):
        if features is not None and int((host_ids == token_id).sum()) * inputs_embeds.shape[-1] != features.numel():
            raise ValueError("the placeholder tokens and the features do not match")
    return tuple((input_ids == token_id).unsqueeze(-1).to(inputs_embeds.device)
                 for token_id in (config.image_token_id, config.video_token_id, config.audio_token_id))


@contextlib.contextmanager
def no_waits_after_the_tower(loaded):
    """Grids kept on the host by the engine's copy to the device, the vision pre-hook given device grids carrying
    their host copies (so that what it computes lands on the device), the placeholder count checked on the host."""
    original_copy = serve_clef.batch_to_device

    def batch_to_device(value, device):
        moved = original_copy(value, device)
        if type(value) is dict and "media" in value:
            for key in GRID_KEYS:
                if key in value["media"]:
                    moved["media"][key] = value["media"][key]
        return moved

    def vision_hook(tower, args, kwargs):
        pixels = args[0] if args else kwargs["hidden_states"]
        name, grid = ("grid_thw", kwargs["grid_thw"]) if "grid_thw" in kwargs else (None, args[1])
        device_grid = serve_clef.host_to_device(grid, pixels.device)  # keeps `grid` as its host copy
        if name is None:
            args = (args[0], device_grid, *args[2:])
        else:
            kwargs = {**kwargs, name: device_grid}
        return serve_clef.vision_inputs_from_host_grids(tower, args, kwargs)

    hooks = [(tower._forward_pre_hooks, key) for tower in serve_clef.thinker_towers(loaded.model.thinker)
             for key, hook in tower._forward_pre_hooks.items() if hook is serve_clef.vision_inputs_from_host_grids]
    placeholder_modules = [module for module in loaded.model.thinker.modules()
                           if hasattr(type(module), "get_placeholder_mask")]
    serve_clef.batch_to_device = batch_to_device
    for registry, key in hooks:
        registry[key] = vision_hook
    for module in placeholder_modules:
        module.get_placeholder_mask = lambda *args, _module=module, **kwargs: placeholder_masks_checked_on_host(
            _module, *args, **kwargs)
    try:
        yield
    finally:
        serve_clef.batch_to_device = original_copy
        for registry, key in hooks:
            registry[key] = serve_clef.vision_inputs_from_host_grids
        for module in placeholder_modules:
            module.__dict__.pop("get_placeholder_mask", None)


def compare(loaded, name: str, records: list, setting) -> bool:
    """Forwards of `records` (each one record, in turn) as served and under `setting`; prints the medians, the syncs
    of one forward each and whether their logits are bit-identical."""
    times = {False: [], True: []}
    for index in range(2 * FORWARDS):
        changed = index % 2 == 1
        with setting(loaded) if changed else contextlib.nullcontext():
            torch.cuda.synchronize()
            start = time.perf_counter()
            serve_clef.score_records(loaded, [records[index % len(records)]])
            times[changed].append((time.perf_counter() - start) * 1000)
    logits, syncs = {}, {}
    for changed in (False, True):
        with setting(loaded) if changed else contextlib.nullcontext():
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits[changed] = serve_clef.score_records(loaded, [records[-1]])
            torch.cuda.set_sync_debug_mode(0)
            syncs[changed] = sum("synchroniz" in str(warning.message) for warning in caught)
    equal = all(torch.equal(a, b) for first, second in zip(logits[False], logits[True]) for a, b in zip(first, second))
    print(f"{name} ({len(records[-1].input_ids)} tokens), forward medians of {FORWARDS}: as served "
          f"{statistics.median(times[False]):.1f} ms ({syncs[False]} synchronisations), {setting.__name__} "
          f"{statistics.median(times[True]):.1f} ms ({syncs[True]}); logits bit-identical {equal}", flush=True)
    return equal


def graph_gaps(loaded) -> None:
    """The decoder's graph replays against their kernels' summed time (part 3 of the docstring)."""
    decoder = next(module for module in loaded.model.modules() if isinstance(module, serve_clef.PackedTextDecoder))
    for key in ((576, True), (8192, False)):
        graph = decoder.graphs.get(key)
        if graph is None:
            print(f"no graph for {key}")
            continue
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            graph.replay()
            torch.cuda.synchronize()
        # as bench/profile_forward.py counts them: the device's events and their own time
        kernels = [event for event in profile.key_averages()
                   if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total]
        busy = sum(event.self_device_time_total for event in kernels) / 1000
        launches = sum(event.count for event in kernels)
        replay = statistics.median(times)
        print(f"decoder graph {key[0]} tokens ({'one record' if key[1] else 'several'}): replay {replay:.2f} ms, "
              f"its {launches} kernels busy {busy:.2f} ms, {replay - busy:.2f} ms between them "
              f"({(replay - busy) / max(1, launches) * 1000:.2f} us a kernel)", flush=True)


def main() -> int:
    args = serve_clef.parse_args(["--model", "synthetic:full", "--device", "cuda"])
    loaded = serve_clef.load_from_args(args, progress=lambda line: print("   ", line, flush=True))
    if not any("get_rope_index" in module.__dict__ for module in loaded.model.thinker.modules()):
        print("rope_index_from_host is not installed (the load said why)")
        return 1

    def prepared(medium: str) -> list:
        return [serve_clef.prepare(loaded, bench_serve.media_requests(variant)[medium], args.max_length).encoded
                for variant in range(2 * FORWARDS + 1)]

    long_video = synthetic_release.synthetic_mp4(True, seconds=20, size=(320, 240), shift=11)
    long_request = {**bench_serve.media_requests(0)["video 4 s 320x240 + sound"],
                    "videos": ["data:video/mp4;base64," + base64.b64encode(long_video).decode()]}
    videos, images = prepared("video 4 s 320x240 + sound"), prepared("image 640x480")
    results = [
        compare(loaded, "4 s video + sound, positions", videos, transformers_positions),
        compare(loaded, "20 s video + sound, positions", [serve_clef.prepare(loaded, long_request,
                                                                            args.max_length).encoded],
                transformers_positions),
        compare(loaded, "image 640x480, waits after the tower", images, no_waits_after_the_tower),
        compare(loaded, "4 s video + sound, waits after the tower", videos, no_waits_after_the_tower),
    ]
    graph_gaps(loaded)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
