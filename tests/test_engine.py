"""The server's decision walk on CPU: records padded to a length bucket answer as unpadded ones, and `decide` answers
as the decision module's own `systemone()`.

On a GPU the padded inputs are replayed from CUDA graphs (checked on the H200 by bench/check_engine_gpu.py against
the eager decoder); here the same padded inputs run eagerly, which is what the padding itself changes.
"""

import base64

import serve_clef

REQUESTS = [
    {"model": "clef-omni", "state": "short", "questions": {"ok": {"type": "noul"}}},
    {
        "model": "clef-omni",
        "state": {"ticket": "The parcel came late and the box was crushed. " * 12, "orders": 3},
        "questions": {
            "team": {"type": "choice", "criteria": {"billing": None, "shipping": "parcels", "support": None}},
            "anger": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
        },
    },
]


def probabilities(answers: dict) -> dict:
    return {(question_id, option): probability for question_id, answer in answers.items()
            for option, probability in answer.get("probabilities", {"true": answer.get("noul")}).items()}


def test_padding_to_a_bucket_keeps_every_answer():
    loaded = serve_clef.load_clef("synthetic", device="cpu", progress=lambda line: None)
    unpadded = [serve_clef.decide(loaded, request, 4096) for request in REQUESTS]
    graphed = serve_clef.graph_text_decoder(loaded.model.thinker)
    padded_lengths = []
    run_padded = graphed.run_padded

    def recording_run_padded(inputs_embeds, position_ids):
        padded_lengths.append(inputs_embeds.shape[1])
        return run_padded(inputs_embeds, position_ids)

    graphed.run_padded = recording_run_padded
    padded = [serve_clef.decide(loaded, request, 4096) for request in REQUESTS]
    tokens = [response["usage"]["input_tokens"] for response in unpadded]
    # each record ran padded to the smallest bucket that holds it, and past its own length
    assert padded_lengths == [min(b for b in serve_clef.DECODER_BUCKETS if b >= length) for length in tokens]
    assert all(bucket > length for bucket, length in zip(padded_lengths, tokens))
    for before, after in zip(unpadded, padded):
        before, after = probabilities(before["answers"]), probabilities(after["answers"])
        assert before.keys() == after.keys()
        assert max(abs(before[key] - after[key]) for key in before) <= 1e-4  # answers are rounded to 4 places


def test_decide_answers_as_the_decision_modules_own_systemone(png_bytes, wav_bytes, mp4_with_audio_bytes):
    """The server's walk (encode once, forward, answer) against the reference that does it all in one call."""
    loaded = serve_clef.load_clef("synthetic", device="cpu", progress=lambda line: None)

    def data_url(content_type: str, data: bytes) -> str:
        return f"data:{content_type};base64,{base64.b64encode(data).decode()}"

    media = [{}, {"images": [data_url("image/png", png_bytes)]}, {"audio": [data_url("audio/wav", wav_bytes)]},
             {"videos": [data_url("video/mp4", mp4_with_audio_bytes)]}]
    for request in REQUESTS:
        for medium in media:
            request = {**request, **medium}
            ours = serve_clef.decide(loaded, request, 4096)
            reference = loaded.schema.systemone(loaded.model, loaded.processor, request, 4096)
            assert ours["answers"] == reference["answers"]
            assert ours["usage"]["input_tokens"] == reference["usage"]["input_tokens"]
