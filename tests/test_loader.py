"""serve_clef's checkpoint loader on tiny checkpoints: BF16 releases, exports written by ModelOpt itself (W4A4 and
W4A16), both tensor-name layouts, the synthetic model, a model directory's own joint_schema_model.py, and broken
checkpoints that must fail naming the tensor.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

import joint_schema_model
import serve_clef
from calib import quantize

RELEASE_FILES = (
    "joint_head.safetensors",
    "joint_head_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "chat_template.jinja",
)
REQUEST = {
    "model": "clef-omni",
    "state": {"task": "Tidy the kitchen", "observation": "The sink is full of dishes and the floor is wet."},
    "questions": {
        "done": {"type": "noul", "instructions": "Is the task finished?"},
        "next": {
            "type": "choice",
            "instructions": "What next?",
            "criteria": {"wash": "Wash the dishes", "mop": "Mop", "wait": None},
        },
        "mess": {"type": "score", "instructions": "How messy is it?", "criteria": ["clean", "some mess", "chaos"]},
    },
}


def modelopt_export(release: Path, out_dir: Path, weight_only: bool) -> Path:
    """Quantize the release's thinker experts with ModelOpt on CPU with the project's recipe (calib/quantize.py's
    quantization_config: NVFP4_EXPERTS_ONLY_CFG, max calibration), calibrated on random tokens, export it with
    export_hf_checkpoint, then copy the Clef files beside it, as the recipe of docs/nvfp4-format.md §4.1 does."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    config = transformers.AutoConfig.from_pretrained(release)
    config.enable_audio_output = False
    backbone = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        release, config=config, dtype=torch.bfloat16, experts_implementation="eager"
    )
    quant_config = quantize.quantization_config(weights_only=weight_only)

    def calibrate(model):
        generator = torch.Generator().manual_seed(0)
        for _ in range(4):  # enough tokens that every expert of the tiny model is routed to
            input_ids = torch.randint(0, config.thinker_config.text_config.vocab_size, (1, 96), generator=generator)
            model.thinker(input_ids=input_ids, use_cache=False)

    mtq.quantize(backbone, quant_config, calibrate)
    # Qwen3OmniMoeForConditionalGeneration has no usable forward; the exporter runs one
    # (docs/nvfp4-format.md §4.1, step 5).
    backbone.forward = types.MethodType(
        lambda self, input_ids=None, **kwargs: self.thinker(input_ids=input_ids, use_cache=False), backbone
    )
    export_hf_checkpoint(backbone, export_dir=out_dir)
    for name in RELEASE_FILES:
        if (release / name).exists():
            shutil.copy(release / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def nvfp4_export(tiny_release, tmp_path_factory) -> Path:
    return modelopt_export(tiny_release, tmp_path_factory.mktemp("nvfp4_export"), weight_only=False)


@pytest.fixture(scope="session")
def w4a16_export(tiny_release, tmp_path_factory) -> Path:
    return modelopt_export(tiny_release, tmp_path_factory.mktemp("w4a16_export"), weight_only=True)


def load(model: Path | str, *flags: str) -> serve_clef.LoadedClef:
    return serve_clef.load_from_args(
        serve_clef.parse_args(["--model", str(model), "--device", "cpu", *flags]), progress=lambda line: None
    )


def probabilities(loaded: serve_clef.LoadedClef) -> dict:
    answers = loaded.schema.systemone(loaded.model, loaded.processor, REQUEST)["answers"]
    return {question: answer.get("probabilities", answer.get("noul")) for question, answer in answers.items()}


def raw_probabilities(loaded: serve_clef.LoadedClef) -> list[torch.Tensor]:
    """Unrounded option probabilities of REQUEST, for exact comparisons."""
    schema = loaded.schema
    encoded = schema.encode_record(loaded.processor.tokenizer, REQUEST, processor=loaded.processor)
    with torch.inference_mode():
        logits = loaded.model(schema.collate_records([encoded], loaded.processor.tokenizer.pad_token_id, "cpu"))[0]
    return [question_logits.float().softmax(-1) for question_logits in logits]


def rewrite_checkpoint(source: Path, destination: Path, change) -> Path:
    """A copy of a checkpoint dir whose tensors went through change(dict) -> dict, saved as one model.safetensors."""
    destination.mkdir()
    for path in source.iterdir():
        if not path.name.startswith("model"):
            shutil.copy(path, destination / path.name)
    tensors = dict(serve_clef.checkpoint_tensors(source))
    safetensors.torch.save_file(change(tensors), destination / "model.safetensors", metadata={"format": "pt"})
    return destination


def test_quantizer_writes_the_bytes_modelopts_exporter_writes(tiny_release, nvfp4_export):
    exported = dict(serve_clef.checkpoint_tensors(nvfp4_export))
    ours = dict(serve_clef.quantize_experts_to_nvfp4(serve_clef.checkpoint_tensors(tiny_release), input_scale=1.0))
    expert_names = [name for name in exported if ".experts." in name and not name.endswith("input_scale")]
    assert len(expert_names) == 2 * 8 * 3 * 3  # layers x experts x projections x (weight, weight_scale, weight_scale_2)
    for name in expert_names:
        assert exported[name].dtype == ours[name].dtype and exported[name].shape == ours[name].shape, name
        assert torch.equal(exported[name].reshape(-1).view(torch.uint8), ours[name].reshape(-1).view(torch.uint8)), name


def test_modelopt_export_loads_and_answers(nvfp4_export, tiny_release, tmp_path):
    """The export answers exactly as a BF16 checkpoint of its weights dequantised by docs/nvfp4-format.md §2.1 as
    written (test_nvfp4.reference_dequantize), and differently from the release it was quantized from."""
    from test_checkpoint_layouts import checkpoint_files, dequantised, write_checkpoint  # it imports this module

    loaded = load(nvfp4_export)
    assert loaded.kind == "modelopt:NVFP4" and loaded.notice is None
    experts = [module for module in loaded.model.modules() if isinstance(module, serve_clef.PackedNVFP4Experts)]
    assert len(experts) == 2 and experts[0].gate_up_packed_codes.dtype == torch.uint8
    reference = write_checkpoint(nvfp4_export, tmp_path / "bf16", dequantised(checkpoint_files(nvfp4_export)[0]))
    assert load(reference).kind == "bf16"
    served = raw_probabilities(loaded)
    for got, expected in zip(served, raw_probabilities(load(reference)), strict=True):
        assert torch.equal(got, expected)
    release = raw_probabilities(load(tiny_release))
    assert any(not torch.equal(a, b) for a, b in zip(served, release, strict=True))


def to_internal_layout(tensors: dict) -> dict:
    """Rename hub-layout keys to transformers' internal ones, as a ModelOpt export of the bare thinker writes them."""
    renames = {
        "thinker.model.": "model.language_model.",
        "thinker.visual.": "model.visual.",
        "thinker.audio_tower.": "model.audio_tower.",
        "thinker.lm_head.": "lm_head.",
    }
    renamed = {}
    for name, tensor in tensors.items():
        prefix = next(prefix for prefix in renames if name.startswith(prefix))
        renamed[renames[prefix] + name.removeprefix(prefix)] = tensor
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight_scale" in renamed
    return renamed


def test_both_name_layouts_give_identical_probabilities(nvfp4_export, tmp_path):
    internal = rewrite_checkpoint(nvfp4_export, tmp_path / "internal", to_internal_layout)
    hub_probabilities = raw_probabilities(load(nvfp4_export))
    internal_probabilities = raw_probabilities(load(internal))
    for hub, internal in zip(hub_probabilities, internal_probabilities, strict=True):
        assert torch.equal(hub, internal)


def test_packed_and_unpacked_experts_give_identical_probabilities(nvfp4_export):
    packed = raw_probabilities(load(nvfp4_export))
    unpacked_model = load(nvfp4_export, "--no-packed-nvfp4")
    assert not any(isinstance(module, serve_clef.PackedNVFP4Experts) for module in unpacked_model.model.modules())
    for packed_question, unpacked_question in zip(packed, raw_probabilities(unpacked_model), strict=True):
        assert torch.equal(packed_question, unpacked_question)


def test_simulated_fp4_activations_change_the_answers(nvfp4_export):
    w4a16 = raw_probabilities(load(nvfp4_export))
    w4a4 = raw_probabilities(load(nvfp4_export, "--simulate-fp4-activations"))
    assert any(not torch.equal(a, b) for a, b in zip(w4a16, w4a4, strict=True))
    assert all(torch.allclose(a, b, atol=0.2) for a, b in zip(w4a16, w4a4, strict=True))


def test_bf16_release_answers_like_load_release_model(tiny_release):
    """Loaded by serve_clef, a BF16 release computes what load_release_model's model computes: the thinker's outputs
    bit for bit, and the options' logits to within BF16 noise, since serve_clef scores with its batched joint head,
    whose masked attention may sum in another order than the decision module's head (it does on some CPUs); the
    answers agree to two decimals."""
    loaded = load(tiny_release)
    assert loaded.kind == "bf16"
    reference_model, reference_processor = joint_schema_model.load_release_model(tiny_release, device="cpu")
    encoded = joint_schema_model.encode_record(reference_processor.tokenizer, REQUEST)
    batch = joint_schema_model.collate_records([encoded], reference_processor.tokenizer.pad_token_id, "cpu")
    with torch.inference_mode():
        thinker_outputs = [model.thinker(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                         use_cache=False, return_dict=True).logits
                           for model in (loaded.model, reference_model)]
        assert torch.equal(*thinker_outputs)
        ours, theirs = (model._forward_unpadded(batch)[0] for model in (loaded.model, reference_model))
    for got, expected in zip(ours, theirs, strict=True):
        allowed = serve_clef.BATCHED_HEAD_TOLERANCE * max(1.0, expected.abs().max().item())
        assert (got.float() - expected.float()).abs().max() <= allowed
    reference = joint_schema_model.systemone(reference_model, reference_processor, REQUEST)["answers"]
    answers = loaded.schema.systemone(loaded.model, loaded.processor, REQUEST)["answers"]
    assert answers.keys() == reference.keys()
    for question_id, answer in answers.items():
        expected = reference[question_id]
        assert answer.keys() == expected.keys() and answer.get("choice") == expected.get("choice")
        for key in ("noul", "score", "confidence"):
            assert answer.get(key) == pytest.approx(expected.get(key), abs=0.01)
        for option, probability in answer.get("probabilities", {}).items():
            assert probability == pytest.approx(expected["probabilities"][option], abs=0.01)


def test_w4a16_export_refuses_simulated_activations(w4a16_export):
    assert (
        json.loads((w4a16_export / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "W4A16_NVFP4"
    )
    assert load(w4a16_export).kind == "modelopt:W4A16_NVFP4"
    with pytest.raises(serve_clef.CheckpointError, match="--simulate-fp4-activations.*W4A16_NVFP4"):
        load(w4a16_export, "--simulate-fp4-activations")


def test_bf16_release_refuses_simulated_activations(tiny_release):
    with pytest.raises(serve_clef.CheckpointError, match="--simulate-fp4-activations.*bf16"):
        load(tiny_release, "--simulate-fp4-activations")


def without(name):
    def change(tensors):
        del tensors[name]
        return tensors

    return change


def with_nan_scale_byte(name):
    def change(tensors):
        scale_bytes = tensors[name].view(torch.uint8).clone()
        scale_bytes[1, 0] = 0x7F
        tensors[name] = scale_bytes.view(torch.float8_e4m3fn)
        return tensors

    return change


@pytest.mark.parametrize(
    "change, tensor_named",
    [
        (
            without("thinker.model.layers.1.mlp.experts.5.down_proj.weight_scale"),
            "layers.1.mlp.experts.5.down_proj.weight_scale",
        ),
        (without("thinker.model.layers.0.self_attn.q_proj.weight"), "layers.0.self_attn.q_proj.weight"),
        (
            with_nan_scale_byte("thinker.model.layers.0.mlp.experts.2.gate_proj.weight_scale"),
            "thinker.model.layers.0.mlp.experts.2.gate_proj.weight_scale",
        ),
    ],
    ids=["missing-expert-tensor", "missing-attention-weight", "nan-scale-byte"],
)
def test_broken_checkpoints_fail_naming_the_tensor(nvfp4_export, tmp_path, change, tensor_named):
    broken = rewrite_checkpoint(nvfp4_export, tmp_path / "broken", change)
    with pytest.raises(serve_clef.CheckpointError, match=tensor_named.replace(".", r"\.")):
        load(broken)


def test_unknown_tensor_fails_naming_it(nvfp4_export, tmp_path):
    def add_stray(tensors):
        tensors["thinker.model.layers.0.mlp.shared_expert.weight"] = torch.zeros(4)
        return tensors

    broken = rewrite_checkpoint(nvfp4_export, tmp_path / "stray", add_stray)
    with pytest.raises(serve_clef.CheckpointError, match=r"thinker\.model\.layers\.0\.mlp\.shared_expert\.weight"):
        load(broken)


def test_synthetic_loads_offline_with_its_notice():
    loaded = load("synthetic")
    assert loaded.kind == "modelopt:NVFP4" and loaded.model_id == "synthetic"
    assert "meaningless" in loaded.notice
    answers = loaded.schema.systemone(loaded.model, loaded.processor, REQUEST)["answers"]
    assert answers["mess"]["type"] == "score"


def test_model_directory_with_its_own_joint_schema_model_is_served_through_it(nvfp4_export, tmp_path):
    own = tmp_path / "own"
    shutil.copytree(nvfp4_export, own)
    source = Path(joint_schema_model.__file__).read_text()
    marked = source.replace(
        '        return {"type": "noul", "noul": round(',
        '        return {"type": "noul", "marker": "own copy", "noul": round(',
    )
    assert marked != source
    (own / "joint_schema_model.py").write_text(marked)
    loaded = load(own)
    assert loaded.schema is not joint_schema_model
    assert Path(loaded.schema.__file__) == own / "joint_schema_model.py"
    assert loaded.schema.systemone(loaded.model, loaded.processor, REQUEST)["answers"]["done"]["marker"] == "own copy"


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="needs a machine without torchvision")
def test_a_release_processor_that_needs_torchvision_is_refused_in_one_line_without_it(nvfp4_export, tmp_path):
    """A release's own decision file has no load_processor (the spec's): the processor comes from transformers'
    AutoProcessor, whose Qwen3-Omni video processor imports torchvision; without it the load says so."""
    own = tmp_path / "own"
    shutil.copytree(nvfp4_export, own)
    source = Path(joint_schema_model.__file__).read_text()
    (own / "joint_schema_model.py").write_text(source + "\n\ndel load_processor  # as the release's file has none\n")
    with pytest.raises(serve_clef.CheckpointError, match=r"processor cannot be built here \(.*Torchvision.*\): "
                                                         r"install torchvision"):
        load(own)


def test_hub_id_that_cannot_be_downloaded_fails_with_one_clear_line():
    with pytest.raises(serve_clef.CheckpointError, match="--model DIR") as failure:
        load("nobody/no-such-clef-model")
    assert "\n" not in str(failure.value) and "hf download nobody/no-such-clef-model" in str(failure.value)


@pytest.mark.parametrize("local_path", ["./no/such/dir", "~/no-such-model", "/nowhere/clef"])
def test_missing_local_directory_is_named_not_sent_to_the_hub(local_path):
    with pytest.raises(serve_clef.CheckpointError, match=f"--model {local_path}: does not exist") as failure:
        load(local_path)
    assert "hub" not in str(failure.value)


def test_a_file_given_as_model_is_refused(nvfp4_export):
    with pytest.raises(serve_clef.CheckpointError, match="is a file, not a model directory"):
        load(nvfp4_export / "config.json")


def test_device_without_a_gpu_and_synthetic_full_on_cpu_fail_before_loading(monkeypatch):
    import synthetic_release

    def generate(*args, **kwargs):
        raise AssertionError("no weight may be generated before the refusal")

    monkeypatch.setattr(synthetic_release, "release_tensors", generate)
    with pytest.raises(serve_clef.CheckpointError, match="generates 29 B expert parameters in GPU memory and needs a"):
        load("synthetic:full")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(serve_clef.CheckpointError, match="--device cuda: this machine has no CUDA GPU"):
        serve_clef.load_clef("synthetic", device="cuda", progress=lambda line: None)


def test_synthetic_full_streams_the_same_weights_into_the_packed_store(monkeypatch):
    """synthetic:full's streaming path (release_tensors -> quantizer -> packed store, no weights on disk), run at
    tiny size: it must serve exactly what the tiny checkpoint written to disk serves."""
    import synthetic_release

    write_release = synthetic_release.write_release
    monkeypatch.setattr(
        synthetic_release, "write_release", lambda out_dir, size, **kwargs: write_release(out_dir, "tiny", **kwargs)
    )
    streamed = load("synthetic:full")
    assert streamed.kind == "modelopt:NVFP4" and "meaningless" in streamed.notice
    assert not list(streamed.checkpoint_dir.glob("model*.safetensors"))
    for from_stream, from_disk in zip(raw_probabilities(streamed), raw_probabilities(load("synthetic")), strict=True):
        assert torch.equal(from_stream, from_disk)


def test_directory_without_the_clef_files_fails_clearly(nvfp4_export, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(nvfp4_export, bare)
    (bare / "joint_head_config.json").unlink()
    with pytest.raises(serve_clef.CheckpointError, match="no joint_head_config.json: not a Clef-Omni model directory"):
        load(bare)


def write_text(name: str, text: str):
    return lambda checkpoint: (checkpoint / name).write_text(text)


def edit_json(name: str, edit):
    def change(checkpoint: Path) -> None:
        value = json.loads((checkpoint / name).read_text())
        edit(value)
        (checkpoint / name).write_text(json.dumps(value))

    return change


@pytest.mark.parametrize(
    "damage, phrase",
    [
        (write_text("hf_quant_config.json", '{"quantization": {'), r"hf_quant_config\.json cannot be read as JSON"),
        (write_text("config.json", "\xff not json"), r"config\.json cannot be read as JSON"),
        (write_text("joint_head_config.json", "[1, 2]"), r"joint_head_config\.json holds list"),
        (edit_json("hf_quant_config.json", lambda config: config.update(quantization=None)),
         r"hf_quant_config\.json: quantization holds NoneType"),
        (edit_json("hf_quant_config.json", lambda config: config["quantization"].update(config_groups={"g": "w"})),
         r"hf_quant_config\.json: config_groups\.g holds str"),
        (edit_json("hf_quant_config.json", lambda config: config["quantization"].update(
            quant_algo="MIXED_PRECISION", quantized_layers={"thinker.model.layers.0.mlp.experts.0.up_proj": 4})),
         r"quantized_layers\.thinker\.model\.layers\.0\.mlp\.experts\.0\.up_proj holds int"),
        (write_text("model.safetensors.index.json", '{"weight_map": ["model.safetensors"]}'),
         r"model\.safetensors\.index\.json: weight_map holds list"),
        (edit_json("joint_head_config.json", lambda config: config.pop("hidden_size")),
         r"joint_head_config\.json: missing a required argument: 'hidden_size'; its keys are the joint head's"),
        (edit_json("joint_head_config.json", lambda config: config.update(depth=3)),
         r"joint_head_config\.json: got an unexpected keyword argument 'depth'"),
    ],
    ids=["quant-config-not-json", "config-not-json", "head-config-a-list", "quantization-null", "group-a-string",
         "layer-a-number", "weight-map-a-list", "head-config-without-hidden-size", "head-config-unknown-key"],
)
def test_damaged_metadata_is_refused_in_one_line_naming_the_file(nvfp4_export, tmp_path, damage, phrase):
    """Metadata files that do not parse, or hold another JSON type where an object belongs, are refused with a
    CheckpointError naming the file and field (the command line prints it in one line), not a parser's traceback."""
    damaged = tmp_path / "damaged"
    shutil.copytree(nvfp4_export, damaged)
    damage(damaged)
    with pytest.raises(serve_clef.CheckpointError, match=phrase):
        load(damaged)


def test_a_compressed_tensors_group_without_a_global_scale_is_refused_by_its_scheme(tmp_path):
    """An FP4 group with strategy "group" has no global scale: its scheme is named, not its missing tensors."""
    config = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "group",
                                           "symmetric": True, "dynamic": False}}}}
    with pytest.raises(serve_clef.CheckpointError, match=r"config group group_0 .* strategy 'group'.* is not served"):
        serve_clef.compressed_tensors_quantization(config, "config.json quantization_config")


def test_joint_head_of_another_size_fails_clearly(nvfp4_export, tmp_path):
    mismatched = tmp_path / "mismatched"
    shutil.copytree(nvfp4_export, mismatched)
    head_config = json.loads((mismatched / "joint_head_config.json").read_text())
    (mismatched / "joint_head_config.json").write_text(json.dumps(head_config | {"width": 2 * head_config["width"]}))
    with pytest.raises(serve_clef.CheckpointError, match="joint_head.safetensors does not fit joint_head_config.json"):
        load(mismatched)


def run_alone(tmp_path: Path, *cli_args: str) -> subprocess.CompletedProcess:
    """serve_clef.py copied alone into an empty folder and run from there, without the repository on the path."""
    alone = tmp_path / "alone"
    alone.mkdir(exist_ok=True)
    shutil.copy(serve_clef.__file__, alone / "serve_clef.py")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(alone / "serve_clef.py"), *cli_args], capture_output=True, text=True,
                          cwd=alone, env=env, timeout=600)


def test_serve_clef_alone_serves_a_directory_that_carries_its_decision_file(nvfp4_export, tmp_path):
    own = tmp_path / "own"
    shutil.copytree(nvfp4_export, own)
    shutil.copy(joint_schema_model.__file__, own / "joint_schema_model.py")
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps(REQUEST))
    run = run_alone(tmp_path, "--model", str(own), "--device", "cpu", "--request", str(request_file))
    assert run.returncode == 0, run.stderr[-3000:]
    response = json.loads(run.stdout)
    assert list(response["answers"]) == list(REQUEST["questions"])
    assert f"decision code: the checkpoint's own {own / 'joint_schema_model.py'}" in run.stderr


@pytest.mark.parametrize("model, missing", [("synthetic", "synthetic_release.py"), (None, "joint_schema_model.py")])
def test_serve_clef_alone_says_which_sibling_file_it_needs(nvfp4_export, tmp_path, model, missing):
    run = run_alone(tmp_path, "--model", model or str(nvfp4_export), "--device", "cpu", "--demo")
    assert run.returncode == 2
    assert f"needs serve_clef's {missing}, which is not beside serve_clef.py" in run.stderr
    assert "Traceback" not in run.stderr


def test_default_context_is_the_decision_apis():
    assert serve_clef.DEFAULT_MAX_LENGTH == joint_schema_model.DEFAULT_MAX_LENGTH
