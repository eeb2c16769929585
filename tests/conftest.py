"""Shared fixtures: a tiny synthetic Clef-Omni release and small media files, all built offline once per session."""

import io
import math
import os
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

# No test may reach the hub: everything it loads is written by the fixtures below.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

AUDIO_RATE = 16_000
VIDEO_SIZE = (64, 48)  # width, height: small even frames keep vision forwards fast
VIDEO_FPS = 8
VIDEO_SECONDS = 2


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory) -> Path:
    """Path of a BF16 tiny synthetic release (seed 0), built once per session."""
    from synthetic_release import write_release

    return write_release(tmp_path_factory.mktemp("tiny_release"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def png_bytes() -> bytes:
    """A 96x64 RGB PNG: colour gradients, so resizing and normalisation see varied pixels."""
    from PIL import Image

    y, x = np.mgrid[0:64, 0:96]
    pixels = np.stack([x * 255 // 95, y * 255 // 63, (x + y) * 255 // 158], axis=-1).astype(np.uint8)  # [64,96,3]
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _sine(seconds: float, frequency: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * AUDIO_RATE)) / AUDIO_RATE
    return (0.3 * np.sin(2 * math.pi * frequency * t)).astype(np.float32)


@pytest.fixture(scope="session")
def wav_bytes() -> bytes:
    """1.5 s of a 440 Hz sine, 16 kHz mono 16-bit WAV."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, _sine(1.5), AUDIO_RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def _mp4(with_audio: bool) -> bytes:
    """2 s of 64x48 moving-gradient frames at 8 fps (mpeg4), optionally with a 16 kHz mono AAC sine soundtrack."""
    import av

    width, height = VIDEO_SIZE
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=VIDEO_FPS)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = container.add_stream("aac", rate=AUDIO_RATE, layout="mono") if with_audio else None
        y, x = np.mgrid[0:height, 0:width]
        for index in range(VIDEO_FPS * VIDEO_SECONDS):
            shift = index * 8
            pixels = np.stack([(x + shift) % 256, (y * 4) % 256, np.full_like(x, index * 16)], axis=-1)  # [h,w,3]
            frame = av.VideoFrame.from_ndarray(pixels.astype(np.uint8), format="rgb24")
            container.mux(video.encode(frame))
        container.mux(video.encode())
        if audio is not None:
            samples = _sine(VIDEO_SECONDS, 330.0)
            chunk = 1024  # AAC frame size
            for start in range(0, len(samples), chunk):
                piece = samples[start : start + chunk][None, :]  # [channels=1, n]
                frame = av.AudioFrame.from_ndarray(piece, format="flt", layout="mono")
                frame.sample_rate, frame.pts, frame.time_base = AUDIO_RATE, start, Fraction(1, AUDIO_RATE)
                container.mux(audio.encode(frame))
            container.mux(audio.encode())
    return buffer.getvalue()


@pytest.fixture(scope="session")
def mp4_with_audio_bytes() -> bytes:
    """About 2 s of small mpeg4 video with an AAC soundtrack."""
    return _mp4(with_audio=True)


@pytest.fixture(scope="session")
def mp4_silent_bytes() -> bytes:
    """The same video without an audio stream."""
    return _mp4(with_audio=False)
