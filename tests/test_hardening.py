"""Bounded work per request, and what the SystemOne clients send, against `--model synthetic` (docs/api.md §2, §6).

Every bound is shown with a tiny hand-built file whose header, packets or size says what the limit must catch, and
is checked to be refused before the costly step it guards: the decision module's own decoding (`load_audio`,
`encode_record`) is replaced by a function that fails the test if it is reached. Answers that must not change are
compared with the decision module's own encoding of the same record, or with the same request in another form.
"""

import base64
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys

import av
import jsonschema
import numpy as np
import pytest
import requests
import zstandard
from PIL import Image

import serve_clef
from test_http import GOOD_REQUEST, SERVER_ARGS, TIMEOUT_S, data_url, free_port, serve_in_thread, wait_until_ready

MAX_LENGTH = 2048


@pytest.fixture(scope="module")
def loaded():
    args = serve_clef.parse_args([*SERVER_ARGS, "--api-key", ""])
    return serve_clef.load_from_args(args, progress=lambda line: None)


@pytest.fixture(scope="module")
def base_url(loaded):
    """An in-process server (no API key) over the module's model."""
    args = serve_clef.parse_args([*SERVER_ARGS, "--api-key", ""])
    with serve_in_thread(serve_clef.create_app(args, load=lambda args, progress: loaded)) as url:
        wait_until_ready(url, limit_s=TIMEOUT_S)
        yield url


def refusal(loaded, request: dict) -> serve_clef.RequestError:
    with pytest.raises(serve_clef.RequestError) as refused:
        serve_clef.decide(loaded, request, MAX_LENGTH)
    return refused.value


def answers(loaded, request: dict) -> dict:
    response = serve_clef.decide(loaded, request, MAX_LENGTH)
    del response["usage"]["latency_ms"]
    return response


def never(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} was reached: the limit must refuse the request before it")

    return fail


# ---- hand-built media ------------------------------------------------------------------------------------------------


def pcm_wav(sample_rate: int, samples: int) -> bytes:
    """A mono 16-bit PCM WAV written field by field (RIFF header, fmt chunk, data chunk), so that its header can
    declare any sample rate."""
    data = np.zeros(samples, dtype="<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)  # PCM, mono, rate, bytes/s, align, bits
    chunks = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(chunks)) + chunks


def silent_audio(container_format: str, codec: str, seconds: float, sample_rate: int) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=sample_rate)
        stream.layout = "mono"
        write_silence(container, stream, seconds, sample_rate)
    return buffer.getvalue()


SAMPLE_DTYPES = {"s16": np.int16, "s32": np.int32, "flt": np.float32}


def write_silence(container, stream, seconds: float, sample_rate: int) -> None:
    total, written = round(seconds * sample_rate), 0
    frame_format = stream.codec_context.format.name
    while written < total:
        count = min(1152, total - written)
        planar = np.zeros((1, count), dtype=SAMPLE_DTYPES[frame_format.rstrip("p")])
        frame = av.AudioFrame.from_ndarray(planar, format=frame_format, layout="mono")
        frame.sample_rate, frame.pts = sample_rate, written
        container.mux(stream.encode(frame))
        written += count
    container.mux(stream.encode())


def video_of_copies(container_format: str, codec: str, width: int, height: int, copies: int, fps: int = 30,
                    soundtrack_seconds: float | None = None) -> bytes:
    """A video of `copies` frames for the cost of encoding two: a key frame, then the frame that repeats it (a
    predicted frame with nothing to predict, a few bytes) muxed again and again at successive timestamps."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        sound = None
        if soundtrack_seconds is not None:
            sound = container.add_stream("aac", rate=8000)
            sound.layout = "mono"
        stream.codec_context.gop_size = 1000
        stream.codec_context.options = {"deadline": "realtime", "cpu-used": "8"}  # libvpx: seconds, not minutes
        stream.codec_context.max_b_frames = 0
        frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 90, dtype=np.uint8), format="rgb24")
        encoded = [bytes(packet) for packet in [*stream.encode(frame), *stream.encode(frame), *stream.encode()]]
        key_frame, repeat = encoded[0], encoded[1]
        for index in range(copies):
            packet = av.Packet(key_frame if index == 0 else repeat)
            packet.stream, packet.pts, packet.dts, packet.is_keyframe = stream, index, index, index == 0
            packet.time_base = stream.codec_context.time_base
            container.mux(packet)
        if sound is not None:
            write_silence(container, sound, soundtrack_seconds, 8000)
    return buffer.getvalue()


def with_media(field_name: str, content_type: str, data: bytes) -> dict:
    return {**GOOD_REQUEST, field_name: [data_url(content_type, data)]}


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


# ---- audio -----------------------------------------------------------------------------------------------------------


def test_a_wav_declaring_1_hz_is_refused_from_its_header(loaded, monkeypatch):
    wav = pcm_wav(1, 10_000)  # 20 KB; 10,000 s at 1 Hz, 160 million samples once resampled to 16 kHz
    monkeypatch.setattr(loaded.schema, "load_audio", never("the decision module's audio decoding"))
    refused = refusal(loaded, with_media("audio", "audio/wav", wav))
    assert (refused.status, refused.loc) == (422, ("body", "audio", 0))
    assert "10000.0 s by its header" in refused.message and "at most 300 s" in refused.message


def test_an_mp3_past_300_s_is_refused_while_decoding_before_resampling(loaded, monkeypatch):
    mp3 = silent_audio("mp3", "libmp3lame", 301, 8000)  # MP3 headers only estimate a duration: it is decoded
    monkeypatch.setattr(loaded.schema, "load_audio", never("the decision module's audio decoding"))
    refused = refusal(loaded, with_media("audio", "audio/mpeg", mp3))
    assert (refused.status, refused.loc) == (422, ("body", "audio", 0))
    assert "over 300 s" in refused.message


def tone_clip(container_format: str, codec: str, sample_rate: int, layout: str, seconds: float) -> bytes:
    """A 440 Hz tone (every frame carries sound, unlike silence, which MP3 encoders may squeeze) encoded by FFmpeg."""
    channels = 2 if layout == "stereo" else 1
    times = np.arange(round(seconds * sample_rate)) / sample_rate
    samples = np.repeat(0.3 * np.sin(2 * np.pi * 440 * times), channels).astype(np.float32)[None]  # packed channels
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=sample_rate, layout=layout)
        for start in range(0, samples.shape[1] // channels, 1152):
            frame = av.AudioFrame.from_ndarray(samples[:, start * channels:(start + 1152) * channels], format="flt",
                                               layout=layout)
            frame.sample_rate, frame.pts = sample_rate, start
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


@pytest.mark.parametrize("container_format, codec, sample_rate, layout, seconds", [
    ("mp3", "libmp3lame", 8_000, "mono", 0.005),
    ("mp3", "libmp3lame", 8_000, "mono", 3.0),
    ("mp3", "libmp3lame", 16_000, "mono", 10.0),
    ("mp3", "libmp3lame", 44_100, "stereo", 2.5),
    ("mp3", "libmp3lame", 48_000, "stereo", 1.0),
    ("wav", "pcm_s16le", 44_100, "stereo", 2.5),
    ("wav", "pcm_s16le", 16_000, "mono", 0.013),
])
def test_an_audio_clips_packets_bound_its_decoded_length(container_format, codec, sample_rate, layout, seconds):
    # what the server's single decode rests on: a clip decodes to at most its packets' durations (the packets of an
    # MP3 also count the encoder's delay and padding, a few frames); FFmpeg's decoder is the reference
    data = tone_clip(container_format, codec, sample_rate, layout, seconds)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        packets = serve_clef._packet_seconds(container, stream)
    with av.open(io.BytesIO(data)) as container:
        decoded = sum(frame.samples / frame.sample_rate for frame in container.decode(audio=0))
    assert 0 < decoded <= packets <= decoded + (0.3 if container_format == "mp3" else 1e-9)


def test_an_mp3_within_the_limits_is_decoded_once_by_the_decision_module(loaded, monkeypatch):
    mp3 = tone_clip("mp3", "libmp3lame", 44_100, "stereo", 2.5)
    expected = answers(loaded, with_media("audio", "audio/mpeg", mp3))
    decodes = []
    real_load_audio = loaded.schema.load_audio
    monkeypatch.setattr(loaded.schema, "load_audio", lambda value: decodes.append(value) or real_load_audio(value))
    monkeypatch.setattr(serve_clef, "_decoded_seconds", never("the server's own decoding of the clip"))
    assert answers(loaded, with_media("audio", "audio/mpeg", mp3)) == expected
    assert [type(value) for value in decodes] == [bytes, np.ndarray]  # the clip once, then its samples as they are


def test_an_mp3_whose_samples_fall_short_of_13_ms_gets_422(loaded):
    mp3 = tone_clip("mp3", "libmp3lame", 8_000, "mono", 0.005)  # 40 samples; its packets say 144 ms or more
    with av.open(io.BytesIO(mp3)) as container:
        stream = container.streams.audio[0]
        assert serve_clef._packet_seconds(container, stream) > serve_clef.MIN_AUDIO_SECONDS
    refused = refusal(loaded, with_media("audio", "audio/mpeg", mp3))
    assert (refused.status, refused.loc) == (422, ("body", "audio", 0))
    assert "at least 13 ms" in refused.message


def test_audio_shorter_than_the_feature_window_gets_422_not_500(loaded):
    # the reference: the release's own feature extraction fails below its window, and serves a clip above it
    record = {**GOOD_REQUEST, "audio": [np.zeros(200, dtype=np.float32)]}
    with pytest.raises(RuntimeError, match="Padding size"):
        loaded.schema.encode_record(loaded.processor.tokenizer, record, MAX_LENGTH, processor=loaded.processor)
    for samples in (1, 100, 200):
        refused = refusal(loaded, with_media("audio", "audio/wav", pcm_wav(16_000, samples)))
        assert (refused.status, refused.loc) == (422, ("body", "audio", 0))
        assert "at least 13 ms" in refused.message
    assert answers(loaded, with_media("audio", "audio/wav", pcm_wav(16_000, 208)))["answers"]


# ---- video -----------------------------------------------------------------------------------------------------------


def test_a_soundtrack_longer_than_the_audio_limit_is_refused(loaded, monkeypatch):
    mp4 = video_of_copies("mp4", "mpeg4", 64, 48, copies=16, fps=8, soundtrack_seconds=301)  # 2 s of video
    monkeypatch.setattr(loaded.schema, "encode_record", never("encoding the record"))
    refused = refusal(loaded, with_media("videos", "video/mp4", mp4))
    assert (refused.status, refused.loc) == (422, ("body", "videos", 0))
    assert "soundtrack" in refused.message and "300 s" in refused.message


def test_huge_frames_are_refused_from_the_stream_header(loaded, monkeypatch):
    webm = video_of_copies("webm", "libvpx", 4096, 4096, copies=3)
    monkeypatch.setattr(loaded.schema, "encode_record", never("encoding the record"))
    refused = refusal(loaded, with_media("videos", "video/webm", webm))
    assert (refused.status, refused.loc) == (422, ("body", "videos", 0))
    assert "4096x4096" in refused.message and "16 megapixels per frame" in refused.message


@pytest.mark.parametrize(
    "width, height, copies, phrase",
    [
        (16, 16, serve_clef.MAX_VIDEO_FRAMES + 1, "at most 3600 frames"),  # 30 s at 120 fps
        (4000, 4000, 467, "gigapixels"),  # 467 frames of 16 MP: 7.47 G pixels to decode, over 3,600 frames of 1080p
    ],
)
def test_frame_count_and_decoding_cost_are_bounded_from_the_packets(loaded, monkeypatch, width, height, copies, phrase):
    mp4 = video_of_copies("mp4", "mpeg4", width, height, copies=copies, fps=120)
    assert copies * width * height > serve_clef.MAX_VIDEO_DECODED_PIXELS or copies > serve_clef.MAX_VIDEO_FRAMES
    monkeypatch.setattr(loaded.schema, "encode_record", never("encoding the record"))
    refused = refusal(loaded, with_media("videos", "video/mp4", mp4))
    assert (refused.status, refused.loc) == (422, ("body", "videos", 0))
    assert phrase in refused.message


def test_a_video_within_the_bounds_is_answered(loaded):
    mp4 = video_of_copies("mp4", "mpeg4", 64, 48, copies=16, fps=8, soundtrack_seconds=2)
    assert answers(loaded, with_media("videos", "video/mp4", mp4))["answers"]


@pytest.mark.parametrize("soundtrack_seconds, measured_by_decoding", [(2, False), (0.5, True)])
def test_a_soundtrack_is_decoded_once_unless_its_packets_are_short(loaded, monkeypatch, soundtrack_seconds,
                                                                  measured_by_decoding):
    """The decision module decodes the soundtrack when it encodes the record; the server's checks decode it too only
    when its packets come to less than a second, where a codec's priming could leave too little sound."""
    mp4 = video_of_copies("mp4", "mpeg4", 64, 48, copies=16, fps=8, soundtrack_seconds=soundtrack_seconds)
    decoded = []
    measure = serve_clef._decoded_seconds
    monkeypatch.setattr(serve_clef, "_decoded_seconds", lambda *args: decoded.append(args[-1]) or measure(*args))
    assert answers(loaded, with_media("videos", "video/mp4", mp4))["answers"]
    assert decoded == (["has a soundtrack of"] if measured_by_decoding else [])


# ---- images and the shapes of media items ----------------------------------------------------------------------------


@pytest.mark.parametrize("field_name, content_type, data", [
    ("images", "image/png", png(402, 2)),
    ("videos", "video/mp4", video_of_copies("mp4", "mpeg4", 802, 4, copies=2)),
])
def test_aspect_ratios_the_vision_processor_refuses_are_refused_at_the_field(loaded, field_name, content_type, data):
    # the reference: the release's image processor refuses the same 402x2 picture
    with pytest.raises(ValueError, match="aspect ratio"):
        loaded.processor.image_processor(images=[Image.open(io.BytesIO(png(402, 2)))])
    refused = refusal(loaded, with_media(field_name, content_type, data))
    assert (refused.status, refused.loc) == (422, ("body", field_name, 0))
    assert "200 times" in refused.message


def test_data_url_parameters_and_sniffed_formats_give_the_same_answer(loaded):
    image = png(96, 64)
    expected = answers(loaded, with_media("images", "image/png", image))
    encoded = base64.b64encode(image).decode()
    for item in (f"data:image/png;charset=utf-8;base64,{encoded}",
                 f"data:image/png;name=photo.png;charset=binary;base64,{encoded}",
                 f"data:image/jpeg;base64,{encoded}",  # a PNG declared as JPEG is read as the PNG it is
                 {"content_type": "image/webp", "base64": encoded}):
        assert answers(loaded, {**GOOD_REQUEST, "images": [item]}) == expected


@pytest.mark.parametrize("item, phrase", [
    (base64.b64encode(png(8, 8)).decode(), "looks like base64 without the data URL"),
    ("photos/cat.png", "looks like a file path"),
    (data_url("image/png", b"GIF89a is what these bytes are not"), "not a PNG, JPEG or WebP image"),
    (data_url("audio/wav", b"RIFF\x10\x00\x00\x00WAVEjunk"), "could not be decoded as audio"),
])
def test_media_messages_say_what_to_send_and_leak_nothing(loaded, item, phrase):
    field_name = "audio" if "audio/" in str(item) else "images"
    refused = refusal(loaded, {**GOOD_REQUEST, field_name: [item]})
    assert (refused.status, refused.loc) == (422, ("body", field_name, 0))
    assert phrase in refused.message
    assert "0x" not in refused.message and "object at" not in refused.message and "Errno" not in refused.message


def test_assets_the_typesafe_form_of_images(loaded):
    image = png(96, 64)
    expected = answers(loaded, with_media("images", "image/png", image))
    asset = {"type": "image", "format": "png", "data_base64": base64.b64encode(image).decode()}
    assert answers(loaded, {**GOOD_REQUEST, "assets": {"<image:0001>": asset}}) == expected
    for bad, loc, phrase in [
        ({"<image:0001>": "not an object"}, ("assets", "<image:0001>"), "must be an object"),
        ({"p": {**asset, "type": "video"}}, ("assets", "p", "type"), "type must be \"image\""),
        ({"p": {**asset, "format": "gif"}}, ("assets", "p", "format"), "format must be one of"),
        ({"p": {"type": "image", "part": "asset-0"}}, ("assets", "p", "part"), "not multipart/form-data"),
        ({"p": {"type": "image"}}, ("assets", "p", "data_base64"), "data_base64"),
        ({f"p{i}": asset for i in range(5)}, ("assets",), "at most 4 images"),
    ]:
        refused = refusal(loaded, {**GOOD_REQUEST, "assets": bad})
        assert (refused.status, refused.loc, phrase in refused.message) == (422, ("body", *loc), True), refused.message


# ---- the state, cut by characters before tokenizing ------------------------------------------------------------------

LONG_STATES = [
    "the parcel was late again " * 3000,
    "a" * 150_000,  # one word: a single pre-token
    " " * 150_000,
    "7" * 150_000,
    "日本語の文章" * 30_000,  # three bytes per character
    "📦" * 60_000,  # four bytes per character
    {"notes": ["x" * 100] * 2000, "customer": "é" * 10_000},  # rendered as JSON
]


@pytest.mark.parametrize("state", LONG_STATES, ids=range(len(LONG_STATES)))
def test_a_state_cut_by_characters_encodes_as_the_whole_state(loaded, state):
    record = {**GOOD_REQUEST, "state": state}
    capped = serve_clef.cap_state_text(loaded, record, MAX_LENGTH, truncate=True)
    assert len(capped["state"]) < len(loaded.schema.render(state))  # the cut happened
    tokenizer = loaded.processor.tokenizer
    whole = loaded.schema.encode_record(tokenizer, record, MAX_LENGTH)  # the reference: the module on the whole state
    assert loaded.schema.encode_record(tokenizer, capped, MAX_LENGTH).input_ids == whole.input_ids
    encoded, dropped = serve_clef.encode(loaded, record, MAX_LENGTH, True)
    assert encoded.input_ids == whole.input_ids and dropped > 0


def test_no_token_stands_for_more_characters_than_the_bound(loaded):
    tokenizer = loaded.processor.tokenizer
    longest = max(len(tokenizer.decode([token_id])) for token_id in range(len(tokenizer)))
    assert longest <= serve_clef.longest_token_chars(tokenizer)


def test_a_state_too_long_by_characters_with_truncate_false_gets_413_untokenized(loaded, monkeypatch):
    monkeypatch.setattr(loaded.schema, "encode_record", never("tokenizing"))
    request = {**GOOD_REQUEST, "state": "x" * 200_000, "truncate": False}
    refused = refusal(loaded, request)
    assert (refused.status, refused.error_type) == (413, "context_too_long")
    assert refused.message.startswith("maximum context length")


# ---- HTTP: multipart bodies, slow bodies, the OpenAPI document -------------------------------------------------------


def typesafe_multipart(request: dict, images: list[bytes]) -> tuple[str, bytes]:
    """(Content-Type, body) as the TypeSafe clients build an upload: the JSON request in a part named `request`, whose
    `assets` name each image's part, asset-0, asset-1, ..., each part with its own filename and content type."""
    request = {**request, "assets": {f"<image:{index:032x}>": {"type": "image", "part": f"asset-{index}"}
                                     for index in range(len(images))}}
    boundary = "b0a1c2d3e4f5"
    chunks = [f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\nContent-Type: application/json'
              f'\r\n\r\n'.encode() + json.dumps(request).encode() + b"\r\n"]
    for index, image in enumerate(images):
        chunks.append(f'--{boundary}\r\nContent-Disposition: form-data; name="asset-{index}"; filename="asset-{index}"'
                      f'\r\nContent-Type: image/png\r\n\r\n'.encode() + image + b"\r\n")
    return f"multipart/form-data; boundary={boundary}", b"".join(chunks) + f"--{boundary}--\r\n".encode()


def test_multipart_uploads_answer_as_inline_images(base_url):
    images = [png(96, 64), png(64, 96)]
    inline = requests.post(f"{base_url}/v1/systemone", json={**GOOD_REQUEST, "images": [
        data_url("image/png", image) for image in images]}, timeout=TIMEOUT_S)
    assert inline.status_code == 200, inline.text
    content_type, body = typesafe_multipart(GOOD_REQUEST, images)
    for headers, data in [({"Content-Type": content_type}, body),
                          ({"Content-Type": content_type, "Content-Encoding": "zstd"},
                           zstandard.ZstdCompressor().compress(body))]:  # the clients compress bodies over 1 KiB
        response = requests.post(f"{base_url}/v1/systemone", data=data, headers=headers, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        served = response.json()
        assert served["answers"] == inline.json()["answers"]
        assert served["usage"]["input_tokens"] == inline.json()["usage"]["input_tokens"]


@pytest.mark.parametrize("mangle, loc, phrase", [
    (lambda body: body.replace(b'name="asset-1"', b'name="asset-9"'), ["body", "assets"], "does not hold"),
    (lambda body: body.replace(b'name="request"', b'name="json"'), ["body", "request"], "part named 'request'"),
    (lambda body: body.replace(b'"part": "asset-1"', b'"part": "asset-0"'), ["body", "asset-1"],
     "not named by any entry"),
    (lambda body: body.replace(b"Content-Disposition: form-data", b"Content-Disposition form-data"), ["body"],
     "could not be read"),
])
def test_malformed_multipart_gets_422_naming_the_part(base_url, mangle, loc, phrase):
    content_type, body = typesafe_multipart(GOOD_REQUEST, [png(8, 8), png(8, 8)])
    response = requests.post(f"{base_url}/v1/systemone", data=mangle(body), headers={"Content-Type": content_type},
                             timeout=TIMEOUT_S)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"][: len(loc)] == loc and phrase in detail["msg"]


def test_a_half_sent_body_gets_408_and_its_connection_closed(loaded, monkeypatch):
    monkeypatch.setattr(serve_clef, "BODY_READ_TIMEOUT_S", 1)
    args = serve_clef.parse_args([*SERVER_ARGS, "--api-key", ""])
    with serve_in_thread(serve_clef.create_app(args, load=lambda args, progress: loaded)) as url:
        wait_until_ready(url, limit_s=TIMEOUT_S)
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as client:
            client.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 1000\r\n\r\n{\"model\": \"m\"")
            response = b""
            while chunk := client.recv(65536):  # the server answers, then closes: recv returns b"" at the end
                response += chunk
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert b"connection: close" in head.lower()
        assert json.loads(body)["detail"]["error_type"] == "request_timeout"


def test_openapi_describes_the_request_and_docs_work_offline(base_url):
    document = requests.get(f"{base_url}/openapi.json", timeout=TIMEOUT_S).json()
    content = document["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]
    schema = {**content["application/json"]["schema"], "components": document["components"]}  # where its $refs lead
    jsonschema.validate(GOOD_REQUEST, schema)
    for bad in ({"state": "s", "questions": {"q": {"type": "noul"}}}, {**GOOD_REQUEST, "questions": {}},
                {**GOOD_REQUEST, "questions": {"q": {"type": "ranking"}}}, {**GOOD_REQUEST, "truncate": "no"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    multipart_name = content["multipart/form-data"]["schema"]["$ref"].removeprefix("#/components/schemas/")
    assert "request" in document["components"]["schemas"][multipart_name]["properties"]
    page = requests.get(f"{base_url}/docs", timeout=TIMEOUT_S)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/systemone" in page.text and "/openapi.json" in page.text
    assert "<script" not in page.text and "http://" not in page.text and "https://" not in page.text  # nothing fetched


# ---- shutdown --------------------------------------------------------------------------------------------------------


def test_sigterm_exits_0_promptly_with_half_open_connections_and_removes_temporary_files(tmp_path):
    port = free_port()
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, serve_clef.__file__, *SERVER_ARGS, "--api-key", "", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(temporary)},
        )
    clients = []
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=process)
        assert any(temporary.iterdir())  # the synthetic checkpoint lives there while the server runs
        for _ in range(300):  # each declares a body it never finishes sending
            client = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
            client.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100000\r\n\r\n{\"model\": ")
            clients.append(client)
        wait_until_ready(f"http://127.0.0.1:{port}", process=process)  # answered after the 300 were taken in
        process.send_signal(signal.SIGTERM)
        # within the drain and some slack for a slow machine, well before the bodies' own 60 s timeout would end the
        # half-open requests anyway (which a server that did not drain and cancel would wait for)
        assert serve_clef.SHUTDOWN_DRAIN_S + 30 < serve_clef.BODY_READ_TIMEOUT_S
        returncode = process.wait(timeout=serve_clef.SHUTDOWN_DRAIN_S + 30)
    finally:
        for client in clients:
            client.close()
        if process.poll() is None:
            process.kill()
            process.wait()
    assert returncode == 0, log_path.read_text()[-3000:]
    assert list(temporary.iterdir()) == []
