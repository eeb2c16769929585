"""Deterministic, offline Clef records for calibration and held-out evaluation.

The published recipe (docs/nvfp4-format.md §5) builds its records from ultrachat_200k. Nothing can be downloaded
here, so the conversations come from a built-in word list and sentence templates instead; everything else follows
§5: `state.task` / `state.observation` cut to 1,200 / 2,400 characters, 30% of states with a `history`, 1 to 3
questions per record (choice with 2 to 5 of 8 verbs, noul, score with 3 to 5 levels), media drawn from one uniform
`u` (image below 0.10, video below 0.15, audio below 0.20), a `random.Random(145)` shuffle, the first 512 records for
calibration and the next 128 for evaluation, and per-record generators `numpy.random.default_rng(1)` (calibration)
and `default_rng(2)` (evaluation).

A record is the Clef request itself: `{"id", "model", "state", "questions"}` plus `images` (PIL images), `audio`
(float32 mono arrays at 16 kHz) or `videos` (uint8 frame arrays [T, H, W, 3] at 2 fps) when it has media. Asking for
fewer records returns a prefix of the full set, and the two sets never share a conversation. `to_request` turns a
record into the JSON body a serve_clef server takes, media as data URLs.
"""

import base64
import io
import random
import wave

import numpy as np
from PIL import Image

CALIBRATION_COUNT = 512
EVALUATION_COUNT = 128
MODEL_NAME = "clef-omni"
AUDIO_SAMPLE_RATE = 16_000

CHOICE_VERBS = {
    "approve": "Accept the request as it stands.",
    "reject": "Decline the request and say why.",
    "escalate": "Hand the case to a human reviewer.",
    "defer": "Wait for more information before acting.",
    "retry": "Run the last step again.",
    "summarize": "Reply with a short summary of the conversation.",
    "archive": "Close the case without further action.",
    "clarify": "Ask the user a follow-up question.",
}
SCORE_SCALES = {
    3: ["poor", "acceptable", "good"],
    4: ["unusable", "weak", "solid", "excellent"],
    5: ["very low", "low", "medium", "high", "very high"],
}
TOPICS = (
    "sourdough baking", "tax deductions for freelancers", "marathon training", "home solar panels",
    "learning Japanese", "rust in cast iron pans", "a wedding toast", "container gardening", "sleep hygiene",
    "the French Revolution", "budgeting for college", "adopting a rescue dog", "fixing a leaky faucet",
    "writing a cover letter", "photosynthesis", "electric car charging", "negotiating a salary",
    "the history of jazz", "composting at home", "a beginner guitar routine", "planning a trip to Lisbon",
    "password managers", "teaching kids fractions", "remote team meetings", "the water cycle",
    "choosing a laptop", "vegetarian meal prep", "public speaking nerves", "black holes", "basic first aid",
    "starting a podcast", "moving to a new city", "climate-friendly commuting", "reading nutrition labels",
    "a short mystery story", "indoor air quality", "learning to swim as an adult", "writing unit tests",
    "renting versus buying a home", "birdwatching for beginners",
)
ASKS = (
    "Can you explain {topic} in simple terms?",
    "I need a step-by-step plan for {topic}.",
    "What are the most common mistakes people make with {topic}?",
    "Write a short guide about {topic} for a complete beginner.",
    "Compare two approaches to {topic} and recommend one.",
    "My friend says {topic} is overrated. What do you think?",
    "Give me five tips about {topic}, with a reason for each.",
    "How would you teach {topic} to a twelve-year-old?",
)
DETAILS = (
    "I have about {hours} hours a week for this.",
    "My budget is roughly {money} dollars.",
    "I tried once before and gave up after {days} days.",
    "Please keep the answer under {words} words.",
    "I live in a small apartment with no garden.",
    "English is my second language, so please avoid jargon.",
    "I am {age} years old and fairly new to this.",
    "This is for a presentation I give on {weekday}.",
)
REPLY_SENTENCES = (
    "Start with the basics of {topic} before moving to anything advanced.",
    "A common mistake with {topic} is trying to do everything at once.",
    "Set aside {hours} hours each week and track your progress in a notebook.",
    "If the budget is tight, {money} dollars goes further when spent on fundamentals.",
    "Most people see a real difference after about {days} days of steady practice.",
    "Ask someone experienced to review your first attempt; feedback speeds things up.",
    "Keep notes on what worked and what did not, so the next round goes faster.",
    "Safety matters here: read the instructions twice and never skip a step.",
    "There is no single right answer, but the second option suits most beginners.",
    "Break the goal into small weekly milestones and celebrate each one.",
    "Online forums about {topic} are full of practical advice from beginners.",
    "In short, patience and consistency beat intensity for {topic}.",
    "One useful exercise is to explain {topic} aloud in under a minute.",
    "Remember that conditions differ, so adapt these tips to your own situation.",
)
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
NOUL_PROPOSITIONS = (
    "Does the assistant answer the user's actual question?",
    "Is the reply safe to show without editing?",
    "Does the conversation need a human to step in?",
    "Did the user give enough detail to act on?",
    "Is the reply shorter than the user asked for?",
)
CHOICE_INSTRUCTIONS = (
    "Pick the next action for this conversation about {topic}.",
    "Which action should the support agent take now?",
    "Decide how to route this request.",
)
SCORE_INSTRUCTIONS = (
    "Rate how helpful the reply is.",
    "Rate how well the reply fits the user's constraints.",
    "Rate the clarity of the explanation of {topic}.",
)


def _fill(template: str, rng: random.Random, topic: str) -> str:
    return template.format(
        topic=topic, hours=rng.randint(1, 12), money=rng.choice((20, 50, 100, 250, 1000)), days=rng.randint(3, 60),
        words=rng.choice((100, 200, 300, 500)), age=rng.randint(12, 75), weekday=rng.choice(WEEKDAYS),
    )


def _conversation(rng: random.Random) -> tuple[str, str]:
    """One (user prompt, first assistant reply) pair, the stand-in for an ultrachat row."""
    topic = rng.choice(TOPICS)
    prompt = " ".join([_fill(rng.choice(ASKS), rng, topic)]
                      + [_fill(detail, rng, topic) for detail in rng.sample(DETAILS, rng.randint(0, 4))])
    reply = " ".join(_fill(rng.choice(REPLY_SENTENCES), rng, topic) for _ in range(rng.randint(2, 30)))
    return prompt, reply


def _conversations() -> list[tuple[str, str]]:
    """The shuffled pool: calibration takes the first 512, evaluation the next 128."""
    text_rng = random.Random(0)
    pool = [_conversation(text_rng) for _ in range(CALIBRATION_COUNT + EVALUATION_COUNT)]
    random.Random(145).shuffle(pool)
    return pool


def _topic_of(prompt: str) -> str:
    return next((topic for topic in TOPICS if topic in prompt), "this request")


def _questions(rng: np.random.Generator, topic: str) -> dict:
    questions = {}
    for k in range(int(rng.integers(1, 4))):
        kind = str(rng.choice(["choice", "noul", "score"]))
        if kind == "choice":
            # Drawn order, not sorted: the encoder must sort the options itself.
            verbs = rng.choice(list(CHOICE_VERBS), size=int(rng.integers(2, 6)), replace=False)
            criteria = {str(v): (None if rng.random() < 0.1 else CHOICE_VERBS[str(v)]) for v in verbs}
            instructions = str(rng.choice(CHOICE_INSTRUCTIONS)).format(topic=topic)
            if rng.random() < 0.2:  # object instructions exercise the JSON rendering of the schema
                instructions = {"task": instructions, "audience": "support team"}
            questions[f"next_action_{k}"] = {"type": "choice", "instructions": instructions, "criteria": criteria}
        elif kind == "noul":
            question = {"type": "noul", "instructions": str(rng.choice(NOUL_PROPOSITIONS))}
            if rng.random() < 0.5:
                question["criteria"] = {"true": "Yes, clearly.", "false": "No, or not clearly."}
            questions[f"check_{k}"] = question
        else:
            levels = int(rng.integers(3, 6))
            instructions = str(rng.choice(SCORE_INSTRUCTIONS)).format(topic=topic)
            questions[f"rating_{k}"] = {"type": "score", "instructions": instructions,
                                        "criteria": list(SCORE_SCALES[levels])}
    return questions


def _image(rng: np.random.Generator) -> Image.Image:
    """A gradient with a few coloured rectangles, 64 to 320 px a side."""
    height, width = (int(v) for v in rng.integers(64, 321, size=2))
    y = np.linspace(0.0, 1.0, height)[:, None, None]  # [h, 1, 1]
    x = np.linspace(0.0, 1.0, width)[None, :, None]  # [1, w, 1]
    colour_a, colour_b = rng.uniform(0, 255, size=(2, 3))
    pixels = colour_a * (1 - 0.5 * (x + y)) + colour_b * 0.5 * (x + y)  # [h, w, 3]
    for _ in range(int(rng.integers(1, 5))):
        top, left = int(rng.integers(0, height - 8)), int(rng.integers(0, width - 8))
        pixels[top:top + int(rng.integers(8, 64)), left:left + int(rng.integers(8, 64))] = rng.uniform(0, 255, 3)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def _audio(rng: np.random.Generator) -> np.ndarray:
    """A sine tone with noise, 0.5 to 3 s of float32 mono at 16 kHz."""
    t = np.arange(int(rng.uniform(0.5, 3.0) * AUDIO_SAMPLE_RATE)) / AUDIO_SAMPLE_RATE  # [samples]
    tone = 0.3 * np.sin(2 * np.pi * rng.uniform(110.0, 880.0) * t)
    return (tone + rng.normal(0.0, 0.05, size=t.shape)).astype(np.float32)


def _video(rng: np.random.Generator) -> np.ndarray:
    """2 or 4 frames (1-2 s at 2 fps) of a square moving across a plain background: uint8 [T, H, W, 3]."""
    frame_count = 2 * int(rng.integers(1, 3))
    height, width = 32 * int(rng.integers(2, 5)), 32 * int(rng.integers(2, 5))
    frames = np.empty((frame_count, height, width, 3), dtype=np.uint8)
    frames[:] = rng.integers(0, 256, size=3, dtype=np.uint8)
    square_colour = rng.integers(0, 256, size=3, dtype=np.uint8)
    for t in range(frame_count):
        left = t * (width - 16) // max(frame_count - 1, 1)
        frames[t, height // 2 - 8:height // 2 + 8, left:left + 16] = square_colour
    return frames


def _records(conversations: list[tuple[str, str]], prefix: str, rng: np.random.Generator) -> list[dict]:
    records = []
    for k, (prompt, reply) in enumerate(conversations):
        topic = _topic_of(prompt)
        task, observation = prompt[:1200], reply[:2400]
        if rng.random() < 0.3:
            state = {"task": task, "observation": observation, "history": [
                {"role": "user", "content": f"Earlier I asked about {topic}."},
                {"role": "assistant", "content": "Happy to help; what would you like to know?"},
            ][:int(rng.integers(1, 3))]}
        else:
            state = {"task": task, "observation": observation}
        if rng.random() < 0.1:  # a share of plain-text states: the encoder uses a string verbatim
            state = f"TASK: {task}\nOBSERVATION: {observation}"
        record = {"id": f"{prefix}-{k:04d}", "model": MODEL_NAME, "state": state,
                  "questions": _questions(rng, topic)}
        u = rng.random()
        if u < 0.10:
            record["images"] = [_image(rng)]
        elif u < 0.15:
            record["videos"] = [_video(rng)]
        elif u < 0.20:
            record["audio"] = [_audio(rng)]
        records.append(record)
    return records


def calibration_records(count: int = CALIBRATION_COUNT) -> list[dict]:
    """The first `count` calibration records (at most 512), generated with numpy.random.default_rng(1)."""
    if not 0 < count <= CALIBRATION_COUNT:
        raise ValueError(f"calibration count must be 1..{CALIBRATION_COUNT}, got {count}")
    return _records(_conversations()[:count], "calib", np.random.default_rng(1))


def evaluation_records(count: int = EVALUATION_COUNT) -> list[dict]:
    """The first `count` held-out evaluation records (at most 128), generated with numpy.random.default_rng(2)."""
    if not 0 < count <= EVALUATION_COUNT:
        raise ValueError(f"evaluation count must be 1..{EVALUATION_COUNT}, got {count}")
    return _records(_conversations()[CALIBRATION_COUNT:CALIBRATION_COUNT + count], "eval",
                    np.random.default_rng(2))


def _data_url(content_type: str, data: bytes) -> str:
    return f"data:{content_type};base64,{base64.b64encode(data).decode()}"


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _wav(samples: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as pcm:
        pcm.setnchannels(1)
        pcm.setsampwidth(2)
        pcm.setframerate(AUDIO_SAMPLE_RATE)
        pcm.writeframes((np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def _mp4(frames: np.ndarray) -> bytes:
    """Frames [T, H, W, 3] as MPEG-4 video at 2 fps, so a server's 2 fps sampling keeps every frame."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=2)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def to_request(record: dict) -> dict:
    """The record as a JSON SystemOne request body: images as PNG, audio as 16-bit WAV, videos as MPEG-4 data URLs."""
    request = {key: value for key, value in record.items() if key not in ("images", "audio", "videos")}
    if "images" in record:
        request["images"] = [_data_url("image/png", _png(image)) for image in record["images"]]
    if "audio" in record:
        request["audio"] = [_data_url("audio/wav", _wav(samples)) for samples in record["audio"]]
    if "videos" in record:
        request["videos"] = [_data_url("video/mp4", _mp4(frames)) for frames in record["videos"]]
    return request
