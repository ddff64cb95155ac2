"""Model configuration read from a Hugging Face `config.json` (or a GGUF file's metadata), validated with clear errors.

`ModelConfig.from_dict` is the one validation path: a folder's config.json (`from_folder`) and a GGUF
file's metadata (`engine/gguf/config.py`, translated into the same fields) both go through it. Which of
the two a path is, the format registry decides (`engine/loading/formats.py`); this module imports no
format code. Accepts both the classic fields Hub checkpoints carry (`rope_theta`, `rope_scaling`) and the
`rope_parameters` dict that transformers 5 writes. Invariant: a `ModelConfig` that exists
describes a model this engine can run; anything else raised `ValueError` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always, Llama optionally)
    o_proj_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # keys kept per query (HF semantics: key position > query - window)
    torch_dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        """From a Hugging Face folder's config.json (a GGUF file's metadata: `engine/gguf/config.py`)."""
        return cls.from_dict(read_config_json(folder), source=str(folder / "config.json"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {architectures or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = _positive_int(raw, "hidden_size", source)
        num_heads = _positive_int(raw, "num_attention_heads", source)
        num_kv_heads = _positive_int(raw, "num_key_value_heads", source, default=num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise ValueError(
                    f"{source}: hidden_size ({hidden}) is not divisible by num_attention_heads ({num_heads})"
                )
            head_dim = hidden // num_heads
        head_dim = _positive_int({"head_dim": head_dim}, "head_dim", source)
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported; only 'silu'")
        rope_theta, rope_scaling = _rope(raw, source)
        sliding_window = None
        if arch == "MistralForCausalLM" and raw.get("sliding_window"):
            sliding_window = _positive_int(raw, "sliding_window", source)
        if arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
            raise ValueError(f"{source}: Qwen2 use_sliding_window=true is not supported; set it to false")
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype_name not in DTYPES:
            raise ValueError(f"{source}: torch_dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=_positive_int(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size", source),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers", source),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", source, default=2048),
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", source, default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            o_proj_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=sliding_window,
            torch_dtype=DTYPES[dtype_name],
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=raw.get("bos_token_id"),
        )


def read_config_json(folder: Path) -> dict[str, Any]:
    """A model folder's config.json as a dict; FileNotFoundError / ValueError naming the file."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"config.json not found in model folder {folder}")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or None
    if scaling:
        params.update(scaling)
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if not theta > 0:
        raise ValueError(f"{source}: rope_theta must be > 0, got {theta}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if not float(params.get("factor", 0)) > 0:
        raise ValueError(f"{source}: rope scaling {rope_type!r} needs a positive 'factor'")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ValueError(f"{source}: llama3 rope scaling is missing {key!r}")
    params["rope_type"] = rope_type
    return theta, params


def _positive_int(raw: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"{source}: required field {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _positive_float(raw: dict[str, Any], key: str, source: str, default: float) -> float:
    value = raw.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{source}: {key} must be a positive number, got {value!r}")
    return float(value)
