"""serve_clef's decision and HTTP side, against a real uvicorn server serving `--model synthetic`.

Answers are checked against expectations computed here, independently of the server: answer shapes and key order
from docs/api.md §3, probabilities that sum to 1, the choice as the first argmax in request order, the score as
Σ i·p_i of the returned probabilities, and usage.input_tokens as the length `joint_schema_model.encode_record` gives
for the same request. Every refusal of §6 is checked for its status, its phrase and its body shape, and the server is
asked a good question after each one.
"""

import base64
import contextlib
import gc
import gzip
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
import pytest
import requests
import soundfile
import torch
import uvicorn
import zstandard
from PIL import Image, ImageFile

import joint_schema_model
import serve_clef

API_KEY = "test-key"
MAX_LENGTH = 2048  # the shared server's --max-length: small, so that context limits are cheap to reach
TIMEOUT_S = 60
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVER_ARGS = ["--model", "synthetic", "--device", "cpu", "--max-length", str(MAX_LENGTH)]

GOOD_REQUEST = {
    "model": "jev-latest",
    "state": {"order": 1042, "status": "damaged", "notes": ["customer called twice", "refund requested"]},
    "questions": {
        "refund": {"type": "noul", "instructions": "Should the customer be refunded?"},
        "team": {
            "type": "choice",
            "instructions": "Which team handles this?",
            # request order differs from the sorted order the model sees
            "criteria": {"shipping": "damaged parcels", "billing": {"handles": ["refunds"]}, "returns": None},
        },
        "severity": {"type": "score", "instructions": "How severe is it?", "criteria": ["minor", "moderate", "major"]},
    },
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def data_url(content_type: str, data: bytes) -> str:
    return f"data:{content_type};base64,{base64.b64encode(data).decode()}"


def wait_until_ready(base_url: str, limit_s: float = 240.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert process is None or process.poll() is None, "the server exited while loading"
        with contextlib.suppress(requests.ConnectionError):
            if requests.get(f"{base_url}/healthz", timeout=TIMEOUT_S).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{base_url} was not ready within {limit_s} s")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """Base URL of one `serve_clef.py --model synthetic` process (API key required), shared by the whole session."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, serve_clef.__file__, *SERVER_ARGS, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SERVE_CLEF_API_KEY": API_KEY},
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base_url, process=process)
        yield base_url
        assert process.poll() is None, "the server died during the tests:\n" + log_path.read_text()[-4000:]
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@pytest.fixture(scope="session")
def processor(tiny_release):
    """The processor of the synthetic release (`--model synthetic` is the tiny release with seed 0, quantized)."""
    return joint_schema_model.load_processor(tiny_release)


def post(base_url: str, body, headers: dict | None = None) -> requests.Response:
    headers = {**AUTH, **(headers or {})}
    if isinstance(body, dict):
        return requests.post(f"{base_url}/v1/systemone", json=body, headers=headers, timeout=TIMEOUT_S)
    return requests.post(f"{base_url}/v1/systemone", data=body, headers=headers, timeout=TIMEOUT_S)  # raw bytes


def check_answers(request: dict, response: dict, processor, max_length: int = MAX_LENGTH) -> None:
    """The response of docs/api.md §3 for `request`, recomputed from the returned probabilities."""
    assert list(response) == ["model", "answers", "usage"]
    assert response["model"] == request["model"]
    assert list(response["answers"]) == list(request["questions"])
    for question_id, question in request["questions"].items():
        answer = response["answers"][question_id]
        assert answer["type"] == question["type"]
        if question["type"] == "noul":
            assert list(answer) == ["type", "noul"]
            assert 0.0 <= answer["noul"] <= 1.0
            continue
        probabilities = answer["probabilities"]
        assert abs(sum(probabilities.values()) - 1.0) <= 0.01
        assert all(0.0 <= p <= 1.0 for p in probabilities.values())
        assert answer["confidence"] == max(probabilities.values())  # the reference's confidence: max p
        if question["type"] == "choice":
            assert list(answer) == ["type", "choice", "confidence", "probabilities"]
            assert list(probabilities) == list(question["criteria"])  # request order, not the sorted order
            first_argmax = next(key for key, p in probabilities.items() if p == max(probabilities.values()))
            assert answer["choice"] == first_argmax
        else:
            levels = [str(level) for level in range(len(question["criteria"]))]
            assert list(answer) == ["type", "score", "confidence", "legend", "probabilities"]
            assert list(probabilities) == levels
            # the SystemOne clients refuse null legend values: a level without a description is named by its index
            assert answer["legend"] == {level: level if text is None else text
                                        for level, text in zip(levels, question["criteria"])}
            expected_score = sum(level * probabilities[str(level)] for level in range(len(levels)))
            # each returned p is off by at most 5e-5 (rounding), so Σ i·p by at most 5e-5·Σ i, plus its own rounding
            assert abs(answer["score"] - expected_score) <= 5e-5 * (sum(range(len(levels))) + 1)
    encoded = joint_schema_model.encode_record(processor.tokenizer, request, max_length, processor=processor)
    assert response["usage"]["input_tokens"] == len(encoded.input_ids)
    assert response["usage"]["output_tokens"] == 0


def batch_records_count(server: str) -> float:
    """How many forwards the server has run so far, from its /metrics."""
    metrics = requests.get(f"{server}/metrics", timeout=10).text
    return float(re.search(r"^serve_clef_batch_records_count (\S+)$", metrics, re.MULTILINE)[1])


def answers_of(response: requests.Response) -> dict:
    assert response.status_code == 200, response.text
    body = response.json()
    del body["usage"]["latency_ms"]
    return body


# ---- answers ---------------------------------------------------------------------------------------------------------


def test_text_request_answers(server, processor):
    response = post(server, GOOD_REQUEST)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    check_answers(GOOD_REQUEST, response.json(), processor)


def test_any_model_name_and_unicode_ids_are_echoed(server, processor):
    request = {
        "model": "clef-omni",
        "state": "Le colis est arrivé cassé 📦",
        "questions": {"é q.1 📦": {"type": "choice", "criteria": {"oui": "yes", "non": "no"}}},
        "id": "record-7",
        "an_unknown_field": {"ignored": True},
    }
    response = post(server, request)
    assert response.status_code == 200, response.text
    check_answers(request, response.json(), processor)


def test_long_state_is_truncated_to_the_context(server, processor):
    # 39,000 characters: cut by tokens, not by characters (serve_clef.cap_state_text), so the cut is counted exactly
    request = {**GOOD_REQUEST, "state": "the parcel was late again " * 1500}
    response = post(server, request)
    assert response.status_code == 200, response.text
    check_answers(request, response.json(), processor)
    assert response.json()["usage"]["input_tokens"] == MAX_LENGTH
    # what was cut is said, counted against the record encoded without a limit
    uncut = len(joint_schema_model.encode_record(processor.tokenizer, request, 10**9).input_ids)
    assert response.json()["usage"]["state_tokens_dropped"] == uncut - MAX_LENGTH > 0
    assert response.headers["X-State-Tokens-Dropped"] == str(uncut - MAX_LENGTH)
    whole = post(server, GOOD_REQUEST)
    assert "state_tokens_dropped" not in whole.json()["usage"] and "X-State-Tokens-Dropped" not in whole.headers


def test_image_request(server, processor, png_bytes):
    as_object = {"content_type": "image/png", "base64": base64.b64encode(png_bytes).decode()}
    request = {**GOOD_REQUEST, "images": [data_url("image/png", png_bytes), as_object]}
    response = post(server, request)
    assert response.status_code == 200, response.text
    check_answers(request, response.json(), processor)
    text_only_tokens = post(server, GOOD_REQUEST).json()["usage"]["input_tokens"]
    assert response.json()["usage"]["input_tokens"] >= text_only_tokens + 2 * 64  # each image costs 64+ tokens


def test_audio_request(server, processor, wav_bytes):
    request = {**GOOD_REQUEST, "audio": [data_url("audio/wav", wav_bytes)]}
    response = post(server, request)
    assert response.status_code == 200, response.text
    check_answers(request, response.json(), processor)


@pytest.mark.parametrize("video", ["mp4_with_audio_bytes", "mp4_silent_bytes"])
def test_video_request(server, processor, video, request):
    body = {**GOOD_REQUEST, "videos": [data_url("video/mp4", request.getfixturevalue(video))]}
    response = post(server, body)
    assert response.status_code == 200, response.text
    check_answers(body, response.json(), processor)


def test_concurrent_requests_answer_as_sequential_ones(server):
    """Concurrent requests share forwards (the scheduler batches them): each answer equals its answer alone to within
    BF16 noise (tests/test_engine.py measures it), and every request is answered."""
    bodies = [{**GOOD_REQUEST, "state": f"ticket {index}: the parcel arrived {index} days late"} for index in range(8)]
    sequential = [answers_of(post(server, body)) for body in bodies]
    batches_before = batch_records_count(server)
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(lambda body: answers_of(post(server, body)), bodies))
    assert batch_records_count(server) - batches_before < len(bodies)  # some forwards held several records
    for alone, together in zip(sequential, concurrent):
        assert together["usage"] == alone["usage"]
        assert together["answers"].keys() == alone["answers"].keys()
        for question_id, answer in alone["answers"].items():
            other = together["answers"][question_id]
            values = answer.get("probabilities", {"noul": answer.get("noul")})
            other_values = other.get("probabilities", {"noul": other.get("noul")})
            assert values.keys() == other_values.keys()
            assert max(abs(values[key] - other_values[key]) for key in values) <= 0.01
    assert len({json.dumps(answer["answers"]) for answer in sequential}) > 1  # the states do reach the model


# ---- refusals --------------------------------------------------------------------------------------------------------


def with_question(question: dict) -> dict:
    return {**GOOD_REQUEST, "questions": {"q1": question}}


def media(field_name: str, item) -> dict:
    return {**GOOD_REQUEST, field_name: [item]}


TINY_PNG_B64 = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 32).decode()  # a PNG signature, then garbage
UNPROCESSABLE = [
    # (request, phrase the message must contain, param)
    ({"state": "s", "questions": {"q": {"type": "noul"}}}, "model is required", "model"),
    ({**GOOD_REQUEST, "model": 7}, "model must be a non-empty string", "model"),
    ({**GOOD_REQUEST, "model": ""}, "model must be a non-empty string, not an empty string", "model"),
    ({**GOOD_REQUEST, "state": None}, "state must be", "state"),
    ({**GOOD_REQUEST, "state": 3.5}, "state must be", "state"),
    ({**GOOD_REQUEST, "state": True}, "state must be", "state"),
    ({"model": "m", "state": "s"}, "questions is required", "questions"),
    ({**GOOD_REQUEST, "questions": {}}, "1 to 64", "questions"),
    ({**GOOD_REQUEST, "questions": [{"type": "noul"}]}, "questions must be an object", "questions"),
    ({**GOOD_REQUEST, "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}, "1 to 64", "questions"),
    (with_question({"type": "ranking", "criteria": ["a", "b"]}), "type must be noul, choice, or score",
     "questions.q1.type"),
    (with_question("noul"), "a question must be an object", "questions.q1"),
    (with_question({"type": "noul", "instructions": 5}), "instructions must be", "questions.q1.instructions"),
    (with_question({"type": "noul", "criteria": ["yes"]}), "noul criteria must be an object", "questions.q1.criteria"),
    (with_question({"type": "choice"}), "a choice needs at least two options", "questions.q1.criteria"),
    (with_question({"type": "choice", "criteria": {}}), "a choice needs at least two options", "questions.q1.criteria"),
    (with_question({"type": "choice", "criteria": {"a": "x"}}), "a choice needs at least two options",
     "questions.q1.criteria"),
    (with_question({"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}), "options per choice",
     "questions.q1.criteria"),
    (with_question({"type": "choice", "criteria": ["a", "b"]}), "choice criteria must be an object",
     "questions.q1.criteria"),
    (with_question({"type": "choice", "criteria": {"a": 1, "b": "x"}}), "description of option a",
     "questions.q1.criteria.a"),
    (with_question({"type": "score", "criteria": []}), "a score takes 2 to 10 levels", "questions.q1.criteria"),
    (with_question({"type": "score", "criteria": ["only"]}), "a score takes 2 to 10 levels", "questions.q1.criteria"),
    (with_question({"type": "score", "criteria": [str(i) for i in range(11)]}), "a score takes 2 to 10 levels",
     "questions.q1.criteria"),
    (with_question({"type": "score", "criteria": {"low": "l", "high": "h"}}), "score criteria must be an array",
     "questions.q1.criteria"),
    ({**GOOD_REQUEST, "truncate": "no"}, "truncate must be true or false", "truncate"),
    ({**GOOD_REQUEST, "media_kwargs": {"size": {"longest_edge": 10**9}}}, "media_kwargs is not accepted",
     "media_kwargs"),
    ({**GOOD_REQUEST, "images": "data:image/png;base64,AAAA"}, "images must be an array", "images"),
    ({**GOOD_REQUEST, "images": [f"data:image/png;base64,{TINY_PNG_B64}"] * 5}, "at most 4", "images"),
    (media("images", "https://example.com/cat.png"), "remote URL", "images.0"),
    (media("videos", "http://127.0.0.1:1/clip.mp4"), "remote URL", "videos.0"),
    (media("images", "/etc/hostname"), "file path", "images.0"),
    (media("audio", "clip.wav"), "file path", "audio.0"),
    (media("images", 42), "must be a data URL or a {content_type, base64} object", "images.0"),
    (media("images", {"content_type": "image/png"}), "content_type and base64", "images.0"),
    (media("images", "data:image/gif;base64,R0lGODlhAQABAAAAACw="), "content type 'image/gif'", "images.0"),
    (media("images", "data:image/png;base64,@@not base64@@"), "not valid base64", "images.0"),
    (media("images", {"content_type": "image/png", "base64": "abc"}), "not valid base64", "images.0"),
    (media("images", f"data:image/png;base64,{TINY_PNG_B64}"), "could not be decoded", "images.0"),
    (media("audio", data_url("audio/wav", b"RIFF\x10\x00\x00\x00WAVEjunkjunk")), "could not be decoded", "audio.0"),
    (media("videos", data_url("video/mp4", b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64)), "could not be decoded",
     "videos.0"),
]


def check_error_body(response: requests.Response, status: int, phrase: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    if status == 422:
        assert list(body) == ["detail", "error"]
        assert all(list(item) == ["loc", "msg", "type"] for item in body["detail"])
        assert phrase in body["detail"][0]["msg"]
        assert body["error"]["type"] == "invalid_request_error"
    else:
        assert list(body["detail"]) == ["error_type", "message"]
        assert phrase in body["detail"]["message"]
    assert phrase in body["error"]["message"]
    return body


@pytest.mark.parametrize("request_body, phrase, param", UNPROCESSABLE)
def test_unprocessable_requests_get_422_naming_the_field(server, request_body, phrase, param):
    body = check_error_body(post(server, request_body), 422, phrase)
    assert body["error"]["param"] == param
    assert body["detail"][0]["loc"] == ["body", *(int(part) if part.isdigit() else part for part in param.split("."))]
    assert post(server, GOOD_REQUEST).status_code == 200


def test_image_over_16_megapixels_is_refused_before_decoding(server, monkeypatch):
    buffer = io.BytesIO()
    Image.new("L", (5000, 4000)).save(buffer, format="PNG")  # 20 MP, a few KB compressed
    body = media("images", data_url("image/png", buffer.getvalue()))

    def decode_pixels(image):
        raise AssertionError("the 20 MP image's pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", decode_pixels)  # the server runs in this process (a thread)
    response = post(server, body)
    body = check_error_body(response, 422, "16 megapixels")
    assert body["error"]["param"] == "images.0"


@pytest.fixture(scope="session")
def long_wav_bytes() -> bytes:
    """301 s of silence as 8 kHz 8-bit WAV: 2.4 MB, under every size limit, over the 300 s limit."""
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(301 * 8000, dtype=np.float32), 8000, format="WAV", subtype="PCM_U8")
    return buffer.getvalue()


@pytest.fixture(scope="session")
def long_mp4_bytes() -> bytes:
    """62 s of 16x16 mpeg4 video at 1 fps: a few KB, over the 60 s limit."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=1)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        for second in range(62):
            pixels = np.full((16, 16, 3), second * 4, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def test_media_limits_measured_on_the_decoded_media(server, png_bytes, wav_bytes, mp4_silent_bytes, long_wav_bytes,
                                                    long_mp4_bytes):
    gif = io.BytesIO()
    Image.new("RGB", (8, 8)).save(gif, format="GIF")
    megabytes = b"\x00" * (3 * 1024 * 1024)
    refusals = [
        (media("images", data_url("image/png", gif.getvalue())), "images must be PNG, JPEG or WebP", "images.0"),
        (media("audio", data_url("audio/wav", mp4_silent_bytes)), "audio must be WAV or MP3", "audio.0"),
        (media("videos", data_url("video/mp4", wav_bytes)), "videos must be MP4 or WebM", "videos.0"),
        (media("images", data_url("image/png", png_bytes + b"\x00" * (4 * 1024 * 1024))), "at most 4 MiB", "images.0"),
        ({**GOOD_REQUEST, "images": [data_url("image/png", megabytes)] * 3}, "at most 8 MiB per request", "images"),
        (media("audio", data_url("audio/wav", long_wav_bytes)), "at most 300 s", "audio.0"),
        (media("videos", data_url("video/mp4", long_mp4_bytes)), "at most 60 s", "videos.0"),
    ]
    for request, phrase, param in refusals:
        body = check_error_body(post(server, request), 422, phrase)
        assert body["error"]["param"] == param
    assert post(server, GOOD_REQUEST).status_code == 200


@pytest.mark.parametrize(
    "body, phrase, loc",
    [
        (b'{"model": "m", "state": ', "not valid JSON", ["body", 24]),
        (b"\xff\xfe not utf-8", "not valid JSON", ["body", 0]),
        (b"[" * 100_000, "not valid JSON", ["body"]),
    ],
)
def test_bodies_that_do_not_parse_get_422_json_invalid(server, body, phrase, loc):
    response_body = check_error_body(post(server, body, {"Content-Type": "application/json"}), 422, phrase)
    assert response_body["detail"][0]["type"] == "json_invalid" and response_body["detail"][0]["loc"] == loc
    assert post(server, GOOD_REQUEST).status_code == 200


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
], ids=["no-request-line", "content-length-not-a-number"])
def test_bytes_that_are_not_http_get_a_json_400(server, request_bytes):
    """What uvicorn cannot parse as HTTP/1.1 is answered before the application sees it: in JSON, in the error shape,
    like every other error (the contract), not uvicorn's plain text."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as client:
        client.sendall(request_bytes)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
    assert status_line.startswith("HTTP/1.1 400") and headers["content-type"] == "application/json"
    payload = json.loads(body)
    assert payload["detail"]["error_type"] == "invalid_http" and payload["error"]["type"] == "invalid_request_error"
    assert payload["detail"]["message"].startswith("the request is not valid HTTP/1.1")
    assert post(server, GOOD_REQUEST).status_code == 200


@pytest.mark.parametrize("body", [b'["model", "state"]', b'"just a string"'])
def test_bodies_that_are_not_json_objects_get_422(server, body):
    check_error_body(post(server, body, {"Content-Type": "application/json"}), 422, "must be a JSON object")
    assert post(server, GOOD_REQUEST).status_code == 200


@pytest.mark.parametrize(
    "body, field",
    [
        (b'{"model": "m", "state": {"amount": 1e999}, "questions": {"ok": {"type": "noul"}}}', "state.amount"),
        (b'{"model": "m", "state": "a \\ud800 b", "questions": {"ok": {"type": "noul"}}}', "state"),
        (b'{"model": "\\udfff", "state": "s", "questions": {"ok": {"type": "noul"}}}', "model"),
        (b'{"model": "m", "state": "s", "questions": {"q\\ud800": {"type": "noul"}}}', "questions.q\\ud800"),
        (b'{"model": "m", "state": "s", "questions": {"ok": {"type": "score", "criteria": ["a", -1e400]}}}',
         "questions.ok.criteria.1"),
        (b'{"model": "m", "state": {"n": NaN}, "questions": {"ok": {"type": "noul"}}}', "state.n"),
        (b'{"model": "m", "state": Infinity, "questions": {"ok": {"type": "noul"}}}', "state"),
        (b'{"model": "m", "state": "s", "questions": {"ok": {"type": "score", "criteria": [-Infinity, "b"]}}}',
         "questions.ok.criteria.0"),
        # integers past a 64-bit float's range (1.8e308) overflow as 1e999 does, whatever Python's int could hold
        (b'{"model": "m", "state": {"id": ' + b"9" * 400 + b'}, "questions": {"ok": {"type": "noul"}}}', "state.id"),
        (b'{"model": "m", "state": [1, -' + b"7" * 5000 + b'], "questions": {"ok": {"type": "noul"}}}', "state.1"),
        (b'{"model": "m", "state": {"n": ' + str(int(sys.float_info.max) + 1).encode() + b'}, "questions": {"ok": '
         b'{"type": "noul"}}}', "state.n"),
    ],
)
def test_non_finite_numbers_and_lone_surrogates_get_400_naming_the_field(server, body, field):
    response = post(server, body, {"Content-Type": "application/json"})
    response_body = check_error_body(response, 400, "")
    assert response_body["detail"]["error_type"] == "invalid_json"
    assert response_body["detail"]["message"].startswith(field + ": ")
    assert post(server, GOOD_REQUEST).status_code == 200


def test_the_largest_integer_a_float_holds_is_answered(server):
    body = (b'{"model": "m", "state": {"n": ' + str(int(sys.float_info.max)).encode() + b'}, "questions": {"ok": '
            b'{"type": "noul"}}}')
    assert post(server, body, {"Content-Type": "application/json"}).status_code == 200


def test_a_body_nested_as_deep_as_json_allows_is_answered_not_crashed(server):
    deep = "[" * 900 + "]" * 900
    body = f'{{"model": "m", "state": {{"x": {deep}}}, "questions": {{"ok": {{"type": "noul"}}}}}}'.encode()
    assert post(server, body, {"Content-Type": "application/json"}).status_code == 200
    check_error_body(post(server, deep.encode(), {"Content-Type": "application/json"}), 422, "must be a JSON object")


def test_the_value_check_adds_no_recursion_to_what_the_parser_accepted():
    """The parser and the check share Python's recursion limit: a check that recursed per nesting level would fail,
    with a 500, on bodies the parser had just accepted a few frames higher up the stack."""
    depth = 990
    while True:  # the deepest nesting the parser accepts from here
        try:
            value = json.loads("[" * depth + "]" * depth)
            break
        except RecursionError:
            depth -= 10

    def with_frames_above(frames: int):
        if frames:
            return with_frames_above(frames - 1)
        serve_clef.refuse_unrepresentable_values(value, ("body",))

    with_frames_above(50)  # raises RecursionError if the check recursed


def test_paired_surrogates_and_null_levels_are_answered(server, processor):
    request = {**GOOD_REQUEST, "state": "a smile \U0001F600 in the ticket",
               "questions": {"mood": {"type": "score", "criteria": ["sad", None, "happy"]}}}
    body = json.dumps(request).encode()  # ensure_ascii: the emoji travels as a surrogate pair escape
    assert b"\\ud83d\\ude00" in body
    response = post(server, body, {"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["answers"]["mood"]["legend"] == {"0": "sad", "1": "1", "2": "happy"}
    check_answers(request, response.json(), processor)


def compressed(data: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.compress(data)
    if encoding == "deflate":
        return zlib.compress(data)
    if encoding == "raw deflate":
        compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return compressor.compress(data) + compressor.flush()
    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw deflate", "zstd"])
def test_compressed_bodies_are_answered_as_plain_ones(server, encoding):
    plain = answers_of(post(server, GOOD_REQUEST))
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding.split()[-1]}
    response = post(server, compressed(json.dumps(GOOD_REQUEST).encode(), encoding), headers)
    assert response.status_code == 200, response.text
    assert answers_of(response) == plain


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_body_that_decompresses_past_the_limit_gets_413(server, encoding):
    bomb = compressed(b'{"state": "' + b" " * (20 * 1024 * 1024) + b'"}', encoding)
    assert len(bomb) < 1024 * 1024  # small on the wire
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    check_error_body(post(server, bomb, headers), 413, "decompresses to over 13 MiB")
    assert post(server, GOOD_REQUEST).status_code == 200


def test_unknown_or_corrupt_encodings_are_refused(server):
    body = json.dumps(GOOD_REQUEST).encode()
    check_error_body(post(server, body, {"Content-Type": "application/json", "Content-Encoding": "br"}), 415,
                     "Content-Encoding 'br' is not accepted")
    check_error_body(post(server, b"not gzip at all", {"Content-Type": "application/json", "Content-Encoding": "gzip"}),
                     400, "not valid gzip data")
    check_error_body(post(server, b"not zstd at all", {"Content-Type": "application/json", "Content-Encoding": "zstd"}),
                     400, "not valid zstd data")


def test_non_json_content_type_gets_415(server):
    response = post(server, json.dumps(GOOD_REQUEST), {"Content-Type": "text/plain"})
    check_error_body(response, 415, "application/json")


def test_body_over_13_mib_gets_413_before_parsing(server):
    oversized = b'{"model": "m", "state": "' + b"a" * (13 * 1024 * 1024) + b'", "questions": {}}'
    check_error_body(post(server, oversized), 413, "13 MiB")

    def chunks():  # no Content-Length: the server has to count the streamed bytes
        for start in range(0, len(oversized), 1 << 20):
            yield oversized[start : start + (1 << 20)]

    check_error_body(post(server, chunks(), {"Content-Type": "application/json"}), 413, "13 MiB")
    assert post(server, GOOD_REQUEST).status_code == 200


def test_state_that_does_not_fit_with_truncate_false_gets_413(server):
    request = {**GOOD_REQUEST, "state": "the parcel was late again " * 2000, "truncate": False}
    check_error_body(post(server, request), 413, "maximum context length")
    assert post(server, {**request, "state": "short"}).status_code == 200


def test_schema_that_does_not_fit_gets_413_whatever_truncate_says(server):
    long_options = {f"option {i}": "a long description of this option " * 20 for i in range(40)}
    request = {**GOOD_REQUEST, "questions": {"q1": {"type": "choice", "criteria": long_options}}}
    for truncate in (True, False):
        body = check_error_body(post(server, {**request, "truncate": truncate}), 413, "maximum context length")
        assert body["detail"]["error_type"] == "context_too_long"
    assert post(server, GOOD_REQUEST).status_code == 200


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = requests.post(f"{server}/v1/systemone", json=GOOD_REQUEST, headers=headers, timeout=TIMEOUT_S)
        body = check_error_body(response, 401, "API key")
        assert body["detail"]["error_type"] == body["error"]["type"] == "authentication_error"
        assert response.headers["WWW-Authenticate"] == "Bearer"
    assert requests.get(f"{server}/v1/models", timeout=TIMEOUT_S).status_code == 401
    assert requests.get(f"{server}/healthz", timeout=TIMEOUT_S).status_code == 200  # probes need no key


def test_unknown_paths_and_methods_use_the_error_shape(server):
    check_error_body(requests.get(f"{server}/v2/nothing", headers=AUTH, timeout=TIMEOUT_S), 404, "Not Found")
    response = requests.get(f"{server}/v1/systemone", headers=AUTH, timeout=TIMEOUT_S)
    check_error_body(response, 405, "Method Not Allowed")
    assert response.headers["Allow"] == "POST"


def test_a_fault_of_the_server_gets_a_500_with_an_id_not_its_internals(args, loaded, monkeypatch, capfd):
    with serve_in_thread(serve_clef.create_app(args, load=lambda args, progress: loaded)) as base_url:
        wait_until_ready(base_url, limit_s=TIMEOUT_S)

        def broken_forward(batch):
            raise RuntimeError("secret internal state 0xdeadbeef")

        monkeypatch.setattr(loaded.model, "_forward_unpadded", broken_forward)
        response = requests.post(f"{base_url}/v1/systemone", json=GOOD_REQUEST, timeout=TIMEOUT_S)
        body = check_error_body(response, 500, "internal error")
        monkeypatch.undo()
        request_id = response.headers["X-Request-Id"]
        assert "0xdeadbeef" not in response.text and request_id in body["error"]["message"]
        assert response.headers["Connection"] == "close"
        assert requests.post(f"{base_url}/v1/systemone", json=GOOD_REQUEST, timeout=TIMEOUT_S).status_code == 200
    logged = capfd.readouterr().err
    assert f"request {request_id}: internal error" in logged and "0xdeadbeef" in logged


# ---- models and health -----------------------------------------------------------------------------------------------


def test_models_lists_clef_omni_and_the_checkpoint(server):
    body = requests.get(f"{server}/v1/models", headers=AUTH, timeout=TIMEOUT_S).json()
    assert body["object"] == "list"
    assert [entry["id"] for entry in body["data"]] == ["clef-omni", "synthetic"]
    assert all(entry["object"] == "model" and entry["owned_by"] == "cloudflare" for entry in body["data"])
    assert body["models"][0]["name"] == "clef-omni" and body["models"][0]["release_date"] == "2026-10-09"


def test_health_when_ready(server):
    for path in ("/health", "/healthz"):
        body = requests.get(f"{server}{path}", timeout=TIMEOUT_S).json()
        assert body["ready"] is True
        assert body["model_id"] == "synthetic"
        assert body["kind"] == "modelopt:NVFP4"
        assert body["load_s"] > 0
    assert requests.get(f"{server}/livez", timeout=TIMEOUT_S).status_code == 200


# ---- in-process servers: loading, load failure, out of memory --------------------------------------------------------


@contextlib.contextmanager
def serve_in_thread(app):
    """A real uvicorn server for `app` on a free loopback port, in a thread of this process."""
    port = free_port()
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                   http=serve_clef.JsonErrorsH11Protocol))  # as main serves
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=30)
        gc.unfreeze()  # the server froze what this process had made by its load: let the tests after it collect it


@pytest.fixture(scope="session")
def args():
    """Command-line arguments of an in-process server without an API key."""
    parsed = serve_clef.parse_args([*SERVER_ARGS, "--api-key", ""])
    assert not parsed.api_key
    return parsed


@pytest.fixture(scope="session")
def loaded(args):
    return serve_clef.load_from_args(args, progress=lambda line: None)


def test_503_while_loading_then_ready(args, loaded, processor):
    release_load = threading.Event()

    def held_back_load(args, progress):
        assert release_load.wait(TIMEOUT_S)
        return loaded

    with serve_in_thread(serve_clef.create_app(args, load=held_back_load)) as base_url:
        for path in ("/health", "/healthz"):
            response = requests.get(f"{base_url}{path}", timeout=TIMEOUT_S)
            body = check_error_body(response, 503, "model loading")
            assert body["ready"] is False
            assert int(response.headers["Retry-After"]) > 0
        response = requests.post(f"{base_url}/v1/systemone", json=GOOD_REQUEST, timeout=TIMEOUT_S)
        check_error_body(response, 503, "model loading")
        assert int(response.headers["Retry-After"]) > 0
        assert requests.get(f"{base_url}/livez", timeout=TIMEOUT_S).status_code == 200
        assert requests.get(f"{base_url}/v1/models", timeout=TIMEOUT_S).status_code == 200

        release_load.set()
        wait_until_ready(base_url, limit_s=TIMEOUT_S)
        response = requests.post(f"{base_url}/v1/systemone", json=GOOD_REQUEST, timeout=TIMEOUT_S)  # no key needed
        assert response.status_code == 200, response.text
        check_answers(GOOD_REQUEST, response.json(), processor)


def test_what_the_load_made_is_frozen_out_of_garbage_collection(args, loaded):
    # once loaded, the model's objects must not be walked by the full collections that come while serving
    made = []

    def load(args, progress):
        made.append([loaded])  # a container made by the load, which the collector tracks
        return loaded

    with serve_in_thread(serve_clef.create_app(args, load=load)) as base_url:
        wait_until_ready(base_url, limit_s=TIMEOUT_S)
        assert gc.get_freeze_count() > 0
        assert not any(tracked is made[0] for tracked in gc.get_objects())
        assert requests.post(f"{base_url}/v1/systemone", json=GOOD_REQUEST, timeout=TIMEOUT_S).status_code == 200
    assert any(tracked is made[0] for tracked in gc.get_objects())  # serve_in_thread unfroze them again


def test_http_answers_equal_systemone_called_directly(args, loaded, server):
    direct = loaded.schema.systemone(loaded.model, loaded.processor, GOOD_REQUEST, MAX_LENGTH)
    served = answers_of(post(server, GOOD_REQUEST))
    assert served["usage"] == direct["usage"]
    for question_id, answer in direct["answers"].items():
        for key, value in answer.items():
            if isinstance(value, float):  # another process: allow one step of the 4-decimal rounding
                assert served["answers"][question_id][key] == pytest.approx(value, abs=1e-4)
            elif key == "probabilities":
                assert served["answers"][question_id][key] == pytest.approx(value, abs=1e-4)
            else:
                assert served["answers"][question_id][key] == value


def test_load_failure_is_reported_by_health(args):
    def failing_load(args, progress):
        raise serve_clef.CheckpointError("no checkpoint at /nowhere: pass a local directory with --model")

    with serve_in_thread(serve_clef.create_app(args, load=failing_load)) as base_url:
        deadline = time.monotonic() + TIMEOUT_S
        response = requests.get(f"{base_url}/healthz", timeout=TIMEOUT_S)
        while response.json()["detail"]["error_type"] == "model_loading":  # until the loading thread has failed
            assert time.monotonic() < deadline
            time.sleep(0.05)
            response = requests.get(f"{base_url}/healthz", timeout=TIMEOUT_S)
        body = check_error_body(response, 503, "no checkpoint at /nowhere")
        assert body["ready"] is False
        check_error_body(requests.post(f"{base_url}/v1/systemone", json=GOOD_REQUEST, timeout=TIMEOUT_S), 503,
                         "no checkpoint at /nowhere")


def test_out_of_memory_while_scoring_gets_413_and_the_server_keeps_serving(args, loaded, monkeypatch):
    with serve_in_thread(serve_clef.create_app(args, load=lambda args, progress: loaded)) as base_url:
        wait_until_ready(base_url, limit_s=TIMEOUT_S)

        def failing_forward(batch):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

        monkeypatch.setattr(loaded.model, "_forward_unpadded", failing_forward)
        check_error_body(requests.post(f"{base_url}/v1/systemone", json=GOOD_REQUEST, timeout=TIMEOUT_S), 413,
                         "too many tokens")
        monkeypatch.undo()
        assert requests.post(f"{base_url}/v1/systemone", json=GOOD_REQUEST, timeout=TIMEOUT_S).status_code == 200


def test_fastapi_validation_errors_use_the_422_shape(args, loaded):
    app = serve_clef.create_app(args, load=lambda args, progress: loaded)

    @app.get("/typed/{number}")
    async def typed(number: int) -> dict:  # a route with a typed parameter, so that FastAPI itself validates
        return {"number": number}

    with serve_in_thread(app) as base_url:
        response = requests.get(f"{base_url}/typed/seven", timeout=TIMEOUT_S)
        body = check_error_body(response, 422, "integer")
        assert body["detail"][0]["loc"] == ["path", "number"]


# ---- command line ----------------------------------------------------------------------------------------------------


def run_cli(*cli_args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, serve_clef.__file__, *cli_args], capture_output=True, text=True,
                          timeout=600)


def test_demo_prints_one_answer_of_each_type(loaded, processor):
    completed = run_cli("--model", "synthetic", "--device", "cpu", "--demo")
    assert completed.returncode == 0, completed.stderr
    response = json.loads(completed.stdout)
    check_answers(serve_clef.DEMO_REQUEST, response, processor, joint_schema_model.DEFAULT_MAX_LENGTH)
    assert sorted(answer["type"] for answer in response["answers"].values()) == ["choice", "noul", "score"]
    assert loaded.notice and loaded.notice in completed.stderr  # the synthetic checkpoint says it is meaningless
    shown = completed.stderr.split("the built-in request:\n", 1)[1]
    assert json.loads(shown[: shown.index("\n}\n") + 2]) == serve_clef.DEMO_REQUEST  # the question it answered


def test_request_file_is_answered(tmp_path, processor, server):
    request_path = tmp_path / "request.json"
    request_path.write_text(json.dumps(GOOD_REQUEST))
    completed = run_cli(*SERVER_ARGS, "--request", str(request_path))
    assert completed.returncode == 0, completed.stderr
    response = json.loads(completed.stdout)
    check_answers(GOOD_REQUEST, response, processor)
    served = answers_of(post(server, GOOD_REQUEST))
    assert response["usage"]["input_tokens"] == served["usage"]["input_tokens"]
    for question_id, answer in served["answers"].items():
        assert response["answers"][question_id]["type"] == answer["type"]
        for key in ("noul", "choice", "score"):
            if key in answer:
                assert response["answers"][question_id][key] == pytest.approx(answer[key], abs=1e-4)


@pytest.mark.parametrize(
    "content, phrase",
    [
        (json.dumps(with_question({"type": "choice", "criteria": {"only": "x"}})), "at least two options"),
        ("{not json", "cannot read the request file"),
        ('{"model": "m", "state": {"n": NaN}, "questions": {"q": {"type": "noul"}}}', "HTTP 400: state.n: NaN"),
        ('{"model": "m", "state": "a \\ud800 b", "questions": {"q": {"type": "noul"}}}', "state: text with a lone"),
        ('{"model": "m", "state": {"n": ' + "9" * 5000 + '}, "questions": {"q": {"type": "noul"}}}',
         "HTTP 400: state.n: Infinity, or a number too large"),
    ],
)
def test_bad_request_file_exits_2_with_one_line(tmp_path, content, phrase):
    request_path = tmp_path / "request.json"
    request_path.write_text(content)
    completed = run_cli("--model", "synthetic", "--device", "cpu", "--request", str(request_path))
    assert completed.returncode == 2
    assert phrase in completed.stderr.strip().splitlines()[-1]
    assert "Traceback" not in completed.stderr
    assert completed.stdout == ""


def test_bad_checkpoint_exits_2_without_traceback(tmp_path):
    completed = run_cli("--model", str(tmp_path / "missing-checkpoint"), "--device", "cpu", "--demo")
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    assert "missing-checkpoint" in completed.stderr.strip().splitlines()[-1]


# ---- observability ---------------------------------------------------------------------------------------------------


def metric_value(metrics_text: str, name: str) -> float:
    """The value of one sample line `name value` (name with its labels) of a Prometheus text page."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not on the metrics page")


def test_every_decision_is_timed_counted_and_logged(args, loaded, processor, capfd):
    bad_request = {**GOOD_REQUEST, "questions": {"x": {"type": "maybe"}}}
    with serve_in_thread(serve_clef.create_app(args, load=lambda args, progress: loaded)) as base_url:
        wait_until_ready(base_url, limit_s=TIMEOUT_S)
        answered = [requests.post(f"{base_url}/v1/systemone", json=GOOD_REQUEST, timeout=TIMEOUT_S) for _ in range(2)]
        refused = requests.post(f"{base_url}/v1/systemone", json=bad_request, timeout=TIMEOUT_S)
        metrics = requests.get(f"{base_url}/metrics", timeout=TIMEOUT_S)
    assert [response.status_code for response in answered] == [200, 200] and refused.status_code == 422
    for response in answered:
        stages = dict(part.split(";dur=") for part in response.headers["Server-Timing"].split(", "))
        assert list(stages) == ["queue", "decode", "encode", "forward", "answer"]
        assert all(float(ms) >= 0 for ms in stages.values())
        # the stages are parts of the decision, whose own latency the body reports
        assert sum(float(stages[stage]) for stage in ("decode", "encode", "forward", "answer")) <= (
            response.json()["usage"]["latency_ms"] + 0.5
        )
    request_ids = {response.headers["X-Request-Id"] for response in (*answered, refused)}
    assert len(request_ids) == 3
    tokens = len(joint_schema_model.encode_record(processor.tokenizer, GOOD_REQUEST, MAX_LENGTH).input_ids)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    page = metrics.text
    assert metric_value(page, 'serve_clef_requests_total{status="200"}') == 2
    assert metric_value(page, 'serve_clef_requests_total{status="422"}') == 1
    assert metric_value(page, "serve_clef_request_seconds_count") == 3
    assert metric_value(page, "serve_clef_tokens_total") == 2 * tokens
    assert metric_value(page, "serve_clef_batch_records_count") == 2
    assert metric_value(page, "serve_clef_queue_depth") == 0
    logged = capfd.readouterr().err
    for response in (*answered, refused):
        status, request_id = response.status_code, response.headers["X-Request-Id"]
        expected_tokens = tokens if status == 200 else 0
        assert f"request {request_id} {status} {expected_tokens} tokens " in logged
