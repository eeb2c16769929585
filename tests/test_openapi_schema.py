"""The request models (serve_clef.SystemOneRequest and its kin, docs/api.md §8) and validate_request, the server's own
check of a body (docs/api.md §2), accept and refuse the same bodies.

Three judges look at every body: validate_request; the pydantic model; and the OpenAPI document's schema, applied
by the `jsonschema` package, which knows nothing of pydantic. The valid bodies are those the other test files send
(text and JSON states, every question type, media in each form, assets, truncate, ids) and the edges of every limit;
the invalid ones break the shape of one field each. A body is checked for shape only: neither check decodes media,
so media bytes here need not be real files. Hypothesis then feeds all three the fuzz test's mutated requests and
media items, and the judges must agree on each.
"""

import base64
import copy

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import serve_clef
import synthetic_release
from test_engine import REQUESTS as ENGINE_REQUESTS
from test_fuzz import FUZZ, json_values, media_items, mutated_requests
from test_http import GOOD_REQUEST, UNPROCESSABLE, data_url
from test_prompt import RECORD

PNG = synthetic_release.synthetic_png(8, 8)
WAV = synthetic_release.synthetic_wav(0.1)
SOME_BYTES = base64.b64encode(b"\x00\x00\x00\x18ftypmp42" + bytes(16)).decode()  # only its shape is checked
ASSET = {"type": "image", "format": "png", "data_base64": base64.b64encode(PNG).decode()}


def with_question(question: dict) -> dict:
    return {**GOOD_REQUEST, "questions": {"q": question}}


VALID = {
    "good request": GOOD_REQUEST,
    "demo request": serve_clef.DEMO_REQUEST,
    "engine, short text": ENGINE_REQUESTS[0],
    "engine, choice and score": ENGINE_REQUESTS[1],
    "prompt record: int id, object instructions, one-sided noul": RECORD,
    "text state, unicode ids, unknown field": {
        "model": "clef-omni", "state": "Le colis est arrivé cassé 📦",
        "questions": {"é q.1 📦": {"type": "choice", "criteria": {"oui": "yes", "non": "no"}}},
        "id": "record-7", "an_unknown_field": {"ignored": True},
    },
    "array state": {**GOOD_REQUEST, "state": [1, "two", {"three": None}]},
    "empty text state": {**GOOD_REQUEST, "state": ""},
    "null score level": with_question({"type": "score", "criteria": ["sad", None, "happy"]}),
    "object and array levels": with_question({"type": "score", "criteria": [{"level": 0}, ["high"]]}),
    "noul, null criteria and instructions": with_question({"type": "noul", "instructions": None, "criteria": None}),
    "noul, array instructions": with_question({"type": "noul", "instructions": ["a", "b"],
                                               "criteria": {"false": {"why": "no"}}}),
    "question with unknown keys": with_question({"type": "noul", "weight": 3}),
    "empty option id": with_question({"type": "choice", "criteria": {"": "blank", "x": None}}),
    "fewest options and levels": {**GOOD_REQUEST, "questions": {
        "c": {"type": "choice", "criteria": {"a": None, "b": None}},
        "s": {"type": "score", "criteria": ["low", "high"]}}},
    "most options and levels": {**GOOD_REQUEST, "questions": {
        "c": {"type": "choice", "criteria": {f"o{i}": None for i in range(serve_clef.MAX_CHOICE_OPTIONS)}},
        "s": {"type": "score", "criteria": [str(i) for i in range(serve_clef.MAX_SCORE_LEVELS)]}}},
    "most questions": {**GOOD_REQUEST, "questions": {f"q{i}": {"type": "noul"}
                                                     for i in range(serve_clef.MAX_QUESTIONS)}},
    "truncate false": {**GOOD_REQUEST, "truncate": False},
    "truncate true, id null": {**GOOD_REQUEST, "truncate": True, "id": None},
    "images, data URL and object": {**GOOD_REQUEST, "images": [
        data_url("image/png", PNG), {"content_type": "image/png", "base64": base64.b64encode(PNG).decode()}]},
    "data URL with parameters, upper case": {**GOOD_REQUEST, "images": [
        f"data:IMAGE/PNG;charset=utf-8;name=photo.png;base64,{base64.b64encode(PNG).decode()}"]},
    "object type with spaces and capitals": {**GOOD_REQUEST, "images": [
        {"content_type": " Image/JPEG ", "base64": "iVBO RW0K\nGgo="}]},
    "audio, data URL and object": {**GOOD_REQUEST, "audio": [
        data_url("audio/wav", WAV), {"content_type": "audio/mpeg", "base64": SOME_BYTES}]},
    "videos, mp4 and webm": {**GOOD_REQUEST, "videos": [
        f"data:video/mp4;base64,{SOME_BYTES}", {"content_type": "video/webm", "base64": SOME_BYTES}]},
    "most media of each kind": {**GOOD_REQUEST,
                                "images": [data_url("image/webp", PNG)] * serve_clef.MEDIA_LIMITS["images"][0],
                                "audio": [data_url("audio/x-wav", WAV)] * serve_clef.MEDIA_LIMITS["audio"][0],
                                "videos": [data_url("video/mp4", PNG)] * serve_clef.MEDIA_LIMITS["videos"][0]},
    "null media fields": {**GOOD_REQUEST, "images": None, "audio": None, "videos": None, "assets": None},
    "empty media fields": {**GOOD_REQUEST, "images": [], "audio": [], "videos": [], "assets": {}},
    "assets": {**GOOD_REQUEST, "state": {"photo": "<image:0001>"}, "assets": {"<image:0001>": ASSET}},
    "asset without type or format": {**GOOD_REQUEST, "assets": {"p": {"data_base64": ASSET["data_base64"]}}},
    "asset with a null format": {**GOOD_REQUEST, "assets": {"p": {**ASSET, "format": None}}},
    "images and assets, four together": {**GOOD_REQUEST, "images": [data_url("image/png", PNG)] * 2,
                                         "assets": {"a": ASSET, "b": {**ASSET, "format": "jpeg"}}},
}

SHAPE_INVALID = {
    "not an object": [GOOD_REQUEST],
    "no model": {key: value for key, value in GOOD_REQUEST.items() if key != "model"},
    "no state": {key: value for key, value in GOOD_REQUEST.items() if key != "state"},
    "no questions": {key: value for key, value in GOOD_REQUEST.items() if key != "questions"},
    "model a number": {**GOOD_REQUEST, "model": 7},
    "model empty": {**GOOD_REQUEST, "model": ""},
    "state null": {**GOOD_REQUEST, "state": None},
    "state a number": {**GOOD_REQUEST, "state": 3.5},
    "state a boolean": {**GOOD_REQUEST, "state": True},
    "questions an array": {**GOOD_REQUEST, "questions": [{"type": "noul"}]},
    "no question": {**GOOD_REQUEST, "questions": {}},
    "too many questions": {**GOOD_REQUEST, "questions": {f"q{i}": {"type": "noul"}
                                                         for i in range(serve_clef.MAX_QUESTIONS + 1)}},
    "empty question id": {**GOOD_REQUEST, "questions": {"": {"type": "noul"}}},
    "question a string": with_question("noul"),
    "question without type": with_question({"instructions": "why?"}),
    "bad question type": with_question({"type": "ranking", "criteria": ["a", "b"]}),
    "question type a number": with_question({"type": 1}),
    "instructions a number": with_question({"type": "noul", "instructions": 5}),
    "instructions a boolean": with_question({"type": "score", "instructions": False, "criteria": ["a", "b"]}),
    "noul criteria an array": with_question({"type": "noul", "criteria": ["yes"]}),
    "noul description a number": with_question({"type": "noul", "criteria": {"true": 1}}),
    "choice without criteria": with_question({"type": "choice"}),
    "choice criteria null": with_question({"type": "choice", "criteria": None}),
    "choice of one option": with_question({"type": "choice", "criteria": {"a": "x"}}),
    "too many options": with_question({"type": "choice", "criteria": {
        f"o{i}": None for i in range(serve_clef.MAX_CHOICE_OPTIONS + 1)}}),
    "choice criteria an array": with_question({"type": "choice", "criteria": ["a", "b"]}),
    "option description a number": with_question({"type": "choice", "criteria": {"a": 1, "b": "x"}}),
    "score without criteria": with_question({"type": "score"}),
    "score of one level": with_question({"type": "score", "criteria": ["only"]}),
    "too many levels": with_question({"type": "score", "criteria": [
        str(i) for i in range(serve_clef.MAX_SCORE_LEVELS + 1)]}),
    "score criteria an object": with_question({"type": "score", "criteria": {"low": "l", "high": "h"}}),
    "level a boolean": with_question({"type": "score", "criteria": ["a", True]}),
    "truncate a string": {**GOOD_REQUEST, "truncate": "no"},
    "truncate a number": {**GOOD_REQUEST, "truncate": 1},
    "truncate null": {**GOOD_REQUEST, "truncate": None},
    "media_kwargs": {**GOOD_REQUEST, "media_kwargs": {"size": {"longest_edge": 10**9}}},
    "media_kwargs null": {**GOOD_REQUEST, "media_kwargs": None},
    "images a string": {**GOOD_REQUEST, "images": data_url("image/png", PNG)},
    "too many images": {**GOOD_REQUEST, "images": [data_url("image/png", PNG)] * 5},
    "too many audio clips": {**GOOD_REQUEST, "audio": [data_url("audio/wav", WAV)] * 5},
    "too many videos": {**GOOD_REQUEST, "videos": [f"data:video/mp4;base64,{SOME_BYTES}"] * 3},
    "media item a number": {**GOOD_REQUEST, "images": [42]},
    "media item null": {**GOOD_REQUEST, "audio": [None]},
    "media item an array": {**GOOD_REQUEST, "videos": [["data:video/mp4;base64,AAAA"]]},
    "media object without base64": {**GOOD_REQUEST, "images": [{"content_type": "image/png"}]},
    "media object, type a number": {**GOOD_REQUEST, "images": [{"content_type": 5, "base64": "AAAA"}]},
    "media object, wrong type": {**GOOD_REQUEST, "images": [{"content_type": "image/gif", "base64": "AAAA"}]},
    "remote URL": {**GOOD_REQUEST, "images": ["https://example.com/cat.png"]},
    "file path": {**GOOD_REQUEST, "audio": ["clip.wav"]},
    "base64 without its data URL": {**GOOD_REQUEST, "images": [base64.b64encode(PNG).decode()]},
    "data URL not base64": {**GOOD_REQUEST, "images": ["data:image/png,rawtext"]},
    "data URL of a refused type": {**GOOD_REQUEST, "images": ["data:image/gif;base64,R0lGODlhAQABAAAAACw="]},
    "audio type in images": {**GOOD_REQUEST, "images": [data_url("audio/wav", WAV)]},
    "a content type that only starts right": {**GOOD_REQUEST, "images": [data_url("image/pngx", PNG)]},
    "assets an array": {**GOOD_REQUEST, "assets": [ASSET]},
    "asset a string": {**GOOD_REQUEST, "assets": {"<image:0001>": "not an object"}},
    "asset of type video": {**GOOD_REQUEST, "assets": {"p": {**ASSET, "type": "video"}}},
    "asset format gif": {**GOOD_REQUEST, "assets": {"p": {**ASSET, "format": "gif"}}},
    "asset naming a part in a JSON body": {**GOOD_REQUEST, "assets": {"p": {"type": "image", "part": "asset-0"}}},
    "asset with data and a null part": {**GOOD_REQUEST, "assets": {"p": {**ASSET, "part": None}}},
    "asset without data": {**GOOD_REQUEST, "assets": {"p": {"type": "image"}}},
    "asset data a number": {**GOOD_REQUEST, "assets": {"p": {**ASSET, "data_base64": 12}}},
    "too many assets": {**GOOD_REQUEST, "assets": {f"p{i}": ASSET for i in range(5)}},
}
# Beyond what a JSON Schema can say (a count across two fields): validate_request and the model only.
IMAGES_AND_ASSETS_OVER_FOUR = {**GOOD_REQUEST, "images": [data_url("image/png", PNG)] * 3,
                               "assets": {"a": ASSET, "b": ASSET}}


@pytest.fixture(scope="module")
def openapi() -> dict:
    """The OpenAPI document the server serves at /openapi.json (nothing is loaded until the app starts)."""
    return serve_clef.create_app(serve_clef.parse_args(["--model", "synthetic", "--device", "cpu"])).openapi()


def body_schema(openapi: dict, content_type: str) -> jsonschema.protocols.Validator:
    """A JSON Schema validator for the request body of one content type, its $refs resolved in the document."""
    schema = openapi["paths"]["/v1/systemone"]["post"]["requestBody"]["content"][content_type]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": openapi["components"]})


def server_accepts(body) -> bool:
    try:
        serve_clef.validate_request(copy.deepcopy(body))
    except serve_clef.RequestError as error:
        assert error.status == 422 and error.loc[0] == "body", (error.status, error.loc, error.message)
        return False
    return True


def model_accepts(body, model=serve_clef.SystemOneRequest) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("body", VALID.values(), ids=VALID.keys())
def test_valid_bodies_pass_all_three(openapi, body):
    assert server_accepts(body)
    assert model_accepts(body)
    body_schema(openapi, "application/json").validate(body)


@pytest.mark.parametrize("body", SHAPE_INVALID.values(), ids=SHAPE_INVALID.keys())
def test_shape_invalid_bodies_are_refused_by_all_three(openapi, body):
    assert not server_accepts(body)
    assert not model_accepts(body)
    assert not body_schema(openapi, "application/json").is_valid(body)


def test_images_and_assets_over_the_image_count_are_refused_by_the_model_too():
    assert not server_accepts(IMAGES_AND_ASSETS_OVER_FOUR)
    assert not model_accepts(IMAGES_AND_ASSETS_OVER_FOUR)


@pytest.mark.parametrize("body", [case[0] for case in UNPROCESSABLE], ids=[case[1] for case in UNPROCESSABLE])
def test_the_http_tests_refusals_split_alike(body):
    """Each body the HTTP tests see refused is refused by its shape (by both) or later, for its bytes (by neither)."""
    assert model_accepts(body) == server_accepts(body)


def multipart_request(parts: list[str]) -> dict:
    return {**GOOD_REQUEST, "assets": {f"<image:{index}>": {"type": "image", "part": name}
                                       for index, name in enumerate(parts)}}


def test_multipart_request_part_names_its_image_parts(openapi):
    """A multipart body's request part may name image parts in `assets`; the server takes each part into its entry
    (attach_multipart_images) and then checks the request as a JSON body's."""
    request = multipart_request(["asset-0", "asset-1"])
    parts = {"asset-0": ("image/png", PNG), "asset-1": ("image/png", PNG)}
    body = {"request": request, **{name: data for name, (_, data) in parts.items()}}
    assert model_accepts(body, serve_clef.SystemOneMultipartBody)
    body_schema(openapi, "multipart/form-data").validate({**body, **{name: "<binary>" for name in parts}})
    attached = copy.deepcopy(request)
    serve_clef.attach_multipart_images(attached, parts)
    assert server_accepts(attached)
    # the same request in a JSON body, where there are no parts to name: refused by all three
    assert not server_accepts(request) and not model_accepts(request)
    assert not body_schema(openapi, "application/json").is_valid(request)
    # a part named by a number is no part: the server leaves the entry as it is and refuses it
    odd = {**request, "assets": {"p": {"type": "image", "part": 0}}}
    assert not model_accepts(odd, serve_clef.SystemOneMultipartRequest)
    serve_clef.attach_multipart_images(odd, {})
    assert not server_accepts(odd)
    # five images, parts and inline ones together: over the count for both
    crowded = {**multipart_request(["asset-0", "asset-1", "asset-2"]),
               "images": [data_url("image/png", PNG)] * 2}
    assert not model_accepts(crowded, serve_clef.SystemOneMultipartRequest)
    attached = copy.deepcopy(crowded)
    serve_clef.attach_multipart_images(attached, {f"asset-{index}": ("image/png", PNG) for index in range(3)})
    assert not server_accepts(attached)


def test_the_document_carries_the_models_own_schemas(openapi):
    """/openapi.json's body schemas are the models' JSON Schemas, referenced from components/schemas."""
    content = openapi["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]
    components = openapi["components"]["schemas"]
    for content_type, model in [("application/json", serve_clef.SystemOneRequest),
                                ("multipart/form-data", serve_clef.SystemOneMultipartBody)]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        definitions = schema.pop("$defs")
        assert content[content_type]["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}
        assert components[model.__name__] == schema
        assert all(components[name] == definition for name, definition in definitions.items())
    assert content["multipart/form-data"]["encoding"] == {"request": {"contentType": "application/json"}}


def test_docs_page_links_every_reference_to_its_schema(openapi):
    page = serve_clef.docs_page(openapi)
    for name in openapi["components"]["schemas"]:
        assert f'<h3 id="{name}">' in page
    assert '<a href="#SystemOneRequest">&quot;#/components/schemas/SystemOneRequest&quot;</a>' in page
    assert "<script" not in page and "http://" not in page and "https://" not in page


@given(request=mutated_requests())
@settings(FUZZ, max_examples=400)
def test_mutated_requests_are_judged_alike(openapi, request):
    accepted = server_accepts(request)
    assert model_accepts(request) == accepted
    assert body_schema(openapi, "application/json").is_valid(request) == accepted


asset_entries = json_values | st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["image", "video", None]),
    "format": st.sampled_from(["png", "jpg", "jpeg", "webp", "gif", "PNG", None, 1]),
    "data_base64": st.text(max_size=8) | json_values,
    "part": st.text(max_size=6) | json_values,
})
media_requests = st.one_of(
    st.builds(lambda field, items: {**GOOD_REQUEST, field: items},
              st.sampled_from(["images", "audio", "videos"]), st.lists(media_items, max_size=5) | json_values),
    st.builds(lambda assets, images: {**GOOD_REQUEST, "assets": assets, "images": images},
              st.dictionaries(st.text(max_size=6), asset_entries, max_size=5) | json_values,
              st.lists(media_items, max_size=3)),
)


@given(request=media_requests)
@settings(FUZZ, max_examples=400)
def test_media_and_assets_are_judged_alike(openapi, request):
    accepted = server_accepts(request)
    assert model_accepts(request) == accepted
    images, assets = request.get("images"), request.get("assets")
    if not (isinstance(images, list) and isinstance(assets, dict) and len(images) + len(assets) > 4):
        assert body_schema(openapi, "application/json").is_valid(request) == accepted  # no count across two fields
