"""The engine on CPU: records packed into one forward answer as each record alone through transformers' own text
decoder, padding to a length bucket changes no answer, and `decide` answers as the decision module's `systemone()`.

On a GPU the decoder's packed attention is serve_clef's Triton kernel (the towers': flash attention's varlen kernel)
and the padded inputs are replayed from CUDA graphs (checked by bench/check_engine_gpu.py); here attention is SDPA
with a block-diagonal mask and the padded inputs run eagerly, which is what packing and padding themselves change.
The Triton kernel itself runs here under Triton's interpreter, against SDPA on each record.
"""

import base64
import itertools
import sys

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import serve_clef
import synthetic_release

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
# BF16 noise: the tiny model runs in BF16, and packing changes the shapes (so the summation order) of its matrix
# products and attention. Most tokens' hidden states then differ by under 2% of their largest value; a token whose
# router scores two experts nearly equal may switch expert and differ more, and the answers move by up to ~0.003.
# Attention leaking across records changes every token after the first record (by 80-120%).
ANSWER_NOISE = 0.01
HIDDEN_NOISE = 0.02  # of the record's largest hidden value
MOST_TOKENS_SWITCHING_EXPERT = 0.03  # fraction of a record's tokens allowed past HIDDEN_NOISE

def data_url(content_type: str, data: bytes) -> str:
    return f"data:{content_type};base64,{base64.b64encode(data).decode()}"


def probabilities(answers: dict) -> dict:
    return {(question_id, option): probability for question_id, answer in answers.items()
            for option, probability in answer.get("probabilities", {"true": answer.get("noul")}).items()}


def largest_difference(answers_a: dict, answers_b: dict) -> float:
    a, b = probabilities(answers_a), probabilities(answers_b)
    assert a.keys() == b.keys()
    return max(abs(a[key] - b[key]) for key in a)


@pytest.fixture(scope="module")
def loaded():
    return serve_clef.load_clef("synthetic", device="cpu", progress=lambda line: None)


@pytest.fixture(scope="module")
def stock_loaded():
    """The same checkpoint with transformers' own text decoder and attention put back: the reference."""
    loaded = serve_clef.load_clef("synthetic", device="cpu", progress=lambda line: None)
    for name, module in list(loaded.model.named_modules()):
        if isinstance(module, serve_clef.PackedTextDecoder):
            parent_name, _, attribute = name.rpartition(".")
            setattr(loaded.model.get_submodule(parent_name), attribute, module.decoder)
            module.decoder.config._attn_implementation = "sdpa"
            del module.decoder._deepstack_process  # transformers' own, through the visual tokens' mask
    for tower in serve_clef.thinker_towers(loaded.model.thinker):
        tower.config._attn_implementation = "sdpa"
        layers = tower.blocks if hasattr(tower, "blocks") else tower.layers
        for index, step in enumerate(layers):
            layers[index] = step.layer  # transformers' own layer, on the tower's own inputs
        tower._forward_pre_hooks.clear()  # the vision encoder computes its positions and boundaries itself
    for module in loaded.model.thinker.modules():
        module.__dict__.pop("get_rope_index", None)  # transformers' own 3-D positions
        module.__dict__.pop("get_placeholder_mask", None)  # and placeholder masks
    return loaded


@pytest.fixture(scope="module")
def mixed_requests(png_bytes, wav_bytes, mp4_with_audio_bytes):
    """Text of two lengths, an image, audio and a video with its soundtrack: different lengths and media."""
    text, long_text = REQUESTS
    return [
        long_text,
        {**text, "images": [data_url("image/png", png_bytes)]},
        text,
        {**long_text, "audio": [data_url("audio/wav", wav_bytes)]},
        {**text, "state": "a video", "videos": [data_url("video/mp4", mp4_with_audio_bytes)]},
    ]


def test_packed_attention_is_causal_attention_within_each_record():
    """The CPU spelling of the text decoder's packed attention (from its chunks) against SDPA run on each record alone
    (grouped heads expanded); one record is long enough to be cut in three chunks."""
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 1, 2 * serve_clef.QUERY_CHUNK + 9]
    query = torch.randn(1, 4, sum(lengths) + 3, 8, generator=generator)  # 3 padding tokens at the end
    key, value = torch.randn(2, 1, 2, sum(lengths) + 3, 8, generator=generator)
    boundaries = [0, *itertools.accumulate(lengths), sum(lengths) + 3]  # the padding as one more record
    chunks = torch.from_numpy(serve_clef.query_chunks(boundaries, 8))
    packed, _ = serve_clef.packed_records_attention(None, query, key, value, None, 0.3, attention_chunks=chunks)
    assert packed.shape == (1, sum(lengths) + 3, 4, 8)
    for start, end in itertools.pairwise(boundaries):
        alone = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end].repeat_interleave(2, 1),
            value[:, :, start:end].repeat_interleave(2, 1), is_causal=True, scale=0.3,
        )
        torch.testing.assert_close(packed[0, start:end], alone[0].transpose(0, 1))


def test_query_chunks_read_as_the_attention_kernel_reads_them_are_each_record_s_causal_attention():
    """The chunk table as packed_causal_attention_kernel reads it on the GPU: chunk c's queries [q[c], q[c+1]), its
    keys from k[c] up to its last query, causal aligned to the last key (torch's causal_lower_right). Chunk by chunk,
    that must be each record's own causal attention, with every query in exactly one chunk and no chunk across two
    records or longer than QUERY_CHUNK."""
    generator = torch.Generator().manual_seed(3)
    chunk = serve_clef.QUERY_CHUNK
    boundaries = [0, chunk, chunk, 3 * chunk + 1, 3 * chunk + 40, 4 * chunk + 64]  # an empty record, a full chunk
    total = boundaries[-1]
    table = serve_clef.query_chunks(boundaries, 12)
    assert table.shape == (2, 13) and table.dtype == np.int32
    query_starts, first_keys = table[0], table[1, :-1]
    assert query_starts[0] == 0 and (np.diff(query_starts) >= 0).all() and (query_starts[-1] == total)
    query, key, value = torch.randn(3, 1, 2, total, 8, generator=generator)
    expected = torch.empty(1, 2, total, 8)
    for start, end in itertools.pairwise(boundaries):
        expected[:, :, start:end] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=True, scale=0.25)
    chunked = torch.full((1, 2, total, 8), float("nan"))
    chunks_seen = 0
    for c in range(12):
        queries = slice(query_starts[c], query_starts[c + 1])
        if queries.start == queries.stop:
            continue
        chunks_seen += 1
        record = max(i for i, b in enumerate(boundaries[:-1]) if b <= queries.start)
        assert queries.stop <= boundaries[record + 1] and queries.stop - queries.start <= chunk
        keys = slice(first_keys[c], queries.stop)
        chunked[:, :, queries] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, queries], key[:, :, keys], value[:, :, keys], scale=0.25,
            attn_mask=causal_lower_right(queries.stop - queries.start, keys.stop - keys.start))
    assert chunks_seen == 1 + 3 + 1 + 2  # 128 tokens; 257 in three chunks; 39; 152 in two (the empty record: none)
    torch.testing.assert_close(chunked, expected)
    with pytest.raises(ValueError, match="chunks"):
        serve_clef.query_chunks(boundaries, 5)


def test_packed_causal_attention_kernel_is_each_record_s_causal_attention():
    """The Triton kernel of the decoder's attention over several records (CUDA's path; here Triton's interpreter) on
    the chunks of an empty record, a one-token record, a record of three chunks and the padding, with 16 query heads
    on 2 key-value heads (8 a program at the served tiles, as Clef-Omni's 32 on 4) and q, k and v as the decoder passes
    them (views of [1, heads, T, D], token-major in memory), against fp32 SDPA run on each record alone. The kernel
    rounds its probabilities to BF16 and its output too, as flash attention does: within a few BF16 steps of outputs
    of about 1, where one key too many or too few moves a record's first outputs by tenths."""
    generator = torch.Generator().manual_seed(5)
    lengths = [0, 1, 2 * serve_clef.QUERY_CHUNK + 9, 70]
    total = sum(lengths) + 23  # the padding, as one more record
    boundaries = [0, *itertools.accumulate(lengths), total]
    chunks = torch.from_numpy(serve_clef.query_chunks(boundaries, 10))
    # [1, T, heads, 16] in memory, viewed as [1, heads, T, 16]
    query = torch.randn(1, total, 16, 16, generator=generator).to(torch.bfloat16).transpose(1, 2)
    key, value = (torch.randn(1, total, 2, 16, generator=generator).to(torch.bfloat16).transpose(1, 2)
                  for _ in range(2))
    attention = serve_clef.packed_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                                                   value[0].transpose(0, 1), chunks, 0.25)  # [T, 16, 16]
    assert attention.shape == (total, 16, 16) and attention.dtype == torch.bfloat16
    for start, end in itertools.pairwise(boundaries):
        if start == end:
            continue
        alone = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end].float(), key[:, :, start:end].float().repeat_interleave(8, 1),
            value[:, :, start:end].float().repeat_interleave(8, 1), is_causal=True, scale=0.25)  # [1, 16, L, 16]
        torch.testing.assert_close(attention[start:end].float(), alone[0].transpose(0, 1), atol=0.02, rtol=0.02)
    assert torch.equal(attention[1], value[0, :, 1].repeat_interleave(8, 0))  # the one-token record: its own value


def test_packed_attention_without_causality_is_attention_within_each_record():
    """The towers' call (is_causal=False): each record attends to all of its own tokens and to no other's."""
    generator = torch.Generator().manual_seed(1)
    query, key, value = torch.randn(3, 1, 2, 11, 8, generator=generator)
    boundaries = torch.tensor([0, 4, 11], dtype=torch.int32)
    packed, _ = serve_clef.packed_records_attention(None, query, key, value, None, 0.5, cu_seq_lens_q=boundaries,
                                                    max_length_q=7, is_causal=False)
    for start, end in ((0, 4), (4, 11)):
        alone = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], scale=0.5)  # [1, 2, n, 8]
        torch.testing.assert_close(packed[0, start:end], alone[0].transpose(0, 1))


def test_logits_to_host_keeps_each_record_s_questions_in_order():
    """The batch's logits come back as one tensor split again: each record's questions, each with its own options
    and values, in order."""
    generator = torch.Generator().manual_seed(2)
    batch_logits = [[torch.randn(3, generator=generator), torch.randn(7, generator=generator)],
                    [torch.randn(2, generator=generator)], [torch.randn(5, generator=generator)] * 3]
    on_host, copied = serve_clef.logits_to_host(batch_logits)
    assert copied is None  # on the host already: nothing to wait for
    assert [len(record) for record in on_host] == [2, 1, 3]
    for record, host_record in zip(batch_logits, on_host, strict=True):
        for question, host_question in zip(record, host_record, strict=True):
            assert host_question.device.type == "cpu" and torch.equal(host_question, question)


def test_batch_to_device_keeps_the_batch_s_structure_and_values(loaded, mixed_requests):
    """The decision module's collation, made on the host and then moved, holds the same keys and records, and every
    tensor (the media's among them) is moved, with its host copy kept for host reads, but the grids and the sounds'
    frame masks, which stay on the host. Moved to the meta device, so that a tensor left behind on the host shows (a
    move to the CPU would hand back the same tensors)."""
    encoded = [serve_clef.prepare(loaded, request, 4096).encoded for request in mixed_requests]
    batch = loaded.schema.collate_records(encoded, loaded.processor.tokenizer.pad_token_id, "cpu")
    moved = serve_clef.batch_to_device(batch, torch.device("meta"))
    assert moved.keys() == batch.keys() and moved["records"] == batch["records"]
    assert all(a is b for a, b in zip(moved["records"], batch["records"], strict=True))
    assert batch["media"].keys() == moved["media"].keys() and "pixel_values_videos" in batch["media"]
    tensors = [(batch[key], moved[key]) for key in ("input_ids", "attention_mask")]
    for key, value in batch["media"].items():
        if key in ("image_grid_thw", "video_grid_thw", "feature_attention_mask"):
            assert moved["media"][key] is value  # read on the host by all that read them
        elif isinstance(value, torch.Tensor):
            tensors.append((value, moved["media"][key]))
        else:
            assert moved["media"][key] == value
    assert len(tensors) > 4 and {"image_grid_thw", "feature_attention_mask"} <= batch["media"].keys()
    for host, on_device in tensors:
        assert on_device.device.type == "meta" and on_device.shape == host.shape and on_device.dtype == host.dtype
        assert serve_clef.host_values(on_device) is host


def test_the_collation_hands_a_lone_record_s_media_on_and_joins_several_records(loaded, mixed_requests):
    """A lone record's media tensors reach the batch as they are (a video's patches are megabytes, which a join of a
    list of one would copy); several records' are joined in record order, as torch.cat joins them."""
    encoded = [serve_clef.prepare(loaded, request, 4096).encoded for request in mixed_requests]
    with_video = next(record for record in encoded if "pixel_values_videos" in (record.media or {}))
    pad_token_id = loaded.processor.tokenizer.pad_token_id
    alone = loaded.schema.collate_records([with_video], pad_token_id, "cpu")["media"]
    assert alone["pixel_values_videos"] is with_video.media["pixel_values_videos"]
    together = loaded.schema.collate_records([with_video, with_video], pad_token_id, "cpu")["media"]
    patches = with_video.media["pixel_values_videos"]
    assert torch.equal(together["pixel_values_videos"], torch.cat([patches, patches]))


def test_a_batch_moved_to_the_device_is_read_from_its_host_copy():
    """What the forward reads on the host of a batch host_to_device moved (the token ids, for the embedding lookups)
    comes from the host tensor it was copied from, never back from the device: the meta device keeps no values, so
    a read-back from it raises."""
    token_ids = torch.tensor([[5, 7, 9], [3, 0, 0]])  # [B, L]
    on_device = serve_clef.host_to_device(token_ids, torch.device("meta"))
    assert on_device.device.type == "meta" and serve_clef.host_values(on_device) is token_ids
    embedding = serve_clef.HostEmbedding(torch.nn.Embedding(16, 4))
    embedding.device = torch.device("meta")
    looked_up = embedding(on_device)
    assert looked_up.device.type == "meta" and looked_up.shape == (2, 3, 4)
    assert torch.equal(serve_clef.host_values(token_ids), token_ids)  # a tensor made elsewhere: its own values


def thinker_hidden_states(loaded, encoded_records: list) -> torch.Tensor:
    """The thinker's final hidden states [B, L, H] of a batch, collated and run as the decision module runs it."""
    batch = loaded.schema.collate_records(encoded_records, loaded.processor.tokenizer.pad_token_id, "cpu")
    media = dict(batch["media"])
    use_audio_in_video = media.pop("use_audio_in_video", False)
    for key in ("pixel_values", "pixel_values_videos", "input_features"):
        if key in media:
            media[key] = media[key].to(torch.bfloat16)
    with torch.inference_mode():
        return loaded.model.thinker(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    use_cache=False, use_audio_in_video=use_audio_in_video, **media).logits


def assert_hidden_states_close(hidden: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """A record's hidden states [T, H] against a reference run of it: within HIDDEN_NOISE of the reference's largest
    value at all but the few tokens whose routing may switch an expert on BF16 rounding."""
    token_error = (hidden.float() - reference.float()).abs().amax(-1)  # [T]
    beyond_noise = (token_error > HIDDEN_NOISE * reference.float().abs().max()).float().mean().item()
    assert beyond_noise <= MOST_TOKENS_SWITCHING_EXPERT, f"{what}: {beyond_noise:.0%} of tokens differ"


def test_a_mixed_batch_runs_as_each_record_alone(loaded, stock_loaded, mixed_requests):
    """One packed forward of five records (text, image, audio, video) against each record alone through
    transformers' own text decoder: hidden states token by token, then the answers (the decision module's
    systemone); and the same batch twice gives bit-identical logits."""
    prepared = [serve_clef.prepare(loaded, request, 4096) for request in mixed_requests]
    encoded = [record.encoded for record in prepared]
    packed = thinker_hidden_states(loaded, encoded)
    for index, record in enumerate(encoded):
        alone = thinker_hidden_states(stock_loaded, [record])[0]  # [T, H]
        assert_hidden_states_close(packed[index, :len(record.input_ids)], alone, f"record {index}")
        assert not packed[index, len(record.input_ids):].any()  # the padding of the batch stays zero

    batch_logits = serve_clef.score_records(loaded, encoded)
    for request, record, logits in zip(mixed_requests, prepared, batch_logits):
        reference = stock_loaded.schema.systemone(stock_loaded.model, stock_loaded.processor, request, 4096)
        answers = serve_clef.answer(loaded, record, logits)["answers"]
        assert largest_difference(answers, reference["answers"]) <= ANSWER_NOISE
    again = serve_clef.score_records(loaded, encoded)
    assert all(torch.equal(a, b) for first, second in zip(batch_logits, again) for a, b in zip(first, second))


def test_a_batch_of_records_of_one_length_runs_as_each_record_alone(loaded, stock_loaded):
    """Two different texts of the same token count in one forward: no record is padded, so the decoder packs none
    out (its rows as they lie, not gathered by an index); each record's hidden states against the record alone
    through transformers' own text decoder."""
    by_length = {}
    for state in ("red", "blue", "north", "south", "yes", "no"):
        encoded = serve_clef.prepare(loaded, {**REQUESTS[0], "state": state}, 4096).encoded
        by_length.setdefault(len(encoded.input_ids), []).append(encoded)
    first, second = next(records for records in by_length.values() if len(records) > 1)[:2]
    assert first.input_ids != second.input_ids
    packed = thinker_hidden_states(loaded, [first, second])
    for index, record in enumerate((first, second)):
        assert_hidden_states_close(packed[index], thinker_hidden_states(stock_loaded, [record])[0], f"record {index}")


def test_tower_steps_give_each_tower_layer_s_own_outputs(loaded, png_bytes, wav_bytes, mp4_with_audio_bytes,
                                                          monkeypatch):
    """Each tower layer runs on static buffers padded to a bucket (on CUDA, from its graph). The towers' outputs equal
    those of their own layers run on their own inputs: bit for bit for the final hidden states, to float rounding for
    the deepstack features, for two images of different sizes, a video and two sounds. A forward with more sequences
    than the graphs take runs the layers themselves."""
    request = {**REQUESTS[0], "images": [data_url("image/png", png_bytes),
                                         data_url("image/png", synthetic_release.synthetic_png(48, 80))],
               "videos": [data_url("video/mp4", mp4_with_audio_bytes)],
               "audio": [data_url("audio/wav", wav_bytes), data_url("audio/wav", synthetic_release.synthetic_wav(2.5))]}
    media = serve_clef.prepare(loaded, request, 4096).encoded.media
    vision, audio = sorted(serve_clef.thinker_towers(loaded.model.thinker), key=lambda t: "Audio" in type(t).__name__)
    run_layers = []  # (tower graphs, layer index, bucket) of each layer run on the static buffers
    run_layer = serve_clef.TowerGraphs.run_layer
    monkeypatch.setattr(serve_clef.TowerGraphs, "run_layer",
                        lambda graphs, index, bucket: run_layers.append((graphs, index, bucket)) or run_layer(
                            graphs, index, bucket))

    def own_layers(tower, layers, forward):  # the tower's forward with its own layers in place of the steps
        steps = list(layers)
        for index, step in enumerate(steps):
            layers[index] = step.layer
        try:
            return forward()
        finally:
            for index, step in enumerate(steps):
                layers[index] = step

    with torch.inference_mode():
        for pixels, grid in ((media["pixel_values"], media["image_grid_thw"]),
                             (media["pixel_values_videos"], media["video_grid_thw"])):
            pixels, grid = torch.as_tensor(pixels).to(torch.bfloat16), torch.as_tensor(grid)
            run_layers.clear()
            stepped = vision(pixels, grid_thw=grid)
            assert [index for _, index, _ in run_layers] == list(range(vision.config.depth))
            assert run_layers[0][2] >= pixels.shape[0]  # a bucket that holds every patch
            own = own_layers(vision, vision.blocks, lambda: vision(pixels, grid_thw=grid))
            assert torch.equal(stepped.pooler_output, own.pooler_output)
            for stepped_features, own_features in zip(stepped.deepstack_features, own.deepstack_features, strict=True):
                torch.testing.assert_close(stepped_features, own_features)
        features = torch.as_tensor(media["input_features"]).to(torch.bfloat16)  # [N, mel bins, frames]
        feature_mask = torch.as_tensor(media["feature_attention_mask"]).bool()  # [N, frames]
        input_features = features.permute(0, 2, 1)[feature_mask].permute(1, 0)  # [mel bins, frames of both]
        feature_lens = feature_mask.sum(-1)
        run_layers.clear()
        stepped = audio(input_features, feature_lens=feature_lens)
        assert [index for _, index, _ in run_layers] == list(range(audio.config.encoder_layers))
        own = own_layers(audio, audio.layers, lambda: audio(input_features, feature_lens=feature_lens))
        assert torch.equal(stepped.last_hidden_state, own.last_hidden_state)

        monkeypatch.setattr(serve_clef, "TOWER_MOST_SEQUENCES", 1)  # two images: more sequences than graphs take
        run_layers.clear()
        pixels = torch.as_tensor(media["pixel_values"]).to(torch.bfloat16)
        grid = torch.as_tensor(media["image_grid_thw"])
        alone = vision(pixels, grid_thw=grid)
        assert not run_layers
        assert torch.equal(alone.pooler_output, own_layers(vision, vision.blocks,
                                                           lambda: vision(pixels, grid_thw=grid)).pooler_output)


def test_the_towers_attend_within_each_image_and_sound(loaded, png_bytes, wav_bytes):
    """The towers run the packed attention: one call per layer for all of a record's images (or audio windows), not
    causal, with each image's (window's) own boundaries, which the test above holds to attention within each. Their
    own SDPA path (a call per image or window) gives the same hidden states to BF16 noise, for a record with two
    images of different sizes and two sounds of different lengths."""
    towers = serve_clef.thinker_towers(loaded.model.thinker)
    assert [tower.config._attn_implementation for tower in towers] == [serve_clef.PACKED_ATTENTION] * 2
    request = {**REQUESTS[0], "images": [data_url("image/png", png_bytes),
                                         data_url("image/png", synthetic_release.synthetic_png(48, 80))],
               "audio": [data_url("audio/wav", wav_bytes), data_url("audio/wav", synthetic_release.synthetic_wav(2.5))]}
    record = serve_clef.prepare(loaded, request, 4096).encoded
    tower_calls = []  # (attention module's class, is_causal, boundaries) of each call from a tower

    def recording_attention(module, *args, **kwargs):
        if "Vision" in type(module).__name__ or "Audio" in type(module).__name__:
            tower_calls.append((type(module).__name__, kwargs["is_causal"], kwargs["cu_seq_lens_q"].tolist()))
        return serve_clef.packed_records_attention(module, *args, **kwargs)

    serve_clef.transformers.AttentionInterface.register(serve_clef.PACKED_ATTENTION, recording_attention)
    try:
        packed = thinker_hidden_states(loaded, [record])[0]  # [T, H]
    finally:
        serve_clef.transformers.AttentionInterface.register(serve_clef.PACKED_ATTENTION,
                                                            serve_clef.packed_records_attention)
    vision, audio = sorted(towers, key=lambda tower: "Audio" in type(tower).__name__)
    vision_calls = [call for call in tower_calls if "Vision" in call[0]]
    audio_calls = [call for call in tower_calls if "Audio" in call[0]]
    assert len(vision_calls) == vision.config.depth and len(audio_calls) == audio.config.encoder_layers
    assert all(not causal for _, causal, _ in tower_calls)
    # the tower's steps pad its patches to a bucket, as one more sequence, and leave the remaining sequences empty
    patches = int(torch.as_tensor(record.media["image_grid_thw"]).prod(-1).sum())
    image_boundaries = {tuple(b for b in boundaries if b <= patches) for _, _, boundaries in vision_calls}
    assert len(image_boundaries) == 1 and len(*image_boundaries) == 3  # the same in every layer: two images
    image_lengths = [b - a for a, b in zip(*image_boundaries, next(iter(image_boundaries))[1:])]
    assert image_lengths[0] != image_lengths[1] and sum(image_lengths) == patches  # two sizes, every patch
    assert all(set(boundaries[3:]) == {boundaries[3]} and boundaries[3] >= patches for _, _, boundaries in vision_calls)
    assert all(len(boundaries) >= 3 for _, _, boundaries in audio_calls)  # two sounds at least
    try:
        for tower in towers:
            tower.config._attn_implementation = "sdpa"
        own = thinker_hidden_states(loaded, [record])[0]
    finally:
        for tower in towers:
            tower.config._attn_implementation = serve_clef.PACKED_ATTENTION
    assert_hidden_states_close(packed, own, "the towers' own attention")


def test_the_vision_encoder_takes_its_positions_from_host_grids(loaded, png_bytes, mp4_with_audio_bytes, monkeypatch):
    """The vision encoder's pre-hook computes its interpolation, rotary positions and boundaries from a host copy of
    the grids, and the encoder takes them as given; its outputs are those it computes itself from the grids (its
    forward called without the hook), for two images of different sizes and a video."""
    vision = next(tower for tower in serve_clef.thinker_towers(loaded.model.thinker)
                  if type(tower).__name__ == "Qwen3OmniMoeVisionEncoder")
    modeling = sys.modules[type(vision).__module__]  # where the encoder's forward looks its helpers up
    given = []  # per helper call inside the encoder: whether its value came precomputed in kwargs

    def recording(helper, key):
        def call(*args, kwargs=None, **options):
            given.append(kwargs is not None and key in kwargs)
            return helper(*args, kwargs=kwargs, **options)
        return call

    for name, key in (("get_vision_interpolation_indices_and_weights", "interp_indices"),
                      ("get_vision_position_ids", "position_ids"), ("get_vision_attention_seqlens", "cu_seqlens")):
        monkeypatch.setattr(modeling, name, recording(getattr(modeling, name), key))
    request = {**REQUESTS[0], "images": [data_url("image/png", png_bytes),
                                         data_url("image/png", synthetic_release.synthetic_png(48, 80))],
               "videos": [data_url("video/mp4", mp4_with_audio_bytes)]}
    media = serve_clef.prepare(loaded, request, 4096).encoded.media
    assert len(vision._forward_pre_hooks) == 1
    for pixels, grid in ((media["pixel_values"], media["image_grid_thw"]),
                         (media["pixel_values_videos"], media["video_grid_thw"])):
        pixels = torch.as_tensor(pixels).to(torch.bfloat16)
        with torch.inference_mode():
            given.clear()
            hooked = vision(pixels, grid_thw=torch.as_tensor(grid))
            assert given == [True] * 3
            given.clear()
            own = vision.forward(pixels, grid_thw=torch.as_tensor(grid))  # no hook: computed inside, from the grids
            assert given == [False] * 3
        assert torch.equal(hooked.pooler_output, own.pooler_output)
        assert all(torch.equal(a, b) for a, b in zip(hooked.deepstack_features, own.deepstack_features, strict=True))


def test_the_audio_encoder_takes_its_chunks_and_windows_from_host_lengths(loaded, wav_bytes, monkeypatch):
    """The audio encoder's pre-hook cuts its features into chunks and computes the frames its convolutions keep and
    its attention windows from a host copy of the clips' lengths, and the encoder takes them as given; its outputs are
    those it computes itself from the lengths (its forward called without the hook), for a clip of two chunks and one
    of several attention windows."""
    audio = next(tower for tower in serve_clef.thinker_towers(loaded.model.thinker)
                 if type(tower).__name__ == "Qwen3OmniMoeAudioEncoder")
    modeling = sys.modules[type(audio).__module__]  # where the encoder's forward looks its helpers up
    given = {}  # helper: whether the encoder's forward found its value precomputed in its kwargs (its first call
    # with kwargs: the hook calls the helpers without, and the layers pass their window length to get_max_seqlen)

    def recording(helper, name, key):
        def call(*args, kwargs=None, **options):
            if kwargs is not None:
                given.setdefault(name, key in kwargs)
            return helper(*args, kwargs=kwargs, **options)
        return call

    for name, key in (("chunk_and_pad_features", "padded_feature"), ("get_valid_indices", "valid_indices"),
                      ("get_audio_cu_seqlens", "cu_seqlens"), ("get_max_seqlen", "max_seqlen")):
        monkeypatch.setattr(modeling, name, recording(getattr(modeling, name), name, key))
    long_clip = synthetic_release.synthetic_wav(9.3, frequency=300.0)  # 930 frames: windows of 800 and the rest
    request = {**REQUESTS[0], "audio": [data_url("audio/wav", wav_bytes), data_url("audio/wav", long_clip)]}
    media = serve_clef.prepare(loaded, request, 4096).encoded.media
    mask = torch.as_tensor(media["feature_attention_mask"]).bool()  # [clips, frames]
    features = torch.as_tensor(media["input_features"]).permute(0, 2, 1)[mask].permute(1, 0)  # [mel, real frames]
    lengths = mask.sum(1)  # [clips], as the thinker hands them over
    assert len(audio._forward_pre_hooks) == 1
    with torch.inference_mode():
        given.clear()
        hooked = audio(features, feature_lens=lengths)
        assert given == dict.fromkeys(serve_clef.AUDIO_WINDOW_HELPERS, True)
        given.clear()
        own = audio.forward(features, feature_lens=lengths)  # no hook: computed inside, from the lengths
        assert given == dict.fromkeys(serve_clef.AUDIO_WINDOW_HELPERS, False)
    assert torch.equal(hooked.last_hidden_state, own.last_hidden_state)


def test_placeholder_masks_are_transformers_own_with_the_count_checked_on_the_host(loaded, png_bytes,
                                                                                  mp4_with_audio_bytes):
    """placeholder_masks_checked_on_host against transformers' get_placeholder_mask on a batch with an image, a
    video and its soundtrack: the same three masks, and features of another count refused as transformers refuses
    them (ValueError)."""
    requests = [{**REQUESTS[0], "images": [data_url("image/png", png_bytes)]},
                {**REQUESTS[0], "videos": [data_url("video/mp4", mp4_with_audio_bytes)]}]
    encoded = [serve_clef.prepare(loaded, request, 4096).encoded for request in requests]
    batch = loaded.schema.collate_records(encoded, loaded.processor.tokenizer.pad_token_id, "cpu")
    module = next(module for module in loaded.model.thinker.modules() if "get_placeholder_mask" in module.__dict__)
    input_ids = batch["input_ids"]
    hidden = loaded.model.thinker.config.text_config.hidden_size
    inputs_embeds = torch.zeros(*input_ids.shape, hidden)
    image_tokens = int((input_ids == module.config.image_token_id).sum())
    video_tokens = int((input_ids == module.config.video_token_id).sum())
    assert image_tokens and video_tokens
    for image_features, video_features in ((torch.zeros(image_tokens, hidden), torch.zeros(video_tokens, hidden)),
                                           (None, None)):
        ours = module.get_placeholder_mask(input_ids, inputs_embeds, image_features, video_features)
        theirs = type(module).get_placeholder_mask(module, input_ids, inputs_embeds, image_features, video_features)
        assert len(ours) == len(theirs) == 3 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    for wrong in ({"image_features": torch.zeros(image_tokens + 1, hidden)},
                  {"video_features": torch.zeros(video_tokens - 1, hidden)}):
        with pytest.raises(ValueError):
            type(module).get_placeholder_mask(module, input_ids, inputs_embeds, **wrong)
        with pytest.raises(ValueError, match="do not match"):
            module.get_placeholder_mask(input_ids, inputs_embeds, **wrong)


def test_a_transformers_whose_placeholder_masks_differ_keeps_its_own(loaded, monkeypatch):
    thinker = loaded.model.thinker
    modules = [module for module in thinker.modules() if "get_placeholder_mask" in module.__dict__]
    assert modules
    for module in modules:
        monkeypatch.delitem(module.__dict__, "get_placeholder_mask")
        library = type(module).get_placeholder_mask

        def audio_unmarked(self, *args, _library=library, **kwargs):  # a transformers that marks no audio token
            image_mask, video_mask, audio_mask = _library(self, *args, **kwargs)
            return image_mask, video_mask, torch.zeros_like(audio_mask)
        monkeypatch.setattr(type(module), "get_placeholder_mask", audio_unmarked)
    lines = []
    serve_clef.install_placeholder_masks_checked_on_host(thinker, lines.append)
    assert not any("get_placeholder_mask" in module.__dict__ for module in modules)
    assert lines == [("placeholder masks: transformers' own (placeholder_masks_checked_on_host differs from it on a "
                      "check batch)")]
    monkeypatch.undo()  # transformers' own masks again, and ours installed as the load left them
    for module in modules:
        del module.get_placeholder_mask
    serve_clef.install_placeholder_masks_checked_on_host(thinker, lines.append)
    assert all("get_placeholder_mask" in module.__dict__ for module in modules) and len(lines) == 1


def test_padding_to_a_bucket_keeps_every_answer(loaded, stock_loaded):
    decoder = next(m for m in loaded.model.modules() if isinstance(m, serve_clef.PackedTextDecoder))
    padded_lengths = []
    run_padded = decoder.run_padded

    def recording_run_padded(inputs_embeds, *other_inputs):
        padded_lengths.append(inputs_embeds.shape[1])
        return run_padded(inputs_embeds, *other_inputs)

    decoder.run_padded = recording_run_padded
    try:
        padded = [serve_clef.decide(loaded, request, 4096) for request in REQUESTS]
    finally:
        del decoder.run_padded
    tokens = [response["usage"]["input_tokens"] for response in padded]
    # each record ran padded to the smallest bucket that holds it, and past its own length
    assert padded_lengths == [min(b for b in serve_clef.DECODER_BUCKETS if b >= length) for length in tokens]
    assert all(bucket > length for bucket, length in zip(padded_lengths, tokens))
    for request, response in zip(REQUESTS, padded):
        reference = stock_loaded.schema.systemone(stock_loaded.model, stock_loaded.processor, request, 4096)
        assert largest_difference(response["answers"], reference["answers"]) <= ANSWER_NOISE


def test_the_static_inputs_hold_the_count_and_chunk_table_the_graphs_read(loaded, monkeypatch):
    """Besides its tensors, a graph reads the real tokens' count and the attention's chunk table from one static
    buffer, which write_counts fills in one copy: static_views must show every bucket's graphs exactly what
    query_chunks made, the table of a batch of fewer records leaving nothing of a longer one's behind."""
    decoder = next(m for m in loaded.model.modules() if isinstance(m, serve_clef.PackedTextDecoder))
    monkeypatch.setattr(decoder, "static_buffers", None)  # buffers of its own, on the CPU
    monkeypatch.setattr(decoder, "position_rows", decoder.position_rows or 3)
    like = torch.zeros(1, 1, loaded.model.thinker.config.text_config.hidden_size, dtype=torch.bfloat16)
    small, large = decoder.buckets[1], decoder.buckets[-1]
    decoder.static_views(large, like)  # the buffers made, as before a capture or a replay
    for real_tokens, boundaries in ((large - 7, [0, 5, 300, 301, large - 7, large]), (100, [0, 40, 100, small])):
        decoder.write_counts(real_tokens, boundaries)
        expected = torch.from_numpy(serve_clef.query_chunks(boundaries, serve_clef.MAX_QUERY_CHUNKS))  # [2, C + 1]
        for bucket in (small, large):
            _, _, chunks, _, count, _ = decoder.static_views(bucket, like)
            assert count.tolist() == [real_tokens]
            assert chunks.shape == expected.shape and torch.equal(chunks, expected)


def test_one_record_batches_replay_their_own_graphs_and_tell_the_attention(loaded, monkeypatch):
    """On CUDA a bucket has two graphs: a batch of one record replays the one whose text-decoder attention was told
    `one_record` (cuDNN's causal attention, which is only right when nothing but padding follows the record), a
    batch of several the other (packed_causal_attention). Here fake graphs record which one a batch replays, and the
    flag is followed through transformers' decoder into the attention calls."""
    decoder = next(m for m in loaded.model.modules() if isinstance(m, serve_clef.PackedTextDecoder))
    replayed = []

    class RecordingGraph:
        def __init__(self, key):
            self.key = key

        def replay(self):
            replayed.append(self.key)

    monkeypatch.setattr(decoder, "graphs", {(bucket, one): RecordingGraph((bucket, one))
                                            for bucket in decoder.buckets for one in (False, True)})
    encoded = [serve_clef.prepare(loaded, request, 4096).encoded for request in REQUESTS]
    serve_clef.score_records(loaded, encoded[:1])
    serve_clef.score_records(loaded, encoded)
    alone = min(b for b in decoder.buckets if b >= len(encoded[0].input_ids))
    together = min(b for b in decoder.buckets if b >= sum(len(record.input_ids) for record in encoded))
    assert replayed == [(alone, True), (together, False)]
    # where cuDNN's attention could not be captured (no one-record graphs), a record alone takes the other graph
    monkeypatch.setattr(decoder, "graphs", {(bucket, False): RecordingGraph((bucket, False))
                                            for bucket in decoder.buckets})
    serve_clef.score_records(loaded, encoded[:1])
    assert replayed[-1] == (alone, False)

    monkeypatch.setattr(decoder, "graphs", {})
    text_calls = []

    def recording_attention(module, *args, **kwargs):
        if kwargs.get("is_causal", True):  # the text decoder's (the towers pass is_causal=False)
            text_calls.append(kwargs.get("one_record"))
        return serve_clef.packed_records_attention(module, *args, **kwargs)

    serve_clef.transformers.AttentionInterface.register(serve_clef.PACKED_ATTENTION, recording_attention)
    try:
        embeds = torch.zeros(1, 64, loaded.model.thinker.config.text_config.hidden_size, dtype=torch.bfloat16)
        positions = torch.arange(64).expand(decoder.position_rows, 1, 64)
        chunks = torch.from_numpy(serve_clef.query_chunks([0, 64], 4))
        with torch.inference_mode():
            decoder.run_padded(embeds, positions, chunks, None, one_record=True)
            decoder.run_padded(embeds, positions, chunks, None)
    finally:
        serve_clef.transformers.AttentionInterface.register(serve_clef.PACKED_ATTENTION,
                                                            serve_clef.packed_records_attention)
    layers = len(decoder.decoder.layers)
    assert text_calls == [True] * layers + [False] * layers


def test_compiled_layers_answer_as_transformers_own_decoder(stock_loaded):
    """On CUDA the engine compiles the decoder layers (torch.compile, any length) before capturing its graphs; here
    Inductor compiles them for CPU, and a packed batch of two lengths still answers as transformers' own eager
    decoder, with the packed experts run by their Triton kernels outside the compiled graphs, as served on CUDA."""
    compiled = serve_clef.load_clef("synthetic", device="cpu", expert_kernels="triton", progress=lambda line: None)
    decoder = next(m for m in compiled.model.modules() if isinstance(m, serve_clef.PackedTextDecoder))
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    decoder.compile_layers()
    prepared = [serve_clef.prepare(compiled, request, 4096) for request in REQUESTS]
    batch_logits = serve_clef.score_records(compiled, [record.encoded for record in prepared])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before  # the layers did run compiled
    for request, record, logits in zip(REQUESTS, prepared, batch_logits):
        reference = stock_loaded.schema.systemone(stock_loaded.model, stock_loaded.processor, request, 4096)
        answers = serve_clef.answer(compiled, record, logits)["answers"]
        assert largest_difference(answers, reference["answers"]) <= ANSWER_NOISE


@pytest.mark.parametrize("expert_kernels", ["triton", "unpack"])
def test_the_residual_added_by_the_experts_gives_transformers_decoder_layer_bit_for_bit(stock_loaded, expert_kernels,
                                                                                       monkeypatch):
    """ResidualInTopKSumLayer against transformers' own decoder layer on the same modules: the residual add after the
    MoE block, done by the packed experts (the Triton kernels' top-k sum, here interpreted, with a bucket's padding
    past the real tokens; or torch's add after the unpacked experts), gives the layer's output bit for bit."""
    text_model = stock_loaded.model.thinker.model.language_model  # transformers' own, as the fixture put it back
    layer = text_model.layers[1]
    assert serve_clef.ResidualInTopKSumLayer.fusable(layer)
    stand_in = serve_clef.ResidualInTopKSumLayer(layer)
    assert dict(stand_in.named_parameters()) == dict(layer.named_parameters())  # the same weights, the same names
    num_tokens = 40
    monkeypatch.setattr(layer.mlp.experts, "kernels", expert_kernels)
    if expert_kernels == "triton":  # the last 3 tokens a bucket's padding, whose pairs are routed nowhere
        monkeypatch.setattr(layer.mlp.experts, "real_tokens", torch.tensor([num_tokens - 3], dtype=torch.int32))
    generator = torch.Generator().manual_seed(5)
    # small, as a residual stream is next to this random model's MoE outputs, so that both shape each sum's bits
    hidden_states = (torch.randn(1, num_tokens, text_model.config.hidden_size, generator=generator)
                     * 0.05).to(torch.bfloat16)
    positions = torch.arange(num_tokens).expand(3, 1, num_tokens)
    position_embeddings = text_model.rotary_emb(hidden_states, positions)
    with torch.inference_mode():
        expected = layer(hidden_states, position_embeddings=position_embeddings)
        got = stand_in(hidden_states, position_embeddings=position_embeddings)
        moe_output = expected - (hidden_states + layer.self_attn(layer.input_layernorm(hidden_states),
                                                                 position_embeddings, None)[0])
    assert moe_output.abs().max() > 0.1 * hidden_states.abs().max()  # the experts' share is not lost in rounding
    assert got.shape == expected.shape and torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_a_batch_with_an_image_leaves_no_features_behind(loaded, png_bytes):
    """Deepstack features sit in a static buffer that every bucket shares: a text answered after a batch whose image
    tokens lie past the next batch's smaller bucket answers bit for bit as it did before them."""
    short, text = REQUESTS[0], {**REQUESTS[1], "state": REQUESTS[1]["state"]["ticket"] * 3}
    before = serve_clef.decide(loaded, text, 4096)
    batch = [serve_clef.prepare(loaded, request, 4096).encoded
             for request in (short, {**short, "images": [data_url("image/png", png_bytes)]})]
    image_token = loaded.model.thinker.config.image_token_id
    image_positions = [len(batch[0].input_ids) + i for i, token in enumerate(batch[1].input_ids) if token == image_token]
    serve_clef.score_records(loaded, batch)
    short_bucket = min(b for b in serve_clef.DECODER_BUCKETS if b >= len(batch[0].input_ids))
    serve_clef.decide(loaded, short, 4096)  # padded to short_bucket, below some of the image's tokens
    assert short_bucket < image_positions[-1] < before["usage"]["input_tokens"]
    assert serve_clef.decide(loaded, text, 4096)["answers"] == before["answers"]


def test_decide_answers_as_the_decision_modules_own_systemone(loaded, png_bytes, wav_bytes, mp4_with_audio_bytes):
    """The server's walk (encode once, forward, answer) against the reference that does it all in one call, on the
    same model: the same forward, so the same answers."""
    media = [{}, {"images": [data_url("image/png", png_bytes)]}, {"audio": [data_url("audio/wav", wav_bytes)]},
             {"videos": [data_url("video/mp4", mp4_with_audio_bytes)]}]
    for text in REQUESTS:
        for medium in media:  # each medium alone with the text
            request = {**text, **medium}
            ours = serve_clef.decide(loaded, request, 4096)
            reference = loaded.schema.systemone(loaded.model, loaded.processor, request, 4096)
            assert ours["answers"] == reference["answers"]
            assert ours["usage"]["input_tokens"] == reference["usage"]["input_tokens"]


def test_videos_with_and_without_soundtrack_never_share_a_forward(loaded, mp4_with_audio_bytes, mp4_silent_bytes):
    text = REQUESTS[0]
    with_sound, silent, plain = (serve_clef.prepare(loaded, request, 4096).encoded for request in (
        {**text, "videos": [data_url("video/mp4", mp4_with_audio_bytes)]},
        {**text, "videos": [data_url("video/mp4", mp4_silent_bytes)]},
        text,
    ))
    assert serve_clef.batch_compatible([with_sound, plain]) and serve_clef.batch_compatible([silent, plain])
    assert not serve_clef.batch_compatible([with_sound, silent, plain])


def test_out_of_memory_in_a_batch_retries_each_record_alone(loaded, monkeypatch):
    """A batch that does not fit is scored record by record; only the record that does not fit alone gets None
    (answered 413), and the others get the logits they get alone."""
    encoded = [serve_clef.prepare(loaded, request, 4096).encoded for request in REQUESTS * 2]
    alone = [serve_clef.score_records(loaded, [record])[0] for record in encoded]
    longest = max(len(record.input_ids) for record in encoded)
    forward = loaded.model._forward_unpadded
    batch_sizes = []

    def forward_with_little_memory(batch):
        batch_sizes.append(batch["input_ids"].shape[0])
        if batch["input_ids"].shape[0] > 1 or batch["input_ids"].shape[1] == longest:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return forward(batch)

    monkeypatch.setattr(loaded.model, "_forward_unpadded", forward_with_little_memory)
    scored = serve_clef.score_records(loaded, encoded)
    assert batch_sizes == [4, 1, 1, 1, 1]
    for record, logits, logits_alone in zip(encoded, scored, alone):
        if len(record.input_ids) == longest:
            assert logits is None
        else:
            assert all(torch.equal(a, b) for a, b in zip(logits, logits_alone))


def test_the_device_gathers_host_rows_as_index_select_does():
    """gather_host_rows_kernel (on CUDA it reads a pinned host table over the bus; here Triton's interpreter runs it
    on CPU tensors) gives the rows torch.index_select gives, for row counts that are and are not multiples of its 4
    rows a program, repeated ids and the table's first and last rows, a width that is not a power of two."""
    generator = torch.Generator().manual_seed(4)
    table = torch.randn(50, 24, generator=generator).to(torch.bfloat16)  # [V, D]
    for row_ids in (torch.tensor([0, 49, 7, 7, 3]), torch.randint(0, 50, (8,), generator=generator)):
        rows = torch.empty(row_ids.numel(), 24, dtype=torch.bfloat16)
        serve_clef.gather_host_rows_kernel[(serve_clef.triton.cdiv(row_ids.numel(), 4),)](
            table, row_ids, row_ids, rows, row_ids.numel(), 24, BLOCK_D=32, COUNTED=False)
        assert torch.equal(rows, torch.index_select(table, 0, row_ids))
    # counted: the rows from the count on are padding, zeros whatever their ids
    row_ids = torch.tensor([5, 9, 9, 1, 0, 0, 0])
    rows = torch.full((7, 24), float("nan"), dtype=torch.bfloat16)
    serve_clef.gather_host_rows_kernel[(2,)](table, row_ids, torch.tensor([3]), rows, 7, 24, BLOCK_D=32, COUNTED=True)
    assert torch.equal(rows[:3], torch.index_select(table, 0, row_ids[:3])) and not rows[3:].any()
