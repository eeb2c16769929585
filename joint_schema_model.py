"""The Clef-Omni decision API: prompt, token spans, joint schema head and answers.

serve_clef's own implementation of the `joint_schema_model.py` that Cloudflare ships with its Clef-Omni release,
compatible name for name: the same constants, functions, classes, prompt pieces, spans, head parameter names and
answers. A Clef-Omni model directory that carries its own copy is served through that copy; this one serves every
other directory and is the reference the tests pin (see docs/decision-api.md).

Flow: `encode_record` renders a record (state, questions, media) into token ids with the spans of every question and
option; `collate_records` batches encoded records; `ClefModel` runs the Qwen3-Omni thinker once per record and scores
every option with `JointSchemaHead`; `systemone` validates a request and turns the option logits into answers.

Dimension letters: B records, T tokens, H thinker hidden, W head width, V vocabulary, N options of a record,
Q questions of a record.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import inspect
import io
import itertools
import json
import math
import re
import urllib.request
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# ---- constants -------------------------------------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. "
    "Each answer must be exactly one of that field's allowed options."
)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>\n"
AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>\n"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>\n"
MEDIA_BATCH_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "video_second_per_grid")
AUDIO_BATCH_KEYS = ("input_features", "feature_attention_mask")
QUESTION_TYPES = {"noul": 0, "choice": 1, "score": 2}  # value = row of JointSchemaHead.type_embedding
DEFAULT_MAX_LENGTH = 64000
AUDIO_SAMPLE_RATE = 16_000
VIDEO_FPS = 2.0
MAX_VIDEO_FRAME_PIXELS = 256 * 32 * 32
# FFmpeg reads up to 5 MB of a stream when it opens it, to find parameters that WAV, MP3 and MP4 headers state
# already: a 10 s WAV paid about 5 ms per open for it. The samples decoded are the same.
AUDIO_OPEN_OPTIONS = {"probesize": "32"}
# Decoded audio goes to the resampler this many seconds at a time rather than frame by frame: each call costs tens of
# microseconds, and a clip has 16 to 40 frames a second; the chunks keep what is held in its decoded format bounded.
AUDIO_RESAMPLE_SECONDS = 30
IMAGE_SIZE = {"shortest_edge": 65_536, "longest_edge": 1_048_576}  # pixel areas: 64 to 1,024 image tokens
_DATA_URL = re.compile(r"^data:[\w.+-]+/[\w.+-]+;base64,(?P<data>.+)$", re.DOTALL)

_NOUL_DEFAULTS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
_PROMPT_PREFIX = "<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\nSTATE:\n"
_PROMPT_SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"


@dataclass(frozen=True)
class EncodedQuestion:
    question_id: str
    question_type: int
    question_span: tuple[int, int]  # half-open [start, end) into input_ids
    option_spans: tuple[tuple[int, int], ...]
    option_ids: tuple[str, ...]


@dataclass(frozen=True)
class EncodedRecord:
    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    record_id: str
    media: dict[str, Any] | None = field(default=None, compare=False, repr=False)


# ---- prompt and spans ------------------------------------------------------------------------------------------------


def render(value: Any) -> str:
    """Strings go to the model verbatim; everything else as compact JSON with sorted keys."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def question_options(question: dict) -> list[tuple[str, Any]]:
    """(option_id, description) pairs in the order the model sees them."""
    if question["type"] == "noul":
        descriptions = dict(_NOUL_DEFAULTS)
        descriptions.update(question.get("criteria") or {})
        return [("true", descriptions["true"]), ("false", descriptions["false"])]
    criteria = question["criteria"]
    if question["type"] == "choice":
        return sorted((str(option_id), description) for option_id, description in criteria.items())
    return [(str(level), description) for level, description in enumerate(criteria)]


# A prompt piece costs the tokenizer tens of microseconds however short it is, and a record has ~50: most of a
# ~512-token record's encode time, where the state alone takes ~0.1 ms. Every piece but the state repeats from record
# to record wherever the questions do, so their ids are kept, per tokenizer, up to _KEPT_PIECES pieces of at most
# _KEPT_PIECE_CHARS characters (then all are dropped and kept afresh), which bounds what they hold (~4 M characters'
# ids a tokenizer); the state's never are. A piece's ids do not depend on the pieces around it.
_KEPT_PIECES = 4096
_KEPT_PIECE_CHARS = 1024  # a longer piece costs the tokenizer mostly for its length: tokenised each time
_kept_piece_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {piece: its ids}


def _piece_token_ids(tokenizer, pieces: list[str], state_piece: int) -> list[list[int]]:
    """`tokenizer(pieces, add_special_tokens=False).input_ids`: each piece tokenised alone, in one call for the
    state and the pieces not kept yet."""
    try:
        kept = _kept_piece_ids.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be a weak dictionary's key (unhashable, say) keeps nothing
        kept = {}
    known = {piece: kept.get(piece) for i, piece in enumerate(pieces) if i != state_piece}
    missing = [piece for piece, ids in known.items() if ids is None]
    state_ids, *missing_ids = tokenizer([pieces[state_piece], *missing], add_special_tokens=False).input_ids
    new = dict(zip(missing, missing_ids))
    keep = {piece: ids for piece, ids in new.items() if len(piece) <= _KEPT_PIECE_CHARS}
    if len(kept) + len(keep) > _KEPT_PIECES:
        kept.clear()
    kept.update(itertools.islice(keep.items(), _KEPT_PIECES))  # a record of more pieces keeps its first ones
    known.update(new)
    return [state_ids if i == state_piece else known[piece] for i, piece in enumerate(pieces)]


def encode_record(
    tokenizer,
    record: dict,
    max_length: int = DEFAULT_MAX_LENGTH,
    max_state_tokens: int | None = None,
    processor=None,
) -> EncodedRecord:
    """Token ids of one record and the spans of its questions and options.

    Every prompt piece is tokenised on its own and the id lists are concatenated, exactly as the model was trained:
    tokenising the joined text would let BPE merges cross piece boundaries. The pieces go to the tokenizer as one
    batch (each item still tokenised alone; one call instead of ~50 saves milliseconds of host time per record).
    Only the end of the state is ever cut. The ids of the pieces other than the state are kept for the next record
    (_piece_token_ids).
    """
    media_ids, media = _encode_media(processor, record)
    # pieces[0] the prefix, [1] the state, [2:-1] the schema, [-1] the suffix; spans are piece numbers until tokenised
    pieces = [_PROMPT_PREFIX, render(record["state"]), "\n\nSCHEMA FIELDS:\n"]
    schema_pieces = []
    for k, (question_id, question) in enumerate(record["questions"].items(), start=1):
        pieces.append(f"\nFIELD {k}\nID: {question_id}\nTYPE: {question['type']}\nINSTRUCTION: ")
        instructions = question.get("instructions")
        if instructions is None or instructions == "":
            instructions = question_id
        question_piece = len(pieces)
        pieces += [render(instructions), "\nALLOWED OPTIONS:\n"]
        option_pieces, option_ids = [], []
        for j, (option_id, description) in enumerate(question_options(question), start=1):
            semantics = {"option_id": option_id}
            if description is not None:
                semantics["description"] = description
            option_pieces.append(len(pieces) + 1)
            pieces += [f"OPTION {j}: ", render(semantics), "\n"]
            option_ids.append(option_id)
        pieces.append("END FIELD\n")
        schema_pieces.append((str(question_id), QUESTION_TYPES[question["type"]], question_piece, option_pieces,
                              option_ids))
    pieces.append(_PROMPT_SUFFIX)
    piece_ids = _piece_token_ids(tokenizer, pieces, state_piece=1)
    prefix_ids, state_ids, suffix_ids = piece_ids[0], piece_ids[1], piece_ids[-1]
    schema_ids = [token for ids in piece_ids[2:-1] for token in ids]
    # where each piece starts in schema_ids (piece 2 at 0), and its span [start, end)
    piece_starts = list(itertools.accumulate((len(ids) for ids in piece_ids[2:-1]), initial=0))

    def piece_span(piece: int) -> tuple[int, int]:
        return (piece_starts[piece - 2], piece_starts[piece - 1])

    schema_questions = [
        (question_id, question_type, piece_span(question_piece), [piece_span(p) for p in option_pieces], option_ids)
        for question_id, question_type, question_piece, option_pieces, option_ids in schema_pieces
    ]

    if max_state_tokens is not None:
        state_ids = state_ids[:max_state_tokens]
    fixed = len(prefix_ids) + len(media_ids) + len(schema_ids) + len(suffix_ids)
    if fixed > max_length:
        raise ValueError(f"schema requires {fixed} tokens before state; maximum is {max_length}")
    state_ids = state_ids[: max_length - fixed]

    schema_offset = len(prefix_ids) + len(media_ids) + len(state_ids)

    def shift(span: tuple[int, int]) -> tuple[int, int]:
        return (span[0] + schema_offset, span[1] + schema_offset)

    input_ids = tuple(prefix_ids + media_ids + state_ids + schema_ids + suffix_ids)
    questions = tuple(
        EncodedQuestion(
            question_id=question_id,
            question_type=question_type,
            question_span=shift(question_span),
            option_spans=tuple(shift(span) for span in option_spans),
            option_ids=tuple(option_ids),
        )
        for question_id, question_type, question_span, option_spans, option_ids in schema_questions
    )
    if not input_ids or not questions:
        raise ValueError("record produced no model input or questions")
    return EncodedRecord(
        input_ids=input_ids, questions=questions, record_id=str(record.get("id", "unknown")), media=media
    )


# ---- media -----------------------------------------------------------------------------------------------------------


def _media_bytes(value) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict):  # {"content_type": ..., "base64": ...}, the SystemOne wire form
        try:
            return base64.b64decode(value["base64"], validate=True)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError("media object needs a valid 'base64' string") from error
    if isinstance(value, str):
        match = _DATA_URL.match(value)
        if match:
            return base64.b64decode(match["data"])
        if value.startswith(("http://", "https://")):
            return urllib.request.urlopen(value).read()
    return Path(value).read_bytes()


def _is_encoded(value) -> bool:
    return isinstance(value, (bytes, bytearray, str, Path, dict))


def load_image(value):
    """An RGB PIL image from a PIL image, bytes, a data URL, a URL or a path."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    try:
        return Image.open(io.BytesIO(_media_bytes(value))).convert("RGB")
    except (Image.UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError) as error:
        raise ValueError(f"image could not be decoded: {error}") from error


@contextlib.contextmanager
def _open_media(data: bytes, what: str, options: dict[str, str] | None = None):
    """A PyAV container over media bytes (FFmpeg `options` for opening it); any FFmpeg failure inside the block becomes
    a ValueError naming the medium."""
    import av

    try:
        with av.open(io.BytesIO(data), options=options) as container:
            yield container
    except av.FFmpegError as error:
        raise ValueError(f"{what} could not be decoded: {error}") from error


def _decode_audio(data: bytes) -> np.ndarray | None:
    """The first audio stream of a container as 16 kHz mono float32 samples, or None when there is none."""
    import av

    with _open_media(data, "audio", AUDIO_OPEN_OPTIONS) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=AUDIO_SAMPLE_RATE)
        decoded = av.AudioFifo()  # frames joined into chunks for the resampler
        chunks = []

        def resample(frame):  # None flushes the resampler
            chunks.extend(resampled.to_ndarray().reshape(-1) for resampled in resampler.resample(frame))

        for frame in container.decode(stream):
            frame.pts = None  # the FIFO takes timestamps only if they run on without a gap; the resampler needs none
            decoded.write(frame)
            if decoded.samples >= AUDIO_RESAMPLE_SECONDS * frame.sample_rate:
                resample(decoded.read())
        if decoded.samples:
            resample(decoded.read())
        resample(None)
    if not chunks:
        return None
    samples = np.concatenate(chunks).astype(np.float32, copy=False)
    return samples if samples.size else None


def load_audio(value) -> np.ndarray:
    """16 kHz mono float32 samples from encoded audio, or raw samples taken as 16 kHz mono."""
    if not _is_encoded(value):
        return np.asarray(value, dtype=np.float32).reshape(-1)
    samples = _decode_audio(_media_bytes(value))
    if samples is None:
        raise ValueError("audio has no decodable audio stream")
    return samples


def load_video(value) -> tuple[np.ndarray, np.ndarray | None]:
    """Frames [T,H,W,3] sampled greedily at 2 fps (T even) and the soundtrack, or None when there is none.

    A value that is not encoded is taken as frames already sampled at 2 fps and returned with no soundtrack.
    """
    if not _is_encoded(value):
        return value, None
    data = _media_bytes(value)
    frames = []
    with _open_media(data, "video") as container:
        if not container.streams.video:
            raise ValueError("video has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            if frame.time is None or frame.time + 1e-6 < len(frames) / VIDEO_FPS:
                continue
            scale = min(1.0, math.sqrt(MAX_VIDEO_FRAME_PIXELS / (frame.width * frame.height)))
            width = max(2, round(frame.width * scale / 2) * 2)
            height = max(2, round(frame.height * scale / 2) * 2)
            # one thread: FFmpeg's scaler otherwise starts a thread per CPU for every frame it converts
            frames.append(frame.to_ndarray(format="rgb24", width=width, height=height, threads=1))
    if not frames:
        raise ValueError("video has no decodable frames")
    if len(frames) % 2:
        frames.append(frames[-1].copy())  # the vision tower groups frames in pairs
    return np.stack(frames), _decode_audio(data)


def _encode_media(processor, record: dict) -> tuple[list[int], dict | None]:
    """Pad-expanded media token ids (images, then audio, then videos) and the processor's tensors."""
    images = [load_image(value) for value in record.get("images") or []]
    audio = [load_audio(value) for value in record.get("audio") or []]
    decoded_videos = [load_video(value) for value in record.get("videos") or []]
    if not images and not audio and not decoded_videos:
        return [], None
    if processor is None:
        raise ValueError("records with images, audio, or videos require a processor")
    videos = [frames for frames, _ in decoded_videos]
    text = IMAGE_PLACEHOLDER * len(images) + AUDIO_PLACEHOLDER * len(audio) + VIDEO_PLACEHOLDER * len(videos)

    # A soundtrack is heard only when every video has one, appended after the standalone clips.
    use_audio_in_video = bool(videos) and all(track is not None for _, track in decoded_videos)
    audio_sources = [None] * len(audio)
    if use_audio_in_video:
        audio += [track for _, track in decoded_videos]
        audio_sources += list(range(len(videos)))

    if videos:
        options = {
            "images_kwargs": {"size": IMAGE_SIZE},
            "videos_kwargs": {"fps": VIDEO_FPS, "do_sample_frames": False},
        }
        if _takes_load_audio_from_video(processor):  # transformers >= 5.2x, where use_audio_in_video is deprecated
            options["load_audio_from_video"] = use_audio_in_video
        else:
            options["videos_kwargs"]["use_audio_in_video"] = use_audio_in_video
    else:
        options = {"size": IMAGE_SIZE}
    options.update(record.get("media_kwargs") or {})
    if use_audio_in_video and _takes_audio_from_video_indices(processor):
        # transformers >= 5.2x must be told which audio slot belongs to which video; older ones take the order above.
        options["audio_from_video_indices"] = audio_sources

    with warnings.catch_warnings():
        # transformers' Qwen3-Omni processor passes torch scalars to np.arange; numpy 2 warns that torch's __array__
        # takes no copy keyword, then converts them correctly all the same.
        warnings.filterwarnings("ignore", r"__array__ implementation doesn't accept a copy keyword", DeprecationWarning)
        encoded = processor(
            text=text,
            images=images or None,
            audio=audio or None,
            videos=videos or None,
            add_special_tokens=False,
            return_tensors="pt",
            **options,
        )
    media = {key: encoded[key] for key in MEDIA_BATCH_KEYS + AUDIO_BATCH_KEYS if key in encoded}
    media["use_audio_in_video"] = use_audio_in_video
    return encoded["input_ids"][0].tolist(), media


def _takes_load_audio_from_video(processor) -> bool:
    """Whether the processor's kwargs (a TypedDict, its bases' keys included) name load_audio_from_video."""
    return "load_audio_from_video" in getattr(getattr(processor, "valid_processor_kwargs", None), "__annotations__", {})


def _takes_audio_from_video_indices(processor) -> bool:
    return "audio_from_video_indices" in inspect.signature(type(processor).__call__).parameters or any(
        "audio_from_video_indices" in inspect.signature(base.__call__).parameters
        for base in type(processor).__mro__
        if "__call__" in vars(base)
    )


# ---- batching --------------------------------------------------------------------------------------------------------


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated on dim 0, a lone one as it is (cat would copy it: a 4 s video's patches are 13.7 MB)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def collate_records(records: list[EncodedRecord], pad_token_id: int, device) -> dict:
    """Right-padded ids and mask [B,T] plus the records' media tensors, concatenated on dim 0."""
    longest = max(len(record.input_ids) for record in records)
    input_ids = torch.full((len(records), longest), pad_token_id, dtype=torch.long)  # [B,T]
    attention_mask = torch.zeros((len(records), longest), dtype=torch.long)  # [B,T]
    for b, record in enumerate(records):
        input_ids[b, : len(record.input_ids)] = torch.tensor(record.input_ids, dtype=torch.long)
        attention_mask[b, : len(record.input_ids)] = 1

    record_media = [record.media or {} for record in records]
    media: dict[str, Any] = {}
    for key in MEDIA_BATCH_KEYS:
        present = [torch.as_tensor(m[key]) for m in record_media if key in m]
        if present:
            media[key] = _joined(present).to(device)
    for key in AUDIO_BATCH_KEYS:
        present = [m[key] for m in record_media if key in m]
        if present:
            frames = max(value.shape[-1] for value in present)
            media[key] = torch.cat([F.pad(value, (0, frames - value.shape[-1])) for value in present], dim=0).to(device)
    video_flags = {bool(m.get("use_audio_in_video", False)) for m in record_media if "pixel_values_videos" in m}
    if len(video_flags) > 1:
        raise ValueError("videos with and without audio tracks cannot share a batch")
    if video_flags == {True}:
        media["use_audio_in_video"] = True
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "records": records,
        "media": media,
    }


# ---- joint schema head -----------------------------------------------------------------------------------------------


class EvidenceRoutingLayer(nn.Module):
    """Pre-norm cross-attention from option queries to the record's memory, then a feedforward; no masks."""

    def __init__(self, width: int, heads: int, feedforward: int, dropout: float = 0.0):
        super().__init__()
        self.query_norm = nn.LayerNorm(width)
        self.memory_norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.attention_dropout = nn.Dropout(dropout)
        self.feedforward_norm = nn.LayerNorm(width)
        self.feedforward = nn.Sequential(
            nn.Linear(width, feedforward),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(feedforward, width),
            nn.Dropout(dropout),
        )

    def forward(self, queries: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:  # [1,N,W], [1,T,W] -> [1,N,W]
        normed_memory = self.memory_norm(memory)
        routed = self.attention(self.query_norm(queries), normed_memory, normed_memory, need_weights=False)[0]
        queries = queries + self.attention_dropout(routed)
        return queries + self.feedforward(self.feedforward_norm(queries))


def _logit_scale(parameter: torch.Tensor) -> torch.Tensor:
    return parameter.clamp(max=math.log(100.0)).exp()  # learned scale, capped at 100, no lower bound


class JointSchemaHead(nn.Module):
    """Scores every option of every question of a record from the thinker's final hidden states."""

    def __init__(self, hidden_size, width, routing_layers, layers, heads, feedforward, dropout=0.0):
        super().__init__()
        self.width = width
        self.hidden_norm = nn.LayerNorm(hidden_size)
        self.memory_projection = nn.Linear(hidden_size, width, bias=False)
        self.question_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_question_projection = nn.Linear(hidden_size, width, bias=False)
        self.global_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_context_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_lexical_projection = nn.Linear(hidden_size, width, bias=False)
        self.type_embedding = nn.Embedding(len(QUESTION_TYPES), width)
        self.evidence_layers = nn.ModuleList(
            EvidenceRoutingLayer(width, heads, feedforward, dropout) for _ in range(routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(
                d_model=width,
                nhead=heads,
                dim_feedforward=feedforward,
                dropout=dropout,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.field_norm = nn.LayerNorm(width)
        self.option_norm = nn.LayerNorm(width)
        self.residual_scorer = nn.Sequential(
            nn.Linear(4 * width, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, 1)
        )
        self.prior_logit_scale = nn.Parameter(torch.tensor(0.0))
        self.joint_logit_scale = nn.Parameter(torch.tensor(0.0))
        self.residual_gate = nn.Parameter(torch.tensor(0.0))

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B,T,H] thinker output after its final norm
        input_ids: torch.Tensor,  # [B,T]
        attention_mask: torch.Tensor,  # [B,T], right padded
        records: list[EncodedRecord],
        output_embedding_weight: torch.Tensor,  # [V,H] the thinker's lm_head rows
    ) -> list[list[torch.Tensor]]:
        normalized = self.hidden_norm(hidden_states)  # [B,T,H]
        batch_logits = []
        for b, record in enumerate(records):
            length = int(attention_mask[b].sum())
            sequence = normalized[b, :length]  # [T,H]
            memory = self.memory_projection(sequence)[None]  # [1,T,W]
            global_vector = sequence[-1]  # [H], the last token of "DECISIONS:"
            question_vectors = torch.stack(
                [sequence[s:e].mean(0) for s, e in (q.question_span for q in record.questions)]
            )  # [Q,H]
            type_ids = torch.tensor(
                [q.question_type for q in record.questions], dtype=torch.long, device=sequence.device
            )

            lexical_per_question, queries = [], []
            for k, question in enumerate(record.questions):
                contexts = torch.stack([sequence[s:e].mean(0) for s, e in question.option_spans])  # [n_k,H]
                lexicals = torch.stack(
                    [output_embedding_weight[input_ids[b, s:e]].mean(0) for s, e in question.option_spans]
                )  # [n_k,H]
                lexical_per_question.append(lexicals)
                queries.append(
                    self.option_context_projection(contexts)
                    + self.option_lexical_projection(lexicals)
                    + self.option_question_projection(question_vectors[k])
                )  # [n_k,W]
            routed = torch.cat(queries)[None]  # [1,N,W]
            for layer in self.evidence_layers:
                routed = layer(routed, memory)
            routed_per_question = routed[0].split([len(q.option_spans) for q in record.questions])

            base = self.question_projection(question_vectors)  # [Q,W]
            summaries = []
            for k, routed_options in enumerate(routed_per_question):
                weights = torch.softmax(routed_options @ base[k] / math.sqrt(self.width), dim=0)  # [n_k]
                summaries.append((weights[:, None] * routed_options).sum(0))  # [W]
            fields = (
                base
                + self.option_summary_norm(torch.stack(summaries))
                + self.global_projection(global_vector)[None]
                + self.type_embedding(type_ids)
            )  # [Q,W]
            decoded = fields[None]  # [1,Q,W]
            for layer in self.layers:
                decoded = layer(decoded, memory)
            fields = self.field_norm(decoded[0])  # [Q,W]

            record_logits = []
            for k, routed_options in enumerate(routed_per_question):
                anchor = F.normalize(question_vectors[k] + global_vector, dim=-1)  # [H]
                lexical = F.normalize(lexical_per_question[k], dim=-1)  # [n_k,H]
                prior = _logit_scale(self.prior_logit_scale) * (lexical @ anchor)  # [n_k]
                options = self.option_norm(routed_options)  # [n_k,W]
                field_vector = fields[k].expand_as(options)  # [n_k,W]
                cosine = F.cosine_similarity(field_vector, options, dim=-1)  # [n_k]
                pair = torch.cat(
                    [field_vector, options, field_vector * options, (field_vector - options).abs()], dim=-1
                )
                residual = self.residual_scorer(pair).squeeze(-1)  # [n_k]
                record_logits.append(
                    prior
                    + torch.sigmoid(self.residual_gate) * (_logit_scale(self.joint_logit_scale) * cosine + residual)
                )
            batch_logits.append(record_logits)
        return batch_logits


# ---- the model -------------------------------------------------------------------------------------------------------


class ClefModel(nn.Module):
    """The Qwen3-Omni thinker (vision and audio encoders included) with the joint schema head."""

    def __init__(self, thinker, head):
        super().__init__()
        self.output_embeddings = thinker.lm_head
        thinker.lm_head = nn.Identity()  # the thinker then returns its final-normed hidden states as "logits"
        self.thinker = thinker
        self.head = head

    def forward(self, batch):
        """Score each record of a batch separately, so padding never changes a record's probabilities."""
        device = batch["input_ids"].device
        logits = []
        for record in batch["records"]:
            logits.extend(self._forward_unpadded(collate_records([record], 0, device)))
        return logits

    def _forward_unpadded(self, batch):
        media = dict(batch["media"])
        use_audio_in_video = media.pop("use_audio_in_video", False)
        dtype = self.output_embeddings.weight.dtype
        for key in ("pixel_values", "pixel_values_videos", "input_features"):
            if key in media:
                media[key] = media[key].to(dtype)
        outputs = self.thinker(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            use_cache=False,
            output_router_logits=False,
            use_audio_in_video=use_audio_in_video,
            return_dict=True,
            **media,
        )
        return self.head(
            outputs.logits, batch["input_ids"], batch["attention_mask"], batch["records"], self.output_embeddings.weight
        )


# ---- answers ---------------------------------------------------------------------------------------------------------


def systemone_answer(question: dict, probabilities: dict[str, float]) -> dict:
    """One SystemOne answer from the option probabilities of a question."""
    if question["type"] == "noul":
        return {"type": "noul", "noul": round(probabilities["true"], 4)}
    if question["type"] == "choice":
        options = [str(option_id) for option_id in question["criteria"]]  # request order, not the sorted order
        choice = max(options, key=probabilities.__getitem__)  # ties: first in request order
        return {
            "type": "choice",
            "choice": choice,
            "confidence": round(probabilities[choice], 4),
            "probabilities": {option: round(probabilities[option], 4) for option in options},
        }
    levels = [str(level) for level in range(len(question["criteria"]))]
    return {
        "type": "score",
        "score": round(sum(level * probabilities[str(level)] for level in range(len(levels))), 4),
        "confidence": round(max(probabilities[level] for level in levels), 4),
        "legend": {str(level): description for level, description in enumerate(question["criteria"])},
        "probabilities": {level: round(probabilities[level], 4) for level in levels},
    }


@torch.inference_mode()
def systemone(model, processor, request: dict, max_length: int = DEFAULT_MAX_LENGTH) -> dict:
    """Answer one SystemOne request: every question of the record scored in one prefill pass."""
    if not isinstance(request.get("model"), str) or "state" not in request:
        raise ValueError("model and state are required")
    questions = request.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise ValueError("at least one question is required")
    for question_id, question in questions.items():
        if question.get("type") not in QUESTION_TYPES:
            raise ValueError(f"{question_id}: type must be noul, choice, or score")
        if question["type"] != "noul" and not question.get("criteria"):
            raise ValueError(f"{question_id}: criteria must not be empty")

    encoded = encode_record(processor.tokenizer, request, max_length, processor=processor)
    device = next(model.parameters()).device
    logits = model(collate_records([encoded], processor.tokenizer.pad_token_id, device))[0]
    answers = {}
    for (question_id, question), encoded_question, question_logits in zip(questions.items(), encoded.questions, logits):
        probabilities = dict(zip(encoded_question.option_ids, question_logits.float().softmax(-1).tolist()))
        answers[question_id] = systemone_answer(question, probabilities)
    return {
        "model": request["model"],
        "answers": answers,
        "usage": {"input_tokens": len(encoded.input_ids), "output_tokens": 0},
    }


# ---- loading a BF16 release ------------------------------------------------------------------------------------------


def load_release_model(model_path, device="cuda", dtype=torch.bfloat16, **from_pretrained_kwargs):
    """Load a Clef-Omni release (merged thinker, joint schema head, and processor)"""
    import safetensors.torch
    import transformers
    from transformers import AutoConfig, Qwen3OmniMoeForConditionalGeneration

    path = Path(model_path)
    if not path.is_dir():
        import huggingface_hub

        path = Path(huggingface_hub.snapshot_download(str(model_path)))
    config = AutoConfig.from_pretrained(path)
    config.enable_audio_output = False
    # Let transformers report shape mismatches in the loading info instead of raising a message without names:
    # they are refused below all the same, now naming each tensor.
    from_pretrained_kwargs.setdefault("ignore_mismatched_sizes", True)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        backbone, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            path,
            config=config,
            dtype=dtype,
            device_map={"": device},
            output_loading_info=True,
            **from_pretrained_kwargs,
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    problems = {
        "missing": list(info.get("missing_keys") or []),
        "unexpected": [
            key for key in info.get("unexpected_keys") or [] if not key.startswith(("talker.", "code2wav."))
        ],
        "mismatched": list(info.get("mismatched_keys") or []),
    }
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if problems:
        raise RuntimeError(f"Clef-Omni weights did not load cleanly: {problems}")
    head_config = json.loads((path / "joint_head_config.json").read_text())
    thinker_hidden_size = config.thinker_config.text_config.hidden_size
    if head_config["hidden_size"] != thinker_hidden_size:
        raise ValueError(
            f"joint_head_config.json: hidden_size {head_config['hidden_size']} differs from the thinker's "
            f"{thinker_hidden_size} (config.json thinker_config.text_config.hidden_size): the head reads the "
            "thinker's hidden states, so both files must come from one release"
        )
    head = JointSchemaHead(**head_config)
    head.load_state_dict(safetensors.torch.load_file(path / "joint_head.safetensors"), strict=True)
    head.to(device=device, dtype=dtype)
    processor = load_processor(path)
    return ClefModel(backbone.thinker, head).eval(), processor


# ---- processor loading (CPU without torchvision) ---------------------------------------------------------------------


def load_processor(path):
    """The release's `Qwen3OmniMoeProcessor`: `AutoProcessor.from_pretrained(path)` where torchvision is installed.

    Without torchvision (the CPU machines) transformers cannot build Qwen3-Omni's video processor, so the processor is
    assembled from the release's own files instead (`load_frame_processor`).
    """
    from transformers import AutoProcessor

    if importlib.util.find_spec("torchvision") is None:
        return load_frame_processor(path)
    return AutoProcessor.from_pretrained(path)


def load_frame_processor(path):
    """The release's `Qwen3OmniMoeProcessor` built without torchvision from the release's own files.

    Its tokenizer, its image processor (the PIL variant, which needs no torchvision), its `WhisperFeatureExtractor`,
    and a `FrameVideoProcessor` configured from its video processor settings.
    """
    from transformers import AutoFeatureExtractor, AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3OmniMoeProcessor

    path = Path(path)
    # The constructor accepts only transformers' own video processor classes, which need torchvision: this subclass
    # also accepts a FrameVideoProcessor and is otherwise Qwen3OmniMoeProcessor unchanged.
    processor_class = type(
        "Qwen3OmniMoeFrameProcessor",
        (Qwen3OmniMoeProcessor,),
        {"check_argument_for_proper_class": _accept_frame_video_processor},
    )
    chat_template = path / "chat_template.jinja"
    return processor_class(
        # The PIL variant by name: AutoImageProcessor picks the torchvision one on some transformers versions.
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
        video_processor=FrameVideoProcessor(**_video_processor_config(path)),
        feature_extractor=AutoFeatureExtractor.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=chat_template.read_text() if chat_template.exists() else None,
    )


def _accept_frame_video_processor(processor, argument_name, argument):
    from transformers.processing_utils import ProcessorMixin

    if argument_name == "video_processor" and isinstance(argument, FrameVideoProcessor):
        return FrameVideoProcessor
    return ProcessorMixin.check_argument_for_proper_class(processor, argument_name, argument)


def _video_processor_config(path: Path) -> dict:
    """The video processor settings: transformers 5's processor_config.json, else the older per-processor files."""
    processor_config = path / "processor_config.json"
    if processor_config.exists() and "video_processor" in (config := json.loads(processor_config.read_text())):
        return config["video_processor"]
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (path / name).exists():
            return json.loads((path / name).read_text())
    raise FileNotFoundError(
        f"{path} has no video processor settings: expected processor_config.json with a 'video_processor' entry, "
        "video_preprocessor_config.json or preprocessor_config.json"
    )


class FrameVideoProcessor:
    """Qwen2-VL video preprocessing of decoded, already sampled RGB frames, in torch alone (no torchvision).

    Same contract as transformers' `Qwen2VLVideoProcessor` called with `do_sample_frames=False`, and the attributes
    `Qwen3OmniMoeProcessor` reads (`patch_size`, `temporal_patch_size`, `merge_size`, `model_input_names`). Each video
    [T,H,W,3] is padded to a multiple of `temporal_patch_size` frames by repeating its last frame, resized to
    `smart_resize`'s size (factor patch*merge, pixel area within `size`), rescaled and normalised with the configured
    mean/std, and cut into patches in the same order. Outputs: `pixel_values_videos` [P, 3*t*p*p] float32 and
    `video_grid_thw` [V,3] int64. Grids, patch layout and token counts are identical to transformers'. The frames are
    resized as uint8, by torch's antialiased bicubic `interpolate`: the kernel that torchvision's resize runs on uint8
    frames on the CPU (transformers' path), within one level of PIL's bicubic resize (the image processor's), and
    about 20x faster on a CPU than resizing in float. Patches are cut from the uint8 frames and normalised last, on
    4x fewer bytes.
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, **config):
        required = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
        if missing := [key for key in required if key not in config]:
            raise ValueError(f"video processor settings lack {missing}: is this a Qwen3-Omni release?")
        self.patch_size = config["patch_size"]
        self.temporal_patch_size = config["temporal_patch_size"]
        self.merge_size = config["merge_size"]
        self.image_mean = list(config["image_mean"])
        self.image_std = list(config["image_std"])
        self.rescale_factor = config.get("rescale_factor", 1 / 255)
        # Older configs give the pixel-area bounds as min_pixels/max_pixels.
        self.size = dict(config.get("size") or {})
        self.size.setdefault("shortest_edge", config.get("min_pixels"))
        self.size.setdefault("longest_edge", config.get("max_pixels"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({json.dumps(self.to_dict())})"

    def to_dict(self) -> dict:
        return {
            key: getattr(self, key)
            for key in (
                "patch_size",
                "temporal_patch_size",
                "merge_size",
                "image_mean",
                "image_std",
                "rescale_factor",
                "size",
            )
        }

    def __call__(self, videos, size=None, do_sample_frames=False, return_tensors=None, **options):
        """`Qwen2VLVideoProcessor(videos, ...)`; decoding/sampling `options` (fps, device...) do not apply to frames."""
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        if do_sample_frames:
            raise ValueError("FrameVideoProcessor takes frames already sampled: call it with do_sample_frames=False")
        size = dict(size or self.size)
        t, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        # mean and std in 0..255 units: one fused normalisation, as transformers does it; [3, 1] for rows (3, t*p*p).
        mean = torch.tensor(self.image_mean).view(3, 1) / self.rescale_factor
        std = torch.tensor(self.image_std).view(3, 1) / self.rescale_factor
        if isinstance(videos, (np.ndarray, torch.Tensor)) and videos.ndim == 4:
            videos = [videos]
        patches, grids = [], []
        for video in videos:
            frames = torch.as_tensor(np.asarray(video))
            if frames.ndim != 4 or frames.shape[-1] != 3:
                raise ValueError(f"a video must be RGB frames [T,H,W,3], got shape {tuple(frames.shape)}")
            if frames.dtype != torch.uint8:  # frames given as numbers: taken as 0..255 levels
                frames = frames.float().round().clamp(0, 255).to(torch.uint8)
            frames = frames.permute(0, 3, 1, 2)  # [T,3,H,W] uint8
            if pad := -frames.shape[0] % t:
                frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
            height, width = smart_resize(
                frames.shape[2],
                frames.shape[3],
                p * m,
                min_pixels=size["shortest_edge"],
                max_pixels=size["longest_edge"],
            )
            frames = F.interpolate(frames, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
            grid_t, grid_h, grid_w = frames.shape[0] // t, height // p, width // p
            # [gt, t, 3, gh/m, m, p, gw/m, m, p] -> rows ordered (gt, gh/m, gw/m, m, m), each row (3, t, p, p),
            # made float in the one copy that orders them and normalised in place: (x - mean) / std as before, with
            # no more buffers of the video's size (each costs its page faults: 13.7 MB for 8 frames of 320x448).
            frames = frames.reshape(grid_t, t, 3, grid_h // m, m, p, grid_w // m, m, p)
            rows = frames.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).to(torch.float32, memory_format=torch.contiguous_format)
            rows = rows.view(grid_t * grid_h * grid_w, 3, t * p * p).sub_(mean).div_(std)
            patches.append(rows.view(grid_t * grid_h * grid_w, 3 * t * p * p))
            grids.append([grid_t, grid_h, grid_w])
        data = {"pixel_values_videos": _joined(patches), "video_grid_thw": torch.tensor(grids)}  # [P, 3*t*p*p], [V, 3]
        return BatchFeature(data=data, tensor_type=return_tensors)
