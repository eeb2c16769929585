"""The exact Clef prompt and token layout (docs/decision-api.md §3-§4), written out by hand: every expected string
below is typed from the spec, not produced by joint_schema_model."""

import pytest
from transformers import AutoTokenizer

import joint_schema_model as jsm

PREFIX = (
    "<|im_start|>system\nRead the complete state and schema. Decide every field jointly. Each answer must be exactly "
    "one of that field's allowed options.<|im_end|>\n<|im_start|>user\nSTATE:\n"
)
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"

RECORD = {
    "id": 17,
    "model": "clef-omni",
    "state": {"user": "Zoë", "cart": [1, 2], "note": "naïve café ☕"},
    "questions": {
        "intent": {
            "type": "choice",
            "instructions": "Which intent?",
            # unsorted ids, a null description and an object description
            "criteria": {"refund": "Wants money back", "browse": None, "cancel": {"scope": "order"}},
        },
        "risk": {"type": "score", "instructions": {"rubric": "fraud risk"}, "criteria": ["low", "high"]},
        # empty instructions fall back to the id; one-sided criteria keep the other default
        "human": {"type": "noul", "instructions": "", "criteria": {"true": "Needs a human.", "maybe": "ignored"}},
    },
}
STATE_TEXT = '{"cart":[1,2],"note":"naïve café ☕","user":"Zoë"}'
# (text, kind) in prompt order; kind marks the spans: "q" a question span, "o" an option span.
SCHEMA_PIECES = [
    ("\n\nSCHEMA FIELDS:\n", None),
    ("\nFIELD 1\nID: intent\nTYPE: choice\nINSTRUCTION: ", None),
    ("Which intent?", "q"),
    ("\nALLOWED OPTIONS:\n", None),
    ("OPTION 1: ", None),
    ('{"option_id":"browse"}', "o"),
    ("\n", None),
    ("OPTION 2: ", None),
    ('{"description":{"scope":"order"},"option_id":"cancel"}', "o"),
    ("\n", None),
    ("OPTION 3: ", None),
    ('{"description":"Wants money back","option_id":"refund"}', "o"),
    ("\n", None),
    ("END FIELD\n", None),
    ("\nFIELD 2\nID: risk\nTYPE: score\nINSTRUCTION: ", None),
    ('{"rubric":"fraud risk"}', "q"),
    ("\nALLOWED OPTIONS:\n", None),
    ("OPTION 1: ", None),
    ('{"description":"low","option_id":"0"}', "o"),
    ("\n", None),
    ("OPTION 2: ", None),
    ('{"description":"high","option_id":"1"}', "o"),
    ("\n", None),
    ("END FIELD\n", None),
    ("\nFIELD 3\nID: human\nTYPE: noul\nINSTRUCTION: ", None),
    ("human", "q"),
    ("\nALLOWED OPTIONS:\n", None),
    ("OPTION 1: ", None),
    ('{"description":"Needs a human.","option_id":"true"}', "o"),
    ("\n", None),
    ("OPTION 2: ", None),
    ('{"description":"The proposition is false or the answer is no.","option_id":"false"}', "o"),
    ("\n", None),
    ("END FIELD\n", None),
]
# RECORD's pieces other than its state, each once ("\n", "OPTION 1: ", ... repeat within the record)
DISTINCT_PIECES = {PREFIX, SUFFIX, *(text for text, _ in SCHEMA_PIECES)}


@pytest.fixture(scope="module")
def tokenizer(tiny_release):
    return AutoTokenizer.from_pretrained(tiny_release)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def expected_layout(tokenizer, state_tokens=None):
    """Ids piece by piece, and the spans of questions and options, computed from the hand-written pieces."""
    state_ids = ids(tokenizer, STATE_TEXT)
    if state_tokens is not None:
        state_ids = state_ids[:state_tokens]
    input_ids = ids(tokenizer, PREFIX) + state_ids
    question_spans, option_spans = [], []
    for text, kind in SCHEMA_PIECES:
        start = len(input_ids)
        input_ids += ids(tokenizer, text)
        if kind == "q":
            question_spans.append((start, len(input_ids)))
            option_spans.append([])
        elif kind == "o":
            option_spans[-1].append((start, len(input_ids)))
    input_ids += ids(tokenizer, SUFFIX)
    return input_ids, question_spans, option_spans


def test_special_tokens_are_single_ids(tokenizer):
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|vision_start|>", "<|image_pad|>"):
        assert len(ids(tokenizer, token)) == 1, token


def test_prompt_text_and_token_layout(tokenizer):
    encoded = jsm.encode_record(tokenizer, RECORD)
    expected_ids, question_spans, option_spans = expected_layout(tokenizer)
    assert list(encoded.input_ids) == expected_ids
    full_text = PREFIX + STATE_TEXT + "".join(text for text, _ in SCHEMA_PIECES) + SUFFIX
    assert tokenizer.decode(list(encoded.input_ids), skip_special_tokens=False) == full_text
    assert encoded.record_id == "17"
    assert encoded.media is None

    assert [q.question_id for q in encoded.questions] == ["intent", "risk", "human"]
    assert [q.question_type for q in encoded.questions] == [1, 2, 0]
    assert [q.option_ids for q in encoded.questions] == [("browse", "cancel", "refund"), ("0", "1"), ("true", "false")]
    assert [q.question_span for q in encoded.questions] == question_spans
    assert [list(q.option_spans) for q in encoded.questions] == option_spans

    # Spans decode back to exactly the instruction and option texts.
    def text(span):
        return tokenizer.decode(list(encoded.input_ids[span[0] : span[1]]))

    assert [text(q.question_span) for q in encoded.questions] == ["Which intent?", '{"rubric":"fraud risk"}', "human"]
    assert text(encoded.questions[0].option_spans[1]) == '{"description":{"scope":"order"},"option_id":"cancel"}'
    assert text(encoded.questions[2].option_spans[1]).endswith('"option_id":"false"}')


class CountingTokenizer:
    """A tokenizer that records how many texts each call tokenises."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts_per_call = tokenizer, []

    def __call__(self, texts, **kwargs):
        self.texts_per_call.append(len(texts))
        return self.tokenizer(texts, **kwargs)


def test_kept_piece_ids_give_the_pieces_tokenised_alone(tokenizer, monkeypatch):
    """The ids of the pieces other than the state are kept from record to record: the next record with the same
    questions tokenises only its state, and every record still gets the ids of its pieces tokenised alone, also when
    the kept ids are dropped for being too many and for pieces too long to be kept."""
    counting = CountingTokenizer(tokenizer)  # a tokenizer of its own: nothing kept for it yet
    expected_ids, _, _ = expected_layout(tokenizer)
    assert list(jsm.encode_record(counting, RECORD).input_ids) == expected_ids
    distinct_pieces = len(DISTINCT_PIECES)  # the state and each distinct piece once
    assert counting.texts_per_call == [1 + distinct_pieces]

    state = "another state, not seen before"
    schema_and_suffix = expected_ids[len(ids(tokenizer, PREFIX)) + len(ids(tokenizer, STATE_TEXT)):]
    other_state_ids = ids(tokenizer, PREFIX) + ids(tokenizer, state) + schema_and_suffix
    assert list(jsm.encode_record(counting, {**RECORD, "state": state}).input_ids) == other_state_ids
    assert counting.texts_per_call[-1] == 1  # the state alone

    monkeypatch.setattr(jsm, "_KEPT_PIECES", 4)  # fewer than a record has: dropped every record, 4 kept afresh
    other_questions = {"state": state, "questions": {"q": {"type": "noul"}}}
    for record, expected in ((other_questions, None), (RECORD, expected_ids), (other_questions, None),
                             ({**RECORD, "state": state}, other_state_ids)):
        encoded = jsm.encode_record(counting, record)
        if expected is not None:
            assert list(encoded.input_ids) == expected
            # all but at most 4 of its pieces tokenised again: what the other record kept was dropped
            assert counting.texts_per_call[-1] >= 1 + distinct_pieces - 4
        assert len(jsm._kept_piece_ids[counting]) <= 4

    # pieces longer than _KEPT_PIECE_CHARS are tokenised every time, and still give their ids
    monkeypatch.setattr(jsm, "_KEPT_PIECES", 4096)
    monkeypatch.setattr(jsm, "_KEPT_PIECE_CHARS", len("END FIELD\n"))
    counting = CountingTokenizer(tokenizer)  # nothing kept for it yet
    assert list(jsm.encode_record(counting, RECORD).input_ids) == expected_ids
    kept = jsm._kept_piece_ids[counting]
    assert kept and all(len(piece) <= len("END FIELD\n") for piece in kept)
    short_pieces = len({text for text in DISTINCT_PIECES if len(text) <= len("END FIELD\n")})
    assert len(kept) == short_pieces
    assert list(jsm.encode_record(counting, RECORD).input_ids) == expected_ids
    assert counting.texts_per_call[-1] == 1 + distinct_pieces - short_pieces  # the state and the long pieces


def test_a_tokenizer_that_cannot_be_a_key_tokenizes_every_piece(tokenizer):
    """A tokenizer that cannot be a weak dictionary's key (unhashable) keeps no ids: every record tokenises all its
    pieces, and gets their ids."""

    class UnhashableTokenizer(CountingTokenizer):
        __hash__ = None

    unhashable = UnhashableTokenizer(tokenizer)
    expected_ids, _, _ = expected_layout(tokenizer)
    distinct_pieces = len(DISTINCT_PIECES)
    for _ in range(2):
        assert list(jsm.encode_record(unhashable, RECORD).input_ids) == expected_ids
    assert unhashable.texts_per_call == [1 + distinct_pieces] * 2


def test_string_state_is_verbatim_and_missing_id_is_unknown(tokenizer):
    record = {"state": '  {"not": "re-rendered"}\n', "questions": {"q": {"type": "noul"}}}
    encoded = jsm.encode_record(tokenizer, record)
    start = len(ids(tokenizer, PREFIX))
    state_ids = ids(tokenizer, '  {"not": "re-rendered"}\n')
    assert list(encoded.input_ids[start : start + len(state_ids)]) == state_ids
    assert encoded.record_id == "unknown"
    # no instructions at all: the id is the instruction
    q = encoded.questions[0]
    assert tokenizer.decode(list(encoded.input_ids[q.question_span[0] : q.question_span[1]])) == "q"


def test_truncation_cuts_only_the_end_of_the_state(tokenizer):
    full_ids, _, _ = expected_layout(tokenizer)
    state_length = len(ids(tokenizer, STATE_TEXT))
    fixed = len(full_ids) - state_length
    encoded = jsm.encode_record(tokenizer, RECORD, max_length=fixed + 5)
    expected_ids, question_spans, option_spans = expected_layout(tokenizer, state_tokens=5)
    assert len(encoded.input_ids) == fixed + 5
    assert list(encoded.input_ids) == expected_ids
    assert [q.question_span for q in encoded.questions] == question_spans
    assert [list(q.option_spans) for q in encoded.questions] == option_spans

    # max_state_tokens cuts first, max_length after
    encoded = jsm.encode_record(tokenizer, RECORD, max_state_tokens=3)
    assert list(encoded.input_ids) == expected_layout(tokenizer, state_tokens=3)[0]

    # a record that fits exactly is not cut
    assert list(jsm.encode_record(tokenizer, RECORD, max_length=len(full_ids)).input_ids) == full_ids

    with pytest.raises(ValueError) as error:
        jsm.encode_record(tokenizer, RECORD, max_length=fixed - 1)
    assert str(error.value) == f"schema requires {fixed} tokens before state; maximum is {fixed - 1}"


def test_record_without_questions_is_refused(tokenizer):
    with pytest.raises(ValueError, match="record produced no model input or questions"):
        jsm.encode_record(tokenizer, {"state": "x", "questions": {}})


def test_render_and_options_follow_the_spec():
    assert jsm.render("as is") == "as is"
    assert jsm.render({"b": 1, "a": ["é", None]}) == '{"a":["é",null],"b":1}'
    assert jsm.question_options({"type": "choice", "criteria": {"b": 1, "a": 2, "10": 3, 9: 4}}) == [
        ("10", 3),
        ("9", 4),
        ("a", 2),
        ("b", 1),
    ]
    assert jsm.question_options({"type": "score", "criteria": ["x", None]}) == [("0", "x"), ("1", None)]
    assert jsm.question_options({"type": "noul", "criteria": None}) == [
        ("true", "The proposition is true or the answer is yes."),
        ("false", "The proposition is false or the answer is no."),
    ]


def test_module_constants_are_the_release_values():
    assert jsm.SYSTEM_PROMPT == (
        "Read the complete state and schema. Decide every field jointly. "
        "Each answer must be exactly one of that field's allowed options."
    )
    assert jsm.IMAGE_PLACEHOLDER == "<|vision_start|><|image_pad|><|vision_end|>\n"
    assert jsm.AUDIO_PLACEHOLDER == "<|audio_start|><|audio_pad|><|audio_end|>\n"
    assert jsm.VIDEO_PLACEHOLDER == "<|vision_start|><|video_pad|><|vision_end|>\n"
    assert jsm.MEDIA_BATCH_KEYS == (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "video_second_per_grid",
    )
    assert jsm.AUDIO_BATCH_KEYS == ("input_features", "feature_attention_mask")
    assert jsm.QUESTION_TYPES == {"noul": 0, "choice": 1, "score": 2}
    assert (jsm.DEFAULT_MAX_LENGTH, jsm.AUDIO_SAMPLE_RATE, jsm.VIDEO_FPS) == (64000, 16000, 2.0)
    assert jsm.MAX_VIDEO_FRAME_PIXELS == 262_144
    assert jsm.IMAGE_SIZE == {"shortest_edge": 65_536, "longest_edge": 1_048_576}
    public = [
        "EncodedQuestion",
        "EncodedRecord",
        "render",
        "question_options",
        "encode_record",
        "collate_records",
        "load_image",
        "load_audio",
        "load_video",
        "EvidenceRoutingLayer",
        "JointSchemaHead",
        "ClefModel",
        "systemone_answer",
        "systemone",
        "load_release_model",
    ]
    assert all(callable(getattr(jsm, name)) for name in public)


def test_answers_follow_the_reference_rules():
    choice = {"type": "choice", "criteria": {"b": "x", "a": "y", "c": "z"}}
    answer = jsm.systemone_answer(choice, {"a": 0.4, "b": 0.4, "c": 0.2})
    assert answer == {
        "type": "choice",
        "choice": "b",
        "confidence": 0.4,
        "probabilities": {"b": 0.4, "a": 0.4, "c": 0.2},
    }
    assert list(answer) == ["type", "choice", "confidence", "probabilities"]
    assert list(answer["probabilities"]) == ["b", "a", "c"]  # request order, not sorted

    score = {"type": "score", "criteria": ["low", "mid", "high"]}
    answer = jsm.systemone_answer(score, {"0": 0.123456, "1": 0.5, "2": 0.376544})
    assert answer == {
        "type": "score",
        "score": round(0.5 + 2 * 0.376544, 4),
        "confidence": 0.5,
        "legend": {"0": "low", "1": "mid", "2": "high"},
        "probabilities": {"0": 0.1235, "1": 0.5, "2": 0.3765},
    }
    assert jsm.systemone_answer({"type": "noul"}, {"true": 0.987654, "false": 0.012346}) == {
        "type": "noul",
        "noul": 0.9877,
    }
