"""What a new user meets first: --help before the heavy imports, parity's verdict against the documented gates, the
synthetic notice, and consoles free of known-harmless library warnings.

References: Python's own import log (-X importtime), the gate numbers as docs/nvfp4-format.md §6 writes them, the
report's own probability statistics, and what transformers itself logs and warns.
"""

import base64
import json
import re
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import joint_schema_model
import serve_clef
import synthetic_release
from calib import parity

ROOT = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("torch", "transformers", "triton", "fastapi", "av")


def imported_modules(importtime_log: str) -> set[str]:
    """Top-level names of every module that `python -X importtime` logged as imported."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize("flags, status, refusal", [
    (["--help"], 0, None),
    (["--no-such-flag"], 2, "serve_clef.py: error: unrecognized arguments: --no-such-flag"),
    (["--port", "70000"], 2, "serve_clef.py: error: argument --port: 70000 is not a TCP port (1 to 65535)"),
    (["--max-length", "0"], 2, "serve_clef.py: error: argument --max-length: 0 is not a positive number"),
    (["--request-timeout", "-1"], 2,
     "serve_clef.py: error: argument --request-timeout: -1 is not a positive number of seconds"),
    (["--request-timeout", "nan"], 2,
     "serve_clef.py: error: argument --request-timeout: nan is not a positive number of seconds"),
])
def test_the_command_line_answers_before_torch_is_imported(flags, status, refusal):
    completed = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "serve_clef.py"), *flags],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == status
    if status == 0:
        assert completed.stdout.startswith("usage: serve_clef.py") and "--expert-kernels" in completed.stdout
    else:
        assert refusal in completed.stderr
    imported = imported_modules(completed.stderr)
    assert "argparse" in imported  # the log is the one that lists what ran
    assert not imported & set(HEAVY_MODULES), imported & set(HEAVY_MODULES)


def test_the_default_device_is_chosen_at_load():
    args = serve_clef.parse_args(["--model", "synthetic"])
    assert args.device is None
    import torch

    loaded = serve_clef.load_from_args(args, progress=lambda line: None)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(loaded.model.parameters()).device.type == expected


def test_the_default_device_is_cuda_where_torch_has_one(monkeypatch):
    """The other branch of the default, on a machine without a GPU: torch told it has one, the load goes to CUDA
    (stopped at the first step that takes the device)."""
    import torch

    class DeviceChosen(Exception):
        pass

    def synthetic_checkpoint(model, device, progress):
        raise DeviceChosen(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(serve_clef, "synthetic_checkpoint", synthetic_checkpoint)
    with pytest.raises(DeviceChosen) as chosen:
        serve_clef.load_from_args(serve_clef.parse_args(["--model", "synthetic"]), progress=lambda line: None)
    assert chosen.value.args == (torch.device("cuda"),)


@pytest.mark.parametrize("where", ["a port in use", "a host of no machine"])
def test_an_address_that_cannot_be_listened_on_is_refused_in_one_line_before_loading(where):
    """A second server on a taken port, or a mistyped --host, gets one line saying what to change, exit status 2,
    and nothing is loaded (uvicorn alone said it after the model's load had begun, with exit status 3)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        host, port = ("127.0.0.1", taken.getsockname()[1]) if where == "a port in use" else ("no-such-host.invalid",
                                                                                         8000)
        completed = subprocess.run(
            [sys.executable, serve_clef.__file__, "--model", "synthetic", "--device", "cpu", "--host", host,
             "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1].startswith(f"serve_clef: cannot listen on {host}:{port} (")
    assert "synthetic checkpoint" not in completed.stderr and "Traceback" not in completed.stderr


def test_the_server_hands_pythons_lock_between_its_threads_every_millisecond(monkeypatch):
    """The scorer's many short torch calls each wait up to the switch interval for Python's lock while the HTTP and
    preparing threads run: the server shortens it from Python's 5 ms to 1 ms before it starts serving."""
    seen = {}
    monkeypatch.setattr(serve_clef.signal, "signal", lambda signal_number, handler: None)
    monkeypatch.setattr(serve_clef, "create_app", lambda args: "app")
    monkeypatch.setattr(serve_clef.uvicorn, "run", lambda app, **options: seen.update(interval=sys.getswitchinterval()))
    with socket.socket() as free:  # a port the server's listening probe can bind
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    before = sys.getswitchinterval()
    try:
        assert serve_clef.main(["--model", "synthetic", "--host", "127.0.0.1", "--port", str(port)]) == 0
    finally:
        sys.setswitchinterval(before)
    assert seen["interval"] == pytest.approx(0.001)


# ---- parity verdict -------------------------------------------------------------------------------------------------

def documented_gates() -> tuple[float, float]:
    """(minimum top-1 agreement, maximum mean TV) as docs/nvfp4-format.md §6 states them."""
    text = (ROOT / "docs" / "nvfp4-format.md").read_text()
    found = re.search(r"`top1 ≥ ([0-9.]+)` and `mean_tv ≤ ([0-9.]+)`", text)
    return float(found[1]), float(found[2])


def stats(top1: float, mean_tv: float) -> dict:
    return {"top1_agreement": top1, "mean_tv": mean_tv}


def test_the_verdict_applies_the_documented_gates():
    min_top1, max_mean_tv = documented_gates()
    assert (min_top1, max_mean_tv) == (0.98, 0.03)
    assert parity.judge(stats(min_top1, max_mean_tv), [])["verdict"] == "pass"  # both gates are inclusive
    assert parity.judge(stats(1.0, 0.0), [])["verdict"] == "pass"
    below = parity.judge(stats(min_top1 - 0.001, 0.0), [])
    assert below["verdict"] == "fail" and len(below["failed_gates"]) == 1
    assert "top1_agreement" in below["failed_gates"][0]
    above = parity.judge(stats(1.0, max_mean_tv + 0.0001), [])
    assert above["verdict"] == "fail" and len(above["failed_gates"]) == 1 and "mean_tv" in above["failed_gates"][0]
    assert len(parity.judge(stats(0.5, 0.5), [])["failed_gates"]) == 2
    assert parity.judge(stats(0.5, 0.5), [])["gates"] == {"min_top1_agreement": min_top1, "max_mean_tv": max_mean_tv}


def test_synthetic_sides_are_not_judged():
    for sides in (["reference"], ["candidate"], ["reference", "candidate"]):
        verdict = parity.judge(stats(0.5, 0.5), sides)
        assert verdict["verdict"] == "not judged" and verdict["synthetic"] == sides
        assert len(verdict["failed_gates"]) == 2  # still said, for the record


def test_parity_of_synthetic_checkpoints_says_so(tiny_release, capsys):
    report = parity.main([str(tiny_release), str(tiny_release), "--records", "1", "--device", "cpu"])
    assert report["synthetic"] == ["reference", "candidate"] and report["verdict"] == "not judged"
    assert report["reference"]["synthetic"] and report["candidate"]["synthetic"]
    captured = capsys.readouterr()
    assert "verdict: not judged: synthetic (random weights)" in captured.out
    assert serve_clef.SYNTHETIC_NOTICE in captured.err  # the loader says it too


def without_synthetic_marker(release: Path, destination: Path) -> Path:
    """A copy of a synthetic release that no longer says it is one, standing in for a real release."""
    shutil.copytree(release, destination)
    (destination / serve_clef.SYNTHETIC_MARKER).unlink()
    return destination


def test_parity_fails_with_status_1_when_a_gate_fails(tiny_release, tmp_path):
    reference = without_synthetic_marker(tiny_release, tmp_path / "reference")
    other = synthetic_release.write_release(tmp_path / "other", size="tiny", seed=1)  # other random weights
    candidate = without_synthetic_marker(other, tmp_path / "candidate")
    out = tmp_path / "parity.json"
    completed = subprocess.run(
        [sys.executable, str(ROOT / "calib" / "parity.py"), str(reference), str(candidate), "--records", "2",
         "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    report = json.loads(out.read_text())
    min_top1, max_mean_tv = documented_gates()
    measured = report["candidate_vs_reference"]
    assert measured["top1_agreement"] < min_top1 or measured["mean_tv"] > max_mean_tv  # unrelated weights
    assert report["synthetic"] == [] and report["verdict"] == "fail"
    assert completed.returncode == 1, completed.stderr[-2000:]
    assert "verdict: FAIL" in completed.stdout
    # Progress: each step on stderr, with its counts.
    assert "2 held-out records" in completed.stderr
    assert f"reference: loading {reference}" in completed.stderr
    assert f"candidate: loading {candidate}" in completed.stderr
    assert "scoring the reference" in completed.stderr and "2/2" in completed.stderr


# ---- quiet consoles -------------------------------------------------------------------------------------------------

def test_a_long_state_is_cut_without_the_tokenizers_length_warning(capfd):
    loaded = serve_clef.load_clef("synthetic", device="cpu", progress=lambda line: None)
    limit = loaded.processor.tokenizer.model_max_length
    capfd.readouterr()
    request = {"model": "clef-omni", "state": "word " * 40_000, "questions": {"late": {"type": "noul"}}}
    # the decision module tokenizes the whole state (80,000 tokens) before cutting it; the server cuts its characters
    # first (cap_state_text), so both paths are checked
    encoded = loaded.schema.encode_record(loaded.processor.tokenizer, request, 512, processor=loaded.processor)
    assert len(encoded.input_ids) == 512
    response = serve_clef.decide(loaded, request, max_length=512)
    assert response["usage"]["input_tokens"] == 512 and response["usage"]["state_tokens_dropped"] > 0
    assert limit > 10**20  # transformers' "no limit"
    assert "Token indices sequence length" not in capfd.readouterr().err


def test_media_encode_without_deprecation_noise(tiny_release, png_bytes, wav_bytes, mp4_with_audio_bytes, capfd,
                                                monkeypatch):
    processor = joint_schema_model.load_processor(tiny_release)

    def data_url(content_type: str, data: bytes) -> str:
        return f"data:{content_type};base64,{base64.b64encode(data).decode()}"

    record = {"model": "clef-omni", "state": "media", "questions": {"q": {"type": "noul"}},
              "images": [data_url("image/png", png_bytes)], "audio": [data_url("audio/wav", wav_bytes)],
              "videos": [data_url("video/mp4", mp4_with_audio_bytes)]}
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encoded = joint_schema_model.encode_record(processor.tokenizer, record, processor=processor)
    assert not [str(w.message) for w in caught if "__array__" in str(w.message)]
    assert "use_audio_in_video" not in capfd.readouterr().err  # deprecated in transformers 5.2x

    # The deprecated spelling, where the processor still takes it, encodes the same record to the same tensors.
    monkeypatch.setattr(joint_schema_model, "_takes_load_audio_from_video", lambda processor: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old_spelling = joint_schema_model.encode_record(processor.tokenizer, record, processor=processor)
    assert encoded.input_ids == old_spelling.input_ids
    assert sorted(encoded.media) == sorted(old_spelling.media)
    for key, value in encoded.media.items():
        assert (value == old_spelling.media[key]).all() if hasattr(value, "shape") else value == old_spelling.media[key]
