"""Shared fixtures: a tiny synthetic Clef-Omni release and small media files, all built offline once per session."""

import os
import sys
from pathlib import Path

import pytest

# No test may reach the hub: everything it loads is written by the fixtures below.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# The packed-expert Triton kernels run on CPU tensors under Triton's interpreter; it is chosen when a kernel is
# decorated, so before serve_clef is imported.
os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import synthetic_release  # noqa: E402  (needs ROOT on sys.path)


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory) -> Path:
    """Path of a BF16 tiny synthetic release (seed 0), built once per session."""
    return synthetic_release.write_release(tmp_path_factory.mktemp("tiny_release"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def png_bytes() -> bytes:
    """A 96x64 RGB PNG of colour gradients."""
    return synthetic_release.synthetic_png(96, 64)


@pytest.fixture(scope="session")
def wav_bytes() -> bytes:
    """1.5 s of a 440 Hz sine, 16 kHz mono 16-bit WAV."""
    return synthetic_release.synthetic_wav(1.5)


@pytest.fixture(scope="session")
def mp4_with_audio_bytes() -> bytes:
    """2 s of 64x48 mpeg4 video at 8 fps with a 16 kHz mono AAC soundtrack."""
    return synthetic_release.synthetic_mp4(with_audio=True)


@pytest.fixture(scope="session")
def mp4_silent_bytes() -> bytes:
    """The same video without an audio stream."""
    return synthetic_release.synthetic_mp4(with_audio=False)
