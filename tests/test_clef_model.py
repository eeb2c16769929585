"""ClefModel, systemone and load_release_model on the tiny synthetic release: text and media requests, per-record
independence, and loading failures that name what failed."""

import base64
import io
import json
import shutil

import av
import numpy as np
import pytest
import safetensors.torch
import torch

import joint_schema_model as jsm
import synthetic_release

QUESTIONS = {
    "intent": {"type": "choice", "instructions": "Which intent?", "criteria": {"refund": "money back", "browse": None}},
    "risk": {"type": "score", "instructions": "Fraud risk", "criteria": ["low", "mid", "high"]},
    "human": {"type": "noul", "instructions": "Needs a human?"},
}


@pytest.fixture(scope="module")
def clef(tiny_release):
    return jsm.load_release_model(tiny_release, device="cpu")


def data_url(mime, data):
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def check_answers(response, questions):
    """Answer shapes of docs/decision-api.md §10, checked against the request, not against the code."""
    assert list(response) == ["model", "answers", "usage"]
    assert list(response["answers"]) == list(questions)
    for question_id, question in questions.items():
        answer = response["answers"][question_id]
        assert answer["type"] == question["type"]
        if question["type"] == "noul":
            assert list(answer) == ["type", "noul"] and 0.0 <= answer["noul"] <= 1.0
            continue
        probabilities = answer["probabilities"]
        assert abs(sum(probabilities.values()) - 1.0) < 0.01
        if question["type"] == "choice":
            assert list(probabilities) == [str(k) for k in question["criteria"]]
            assert answer["choice"] in probabilities
            assert answer["confidence"] == max(probabilities.values())
        else:
            assert list(probabilities) == [str(i) for i in range(len(question["criteria"]))]
            expected = sum(int(level) * p for level, p in probabilities.items())
            assert abs(answer["score"] - expected) < 1e-3
            assert answer["legend"] == {str(i): d for i, d in enumerate(question["criteria"])}


def test_text_request_answers(clef):
    model, processor = clef
    request = {"model": "clef-omni", "state": {"order": 42, "text": "I want my money back"}, "questions": QUESTIONS}
    response = jsm.systemone(model, processor, request)
    check_answers(response, QUESTIONS)
    encoded = jsm.encode_record(processor.tokenizer, request, processor=processor)
    assert response["usage"] == {"input_tokens": len(encoded.input_ids), "output_tokens": 0}
    assert response["model"] == "clef-omni"
    # deterministic
    assert jsm.systemone(model, processor, request) == response


def test_probabilities_are_the_softmax_of_the_head_logits(clef):
    """systemone's numbers, recomputed from the thinker and head called directly."""
    model, processor = clef
    request = {"model": "m", "state": "The customer is angry.", "questions": QUESTIONS}
    encoded = jsm.encode_record(processor.tokenizer, request)
    input_ids = torch.tensor([encoded.input_ids])
    mask = torch.ones_like(input_ids)
    with torch.inference_mode():
        hidden = model.thinker(input_ids=input_ids, attention_mask=mask, use_cache=False, return_dict=True).logits
        logits = model.head(hidden, input_ids, mask, [encoded], model.output_embeddings.weight)[0]
    response = jsm.systemone(model, processor, request)
    intent = dict(zip(encoded.questions[0].option_ids, logits[0].float().softmax(-1).tolist()))
    assert response["answers"]["intent"]["probabilities"] == {k: round(intent[k], 4) for k in ("refund", "browse")}
    human = logits[2].float().softmax(-1).tolist()
    assert response["answers"]["human"]["noul"] == round(human[0], 4)


def test_a_record_scores_the_same_alone_and_in_a_padded_batch(clef):
    """Each record of a padded batch gets the logits of the thinker and head called directly on that record alone,
    in the batch's order; the thinker never sees a padding token (docs/decision-api.md: padding must not change a
    record's probabilities)."""
    model, processor = clef
    records = [
        jsm.encode_record(processor.tokenizer, {"state": "short", "questions": QUESTIONS}),
        jsm.encode_record(processor.tokenizer, {"state": "a much longer state " * 20, "questions": QUESTIONS}),
        jsm.encode_record(processor.tokenizer, {"state": {"k": [1, 2, 3]}, "questions": {"x": QUESTIONS["risk"]}}),
    ]
    assert len({len(r.input_ids) for r in records}) == 3
    thinker_inputs = []
    hook = model.thinker.register_forward_pre_hook(
        lambda module, args, kwargs: thinker_inputs.append((kwargs["input_ids"], kwargs["attention_mask"])),
        with_kwargs=True,
    )
    try:
        with torch.inference_mode():
            batched = model(jsm.collate_records(records, processor.tokenizer.pad_token_id, "cpu"))
    finally:
        hook.remove()
    assert [ids.tolist() for ids, _ in thinker_inputs] == [[list(r.input_ids)] for r in records]
    assert all(bool(mask.all()) for _, mask in thinker_inputs)
    assert len(batched) == len(records)
    for record, batch_logits in zip(records, batched):
        input_ids = torch.tensor([record.input_ids])
        mask = torch.ones_like(input_ids)
        with torch.inference_mode():
            hidden = model.thinker(input_ids=input_ids, attention_mask=mask, use_cache=False, return_dict=True).logits
            alone = model.head(hidden, input_ids, mask, [record], model.output_embeddings.weight)[0]
        assert [len(q.option_ids) for q in record.questions] == [len(logits) for logits in batch_logits]
        for a, b in zip(alone, batch_logits, strict=True):
            assert torch.equal(a, b)


def test_head_runs_in_the_backbone_dtype(clef):
    model, _ = clef
    assert {p.dtype for p in model.head.parameters()} == {torch.bfloat16}
    assert isinstance(model.thinker.lm_head, torch.nn.Identity)
    assert set(name.split(".")[0] for name in model.state_dict()) == {"thinker", "head", "output_embeddings"}


def test_image_audio_and_video_request(clef, png_bytes, wav_bytes, mp4_with_audio_bytes):
    model, processor = clef
    request = {
        "model": "clef-omni",
        "state": "Describe what you see and hear.",
        "images": [data_url("image/png", png_bytes)],
        "audio": [{"content_type": "audio/wav", "base64": base64.b64encode(wav_bytes).decode()}],
        "videos": [data_url("video/mp4", mp4_with_audio_bytes)],
        "questions": QUESTIONS,
    }
    encoded = jsm.encode_record(processor.tokenizer, request, processor=processor)
    media = encoded.media
    assert media["use_audio_in_video"] is True  # the only video has a soundtrack
    tokenizer = processor.tokenizer
    ids = list(encoded.input_ids)
    image_pad, audio_pad, video_pad = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|audio_pad|>", "<|video_pad|>")
    )
    # image pads: prod(grid_thw) / merge^2
    assert ids.count(image_pad) == int(media["image_grid_thw"].prod()) // 4
    assert ids.count(video_pad) == int(media["video_grid_thw"].prod()) // 4
    assert ids.count(audio_pad) > 0
    # media come right after "STATE:\n" and before the state text, images first
    prefix = tokenizer(jsm._PROMPT_PREFIX, add_special_tokens=False).input_ids
    assert ids[: len(prefix)] == prefix
    assert ids[len(prefix)] == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert ids[len(prefix) + 1] == image_pad
    # the video with its soundtrack is wrapped as <|vision_start|><|audio_start|> ... <|audio_end|><|vision_end|>
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|vision_start|><|audio_start|>" in text and "<|audio_end|><|vision_end|>" in text

    response = jsm.systemone(model, processor, request)
    check_answers(response, QUESTIONS)
    assert response["usage"]["input_tokens"] == len(ids)


def test_silent_video_is_seen_not_heard(clef, mp4_silent_bytes):
    model, processor = clef
    request = {"model": "m", "state": "s", "videos": [mp4_silent_bytes], "questions": {"h": QUESTIONS["human"]}}
    encoded = jsm.encode_record(processor.tokenizer, request, processor=processor)
    assert encoded.media["use_audio_in_video"] is False
    check_answers(jsm.systemone(model, processor, request), {"h": QUESTIONS["human"]})


def test_video_frames_are_sampled_at_two_fps_and_even(mp4_with_audio_bytes):
    """The 2 s clip at 8 fps gives the frames at 0, 0.5, 1 and 1.5 s: every fourth frame FFmpeg decodes from it."""
    frames, track = jsm.load_video(mp4_with_audio_bytes)
    with av.open(io.BytesIO(mp4_with_audio_bytes)) as container:
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]  # [H, W, 3] each
    assert len(decoded) == 16 and frames.shape == (4, *decoded[0].shape)
    assert all(np.array_equal(frames[index], decoded[4 * index]) for index in range(4))
    assert track is not None and track.dtype.name == "float32"


def noise_clip(container_format: str, codec: str, sample_rate: int, layout: str, seconds: float) -> bytes:
    """Seeded white noise (so that every sample counts) encoded by FFmpeg."""
    channels = 2 if layout == "stereo" else 1
    samples = np.random.default_rng(0).uniform(-0.5, 0.5, size=(1, round(seconds * sample_rate) * channels))
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=sample_rate, layout=layout)
        step = 1152  # samples per channel in a frame; packed "flt" frames interleave the channels
        for start in range(0, samples.shape[1] // channels, step):
            chunk = samples[:, start * channels:(start + step) * channels].astype(np.float32)
            frame = av.AudioFrame.from_ndarray(chunk, format="flt", layout=layout)
            frame.sample_rate, frame.pts = sample_rate, start
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def resampled_frame_by_frame(data: bytes) -> np.ndarray:
    """The plain way: opened with FFmpeg's defaults, each decoded frame through its resampler as it comes."""
    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=16_000)
        frames = [out for frame in container.decode(audio=0) for out in resampler.resample(frame)]
        frames += resampler.resample(None)
    return np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames])


@pytest.mark.parametrize("resample_seconds", [jsm.AUDIO_RESAMPLE_SECONDS, 1])
def test_audio_decodes_to_ffmpeg_s_samples_frame_by_frame(monkeypatch, resample_seconds):
    # load_audio opens clips without FFmpeg's stream probing and resamples them in chunks, not frame by frame (with
    # chunks of 1 s, most clips here are several): the samples must be those of the plain way
    monkeypatch.setattr(jsm, "AUDIO_RESAMPLE_SECONDS", resample_seconds)
    clips = [
        synthetic_release.synthetic_wav(3.0),
        noise_clip("wav", "pcm_s16le", 44_100, "stereo", 2.5),
        noise_clip("wav", "pcm_f32le", 22_050, "mono", 1.0),
        noise_clip("mp3", "libmp3lame", 44_100, "stereo", 2.5),
        noise_clip("mp3", "libmp3lame", 8_000, "mono", 3.0),
        synthetic_release.synthetic_mp4(True, seconds=2),  # a video's soundtrack (AAC)
    ]
    for clip in clips:
        samples, expected = jsm.load_audio(clip), resampled_frame_by_frame(clip)
        assert samples.dtype == np.float32 and samples.size > 8_000
        assert np.array_equal(samples, expected)


def test_video_frames_converted_on_one_thread_equal_ffmpeg_s_threaded_conversion():
    mp4 = synthetic_release.synthetic_mp4(False, seconds=2, size=(640, 480))  # over the frame cap: frames are scaled
    frames, _ = jsm.load_video(mp4)
    height, width = frames.shape[1:3]
    assert (width, height) != (640, 480)
    with av.open(io.BytesIO(mp4)) as container:
        decoded = list(container.decode(video=0))
    expected = []
    for frame in decoded:  # the first frame at or after each half second
        if frame.time + 1e-6 >= len(expected) / jsm.VIDEO_FPS:
            expected.append(frame.to_ndarray(format="rgb24", width=width, height=height))
    assert np.array_equal(frames, np.stack(expected))


def test_bad_media_raise_clear_value_errors(clef, wav_bytes, png_bytes):
    _, processor = clef
    cases = [
        ({"images": [b"not an image"]}, "image could not be decoded"),
        ({"audio": [b"not audio at all"]}, "audio could not be decoded"),
        ({"videos": [b"not a video"]}, "video could not be decoded"),
        ({"videos": [wav_bytes]}, "video has no video stream"),
        ({"audio": [png_bytes]}, "audio has no decodable audio stream"),
    ]
    for media, phrase in cases:
        record = {"state": "s", "questions": {"q": {"type": "noul"}}, **media}
        with pytest.raises(ValueError, match=phrase):
            jsm.encode_record(processor.tokenizer, record, processor=processor)
    with pytest.raises(ValueError, match="require a processor"):
        jsm.encode_record(
            processor.tokenizer, {"state": "s", "questions": {"q": {"type": "noul"}}, "images": [png_bytes]}
        )


def test_systemone_validation_messages(clef):
    model, processor = clef
    cases = [
        ({"state": "s", "questions": QUESTIONS}, "model and state are required"),
        ({"model": 3, "state": "s", "questions": QUESTIONS}, "model and state are required"),
        ({"model": "m", "questions": QUESTIONS}, "model and state are required"),
        ({"model": "m", "state": "s", "questions": {}}, "at least one question is required"),
        ({"model": "m", "state": "s", "questions": {"q": {"type": "rank"}}}, "q: type must be noul, choice, or score"),
        (
            {"model": "m", "state": "s", "questions": {"q": {"type": "choice", "criteria": {}}}},
            "q: criteria must not be empty",
        ),
    ]
    for request, message in cases:
        with pytest.raises(ValueError) as error:
            jsm.systemone(model, processor, request)
        assert str(error.value) == message


def copy_release(source, target):
    shutil.copytree(source, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    return index


def rewrite_shard(release, tensor_name, change):
    """Apply change(tensors) to the shard holding tensor_name and write it back."""
    index = json.loads((release / "model.safetensors.index.json").read_text())
    shard = release / index["weight_map"][tensor_name]
    tensors = safetensors.torch.load_file(shard)
    change(tensors)
    safetensors.torch.save_file(tensors, shard, metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_release, tmp_path):
    release = tmp_path / "release"
    index = copy_release(tiny_release, release)
    name = next(k for k in index["weight_map"] if k.endswith("mlp.gate.weight"))
    rewrite_shard(release, name, lambda tensors: tensors.pop(name))
    del index["weight_map"][name]
    (release / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(RuntimeError) as error:
        jsm.load_release_model(release, device="cpu")
    assert "did not load cleanly" in str(error.value) and "mlp.gate.weight" in str(error.value)


def test_wrongly_shaped_tensor_is_named(tiny_release, tmp_path):
    release = tmp_path / "release"
    index = copy_release(tiny_release, release)
    name = next(k for k in index["weight_map"] if k.endswith("input_layernorm.weight"))

    def corrupt(tensors):
        tensors[name] = torch.ones(tensors[name].numel() + 1, dtype=tensors[name].dtype)

    rewrite_shard(release, name, corrupt)
    # transformers reports the misfit as mismatched (name, checkpoint shape, model shape); the loader refuses it
    with pytest.raises(RuntimeError, match=r"did not load cleanly.*layers\.0\.input_layernorm\.weight.*65.*64"):
        jsm.load_release_model(release, device="cpu")


def test_head_with_a_missing_parameter_is_named(tiny_release, tmp_path):
    release = tmp_path / "release"
    copy_release(tiny_release, release)
    head = safetensors.torch.load_file(release / "joint_head.safetensors")
    del head["residual_gate"]
    safetensors.torch.save_file(head, release / "joint_head.safetensors")
    with pytest.raises(RuntimeError, match="residual_gate"):
        jsm.load_release_model(release, device="cpu")


def test_a_head_config_for_another_hidden_size_is_refused(tiny_release, tmp_path):
    """The spec's check: the head's hidden_size must be the thinker's text hidden size (config.json)."""
    release = tmp_path / "release"
    copy_release(tiny_release, release)
    head_config = json.loads((release / "joint_head_config.json").read_text())
    thinker_hidden_size = json.loads((release / "config.json").read_text())["thinker_config"]["text_config"][
        "hidden_size"]
    assert head_config["hidden_size"] == thinker_hidden_size
    head_config["hidden_size"] = thinker_hidden_size * 2
    (release / "joint_head_config.json").write_text(json.dumps(head_config))
    with pytest.raises(ValueError, match=rf"hidden_size {thinker_hidden_size * 2} differs from the thinker's "
                                         rf"{thinker_hidden_size}"):
        jsm.load_release_model(release, device="cpu")
