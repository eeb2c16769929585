# /// script
# requires-python = ">=3.11"
# dependencies = [
#   "torch==2.11.0",  # the build serve_clef runs on the H200 (CUDA 13.0); CPU machines: see the README
#   "transformers>=5.17",
#   "accelerate",
#   "nvidia-modelopt==0.47.0",
#   "requests",
#   "safetensors",
#   "tokenizers",
#   "huggingface_hub",
#   "numpy",
#   "pillow",
#   "av>=17",  # VideoFrame.to_ndarray(threads=...)
#   "triton",  # serve_clef's own imports (the export check uses its loader's validator)
#   "fastapi",
#   "uvicorn",
#   "prometheus-client",
#   "zstandard",
#   "python-multipart",
#   "tqdm",
# ]
# ///
"""Quantize a BF16 Clef-Omni release into a ModelOpt NVFP4 checkpoint: thinker MoE experts only, `max` calibration.

    python calib/quantize.py RELEASE_DIR OUT_DIR [--records 512] [--weights-only] [--device cuda] [--resume]

The recipe of docs/nvfp4-format.md §4: ModelOpt's NVFP4_EXPERTS_ONLY_CFG with the audio tower, vision tower,
talker, code2wav, LM head, routers and embeddings kept in BF16; calibration runs Clef's own scoring path
(`encode_record` -> `collate_records` -> `ClefModel`) over the calibration records of calib/records.py; the export is
ModelOpt's `export_hf_checkpoint`, then the release's non-weight files (joint head, tokenizer, processor, ...) are
copied beside it. `--weights-only` writes W4A16_NVFP4 (expert input quantizers disabled) instead of W4A4 NVFP4.

The calibrated quantizer state is saved next to OUT_DIR (`OUT_DIR.calibration.pt`) before the export starts, so a
failed export can be retried with `--resume` without calibrating again. The export counts as done only when
`check_export` passes: every expert packed, no NaN scale bytes, no BF16 experts left, the joint head byte-identical,
every expert input scale calibrated (W4A4). It then writes SHA256SUMS.
"""

import argparse
import contextlib
import copy
import hashlib
import json
import logging
import re
import shutil
import sys
import time
import types
import warnings
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script (`python calib/quantize.py`, `uv run`): find the repo modules
    sys.path.insert(0, str(REPO_ROOT))

import serve_clef
from calib.records import calibration_records

# Importing ModelOpt 0.47 warns that any transformers newer than its own pin is "not tested" (this recipe is tested with
# transformers 5.17 and 5.24, and the fix it suggests, nvidia-modelopt[hf], pins transformers < 5.15), and scripts
# functions with the deprecated torch.jit.script and script_method (deprecations addressed to ModelOpt's authors).
warnings.filterwarnings("ignore", r"transformers \S+ is not tested with current version of modelopt", UserWarning,
                        r"modelopt\.")
warnings.filterwarnings("ignore", r"`torch\.jit\.script(_method)?` is deprecated", DeprecationWarning, r"torch\.jit\.")

# Quantizers of these modules stay disabled on top of NVFP4_EXPERTS_ONLY_CFG's own list, which does not cover the
# audio tower, the talker or code2wav (docs/nvfp4-format.md §4.2). The joint head is never handed to ModelOpt at all.
KEEP_BF16 = ("*audio_tower*", "*visual*", "*talker*", "*code2wav*", "*lm_head*", "*mlp.gate.*", "*embed*")
LM_HEAD = "thinker.lm_head"  # kept in BF16 (KEEP_BF16), as the export's module lists name it
# Release files the exporter writes itself (config.json, generation_config.json) or replaces (the BF16 weights).
NOT_COPIED = re.compile(r"^(model.*\.safetensors|model\.safetensors\.index\.json|config\.json|"
                        r"generation_config\.json|hf_quant_config\.json|SHA256SUMS)$")
# Expert tensors of the thinker's text decoder in either naming layout (docs/nvfp4-format.md §3.4).
EXPERT_TENSOR = re.compile(r"^(?:thinker\.)?model\.(?:language_model\.)?layers\.(\d+)\.mlp\.experts\.(.+)$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ExportCheckError(RuntimeError):
    """An exported checkpoint is not a complete, valid NVFP4-experts checkpoint; the message names the tensor."""


# ==== loading =========================================================================================================


def load_for_calibration(release_dir: Path, device: str):
    """The release's backbone (eager experts, so ModelOpt sees every expert matmul), its ClefModel and processor."""
    import safetensors.torch
    from transformers import AutoConfig, Qwen3OmniMoeForConditionalGeneration

    from joint_schema_model import ClefModel, JointSchemaHead, load_processor

    config = AutoConfig.from_pretrained(release_dir)
    config.enable_audio_output = False  # the talker and code2wav are not part of Clef
    # ModelOpt 0.47 intercepts F.linear of the eager per-expert loop; under grouped_mm calibration would see nothing
    # and it only switches the top config and its text_config, not thinker_config.text_config
    # (docs/nvfp4-format.md §8.4).
    backbone, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        release_dir, config=config, dtype=torch.bfloat16, device_map={"": device}, experts_implementation="eager",
        output_loading_info=True,
    )
    missing = list(info.get("missing_keys") or [])
    if missing:
        raise RuntimeError(f"{release_dir}: the release lacks thinker weights {missing[:8]} "
                           f"({len(missing)} in all)")
    head = JointSchemaHead(**json.loads((release_dir / "joint_head_config.json").read_text()))
    head.load_state_dict(safetensors.torch.load_file(release_dir / "joint_head.safetensors"), strict=True)
    head.to(device=device, dtype=torch.bfloat16)
    clef = ClefModel(backbone.thinker, head).eval()  # swaps thinker.lm_head for Identity: it is never quantized
    return backbone, clef, load_processor(release_dir)


def quantization_config(weights_only: bool) -> dict:
    import modelopt.torch.quantization as mtq

    config = copy.deepcopy(mtq.NVFP4_EXPERTS_ONLY_CFG)  # later entries of quant_cfg win
    for pattern in KEEP_BF16:
        config["quant_cfg"].append({"quantizer_name": pattern, "enable": False})
    if weights_only:
        config["quant_cfg"].append({"quantizer_name": "*.experts.*input_quantizer", "enable": False})
    return config


# ==== calibration =====================================================================================================


def calibration_forward_loop(clef, processor, records: list[dict], device: str):
    """A ModelOpt forward_loop that scores each record through Clef's real path, with a progress bar."""
    from tqdm import tqdm

    from joint_schema_model import collate_records, encode_record

    def forward_loop(_backbone):
        tokens, started = 0, time.perf_counter()
        progress = tqdm(records, desc="calibrating", unit="record")
        with torch.no_grad():
            for record in progress:
                encoded = encode_record(processor.tokenizer, record, processor=processor)
                clef(collate_records([encoded], processor.tokenizer.pad_token_id, device))
                tokens += len(encoded.input_ids)
                progress.set_postfix(tokens=tokens, tokens_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
        print(f"calibration: {len(records)} records, {tokens} tokens, {time.perf_counter() - started:.1f} s")

    return forward_loop


def calibrate(backbone, clef, processor, records: list[dict], weights_only: bool, device: str):
    """mtq.quantize with `max` calibration over the records; checks every expert quantizer afterwards."""
    import modelopt.torch.quantization as mtq

    forward_loop = calibration_forward_loop(clef, processor, records, device)
    mtq.quantize(backbone, quantization_config(weights_only), forward_loop)
    check_quantizers(backbone, weights_only)


def check_quantizers(backbone, weights_only: bool) -> None:
    """Every expert weight quantizer has a finite, non-zero amax; every layer's input quantizers are calibrated."""
    experts_modules = [(name, module) for name, module in backbone.named_modules()
                       if name.startswith("thinker.") and hasattr(module, "gate_up_proj_weight_quantizers")]
    if not experts_modules:
        raise RuntimeError("no quantized fused experts found in the thinker: was it loaded with eager experts?")
    for name, experts in experts_modules:
        for kind in ("gate_up_proj", "down_proj"):
            for e, quantizer in enumerate(getattr(experts, f"{kind}_weight_quantizers")):
                amax = getattr(quantizer, "amax", None)
                if amax is None or not torch.isfinite(amax).all() or (amax == 0).any():
                    raise RuntimeError(f"{name}.{kind}_weight_quantizers.{e}: amax {amax} is not finite and non-zero")
            input_quantizer = getattr(experts, f"{kind}_input_quantizer")
            if weights_only:
                if input_quantizer.is_enabled:
                    raise RuntimeError(f"{name}.{kind}_input_quantizer is enabled in a weights-only run")
                continue
            amax = getattr(input_quantizer, "amax", None)
            if amax is None or not torch.isfinite(amax).all() or (amax == 0).any():
                raise RuntimeError(f"{name}.{kind}_input_quantizer: amax {amax} is not calibrated (finite, non-zero);"
                                   " did the calibration records reach this layer?")


def calibration_state_path(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".calibration.pt")


def save_calibration_state(backbone, path: Path, weights_only: bool, record_count: int) -> None:
    """ModelOpt's mode state plus every quantizer tensor (amax buffers): enough to rebuild the calibrated model."""
    import modelopt.torch.opt as mto

    quantizer_tensors = {key: value.detach().cpu() for key, value in backbone.state_dict().items()
                         if "quantizer" in key}
    torch.save({"modelopt_state": mto.modelopt_state(backbone), "quantizer_tensors": quantizer_tensors,
                "weights_only": weights_only, "records": record_count}, path)


def restore_calibration_state(backbone, path: Path, weights_only: bool):
    """The calibrated backbone from a saved state, on a freshly loaded (and ClefModel-wrapped) backbone."""
    import modelopt.torch.opt as mto

    saved = torch.load(path, map_location="cpu", weights_only=False)
    if saved["weights_only"] != weights_only:
        raise RuntimeError(f"{path} was calibrated with weights_only={saved['weights_only']}: run with the same "
                           "--weights-only setting or delete the file to calibrate again")
    backbone = mto.restore_from_modelopt_state(backbone, saved["modelopt_state"])
    device = next(backbone.parameters()).device
    result = backbone.load_state_dict({k: v.to(device) for k, v in saved["quantizer_tensors"].items()}, strict=False)
    unfilled = [key for key in result.missing_keys if "quantizer" in key]
    if result.unexpected_keys or unfilled:
        raise RuntimeError(f"{path} does not match this release: unexpected {result.unexpected_keys[:8]}, "
                           f"unfilled {unfilled[:8]}; delete it to calibrate again")
    print(f"restored calibration of {saved['records']} records from {path}")
    return backbone


# ==== export ==========================================================================================================


def _thinker_forward(self, input_ids=None, **kwargs):
    # Qwen3OmniMoeForConditionalGeneration has no usable forward; the exporter's probe forward only needs the thinker.
    return self.thinker(input_ids=input_ids, use_cache=False)


def _without_torch_dtype_deprecation(record: logging.LogRecord) -> bool:
    return record.getMessage() != "`torch_dtype` is deprecated! Use `dtype` instead!"


def export(backbone, clef, release_dir: Path, out_dir: Path) -> None:
    """ModelOpt's HF export in BF16, then the release's non-weight files copied beside it."""
    from modelopt.torch.export import export_hf_checkpoint

    backbone.thinker.lm_head = clef.output_embeddings  # put the real LM head back so it is exported
    backbone.forward = types.MethodType(_thinker_forward, backbone)
    # The exporter reads config.torch_dtype, and transformers answers with a deprecation addressed to ModelOpt's
    # authors: that one message is dropped while it exports.
    config_logger = logging.getLogger("transformers.configuration_utils")
    config_logger.addFilter(_without_torch_dtype_deprecation)
    try:
        export_hf_checkpoint(backbone, dtype=torch.bfloat16, export_dir=out_dir, max_shard_size="5GB")
    finally:
        config_logger.removeFilter(_without_torch_dtype_deprecation)
    list_lm_head_as_unquantized(out_dir)
    for source in sorted(release_dir.iterdir()):
        if source.is_file() and not NOT_COPIED.match(source.name):
            shutil.copy2(source, out_dir / source.name)


def list_lm_head_as_unquantized(out_dir: Path) -> None:
    """Add the thinker's LM head to the export's lists of unquantized modules. ModelOpt lists every module it left
    unquantized, but the LM head was not in the model while it quantized (ClefModel scores with the output embeddings
    in its place), so it went unlisted, and a reader that takes unlisted modules for quantized (vLLM's ModelOpt
    loader) would look for NVFP4 tensors of a BF16 `thinker.lm_head.weight`. Both files keep ModelOpt's formatting
    (json.dumps with an indent of 4, no newline at the end)."""
    for path, section, key in ((out_dir / "hf_quant_config.json", "quantization", "exclude_modules"),
                               (out_dir / "config.json", "quantization_config", "ignore")):
        metadata = json.loads(path.read_text())
        unquantized = metadata[section][key]
        if LM_HEAD not in unquantized:
            metadata[section][key] = sorted([*unquantized, LM_HEAD])
            path.write_text(json.dumps(metadata, indent=4))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _text_config(config: dict) -> dict:
    return config.get("thinker_config", config).get("text_config", config)


def check_export(export_dir: Path, release_dir: Path) -> dict:
    """Check an exported checkpoint against its release; raise ExportCheckError naming the first bad tensor.

    Every MoE layer of the thinker must have every expert's gate/up/down exported packed (uint8 codes [out, in/2],
    float8_e4m3fn block scales [out, in/16] without NaN bytes 0x7F/0xFF, a finite positive fp32 global scale), the
    W4A4 input scales calibrated (finite, positive, one per layer and projection type, gate equal to up), no BF16
    fused experts left, and the joint head byte-identical to the release's. Returns a short summary.
    """
    from safetensors import safe_open

    export_dir, release_dir = Path(export_dir), Path(release_dir)
    quant_config_path = export_dir / "hf_quant_config.json"
    if not quant_config_path.exists():
        raise ExportCheckError(f"{quant_config_path} is missing: not a ModelOpt export")
    quant_algo = json.loads(quant_config_path.read_text())["quantization"]["quant_algo"]
    if quant_algo not in ("NVFP4", "W4A16_NVFP4"):
        raise ExportCheckError(f"{quant_config_path}: quant_algo {quant_algo!r}, expected NVFP4 or W4A16_NVFP4")
    weights_only = quant_algo == "W4A16_NVFP4"

    text = _text_config(json.loads((release_dir / "config.json").read_text()))
    hidden, width, expert_count = text["hidden_size"], text["moe_intermediate_size"], text["num_experts"]
    sparse_step, dense_layers = text.get("decoder_sparse_step", 1), set(text.get("mlp_only_layers") or [])
    moe_layers = [layer for layer in range(text["num_hidden_layers"])
                  if layer not in dense_layers and (layer + 1) % sparse_step == 0]
    # [out, in] of each projection: gate/up map H -> I, down maps I -> H.
    shapes = {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}

    with contextlib.ExitStack() as stack:
        found = {}  # (layer, expert, projection, tensor name) -> (open shard, key)
        for shard in sorted(export_dir.glob("*.safetensors")):
            if shard.name == "joint_head.safetensors":
                continue
            handle = stack.enter_context(safe_open(shard, "pt"))
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                match = EXPERT_TENSOR.match(key)
                if match is None:
                    continue
                per_expert = serve_clef.EXPERT_TENSOR.fullmatch(key)  # the loader's reading of expert tensor names
                if per_expert is None:
                    raise ExportCheckError(f"{shard.name}: {key} is not a packed per-expert tensor (BF16 experts left)")
                found[int(match[1]), int(per_expert["expert"]), per_expert["projection"], per_expert["field"]] = (
                    handle, key)

        tensor_names = ("weight", "weight_scale", "weight_scale_2") + (() if weights_only else ("input_scale",))
        input_scales = {}  # (layer, "gate_up" | "down") -> the scale all experts of the layer share
        for layer in moe_layers:
            for expert in range(expert_count):
                for projection in PROJECTIONS:
                    where = f"layer {layer} expert {expert} {projection}"
                    for tensor_name in tensor_names:
                        if (layer, expert, projection, tensor_name) not in found:
                            raise ExportCheckError(f"{where}: {tensor_name} missing from the export")
                    if weights_only and (layer, expert, projection, "input_scale") in found:
                        raise ExportCheckError(f"{where}: input_scale present in a W4A16_NVFP4 export")
                    out_features, in_features = shapes[projection]
                    checked = {}
                    for tensor_name in tensor_names:
                        handle, key = found[layer, expert, projection, tensor_name]
                        if tensor_name == "weight":  # its header only: the dtype of no rows, the shape, no codes read
                            header = handle.get_slice(key)
                            tensor = torch.empty(header.get_shape(), dtype=header[:0].dtype, device="meta")
                        else:
                            tensor = handle.get_tensor(key)
                        try:  # serve_clef's loader checks each tensor with the same function
                            checked[tensor_name], _ = serve_clef.checked_nvfp4_tensor(
                                tensor_name, tensor, out_features, in_features, key, repair_nan_scales=False)
                        except serve_clef.CheckpointError as refusal:
                            raise ExportCheckError(f"serve_clef's loader would refuse it: {refusal}") from None
                    if weights_only:
                        continue
                    input_scale = float(checked["input_scale"])
                    # One input quantizer per projection type per layer (docs/nvfp4-format.md §3.2): gate and up share
                    # theirs.
                    shared_key = (layer, "down" if projection == "down_proj" else "gate_up")
                    shared = input_scales.setdefault(shared_key, input_scale)
                    if input_scale != shared:
                        _, key = found[layer, expert, projection, "input_scale"]
                        raise ExportCheckError(f"{key}: {input_scale} differs from layer {layer}'s shared "
                                               f"{shared_key[1]} input scale {shared}")

    head_sha256 = _sha256(release_dir / "joint_head.safetensors")
    exported_head = export_dir / "joint_head.safetensors"
    if not exported_head.exists() or _sha256(exported_head) != head_sha256:
        raise ExportCheckError(f"{exported_head}: missing or not byte-identical to the release's joint head")
    return {"quant_algo": quant_algo, "moe_layers": len(moe_layers), "experts": expert_count,
            "packed_tensors": len(moe_layers) * expert_count * len(PROJECTIONS), "joint_head_sha256": head_sha256}


def write_sha256sums(export_dir: Path) -> Path:
    """SHA256SUMS in `sha256sum -c` format over every file of the export."""
    files = sorted(path for path in Path(export_dir).rglob("*") if path.is_file() and path.name != "SHA256SUMS")
    lines = [f"{_sha256(path)}  {path.relative_to(export_dir).as_posix()}\n" for path in files]
    sums = Path(export_dir) / "SHA256SUMS"
    sums.write_text("".join(lines))
    return sums


# ==== command line ====================================================================================================


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("release", type=Path, help="BF16 Clef-Omni release directory")
    parser.add_argument("out", type=Path, help="output directory for the NVFP4 checkpoint")
    parser.add_argument("--records", type=int, default=512, help="calibration records (1..512, default 512)")
    parser.add_argument("--weights-only", action="store_true", help="W4A16_NVFP4: expert input quantizers disabled")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse OUT.calibration.pt from an earlier run instead of calibrating again")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    state_path = calibration_state_path(args.out)
    if args.resume and not state_path.exists():
        raise SystemExit(f"--resume: {state_path} does not exist; run without --resume to calibrate")
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty: remove it or choose another output directory (a calibration "
                         f"state {state_path.name} beside it survives that and is reused with --resume)")
    started = time.perf_counter()
    backbone, clef, processor = load_for_calibration(args.release, args.device)
    if args.resume:
        backbone = restore_calibration_state(backbone, state_path, args.weights_only)
        check_quantizers(backbone, args.weights_only)
    else:
        records = calibration_records(args.records)
        calibrate(backbone, clef, processor, records, args.weights_only, args.device)
        save_calibration_state(backbone, state_path, args.weights_only, len(records))
    export(backbone, clef, args.release, args.out)
    summary = check_export(args.out, args.release)
    write_sha256sums(args.out)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    if args.device.startswith("cuda"):
        summary["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(f"wrote {args.out}: {json.dumps(summary)}")
    return summary


if __name__ == "__main__":
    main()
