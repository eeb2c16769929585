"""The thinker's 3-D rotary positions from the host walk (serve_clef.rope_index_from_host) against transformers' own
`get_rope_index`, bit for bit: on records the processor made from real media, on random layouts of text, images,
sounds and videos with and without their soundtracks, and in batches of several records; and the interleaving of a
video's frames with its soundtrack against a plain merge."""

import base64
import functools
import random

import pytest
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
)

import serve_clef


@pytest.fixture(scope="module")
def loaded():
    return serve_clef.load_clef("synthetic", device="cpu", progress=lambda line: None)


@pytest.fixture(scope="module")
def thinker_model(loaded):
    """The module whose get_rope_index the thinker calls in this transformers (the one it is installed on first)."""
    return next(module for module in loaded.model.thinker.modules()
                if isinstance(module.__dict__.get("get_rope_index"), functools.partial))


def both(module, **arguments) -> tuple:
    """(rope_index_from_host's, transformers' own) positions and offsets for the same arguments."""
    return serve_clef.rope_index_from_host(module, **arguments), type(module).get_rope_index(module, **arguments)


def assert_equal(ours: tuple, theirs: tuple) -> None:
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.dtype == reference.dtype and mine.shape == reference.shape
        assert torch.equal(mine, reference)


def batch_arguments(loaded, records) -> dict:
    """get_rope_index's arguments as the thinker passes them for these encoded records, collated as the engine
    collates them."""
    batch = loaded.schema.collate_records(records, loaded.processor.tokenizer.pad_token_id, "cpu")
    media = batch["media"]
    return {
        "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
        "image_grid_thw": media.get("image_grid_thw"), "video_grid_thw": media.get("video_grid_thw"),
        "use_audio_in_video": bool(media.get("use_audio_in_video", False)),
        "audio_seqlens": (media["feature_attention_mask"].sum(1) if "feature_attention_mask" in media else None),
        "second_per_grids": media.get("video_second_per_grid"),
    }


def data_url(content_type: str, data: bytes) -> str:
    return f"data:{content_type};base64,{base64.b64encode(data).decode()}"


def test_the_thinker_takes_its_positions_from_the_host_walk(loaded):
    installed = [module for module in loaded.model.thinker.modules()
                 if isinstance(module.__dict__.get("get_rope_index"), functools.partial)]
    assert installed and all(module.get_rope_index.func is serve_clef.rope_index_from_host for module in installed)


def test_positions_of_real_media_records_are_transformers_own(loaded, thinker_model, png_bytes, wav_bytes,
                                                               mp4_with_audio_bytes, mp4_silent_bytes):
    base = {"model": "clef-omni", "state": "judge the media", "questions": {"ok": {"type": "noul"}}}
    image, sound = [data_url("image/png", png_bytes)], [data_url("audio/wav", wav_bytes)]
    heard, silent = [data_url("video/mp4", mp4_with_audio_bytes)], [data_url("video/mp4", mp4_silent_bytes)]
    requests = {
        "image": {**base, "images": image},
        "two images and a sound": {**base, "images": image * 2, "audio": sound},
        "video with its soundtrack": {**base, "videos": heard},
        "silent video": {**base, "videos": silent},
        "image, sound and a video with its soundtrack": {**base, "images": image, "audio": sound, "videos": heard},
        "text only": base,
    }
    encoded = {name: serve_clef.prepare(loaded, request, 4096).encoded for name, request in requests.items()}
    for record in encoded.values():
        assert_equal(*both(thinker_model, **batch_arguments(loaded, [record])))
    # batches: right-padded records of other lengths, the grids and sounds of all of them in order
    heard_batch = [encoded["video with its soundtrack"], encoded["text only"],
                   encoded["image, sound and a video with its soundtrack"]]
    silent_batch = [encoded["two images and a sound"], encoded["silent video"], encoded["image"]]
    for records in (heard_batch, silent_batch):
        arguments = batch_arguments(loaded, records)
        assert (arguments["attention_mask"] == 0).any()  # padded
        assert_equal(*both(thinker_model, **arguments))


def random_layout(rng: random.Random, config, heard_videos: bool, records: int,
                  kinds: tuple[str, ...] = ("image", "sound", "video")) -> dict:
    """get_rope_index's arguments for `records` records of random pieces: text runs and media of `kinds`: images,
    sounds and videos (all heard with their soundtracks, or all silent), with random grids, sound lengths and seconds
    per grid."""
    def sound_tokens(frames: int) -> list[int]:
        return [config.audio_token_id] * int(_get_feat_extract_output_lengths(torch.tensor(frames),
                                                                             config.audio_config.n_window))

    sequences, image_grids, video_grids, sound_frames, seconds = [], [], [], [], []
    for _ in range(records):
        tokens = []
        for _ in range(rng.randint(0, 5)):
            tokens += [0] * rng.randint(0, 4)  # text (0 is no special token)
            kind = rng.choice(kinds)
            if kind == "image":
                grid = [1, 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)]
                image_grids.append(grid)
                tokens += [config.vision_start_token_id, *[config.image_token_id] * (grid[1] * grid[2] // 4),
                           config.vision_end_token_id]
            elif kind == "sound":
                frames = rng.randint(1, 900)
                sound_frames.append(frames)
                tokens += [config.audio_start_token_id, *sound_tokens(frames), config.audio_end_token_id]
            else:
                grid = [rng.randint(1, 5), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)]
                video_grids.append(grid)
                seconds.append(rng.choice((0.5, 1.0, 2.0, 1.3)))
                video = [config.video_token_id] * (grid[0] * grid[1] * grid[2] // 4)
                if heard_videos:
                    frames = rng.randint(1, 900)
                    sound_frames.append(frames)
                    tokens += [config.vision_start_token_id, config.audio_start_token_id, *video, *sound_tokens(frames),
                               config.audio_end_token_id, config.vision_end_token_id]
                else:
                    tokens += [config.vision_start_token_id, *video, config.vision_end_token_id]
        sequences.append(tokens + [0] * rng.randint(1, 3))
    longest = max(len(tokens) for tokens in sequences)
    return {
        "input_ids": torch.tensor([tokens + [0] * (longest - len(tokens)) for tokens in sequences]),
        "attention_mask": torch.tensor([[1] * len(tokens) + [0] * (longest - len(tokens)) for tokens in sequences]),
        "image_grid_thw": torch.tensor(image_grids) if image_grids else None,
        "video_grid_thw": torch.tensor(video_grids) if video_grids else None,
        "use_audio_in_video": heard_videos,
        "audio_seqlens": torch.tensor(sound_frames) if sound_frames else None,
        "second_per_grids": torch.tensor(seconds) if seconds else None,
    }


def test_positions_of_random_layouts_are_transformers_own(thinker_model):
    rng = random.Random(7)
    for case in range(60):
        arguments = random_layout(rng, thinker_model.config, heard_videos=case % 2 == 1, records=1 + case % 3)
        assert_equal(*both(thinker_model, **arguments))


def test_positions_without_images_or_videos_are_transformers_own(thinker_model):
    """Text alone and text with sounds: transformers numbers every real token in turn (its count of the mask),
    which rope_index_from_host makes on the host; right-padded batches of one to four records."""
    rng = random.Random(11)
    for case in range(40):
        records = 1 + case % 4
        if case % 2:
            arguments = random_layout(rng, thinker_model.config, heard_videos=False, records=records, kinds=("sound",))
        else:
            lengths = [rng.randint(1, 40) for _ in range(records)]
            arguments = {"input_ids": torch.zeros(records, max(lengths), dtype=torch.long),
                         "attention_mask": torch.tensor([[1] * n + [0] * (max(lengths) - n) for n in lengths])}
        assert arguments.get("image_grid_thw") is None and arguments.get("video_grid_thw") is None
        assert_equal(*both(thinker_model, **arguments))


def test_a_video_interleaves_with_its_soundtrack_as_a_plain_merge():
    """interleaved_by_time against the merge transformers runs, written out: column by column, the video's first at
    equal times, until one runs out, then the rest of the other as one piece."""
    rng = random.Random(3)
    for _ in range(200):
        videos, sounds = rng.randint(0, 12), rng.randint(0, 12)
        video_times = sorted(rng.choice((0.0, 0.5, 1.0, 1.5, 2.0, 3.0)) + 5 for _ in range(videos))
        video = torch.tensor([video_times, [rng.randint(0, 3) for _ in range(videos)],
                              [rng.randint(0, 3) for _ in range(videos)]]).view(3, videos)
        start = rng.randint(4, 7)
        sound = (torch.arange(sounds).view(1, -1).expand(3, -1) + start)
        expected, v, a = [], 0, 0
        while v < videos and a < sounds:
            if video[0, v] <= sound[0, a]:
                expected.append(video[:, v:v + 1])
                v += 1
            else:
                expected.append(sound[:, a:a + 1])
                a += 1
        rest = video[:, v:] if v < videos else sound[:, a:]
        pieces = serve_clef.interleaved_by_time(video, sound)
        got = torch.cat([piece.float() for piece in pieces] or [torch.empty(3, 0)], dim=1)
        assert torch.equal(got, torch.cat([piece.float() for piece in [*expected, rest]], dim=1))
        if videos and sounds:  # the last piece is the rest, whose largest the next position follows
            assert torch.equal(pieces[-1].float(), rest.float())


def test_a_transformers_whose_positions_differ_keeps_its_own(loaded, monkeypatch):
    thinker = loaded.model.thinker
    modules = [module for module in thinker.modules() if "get_rope_index" in module.__dict__]
    for module in modules:
        monkeypatch.delitem(module.__dict__, "get_rope_index")
        library = type(module).get_rope_index

        def shifted(self, *args, _library=library, **kwargs):  # a transformers that counts positions from 1
            positions, offsets = _library(self, *args, **kwargs)
            return positions + 1, offsets
        monkeypatch.setattr(type(module), "get_rope_index", shifted)
    lines = []
    serve_clef.install_rope_index_from_host(thinker, lines.append)
    assert not any("get_rope_index" in module.__dict__ for module in modules)
    assert lines == ["3-D positions: transformers' own (rope_index_from_host differs from it on a check batch)"]
