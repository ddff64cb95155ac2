"""Reading a PEFT LoRA adapter folder into host tensors the engine's slots take (`load_adapter`).

Role: `adapter_config.json` + `adapter_model.safetensors` -> `LoadedAdapter`, validated against the
base model's shapes. Pure and thread-safe (no engine state): the server runs it in a worker thread,
the registry re-reads an evicted host copy with it off the engine thread.

Invariants:
- never unpickles: a folder with only `adapter_model.bin` is refused ("convert to safetensors");
- scaling is PEFT's, per module: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, where r and
  lora_alpha come from rank_pattern / alpha_pattern when a pattern matches the module's name (PEFT's
  `get_pattern_key` rule: the first key k with `re.match(rf"(.*\\.)?({k})$", name)`), and it is folded
  into B here (`ModuleWeights.b` is scaling * lora_B, float32 arithmetic, then `dtype`);
- anything the engine would compute differently from PEFT is refused with `LoRAError` (400) naming
  the file, tensor or field: rank > max_rank, targets outside the seven projections, modules_to_save,
  DoRA, biases, fan_in_fan_out, shapes that do not match the base model.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import ModelConfig
from .types import TARGET_MODULES, AdapterInfo, LoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModuleWeights:
    """One adapted projection of one layer: A [r, in] and the scaled B [out, r], on the host."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """A validated adapter in host memory: `modules[(layer, projection)]`, and what the registry reports."""

    info: AdapterInfo
    modules: dict[tuple[int, str], ModuleWeights]

    @property
    def name(self) -> str:
        return self.info.name


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target projection's (in, out) in the whole (unsharded) base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip


def load_adapter(name: str, path: str, model_config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoadedAdapter:
    """Read and validate the PEFT adapter at `path` (a folder); LoRAError(400) saying what is wrong."""
    started = time.perf_counter()
    folder = Path(path)
    config = _read_config(folder)
    _check_config(config, folder / CONFIG_FILE)
    tensors = _read_tensors(folder)
    modules = _modules(tensors, config, model_config, max_rank, dtype, folder / WEIGHTS_FILE)
    targets = tuple(t for t in TARGET_MODULES if any(proj == t for _, proj in modules))
    num_bytes = sum(m.a.nbytes + m.b.nbytes for m in modules.values())
    rank = max(m.rank for m in modules.values())
    info = AdapterInfo(
        name=name,
        path=str(path),
        rank=rank,
        targets=targets,
        scaling=_scaling(config, int(config["r"]), float(config.get("lora_alpha", 8))),
        num_bytes=num_bytes,
        load_seconds=time.perf_counter() - started,
    )
    return LoadedAdapter(info, modules)


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter path {str(folder)!r} is not a folder holding {CONFIG_FILE} and {WEIGHTS_FILE}")
    if not file.is_file():
        raise LoRAError(f"LoRA adapter at {str(folder)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LoRAError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise LoRAError(f"{file} must hold a JSON object")
    return config


def _check_config(config: dict[str, Any], file: Path) -> None:
    """Refuse the PEFT features the engine does not compute as PEFT would."""
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{file}: peft_type is {config.get('peft_type')!r}; only LORA adapters are supported")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRAError(f"{file}: field 'r' must be a positive integer, got {config.get('r')!r}")
    refusals = {
        "modules_to_save": "modules_to_save (fully trained modules) is not supported; train without it",
        "use_dora": "DoRA adapters (use_dora) are not supported",
        "fan_in_fan_out": "fan_in_fan_out adapters are not supported (Llama projections are nn.Linear)",
        "lora_bias": "lora_bias is not supported",
    }
    for field, why in refusals.items():
        if config.get(field):
            raise LoRAError(f"{file}: {why}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{file}: bias={config['bias']!r} is not supported; only bias='none'")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        outside = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in TARGET_MODULES})
        if outside:
            raise LoRAError(f"{file}: target_modules {outside} are outside the supported {list(TARGET_MODULES)}")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        pickled = [p for p in _PICKLE_FILES if (folder / p).is_file()]
        if pickled:
            raise LoRAError(
                f"LoRA adapter at {str(folder)!r} holds {pickled[0]} (a pickle, never loaded): "
                f"convert to safetensors ({WEIGHTS_FILE})"
            )
        raise LoRAError(f"LoRA adapter at {str(folder)!r} has no {WEIGHTS_FILE}")
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise LoRAError(f"{file} is not a readable safetensors file: {err}") from err


def _modules(
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    model_config: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
    file: Path,
) -> dict[tuple[int, str], ModuleWeights]:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.search(key)
        if match is None or match.group(3) not in TARGET_MODULES or _PARENT[match.group(3)] != match.group(2):
            raise LoRAError(f"{file}: tensor {key!r} is not a LoRA A/B weight of one of {list(TARGET_MODULES)}")
        pairs.setdefault((int(match.group(1)), match.group(3)), {})[match.group(4)] = tensor
    if not pairs:
        raise LoRAError(f"{file} holds no LoRA weights")
    shapes = module_shapes(model_config)
    modules = {}
    for (layer, proj), ab in sorted(pairs.items()):
        where = f"{file}: layer {layer} {proj}"
        if layer >= model_config.num_hidden_layers:
            raise LoRAError(f"{where}: the base model has only {model_config.num_hidden_layers} layers")
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where}: lora_{'B' if 'A' in ab else 'A'}.weight is missing")
        modules[(layer, proj)] = _module(ab["A"], ab["B"], config, shapes[proj], max_rank, dtype, layer, proj, where)
    return modules


def _module(
    a: torch.Tensor,
    b: torch.Tensor,
    config: dict[str, Any],
    shape: tuple[int, int],
    max_rank: int,
    dtype: torch.dtype,
    layer: int,
    proj: str,
    where: str,
) -> ModuleWeights:
    """One projection's A and scaled B, after checking them against the base model and the config."""
    num_in, num_out = shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != num_in or b.shape[0] != num_out or a.shape[0] != b.shape[1]:
        raise LoRAError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base model's "
            f"[r, {num_in}] / [{num_out}, r] (an adapter for another base architecture?)"
        )
    rank = a.shape[0]
    if rank > max_rank:
        raise LoRAError(
            f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}; raise --max-lora-rank",
            code="lora_rank_too_large",
        )
    module_name = f"model.layers.{layer}.{_PARENT[proj]}.{proj}"
    r = _pattern_value(config.get("rank_pattern") or {}, module_name, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module_name, config.get("lora_alpha", 8))
    if int(r) != rank:
        raise LoRAError(f"{where}: tensors have rank {rank} but the config says r={r}")
    scaling = _scaling(config, int(r), float(alpha))
    return ModuleWeights(a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous(), scaling)


def _pattern_value(pattern: dict[str, Any], module_name: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup (peft.utils.other.get_pattern_key)."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return pattern[key]
    return default


def _scaling(config: dict[str, Any], r: int, alpha: float) -> float:
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
