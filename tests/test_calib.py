"""calib/: records, calib/quantize.py on the tiny synthetic release, its export checks, and calib/parity.py.

References are independent of the code under test: the recipe numbers of docs/nvfp4-format.md §5 written out
here, the BF16 release's own weights against the §2.1 dequantisation formula, hashlib, and plain-Python statistics.
"""

import contextlib
import fnmatch
import hashlib
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import safetensors.torch
import torch
from PIL import Image

import joint_schema_model
import serve_clef
from calib import parity, quantize
from test_checkpoint_layouts import dequantised, write_checkpoint
from calib.records import CHOICE_VERBS, calibration_records, evaluation_records

E2M1_TABLE = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]  # docs/nvfp4-format.md §2, codes 0..15


def _state_text(record: dict) -> str:
    return json.dumps(record["state"], sort_keys=True)


# ---- records --------------------------------------------------------------------------------------------------------


def test_records_are_deterministic_disjoint_and_follow_the_recipe():
    calibration, evaluation = calibration_records(), evaluation_records()
    assert len(calibration) == 512 and len(evaluation) == 128
    assert not {_state_text(r) for r in calibration} & {_state_text(r) for r in evaluation}
    assert len({r["id"] for r in calibration + evaluation}) == 640

    # Fewer records are a prefix of the full set, and a second call rebuilds the same records.
    for few, full in ((calibration_records(7), calibration), (evaluation_records(5), evaluation)):
        for a, b in zip(few, full):
            assert (a["id"], _state_text(a), a["questions"], sorted(a)) == (b["id"], _state_text(b), b["questions"],
                                                                           sorted(b))
    assert [_state_text(r) for r in calibration_records()] == [_state_text(r) for r in calibration]

    for record in calibration + evaluation:
        assert record["model"] == "clef-omni" and 1 <= len(record["questions"]) <= 3
        if isinstance(record["state"], dict):
            assert len(record["state"]["task"]) <= 1200 and len(record["state"]["observation"]) <= 2400
        for question in record["questions"].values():
            if question["type"] == "choice":
                assert 2 <= len(question["criteria"]) <= 5 and set(question["criteria"]) <= set(CHOICE_VERBS)
            elif question["type"] == "score":
                assert 3 <= len(question["criteria"]) <= 5
            else:
                assert question["type"] == "noul"
        assert sum(key in record for key in ("images", "audio", "videos")) <= 1
        for image in record.get("images", []):
            assert isinstance(image, Image.Image) and image.mode == "RGB"
        for clip in record.get("audio", []):
            assert clip.dtype == np.float32 and clip.ndim == 1 and 0.5 * 16_000 <= len(clip) <= 3 * 16_000
        for frames in record.get("videos", []):
            assert frames.dtype == np.uint8 and frames.ndim == 4 and frames.shape[-1] == 3 and frames.shape[0] % 2 == 0

    # §5: image if u < 0.10, video if u < 0.15, audio if u < 0.20, so shares 10%, 5%, 5% (binomial, within 4 sigma).
    for key, share in (("images", 0.10), ("videos", 0.05), ("audio", 0.05)):
        count = sum(key in record for record in calibration)
        assert abs(count - 512 * share) < 4 * math.sqrt(512 * share * (1 - share)), (key, count)
    shares = [sum(q["type"] == t for r in calibration for q in r["questions"].values()) for t in ("choice", "noul",
                                                                                                   "score")]
    assert min(shares) > 0.25 * sum(shares)
    assert sum(isinstance(r["state"], str) for r in calibration) > 0  # plain-text states occur too
    assert sum("history" in r["state"] for r in calibration if isinstance(r["state"], dict)) > 0.2 * 512


def test_records_encode_with_the_release_processor(tiny_release):
    processor = joint_schema_model.load_processor(tiny_release)
    records = calibration_records(40)
    assert all(any(field in record for record in records) for field in ("images", "audio", "videos"))
    for record in records:
        encoded = joint_schema_model.encode_record(processor.tokenizer, record, processor=processor)
        assert len(encoded.questions) == len(record["questions"])
        assert (encoded.media is not None) == any(key in record for key in ("images", "audio", "videos"))


# ---- quantize ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def nvfp4_export(tiny_release, tmp_path_factory) -> Path:
    """calib/quantize.py's W4A4 export of the tiny release, calibrated on 3 records (the third carries audio)."""
    out = tmp_path_factory.mktemp("calib") / "nvfp4"
    quantize.main([str(tiny_release), str(out), "--records", "3", "--device", "cpu"])
    return out


@pytest.fixture(scope="session")
def w4a16_export(tiny_release, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calib") / "w4a16"
    quantize.main([str(tiny_release), str(out), "--records", "2", "--device", "cpu", "--weights-only"])
    return out


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("model*.safetensors")):
        tensors.update(safetensors.torch.load_file(shard))
    return tensors


def _dequantize(packed_codes, block_scales, global_scale) -> torch.Tensor:
    """docs/nvfp4-format.md §2.1 written out: low nibble = element 2i, E2M1 table, per-block scale times global scale,
    fp32."""
    codes = torch.empty(packed_codes.shape[0], 2 * packed_codes.shape[1], dtype=torch.long)
    codes[:, 0::2], codes[:, 1::2] = (packed_codes & 0x0F).long(), (packed_codes >> 4).long()
    per_block = block_scales.float() * global_scale.float()
    return torch.tensor(E2M1_TABLE)[codes] * per_block.repeat_interleave(16, dim=-1)


def test_export_packs_every_expert_of_the_release(tiny_release, nvfp4_export):
    config = json.loads((tiny_release / "config.json").read_text())["thinker_config"]["text_config"]
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    quant = json.loads((nvfp4_export / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    excluded = quant["exclude_modules"]
    assert any("visual" in m for m in excluded) and any("audio_tower" in m for m in excluded)

    exported, release = _tensors(nvfp4_export), _tensors(tiny_release)
    # the LM head stays BF16, and both lists of unquantized modules say so, as for a model ModelOpt saw whole
    assert exported["thinker.lm_head.weight"].dtype == torch.bfloat16
    config_ignore = json.loads((nvfp4_export / "config.json").read_text())["quantization_config"]["ignore"]
    for unquantized in (excluded, config_ignore):
        assert any(fnmatch.fnmatchcase("thinker.lm_head", pattern) for pattern in unquantized), unquantized
    packed = [name for name, tensor in exported.items() if ".experts." in name and name.endswith(".weight")]
    assert len(packed) == layers * experts * 3 and all(exported[name].dtype == torch.uint8 for name in packed)
    assert not [name for name, tensor in exported.items() if ".experts." in name and tensor.dtype == torch.bfloat16]

    # Every dequantised expert is close to its own BF16 source and farther from every other expert's (no mix-ups).
    for layer in range(layers):
        for projection in ("gate_proj", "up_proj", "down_proj"):
            sources = torch.stack([release[f"thinker.model.layers.{layer}.mlp.experts.{e}.{projection}.weight"].float()
                                   for e in range(experts)])  # [E, out, in]
            for expert in range(experts):
                prefix = f"thinker.model.layers.{layer}.mlp.experts.{expert}.{projection}."
                assert exported[prefix + "input_scale"].item() > 0
                weight = _dequantize(exported[prefix + "weight"], exported[prefix + "weight_scale"],
                                     exported[prefix + "weight_scale_2"])
                errors = (sources - weight).norm(dim=(1, 2)) / sources.norm(dim=(1, 2))  # [E]
                assert int(errors.argmin()) == expert and errors[expert] < 0.2, (prefix, errors)

    head = "joint_head.safetensors"
    assert hashlib.sha256((nvfp4_export / head).read_bytes()).digest() == hashlib.sha256(
        (tiny_release / head).read_bytes()).digest()
    for name in ("joint_head_config.json", "tokenizer.json", "processor_config.json", "LICENSE"):
        assert (nvfp4_export / name).read_bytes() == (tiny_release / name).read_bytes()
    sums = (nvfp4_export / "SHA256SUMS").read_text().splitlines()
    listed = {}
    for line in sums:
        digest, name = line.split("  ", 1)
        listed[name] = digest
    assert set(listed) == {p.name for p in nvfp4_export.iterdir()} - {"SHA256SUMS"}
    for name, digest in listed.items():
        assert hashlib.sha256((nvfp4_export / name).read_bytes()).hexdigest() == digest


def _answer(checkpoint: Path, *flags: str) -> tuple[str, dict]:
    loaded = serve_clef.load_from_args(serve_clef.parse_args(["--model", str(checkpoint), "--device", "cpu", *flags]),
                                      progress=lambda message: None)
    record = evaluation_records(1)[0]
    return loaded.kind, loaded.schema.systemone(loaded.model, loaded.processor, record)


def _dequantised_reference(export: Path, tmp_path: Path) -> Path:
    """A BF16 checkpoint of the export's weights, each NVFP4 linear dequantised by docs/nvfp4-format.md §2.1 as
    written (test_nvfp4.reference_dequantize, through test_checkpoint_layouts.dequantised)."""
    return write_checkpoint(export, tmp_path / "bf16", dequantised(_tensors(export)))


def test_serve_clef_loads_the_export_and_answers(nvfp4_export, tmp_path):
    """Served W4A16 (the default) answers exactly as the export's own weights dequantised; with the W4A4 replay the
    answers move (the replay's numerics are checked against §2.3 in test_nvfp4.py and on the GPU against ModelOpt's
    kernel by bench/calib_gpu_check.py: no CPU whole-model W4A4 reference exists)."""
    kind, response = _answer(nvfp4_export)
    assert kind == "modelopt:NVFP4"
    reference_kind, reference = _answer(_dequantised_reference(nvfp4_export, tmp_path))
    assert reference_kind == "bf16" and response == reference
    kind, w4a4 = _answer(nvfp4_export, "--simulate-fp4-activations")
    assert kind == "modelopt:NVFP4" and list(w4a4["answers"]) == list(response["answers"])
    assert w4a4["answers"] != response["answers"]


def test_weights_only_export_has_no_input_scales_and_is_served(w4a16_export, tmp_path):
    quant = json.loads((w4a16_export / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_NVFP4"
    tensors = _tensors(w4a16_export)
    assert not [name for name in tensors if name.endswith("input_scale")]
    assert sum(name.endswith(".weight") and ".experts." in name for name in tensors) > 0
    kind, response = _answer(w4a16_export)
    assert kind == "modelopt:W4A16_NVFP4"
    assert response == _answer(_dequantised_reference(w4a16_export, tmp_path))[1]


def _rewrite_shard(directory: Path, change) -> None:
    shard = directory / "model.safetensors"
    tensors = safetensors.torch.load_file(shard)
    change(tensors)
    safetensors.torch.save_file(tensors, shard, metadata={"format": "pt"})


EXPERT = "thinker.model.layers.1.mlp.experts.3."


def _nan_scale_byte(tensors):
    scale_bytes = tensors[EXPERT + "down_proj.weight_scale"].view(torch.uint8).clone()
    scale_bytes[5, 1] = 0xFF
    tensors[EXPERT + "down_proj.weight_scale"] = scale_bytes.view(torch.float8_e4m3fn)


def _drop_expert(tensors):
    for name in [name for name in tensors if name.startswith(EXPERT)]:
        del tensors[name]


def _uncalibrated_input_scale(tensors):
    tensors[EXPERT + "up_proj.input_scale"] = torch.tensor(0.0)


def _bf16_experts_left(tensors):
    tensors["thinker.model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(8, 64, 64, dtype=torch.bfloat16)


def _unpacked_weight(tensors):
    tensors[EXPERT + "gate_proj.weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("change, message", [
    (_nan_scale_byte, EXPERT + r"down_proj\.weight_scale: 1 NaN block scales \(bytes 0x7F/0xFF\)"),
    (_drop_expert, r"layer 1 expert 3 gate_proj: weight missing"),
    (_uncalibrated_input_scale, EXPERT + r"up_proj\.input_scale: scale 0\.0 must be finite and positive"),
    (_bf16_experts_left, r"thinker\.model\.layers\.0\.mlp\.experts\.gate_up_proj is not a packed per-expert tensor"),
    (_unpacked_weight, EXPERT + r"gate_proj\.weight: torch\.bfloat16 \[32, 64\], expected packed uint8 \[32, 32\]"),
])
def test_check_export_names_what_is_broken(tiny_release, nvfp4_export, tmp_path, change, message):
    broken = tmp_path / "broken"
    shutil.copytree(nvfp4_export, broken)
    quantize.check_export(broken, tiny_release)  # the copy itself passes
    _rewrite_shard(broken, change)
    with pytest.raises(quantize.ExportCheckError, match=message):
        quantize.check_export(broken, tiny_release)


def test_check_export_catches_a_changed_joint_head_byte(tiny_release, nvfp4_export, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(nvfp4_export, broken)
    head = bytearray((broken / "joint_head.safetensors").read_bytes())
    head[-3] ^= 0x01
    (broken / "joint_head.safetensors").write_bytes(bytes(head))
    with pytest.raises(quantize.ExportCheckError, match=r"joint_head\.safetensors: missing or not byte-identical"):
        quantize.check_export(broken, tiny_release)


def test_resume_exports_the_same_bytes_without_calibrating(tiny_release, nvfp4_export, tmp_path, monkeypatch):
    retry = tmp_path / "retry"
    shutil.copy(quantize.calibration_state_path(nvfp4_export), quantize.calibration_state_path(retry))

    def no_calibration(*args, **kwargs):
        raise AssertionError("--resume must not calibrate again")

    monkeypatch.setattr(quantize, "calibrate", no_calibration)
    quantize.main([str(tiny_release), str(retry), "--device", "cpu", "--resume"])
    assert (retry / "model.safetensors").read_bytes() == (nvfp4_export / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    shutil.copy(quantize.calibration_state_path(nvfp4_export), quantize.calibration_state_path(other))
    with pytest.raises(RuntimeError, match="weights_only=False"):
        quantize.main([str(tiny_release), str(other), "--device", "cpu", "--resume", "--weights-only"])


def test_check_quantizers_names_an_uncalibrated_quantizer(tiny_release, nvfp4_export):
    backbone, _, _ = quantize.load_for_calibration(tiny_release, "cpu")
    backbone = quantize.restore_calibration_state(backbone, quantize.calibration_state_path(nvfp4_export), False)
    quantize.check_quantizers(backbone, weights_only=False)
    experts = next(module for name, module in backbone.named_modules() if name.endswith("layers.1.mlp.experts"))
    experts.down_proj_input_quantizer.amax = torch.tensor(0.0)
    message = r"layers\.1\.mlp\.experts\.down_proj_input_quantizer: amax .* not calibrated"
    with pytest.raises(RuntimeError, match=message):
        quantize.check_quantizers(backbone, weights_only=False)
    experts.down_proj_input_quantizer.amax = torch.tensor(2.0)
    experts.gate_up_proj_weight_quantizers[5].amax = torch.tensor(float("nan"))
    with pytest.raises(RuntimeError, match=r"layers\.1\.mlp\.experts\.gate_up_proj_weight_quantizers\.5: amax"):
        quantize.check_quantizers(backbone, weights_only=False)


# ---- parity ---------------------------------------------------------------------------------------------------------


def _percentile_95(values: list[float]) -> float:
    """Linear interpolation between closest ranks, written out."""
    ordered = sorted(values)
    position = 0.95 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def test_parity_report_against_an_independent_recomputation(tiny_release, nvfp4_export, tmp_path):
    out = tmp_path / "parity.json"
    report = parity.main([str(tiny_release), str(nvfp4_export), "--records", "2", "--device", "cpu",
                          "--simulate-fp4-activations", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["reference"]["kind"] == "bf16" and report["candidate"]["kind"] == "modelopt:NVFP4"
    questions = report["per_question"]
    assert len(questions) == sum(len(r["questions"]) for r in evaluation_records(2))

    tvs, agreements = [], []
    for question in questions:
        p, q = question["reference"], question["candidate"]
        assert len(p) == len(q) == len(question["option_ids"]) and abs(sum(p) - 1) < 1e-5
        tvs.append(0.5 * sum(abs(a - b) for a, b in zip(p, q)))
        agreements.append(p.index(max(p)) == q.index(max(q)))
    stats = report["candidate_vs_reference"]
    assert stats["mean_tv"] == pytest.approx(sum(tvs) / len(tvs), abs=1e-12)
    assert stats["max_tv"] == pytest.approx(max(tvs), abs=1e-12)
    assert stats["p95_tv"] == pytest.approx(_percentile_95(tvs), abs=1e-12)
    assert stats["top1_agreement"] == pytest.approx(sum(agreements) / len(agreements))
    assert len(stats["flips"]) == agreements.count(False)
    assert max(tvs) > 0  # NVFP4 experts do move the probabilities of the tiny release

    floor = report["noise_floor"]
    assert sorted(floor["experts_implementations"]) == ["eager", "grouped_mm"]
    assert floor["questions"] == len(questions)

    # the weights' memory: the release's tensor bytes on disk (the talker's left out, the joint head's in), plus the
    # buffers the model computes at load (rotary frequencies, the audio tower's positions), which no file holds
    on_disk = 0
    for shard in tiny_release.glob("*.safetensors"):
        with safetensors.safe_open(shard, "pt") as tensors:
            on_disk += sum(tensors.get_tensor(name).nbytes for name in tensors.keys()  # noqa: SIM118 (not a dict)
                           if not serve_clef.is_talker_tensor(name))
    model = serve_clef.load_from_args(serve_clef.parse_args(["--model", str(tiny_release), "--device", "cpu"]),
                                      progress=lambda message: None).model
    computed = sum(buffer.nbytes for name, buffer in model.named_buffers() if name not in model.state_dict())
    assert report["reference"]["memory_gib"] == {"weights": (on_disk + computed) / 2**30, "peak": None}  # on CPU
    assert 0 < report["candidate"]["memory_gib"]["weights"] < report["reference"]["memory_gib"]["weights"]


def _scored(question_id: str, option_ids: list[str], probabilities: list[float]) -> dict:
    return {"record_id": "r", "question_id": question_id, "option_ids": option_ids, "probabilities": probabilities}


def test_compare_on_hand_computed_probabilities():
    """parity.compare against numbers worked out by hand: question a keeps its top-1 (TV 0.1), b flips from v to w
    (TV 0.2, reference margin 0.5 - 0.3); identical scores agree fully; other questions are refused."""
    reference = [_scored("a", ["x", "y"], [0.7, 0.3]), _scored("b", ["u", "v", "w"], [0.2, 0.5, 0.3])]
    candidate = [_scored("a", ["x", "y"], [0.6, 0.4]), _scored("b", ["u", "v", "w"], [0.2, 0.3, 0.5])]
    stats = parity.compare(reference, candidate)
    assert stats["questions"] == 2 and stats["top1_agreement"] == 0.5
    assert stats["mean_tv"] == pytest.approx(0.15) and stats["max_tv"] == pytest.approx(0.2)
    assert stats["p95_tv"] == pytest.approx(0.1 + 0.95 * 0.1)  # linear interpolation between the two
    assert stats["max_abs_dp"] == pytest.approx(0.2)
    [flip] = stats["flips"]
    assert flip["question_id"] == "b" and flip["reference_top1"] == "v" and flip["candidate_top1"] == "w"
    assert flip["reference_margin"] == pytest.approx(0.2) and flip["tv"] == pytest.approx(0.2)
    same = parity.compare(reference, reference)
    assert same["top1_agreement"] == 1.0 and same["max_tv"] == 0.0 and same["flips"] == []
    with pytest.raises(ValueError, match="scored different questions or options"):
        parity.compare(reference, candidate[:1] + [_scored("b", ["u", "v"], [0.5, 0.5])])


def test_nan_probabilities_fail_the_gates():
    """A candidate whose probabilities are NaN (a broken kernel) fails the parity gates and shows NaN in its
    statistics, rather than passing every `<`/`>` comparison."""
    reference = [_scored("a", ["x", "y"], [0.7, 0.3]), _scored("b", ["u", "v"], [0.4, 0.6])]
    candidate = [_scored("a", ["x", "y"], [0.7, 0.3]), _scored("b", ["u", "v"], [math.nan, math.nan])]
    stats = parity.compare(reference, candidate)
    assert math.isnan(stats["max_abs_dp"]) and math.isnan(stats["mean_tv"])
    verdict = parity.judge(stats, synthetic_sides=[])
    assert verdict["verdict"] == "fail" and any("mean_tv" in failure for failure in verdict["failed_gates"])


def test_parity_through_a_server_matches_scoring_in_process(tiny_release, tmp_path):
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen([sys.executable, serve_clef.__file__, "--model", str(tiny_release), "--device", "cpu",
                                   "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        records = [evaluation_records(20)[k] for k in (0, 19)]  # text only, and an image (PNG on the wire: lossless)
        assert "images" in records[1]
        loaded = serve_clef.load_from_args(serve_clef.parse_args(["--model", str(tiny_release), "--device", "cpu"]),
                                          progress=lambda message: None)
        in_process = parity.score_records(loaded, records)
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(f"{base_url}/healthz", timeout=10).status_code == 200:
                    break
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.2)
        over_http = parity.score_server(base_url, records)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert [(s["record_id"], s["question_id"], s["option_ids"], s["tokens"]) for s in over_http] == \
        [(s["record_id"], s["question_id"], s["option_ids"], s["tokens"]) for s in in_process]
    for remote, local in zip(over_http, in_process):
        assert np.allclose(remote["probabilities"], local["probabilities"], atol=1e-4 / 2 + 1e-7), (remote, local)
    # the server's log: one line per decision (README), and no access log of uvicorn's repeating it
    log_text = (tmp_path / "server.log").read_text()
    assert len(re.findall(r"^request [0-9a-f]{16} 200 \d+ tokens [\d.]+ ms$", log_text, re.MULTILINE)) == len(records)
    assert "POST /v1/systemone" not in log_text and "GET /healthz" not in log_text


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
