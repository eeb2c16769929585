# /// script
# requires-python = ">=3.11"
# dependencies = [
#   "torch>=2.9",
#   "transformers>=5.17",
#   "safetensors",
#   "tokenizers",
#   "huggingface_hub",
#   "numpy",
#   "pillow",
#   "av",
#   "fastapi",
#   "uvicorn",
#   "requests",
# ]
# ///
"""serve_clef: serve Clef-Omni decisions from an NVFP4 (ModelOpt) checkpoint on one GPU.

Sections, top to bottom: command line, checkpoint loading, packed experts and their kernels, activation replay,
decisions, HTTP.
"""

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
import safetensors
import safetensors.torch
import torch
import transformers
from transformers.integrations.moe import grouped_mm_experts_forward

import joint_schema_model
import synthetic_release

# ==== command line ====================================================================================================

DEFAULT_MODEL = "dbirks/clef-omni-nvfp4"
SYNTHETIC_MODELS = ("synthetic", "synthetic:full")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="serve_clef.py",
        description="Serve Clef-Omni decisions (POST /v1/systemone) from a BF16 release or a ModelOpt NVFP4 export.",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="Hugging Face hub id or local model directory; 'synthetic' serves a tiny random NVFP4 checkpoint built "
        "offline, 'synthetic:full' a full-size one streamed into GPU memory (both give meaningless answers). "
        f"Default: {DEFAULT_MODEL}.",
    )
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model.")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="Torch device to run on. Default: cuda when available, else cpu.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on. Default: 127.0.0.1.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on. Default: 8000.")
    parser.add_argument("--demo", action="store_true", help="Answer one built-in request, print it, and exit.")
    parser.add_argument("--request", type=Path, metavar="FILE", help="Answer the JSON request in FILE, print, exit.")
    parser.add_argument(
        "--simulate-fp4-activations",
        action="store_true",
        help="W4A4 (ModelOpt NVFP4) checkpoints only: round every expert input to NVFP4 as ModelOpt calibrated it, "
        "reproducing Blackwell W4A4 numerics on any device (without it, experts run W4A16: FP4 weights, BF16 inputs).",
    )
    parser.add_argument(
        "--no-packed-nvfp4",
        action="store_true",
        help="Unpack all NVFP4 experts to BF16 at load and run stock transformers experts (~4x the expert memory).",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=joint_schema_model.DEFAULT_MAX_LENGTH,
        help=f"Context limit in tokens per decision. Default: {joint_schema_model.DEFAULT_MAX_LENGTH}.",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SERVE_CLEF_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on API requests. Default: $SERVE_CLEF_API_KEY, else no auth.",
    )
    return parser.parse_args(argv)


# ==== checkpoint loading ==============================================================================================

class CheckpointError(ValueError):
    """A checkpoint or flag combination that cannot be served; the message says what is wrong and how to fix it."""


@dataclass
class LoadedClef:
    model: torch.nn.Module  # schema.ClefModel, eval, on device
    processor: Any
    schema: types.ModuleType  # the joint_schema_model module in use
    kind: str  # "bf16", "modelopt:NVFP4", "modelopt:W4A16_NVFP4"
    model_id: str  # what --model said
    checkpoint_dir: Path
    load_s: float
    notice: str | None  # e.g. the synthetic warning


SYNTHETIC_NOTICE = "synthetic checkpoint: random weights, every answer is meaningless (for testing the server only)"
# Nothing is calibrated in a synthetic checkpoint, so every expert input gets the input_scale that max calibration
# gives activations whose absolute max is 6: 6 / (6 * 448).
SYNTHETIC_INPUT_SCALE = 6.0 / (6 * 448)
SERVED_QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4")

# The two on-disk name layouts of the thinker's tensors (doc §3.4), as (hub layout, transformers-internal) prefixes.
THINKER_NAME_LAYOUTS = (
    ("model.layers.", "model.language_model.layers."),
    ("model.embed_tokens.", "model.language_model.embed_tokens."),
    ("model.norm.", "model.language_model.norm."),
    ("visual.", "model.visual."),
    ("audio_tower.", "model.audio_tower."),
)
# One tensor of one expert as every export writes it (per expert, per projection; doc §3.1).
EXPERT_TENSOR = re.compile(
    r"(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)"
    r"\.(?P<field>weight|weight_scale|weight_scale_2|input_scale)"
)


def is_talker_tensor(name: str) -> bool:
    # Clef only runs the thinker: the speech talker and code2wav of an Omni checkpoint are never read.
    return name.startswith(("talker.", "code2wav."))


def resolve_checkpoint_dir(model_id: str, revision: str | None) -> Path:
    if Path(model_id).is_dir():
        return Path(model_id)
    try:
        return Path(huggingface_hub.snapshot_download(model_id, revision=revision))
    except Exception as error:
        raise CheckpointError(
            f"--model {model_id}: not a local directory and the hub download failed ({type(error).__name__}); "
            f"download it where the hub is reachable (huggingface-cli download {model_id} --local-dir DIR) and "
            "pass --model DIR"
        ) from error


def checkpoint_kind(checkpoint_dir: Path) -> str:
    quant_config_path = checkpoint_dir / "hf_quant_config.json"
    if not quant_config_path.exists():
        quantization = json.loads((checkpoint_dir / "config.json").read_text()).get("quantization_config")
        if quantization is not None:
            raise CheckpointError(
                f"{checkpoint_dir}: config.json has a {quantization.get('quant_method')!r} quantization_config but no "
                "hf_quant_config.json; serve_clef serves BF16 releases and ModelOpt NVFP4 / W4A16_NVFP4 exports"
            )
        return "bf16"
    quantization = json.loads(quant_config_path.read_text())["quantization"]
    if quantization.get("quant_algo") not in SERVED_QUANT_ALGOS or quantization.get("group_size", 16) != 16:
        raise CheckpointError(
            f"{quant_config_path}: quant_algo {quantization.get('quant_algo')!r}, group_size "
            f"{quantization.get('group_size')} is not served; export the thinker experts with ModelOpt as NVFP4 or "
            "W4A16_NVFP4 (group size 16)"
        )
    return "modelopt:" + quantization["quant_algo"]


def import_joint_schema_model(checkpoint_dir: Path, progress: Callable[[str], None]) -> types.ModuleType:
    path = checkpoint_dir / "joint_schema_model.py"
    if not path.exists():
        progress(f"decision code: serve_clef's joint_schema_model.py ({checkpoint_dir} carries none)")
        return joint_schema_model
    spec = importlib.util.spec_from_file_location("_checkpoint_joint_schema_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules while the file executes
    spec.loader.exec_module(module)
    progress(f"decision code: the checkpoint's own {path}")
    return module


def checkpoint_tensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every thinker tensor of a safetensors checkpoint as (name on disk, tensor on CPU), one shard at a time."""
    index_path = checkpoint_dir / "model.safetensors.index.json"
    if index_path.exists():
        shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    for shard in shards:
        if not (checkpoint_dir / shard).exists():
            raise CheckpointError(f"{checkpoint_dir}: shard {shard} is missing; download the whole model directory")
        with safetensors.safe_open(checkpoint_dir / shard, framework="pt") as tensors:
            for name in tensors.keys():
                if not is_talker_tensor(name):
                    yield name, tensors.get_tensor(name)


def build_backbone(config: transformers.PretrainedConfig, device: torch.device, zero_width_experts: bool):
    """Talker-less Qwen3-Omni with random BF16 weights on `device`, to be filled by `load_thinker_weights`."""
    config.enable_audio_output = False
    text_config = config.thinker_config.text_config
    for sub_config in (config, config.thinker_config, text_config):
        if "quantization_config" in sub_config.__dict__:
            del sub_config.quantization_config  # transformers has no "modelopt" quantizer (doc §8.5)
    expert_width = text_config.moe_intermediate_size
    if zero_width_experts:
        # Packed modules replace every experts module right after: build them zero-wide so the BF16 experts
        # (58 GB at full size) are never allocated.
        text_config.moe_intermediate_size = 0
    with torch.device(device):
        backbone = transformers.Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    text_config.moe_intermediate_size = expert_width
    backbone.config.thinker_config.text_config.moe_intermediate_size = expert_width  # in case _from_config copied
    return backbone.eval()


def experts_modules(thinker: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in thinker.named_modules() if name.endswith(".mlp.experts")}


def thinker_tensor_name(checkpoint_name: str, live_names: set[str], experts_names: set[str]) -> str | None:
    """The live thinker name of a checkpoint tensor in either layout (doc §3.4), or None when nothing matches."""
    name = checkpoint_name.removeprefix("thinker.")
    candidates = [name]
    for hub_prefix, internal_prefix in THINKER_NAME_LAYOUTS:
        if name.startswith(hub_prefix):
            candidates.append(internal_prefix + name.removeprefix(hub_prefix))
        if name.startswith(internal_prefix):
            candidates.append(hub_prefix + name.removeprefix(internal_prefix))
    for candidate in candidates:
        expert_match = EXPERT_TENSOR.fullmatch(candidate)
        if candidate in live_names or (expert_match is not None and expert_match["experts"] in experts_names):
            return candidate
    return None


@torch.no_grad()
def load_thinker_weights(
    thinker: torch.nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    kind: str,
    expert_stores: dict[str, "PackedNVFP4Experts"],
    progress: Callable[[str], None],
) -> None:
    """Fill the thinker from a stream of (checkpoint name, tensor) in any on-disk layout.

    Experts go to `expert_stores` (NVFP4 kinds: packed, as on disk) or into the stock fused BF16 parameters (bf16
    kind). Fails naming any checkpoint tensor that maps to nothing and any parameter or expert tensor left unfilled.
    """
    experts = experts_modules(thinker)
    targets = {
        name: tensor
        for name, tensor in thinker.state_dict(keep_vars=True).items()
        if not name.startswith(tuple(experts_name + "." for experts_name in experts))
    }
    filled, bf16_experts_filled = set(), set()
    expert_tensors_per_layer = {name: 0 for name in experts}
    fields_per_expert = 3 * {"bf16": 1, "modelopt:W4A16_NVFP4": 3, "modelopt:NVFP4": 4}[kind]
    num_experts = thinker.config.text_config.num_experts
    tensor_count, byte_count, layers_done, start = 0, 0, 0, time.perf_counter()
    for checkpoint_name, tensor in tensors:
        if is_talker_tensor(checkpoint_name):
            continue
        name = thinker_tensor_name(checkpoint_name, set(targets), set(experts))
        if name is None:
            raise CheckpointError(
                f"checkpoint tensor {checkpoint_name} maps to no parameter of transformers {transformers.__version__}'s "
                "Qwen3-Omni thinker (neither the hub nor the transformers-internal name layout); is this a Clef-Omni "
                "checkpoint, with only the experts quantized?"
            )
        expert_match = EXPERT_TENSOR.fullmatch(name)
        if expert_match is None:
            if tuple(tensor.shape) != tuple(targets[name].shape) or not tensor.dtype.is_floating_point:
                raise CheckpointError(
                    f"checkpoint tensor {checkpoint_name}: {tensor.dtype} {list(tensor.shape)}, the thinker expects "
                    f"a floating point {list(targets[name].shape)}; only the experts may be quantized"
                )
            targets[name].copy_(tensor)
            filled.add(name)
        else:
            experts_name, expert = expert_match["experts"], int(expert_match["expert"])
            projection, field = expert_match["projection"], expert_match["field"]
            if expert >= num_experts:
                raise CheckpointError(f"checkpoint tensor {checkpoint_name}: the model has only {num_experts} experts")
            if kind == "bf16":
                store_bf16_expert(experts[experts_name], expert, projection, field, tensor, checkpoint_name)
                bf16_experts_filled.add((experts_name, expert, projection))
            else:
                expert_stores[experts_name].store(expert, projection, field, tensor, checkpoint_name)
            expert_tensors_per_layer[experts_name] += 1
            if expert_tensors_per_layer[experts_name] == num_experts * fields_per_expert:
                layers_done += 1
                progress(
                    f"experts of {layers_done}/{len(experts)} layers loaded "
                    f"({tensor_count + 1} tensors, {(byte_count + tensor.nbytes) / 2**30:.2f} GiB read)"
                )
        tensor_count += 1
        byte_count += tensor.nbytes

    missing = sorted(set(targets) - filled)
    if kind == "bf16":
        missing += [
            f"{experts_name}.{expert}.{projection}.weight"
            for experts_name in experts
            for expert in range(num_experts)
            for projection in ("gate_proj", "up_proj", "down_proj")
            if (experts_name, expert, projection) not in bf16_experts_filled
        ]
    else:
        missing += [name for experts_name, store in expert_stores.items() for name in store.missing_tensors(experts_name)]
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} thinker tensors, first {missing[:3]} (transformers-internal names); "
            "the download or export is incomplete"
        )
    progress(f"thinker loaded: {tensor_count} tensors, {byte_count / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s")


def store_bf16_expert(
    experts: torch.nn.Module, expert: int, projection: str, field: str, weight: torch.Tensor, checkpoint_name: str
) -> None:
    """Copy one per-expert BF16 matrix into transformers' fused [E, 2I, H] / [E, H, I] parameters (doc §3.1)."""
    expert_width = experts.gate_up_proj.shape[1] // 2
    if projection == "down_proj":
        target = experts.down_proj[expert]  # [H, I]
    else:
        rows = slice(0, expert_width) if projection == "gate_proj" else slice(expert_width, 2 * expert_width)
        target = experts.gate_up_proj[expert, rows]  # [I, H]
    if field != "weight" or not weight.dtype.is_floating_point or weight.shape != target.shape:
        raise CheckpointError(
            f"checkpoint tensor {checkpoint_name}: {weight.dtype} {list(weight.shape)} in a checkpoint without "
            f"hf_quant_config.json, expected a BF16 {list(target.shape)} weight; a ModelOpt export needs its "
            "hf_quant_config.json"
        )
    target.copy_(weight)


def quantize_nvfp4(weight: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize a [O, K] weight exactly as ModelOpt's exporter does (doc §2.2), given its weight_scale_2.

    Returns packed_codes uint8 [O, K/2] (element 2i in the low nibble) and block_scales float8_e4m3fn [O, K/16].
    """
    rows, columns = weight.shape
    blocks = weight.float().view(rows, columns // 16, 16)  # [O, K/16, 16]
    block_scales = blocks.abs().amax(dim=-1) / (6 * global_scale)  # [O, K/16]
    block_scales = torch.where(block_scales == 0, 1.0, block_scales)
    block_scales = block_scales.clamp(min=2**-9, max=448).to(torch.float8_e4m3fn)
    scaled = blocks / (block_scales.float() * global_scale).unsqueeze(-1)  # [O, K/16, 16]
    magnitude_codes = round_to_e2m1_codes(scaled.abs())  # [O, K/16, 16] 0..7
    codes = ((scaled < 0).to(torch.uint8) << 3) | magnitude_codes  # [O, K/16, 16]
    codes = codes.view(rows, columns)
    packed_codes = (codes[:, 1::2] << 4) | codes[:, 0::2]  # [O, K/2]
    return packed_codes, block_scales


def quantize_experts_to_nvfp4(
    tensors: Iterable[tuple[str, torch.Tensor]], input_scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """A BF16 tensor stream turned into a ModelOpt NVFP4 (W4A4) export's: every expert matrix becomes weight,
    weight_scale, weight_scale_2 and input_scale as ModelOpt writes them, everything else passes through.

    Gate and up of one expert share one weight_scale_2 computed from both (ModelOpt calibrates the fused gate_up
    tensor, doc §3.2), so a gate waits here for its up (and the other way round); nothing else is held back.
    """
    waiting_for_partner = {}  # "<experts>.<E>" -> {projection: BF16 weight}
    for name, tensor in tensors:
        expert_match = EXPERT_TENSOR.fullmatch(name)
        if expert_match is None:
            yield name, tensor
            continue
        expert_prefix = f"{expert_match['experts']}.{expert_match['expert']}"
        if expert_match["projection"] == "down_proj":
            group = {"down_proj": tensor}
        else:
            group = waiting_for_partner.setdefault(expert_prefix, {})
            group[expert_match["projection"]] = tensor
            if len(group) < 2:
                continue
            del waiting_for_partner[expert_prefix]
        global_scale = torch.stack([weight.abs().amax() for weight in group.values()]).amax().float() / (6 * 448)
        for projection, weight in sorted(group.items()):
            packed_codes, block_scales = quantize_nvfp4(weight, global_scale)
            yield f"{expert_prefix}.{projection}.weight", packed_codes
            yield f"{expert_prefix}.{projection}.weight_scale", block_scales
            yield f"{expert_prefix}.{projection}.weight_scale_2", global_scale.clone()
            yield f"{expert_prefix}.{projection}.input_scale", torch.tensor(input_scale, device=weight.device)
    if waiting_for_partner:
        raise CheckpointError(f"BF16 experts without their gate/up partner: {sorted(waiting_for_partner)[:3]}")


def write_modelopt_metadata(checkpoint_dir: Path, quant_algo: str) -> None:
    """hf_quant_config.json and config.json's quantization_config as ModelOpt's exporter writes them (doc §1)."""
    exclude_modules = ["lm_head", "thinker.audio_tower*", "thinker.model.layers.*.mlp.gate*", "thinker.model.layers.*.self_attn*", "thinker.visual*"]
    producer = {"name": "modelopt", "version": "0.47.0"}
    (checkpoint_dir / "hf_quant_config.json").write_text(json.dumps({
        "producer": producer,
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude_modules},
    }, indent=2))
    nvfp4 = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    config = json.loads((checkpoint_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": quant_algo, "producer": producer,
        "config_groups": {"group_0": {"weights": nvfp4, "input_activations": nvfp4, "targets": ["Linear"]}},
        "ignore": exclude_modules,
    }
    (checkpoint_dir / "config.json").write_text(json.dumps(config, indent=2))


def synthetic_checkpoint(model_id: str, device: torch.device, progress: Callable[[str], None]):
    """The checkpoint dir (ModelOpt NVFP4 layout) of a synthetic model and, for synthetic:full, its tensor stream.

    `synthetic`: helper A's tiny BF16 release, its experts quantized and written as a ModelOpt export, then loaded
    from disk like any other. `synthetic:full`: the full-size release without weights on disk; its tensors are
    generated on `device` one at a time and quantized on the way into the packed store.
    """
    out_dir = Path(tempfile.mkdtemp(prefix="serve_clef-synthetic-"))
    if model_id == "synthetic:full":
        checkpoint_dir = synthetic_release.write_release(out_dir / "nvfp4", "full", weights=False)
        write_modelopt_metadata(checkpoint_dir, "NVFP4")
        config = transformers.AutoConfig.from_pretrained(checkpoint_dir)
        tensors = quantize_experts_to_nvfp4(synthetic_release.release_tensors(config, device=device), SYNTHETIC_INPUT_SCALE)
        return checkpoint_dir, tensors
    release_dir = synthetic_release.write_release(out_dir / "bf16", "tiny")
    checkpoint_dir = out_dir / "nvfp4"
    checkpoint_dir.mkdir()
    for path in release_dir.iterdir():
        if path.is_file() and not (path.name.startswith("model-") or path.name == "model.safetensors.index.json"):
            shutil.copy(path, checkpoint_dir / path.name)
    tensors = dict(quantize_experts_to_nvfp4(checkpoint_tensors(release_dir), SYNTHETIC_INPUT_SCALE))
    shard = "model-00001-of-00001.safetensors"
    safetensors.torch.save_file(tensors, checkpoint_dir / shard, metadata={"format": "pt"})
    (checkpoint_dir / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(tensor.nbytes for tensor in tensors.values())},
        "weight_map": {name: shard for name in tensors},
    }, indent=2))
    write_modelopt_metadata(checkpoint_dir, "NVFP4")
    progress(f"synthetic tiny NVFP4 checkpoint written to {checkpoint_dir}")
    return checkpoint_dir, None


def load_clef(args: argparse.Namespace, progress: Callable[[str], None] = print) -> LoadedClef:
    """Load the checkpoint named by --model as a Clef model on --device (see parse_args)."""
    start = time.perf_counter()
    device = torch.device(args.device)
    notice, tensors = None, None
    if args.model in SYNTHETIC_MODELS:
        notice = SYNTHETIC_NOTICE
        progress(f"{args.model}: {notice}")
        checkpoint_dir, tensors = synthetic_checkpoint(args.model, device, progress)
    else:
        checkpoint_dir = resolve_checkpoint_dir(args.model, args.revision)
    kind = checkpoint_kind(checkpoint_dir)
    if args.simulate_fp4_activations and kind != "modelopt:NVFP4":
        raise CheckpointError(
            f"--simulate-fp4-activations replays W4A4 activations and needs a ModelOpt NVFP4 (W4A4) export with "
            f"input scales; {checkpoint_dir} is {kind}: drop the flag"
        )
    if args.simulate_fp4_activations and args.no_packed_nvfp4:
        raise CheckpointError("--simulate-fp4-activations runs inside the packed experts: drop --no-packed-nvfp4")
    packed = kind != "bf16" and not args.no_packed_nvfp4
    schema = import_joint_schema_model(checkpoint_dir, progress)

    config = transformers.AutoConfig.from_pretrained(checkpoint_dir)
    text_config = config.thinker_config.text_config
    progress(f"loading {kind} checkpoint {checkpoint_dir} onto {device} ({'packed NVFP4' if packed else 'BF16'} experts)")
    thinker = build_backbone(config, device, zero_width_experts=packed).thinker
    expert_stores = {}
    if kind != "bf16":
        with torch.device(device):
            expert_stores = {
                name: PackedNVFP4Experts(text_config, experts.act_fn, has_input_scales=kind == "modelopt:NVFP4")
                for name, experts in experts_modules(thinker).items()
            }
    if packed:
        for experts_name, store in expert_stores.items():
            parent_name, _, attribute = experts_name.rpartition(".")
            setattr(thinker.get_submodule(parent_name), attribute, store)
    if tensors is None:
        tensors = checkpoint_tensors(checkpoint_dir)
    load_thinker_weights(thinker, tensors, kind, expert_stores, progress)
    if kind != "bf16" and not packed:
        for experts_name, store in expert_stores.items():
            store.unpack_into(thinker.get_submodule(experts_name))
    del expert_stores  # --no-packed-nvfp4: the packed copies are no longer needed
    for experts in experts_modules(thinker).values():
        if isinstance(experts, PackedNVFP4Experts):
            experts.simulate_fp4_activations = args.simulate_fp4_activations

    head_config = json.loads((checkpoint_dir / "joint_head_config.json").read_text())
    if head_config["hidden_size"] != text_config.hidden_size:
        raise CheckpointError(
            f"{checkpoint_dir}/joint_head_config.json: hidden_size {head_config['hidden_size']} differs from the "
            f"thinker's text hidden size {text_config.hidden_size}; the joint head belongs to another model"
        )
    head = schema.JointSchemaHead(**head_config)
    head.load_state_dict(safetensors.torch.load_file(checkpoint_dir / "joint_head.safetensors"), strict=True)
    head.to(device=device, dtype=torch.bfloat16)
    model = schema.ClefModel(thinker, head).eval()
    processor = joint_schema_model.load_processor(checkpoint_dir)
    load_s = time.perf_counter() - start
    progress(f"Clef model ready ({kind}) in {load_s:.1f} s")
    return LoadedClef(model, processor, schema, kind, args.model, checkpoint_dir, load_s, notice)


# ==== packed experts and their kernels ================================================================================

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign (doc §2)


def round_to_e2m1_codes(magnitude: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 (uint8) of non-negative values rounded to the E2M1 grid, to nearest with ties to even.

    Left-sided searchsorted over the midpoints rounds every tie down; the ties whose upper neighbour has the even
    mantissa (0.75 -> 1, 1.75 -> 2, 3.5 -> 4) then step up (doc §2.2 step 5, §2.3).
    """
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=magnitude.device)
    codes = torch.searchsorted(midpoints, magnitude.contiguous()) + torch.isin(magnitude, midpoints[1::2])
    return codes.to(torch.uint8)


def unpack_nvfp4(packed_codes: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Dequantise NVFP4 expert weights to BF16 (doc §2.1): W = e2m1(code) * (block_scale * global_scale).

    packed_codes uint8 [E, O, K/2] (element 2i in the low nibble), block_scales float8_e4m3fn [E, O, K/16],
    global_scale fp32 [E] -> BF16 [E, O, K]. Plain elementwise torch, so torch.compile fuses it into one kernel.
    """
    num_experts, rows, half_columns = packed_codes.shape
    codes = torch.stack((packed_codes & 0x0F, packed_codes >> 4), dim=-1).view(num_experts, rows, 2 * half_columns)
    # E2M1: bit 3 sign, bits 1-2 exponent, bit 0 mantissa; exponent 0 is subnormal (0 or 0.5), otherwise
    # 2**(exponent - 1) * (1 + mantissa / 2): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    exponent = ((codes >> 1) & 0b11).float()
    mantissa = (codes & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent - 1) * (1 + 0.5 * mantissa))
    values = torch.where(codes >= 8, -magnitude, magnitude)  # [E, O, K]
    per_block = block_scales.float() * global_scale[:, None, None]  # [E, O, K/16]
    weight = values.view(num_experts, rows, -1, 16) * per_block.unsqueeze(-1)  # [E, O, K/16, 16]
    return weight.view(num_experts, rows, 2 * half_columns).to(torch.bfloat16)


# On CUDA the eager unpack takes ~8 passes over a layer's experts; compiled it is one kernel reading the packed bytes
# once (bandwidth floor ~0.4 ms per full-size layer on an H200). CPU keeps the eager version.
unpack_nvfp4_compiled = torch.compile(unpack_nvfp4, fullgraph=True, dynamic=False)


class PackedNVFP4Experts(torch.nn.Module):
    """One layer's experts kept NVFP4-packed in device memory exactly as on disk, in transformers' fused order.

    Stands in for transformers' Qwen3OmniMoeThinkerTextExperts: forward unpacks this layer to BF16 scratch tensors,
    runs transformers' grouped_mm experts function on them and frees them. E experts, H hidden, I expert width.
    """

    def __init__(self, text_config, act_fn: Callable, has_input_scales: bool):
        super().__init__()
        num_experts, hidden, width = text_config.num_experts, text_config.hidden_size, text_config.moe_intermediate_size
        self.num_experts, self.hidden, self.width = num_experts, hidden, width
        self.act_fn = act_fn
        self.has_input_scales = has_input_scales  # W4A4 exports carry input scales, W4A16 ones do not
        self.simulate_fp4_activations = False
        # gate rows [0, I) then up rows [I, 2I), as transformers fuses them
        self.register_buffer("gate_up_packed_codes", torch.zeros(num_experts, 2 * width, hidden // 2, dtype=torch.uint8))
        self.register_buffer("gate_up_block_scales", torch.zeros(num_experts, 2 * width, hidden // 16, dtype=torch.float8_e4m3fn))
        self.register_buffer("gate_up_global_scale", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("down_packed_codes", torch.zeros(num_experts, hidden, width // 2, dtype=torch.uint8))
        self.register_buffer("down_block_scales", torch.zeros(num_experts, hidden, width // 16, dtype=torch.float8_e4m3fn))
        self.register_buffer("down_global_scale", torch.zeros(num_experts, dtype=torch.float32))
        # The layer's shared activation scales (one input quantizer per projection type per layer, doc §3.2).
        self.register_buffer("gate_up_input_scale", torch.zeros((), dtype=torch.float32))
        self.register_buffer("down_input_scale", torch.zeros((), dtype=torch.float32))
        self.stored = set()  # (expert, projection, field) received so far
        self.first_input_scale_name = {}  # "gate_up" / "down" -> checkpoint name that set the layer's input scale

    @torch.no_grad()
    def store(self, expert: int, projection: str, field: str, tensor: torch.Tensor, checkpoint_name: str) -> None:
        """Put one checkpoint tensor of one expert in place, checking dtype, shape, NaN bytes and scale equalities."""
        group = "down" if projection == "down_proj" else "gate_up"
        rows = slice(0, None)
        if projection == "gate_proj":
            rows = slice(0, self.width)
        elif projection == "up_proj":
            rows = slice(self.width, 2 * self.width)
        in_features = self.width if group == "down" else self.hidden
        out_features = self.hidden if group == "down" else self.width

        def fail(problem: str) -> None:
            raise CheckpointError(f"checkpoint tensor {checkpoint_name}: {problem}")

        if field == "weight":
            if tensor.dtype != torch.uint8 or tuple(tensor.shape) != (out_features, in_features // 2):
                fail(f"{tensor.dtype} {list(tensor.shape)}, expected NVFP4-packed uint8 {[out_features, in_features // 2]}")
            getattr(self, f"{group}_packed_codes")[expert, rows].copy_(tensor)
        elif field == "weight_scale":
            if tensor.dtype != torch.float8_e4m3fn or tuple(tensor.shape) != (out_features, in_features // 16):
                fail(f"{tensor.dtype} {list(tensor.shape)}, expected float8_e4m3fn {[out_features, in_features // 16]}")
            if ((tensor.view(torch.uint8) & 0x7F) == 0x7F).any():
                fail("NaN block scale bytes (0x7F/0xFF), as ModelOpt < 0.47 wrote them; re-export with nvidia-modelopt>=0.47")
            getattr(self, f"{group}_block_scales")[expert, rows].copy_(tensor)
        else:
            if tensor.dtype != torch.float32 or tensor.numel() != 1:
                fail(f"{tensor.dtype} {list(tensor.shape)}, expected a float32 scalar")
            value = tensor.reshape(()).to(self.gate_up_global_scale.device)
            if not torch.isfinite(value) or value <= 0:
                fail(f"scale {value.item()} must be finite and positive")
            if field == "weight_scale_2":
                global_scale = getattr(self, f"{group}_global_scale")
                partner = {"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(projection)
                if (expert, partner, field) in self.stored and global_scale[expert] != value:
                    fail(
                        f"{value.item()} differs from the {partner} weight_scale_2 {global_scale[expert].item()} of "
                        "the same expert; ModelOpt shares one weight_scale_2 between gate and up (doc §3.2): "
                        "re-export with nvidia-modelopt>=0.47"
                    )
                global_scale[expert] = value
            elif not self.has_input_scales:
                fail("input_scale in a W4A16_NVFP4 checkpoint (weight-only exports have none); fix hf_quant_config.json")
            else:
                input_scale = getattr(self, f"{group}_input_scale")
                if group in self.first_input_scale_name and input_scale != value:
                    fail(
                        f"input_scale {value.item()} differs from {self.first_input_scale_name[group]} = "
                        f"{input_scale.item()}; ModelOpt shares one input quantizer for gate and up of all experts of "
                        "a layer and one for down (doc §3.2), so this export is broken: re-export it"
                    )
                self.first_input_scale_name.setdefault(group, checkpoint_name)
                input_scale.copy_(value)
        self.stored.add((expert, projection, field))

    def missing_tensors(self, experts_name: str) -> list[str]:
        fields = ("weight", "weight_scale", "weight_scale_2") + (("input_scale",) if self.has_input_scales else ())
        return [
            f"{experts_name}.{expert}.{projection}.{field}"
            for expert in range(self.num_experts)
            for projection in ("gate_proj", "up_proj", "down_proj")
            for field in fields
            if (expert, projection, field) not in self.stored
        ]

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's experts in BF16: gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
        unpack = unpack_nvfp4_compiled if self.gate_up_packed_codes.is_cuda else unpack_nvfp4
        gate_up_proj = unpack(self.gate_up_packed_codes, self.gate_up_block_scales, self.gate_up_global_scale)
        down_proj = unpack(self.down_packed_codes, self.down_block_scales, self.down_global_scale)
        return gate_up_proj, down_proj

    @torch.no_grad()
    def unpack_into(self, experts: torch.nn.Module) -> None:
        """--no-packed-nvfp4: write the dequantised weights into transformers' stock experts module."""
        gate_up_proj, down_proj = self.unpacked()
        experts.gate_up_proj.copy_(gate_up_proj)
        experts.down_proj.copy_(down_proj)

    def apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:  # [S, 2I] -> [S, I]
        gate, up = gate_up_out.chunk(2, dim=-1)
        intermediate = self.act_fn(gate) * up
        if self.simulate_fp4_activations:
            intermediate = fake_quant_nvfp4_activations(intermediate, self.down_input_scale)
        return intermediate

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states [T, H], top_k_index / top_k_weights [T, k] -> [T, H]
        if self.simulate_fp4_activations:
            hidden_states = fake_quant_nvfp4_activations(hidden_states, self.gate_up_input_scale)
        gate_up_proj, down_proj = self.unpacked()
        # The attributes transformers' grouped_mm experts function reads from a stock experts module (doc §8.3).
        stock_experts_view = types.SimpleNamespace(
            num_experts=self.num_experts,
            has_gate=True,
            has_bias=False,
            is_transposed=False,
            is_concatenated=True,
            has_post_expert_norm=False,
            _is_expert_parallel=False,
            act_fn=self.act_fn,
            _apply_gate=self.apply_gate,
            gate_up_proj=gate_up_proj,
            down_proj=down_proj,
        )
        return grouped_mm_experts_forward(stock_experts_view, hidden_states, top_k_index, top_k_weights)


# ==== activation replay (faithful W4A4) ===============================================================================

def fake_quant_nvfp4_activations(activations: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Round activations [..., K] to NVFP4 as ModelOpt's W4A4 fake-quant does (doc §2.3), in their own dtype.

    Static per-tensor `input_scale` (the layer's calibrated global scale), dynamic e4m3 scales per 16 values along K,
    E2M1 magnitudes rounded to nearest with ties to even. Operation order follows ModelOpt's Triton kernel
    (fp4_fake_quant_block).
    """
    blocks = activations.float().unflatten(-1, (-1, 16))  # [..., K/16, 16]
    input_scale = torch.where(input_scale > 0, input_scale, 1e-12)
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)  # [..., K/16, 1]
    block_scales = (block_amax / (6.0 * input_scale)).clamp(max=448.0).to(torch.float8_e4m3fn).float() * input_scale
    block_scales = torch.where(block_scales >= 1e-5, block_scales, 1.0)
    e2m1_magnitudes = torch.tensor(E2M1_MAGNITUDES, device=activations.device)
    rounded = e2m1_magnitudes[round_to_e2m1_codes(blocks.abs() / block_scales).long()]  # [..., K/16, 16]
    quantized = rounded * block_scales
    quantized = torch.where(blocks >= 0, quantized, -quantized)
    return quantized.flatten(-2).to(activations.dtype)


# ==== decisions =======================================================================================================

# ==== HTTP ============================================================================================================
