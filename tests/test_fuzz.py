"""No input gets a 5xx: over 1,000 generated bodies against a real uvicorn server on `--model synthetic`.

Bodies are valid requests with one part replaced, removed or added, random JSON, raw bytes, JSON text with lone
surrogates and overflowing numbers, malformed media, and wrong content types and encodings. Every answer must be a
200 with answers, or a 4xx whose body names the field (docs/api.md §6.1) and shows no internals. Afterwards the server
must still give the answer it gave before the fuzzing. Hypothesis runs derandomized: the same bodies on every run.
"""

import base64
import copy
import gzip
import json

import pytest
import requests
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import serve_clef
from test_http import GOOD_REQUEST, SERVER_ARGS, TIMEOUT_S, serve_in_thread, wait_until_ready

FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
MEDIA_PREFIXES = [  # the first bytes of real formats, so that decoders get past the signature and then fail
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", b"\xff\xd8\xff\xe0\x00\x10JFIF", b"RIFF\x24\x00\x00\x00WAVEfmt ",
    b"RIFF\x24\x00\x00\x00WEBPVP8 ", b"\x00\x00\x00\x18ftypmp42", b"\x1aE\xdf\xa3", b"ID3\x03\x00", b"GIF89a",
]


@pytest.fixture(scope="module")
def session_and_url():
    args = serve_clef.parse_args([*SERVER_ARGS, "--api-key", ""])
    loaded = serve_clef.load_from_args(args, progress=lambda line: None)
    with serve_in_thread(serve_clef.create_app(args, load=lambda args, progress: loaded)) as url:
        wait_until_ready(url, limit_s=TIMEOUT_S)
        with requests.Session() as session:
            yield session, url


@pytest.fixture(scope="module")
def answer_before_fuzzing(session_and_url) -> dict:
    return answer_of(*session_and_url, GOOD_REQUEST)


def answer_of(session, url, request) -> dict:
    response = session.post(f"{url}/v1/systemone", json=request, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    body = response.json()
    del body["usage"]["latency_ms"]
    return body


def check(session, url, body: bytes, headers: dict | None = None) -> None:
    """POST the body: a 200 with answers, or a 4xx in the error shape naming the field; never a 5xx."""
    response = session.post(f"{url}/v1/systemone", data=body, headers={"Content-Type": "application/json",
                                                                         **(headers or {})}, timeout=TIMEOUT_S)
    assert response.status_code < 500, (body[:300], response.text[:500])
    payload = response.json()
    if response.status_code == 200:
        assert list(payload) == ["model", "answers", "usage"]
        return
    assert 400 <= response.status_code < 500
    message = payload["error"]["message"]
    assert message and "object at 0x" not in message and "Traceback" not in message
    if response.status_code == 422:
        loc = payload["detail"][0]["loc"]
        assert loc and loc[0] in ("body", "header"), loc
        assert payload["detail"][0]["msg"] == message
    else:
        assert payload["detail"]["message"] == message and payload["detail"]["error_type"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=10,
)


def paths(value, prefix=()):
    """Every path into a JSON value: keys of objects and indices of arrays."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


GOOD_PATHS = [path for path in paths(GOOD_REQUEST) if path]


@st.composite
def mutated_requests(draw):
    """GOOD_REQUEST with up to three edits: a value replaced, a key removed, or a key added, anywhere in it."""
    request = copy.deepcopy(GOOD_REQUEST)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(GOOD_PATHS))
        parent = request
        try:
            for part in path[:-1]:
                parent = parent[part]
            edit = draw(st.sampled_from(["replace", "remove", "add"]))
            if edit == "replace":
                parent[path[-1]] = draw(json_values)
            elif edit == "remove" and isinstance(parent, dict):
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[draw(st.text(max_size=6))] = draw(json_values)
        except (KeyError, IndexError, TypeError):  # an earlier edit removed or replaced the way there
            pass
    return request


@given(request=mutated_requests())
@settings(FUZZ, max_examples=450)
def test_mutated_requests(session_and_url, answer_before_fuzzing, request):
    check(*session_and_url, json.dumps(request).encode())


@given(value=json_values)
@settings(FUZZ, max_examples=250)
def test_random_json(session_and_url, value):
    check(*session_and_url, json.dumps(value).encode())


@given(body=st.binary(max_size=120) | st.text(max_size=60).map(lambda text: text.encode("utf-8", "surrogatepass")))
@settings(FUZZ, max_examples=150)
def test_raw_bodies(session_and_url, body):
    check(*session_and_url, body)


@given(
    field=st.sampled_from(["model", "state", "questions", "instructions", "criteria", "option", "key"]),
    injected=st.sampled_from(["\\ud800", "\\udfff", "\\ud83d", "\\udc00\\ud800", "1e999", "-1e400", "9" * 400,
                              "NaN", "Infinity", "1e-999", "\\u0000", '\\"\\u202e']),
)
@settings(FUZZ, max_examples=150)
def test_surrogates_and_numbers_in_the_json_text(session_and_url, field, injected):
    number = not injected.startswith("\\")
    value = injected if number else f'"{injected}"'
    texts = {
        "model": f'{{"model": {value}, "state": "s", "questions": {{"q": {{"type": "noul"}}}}}}',
        "state": f'{{"model": "m", "state": {{"n": {value}}}, "questions": {{"q": {{"type": "noul"}}}}}}',
        "questions": f'{{"model": "m", "state": "s", "questions": {{"q": {value}}}}}',
        "instructions": f'{{"model": "m", "state": "s", "questions": {{"q": {{"type": "noul", "instructions": '
                        f'{value}}}}}}}',
        "criteria": f'{{"model": "m", "state": "s", "questions": {{"q": {{"type": "score", "criteria": [{value}, '
                    f'"b"]}}}}}}',
        "option": f'{{"model": "m", "state": "s", "questions": {{"q": {{"type": "choice", "criteria": {{"a": '
                  f'{value}, "b": null}}}}}}}}',
        "key": f'{{"model": "m", "state": "s", "questions": {{"q{injected if not number else ""}": '
               f'{{"type": "noul"}}}}}}',
    }
    check(*session_and_url, texts[field].encode())


media_items = st.one_of(
    st.builds(lambda prefix, tail, content_type: f"data:{content_type};base64,"
              f"{base64.b64encode(prefix + tail).decode()}",
              st.sampled_from(MEDIA_PREFIXES), st.binary(max_size=64),
              st.sampled_from(["image/png", "image/jpeg", "image/webp", "audio/wav", "audio/mpeg", "video/mp4",
                               "video/webm", "image/gif", "text/plain"])),
    st.builds(lambda content_type, data: {"content_type": content_type, "base64": data},
              st.one_of(st.text(max_size=12), st.sampled_from(["image/png", "audio/wav", "video/mp4"])),
              st.text(alphabet="ABCDabcd0123+/=@ \n", max_size=40)),
    st.text(max_size=40),
    json_values,
)


@given(field=st.sampled_from(["images", "audio", "videos", "assets"]), items=st.lists(media_items, max_size=5))
@settings(FUZZ, max_examples=150)
def test_bad_media(session_and_url, field, items):
    if field == "assets":
        value = {f"<image:{index}>": {"type": "image", "data_base64": item} if isinstance(item, str) else item
                 for index, item in enumerate(items)}
    else:
        value = items
    check(*session_and_url, json.dumps({**GOOD_REQUEST, field: value}).encode())


@given(
    content_type=st.sampled_from(["application/json", "application/json; charset=latin-1", "text/plain",
                                  "multipart/form-data", "multipart/form-data; boundary=x", "application/x+json",
                                  ""]),
    encoding=st.sampled_from(["identity", "gzip", "zstd", "deflate", "br", "gzip, zstd"]),
    compress=st.booleans(),
    body=st.sampled_from([json.dumps(GOOD_REQUEST).encode(), b"--x\r\nContent-Disposition: form-data; "
                          b"name=\"request\"\r\n\r\n{}\r\n--x--\r\n", b"\x1f\x8b\x08\x00garbage", b""]),
)
@settings(FUZZ, max_examples=100)
def test_content_types_and_encodings(session_and_url, content_type, encoding, compress, body):
    if compress and encoding == "gzip":
        body = gzip.compress(body)
    elif compress and encoding == "zstd":
        body = zstandard.ZstdCompressor().compress(body)
    check(*session_and_url, body, {"Content-Type": content_type, "Content-Encoding": encoding})


def test_the_answer_after_fuzzing_equals_the_answer_before(session_and_url, answer_before_fuzzing):
    """After the tests above, and a few bad bodies of its own (so that, run alone, it does not compare two answers
    taken back to back): raw bytes, a field of the wrong type, an image that does not decode."""
    broken_image = {**GOOD_REQUEST, "images": ["data:image/png;base64," + base64.b64encode(MEDIA_PREFIXES[0]).decode()]}
    for body in (b"\xff\xfe{", b'{"model": 1, "state": "s", "questions": {}}', json.dumps(broken_image).encode()):
        check(*session_and_url, body)
    assert answer_of(*session_and_url, GOOD_REQUEST) == answer_before_fuzzing

