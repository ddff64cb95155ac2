"""Writes seeded, random-initialised Llama/Mistral/Qwen2 models in Hugging Face format.

Role: the test and demo model factory. `make_model` produces a folder that both Tidepool and
`transformers` load (config.json, safetensors weights, sharded or not, generation config, a real
byte-level BPE tokenizer and a ChatML chat template) without importing `transformers`.

Invariants:
- Same arguments ⇒ byte-identical files. Weights come from one seeded `torch.Generator`, drawn in
  a fixed tensor order, so sharding does not change any value; the tokenizer is trained on a
  generated corpus (`make_model_corpus`) that depends only on the seed.
- The tokenizer has exactly the preset's vocabulary size, special tokens included.
- `initializer_range` is large enough that next-token logits are far from flat, so greedy tokens
  are stable when an engine is compared with `transformers`.
- Trained tokenizers (make_model_tokenizer.py) are cached under `$TIDEPOOL_CACHE/tokenizers/` (default
  ~/.cache/tidepool):
  training the 49152-token vocabulary takes tens of seconds, the cached copy milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from .make_model_tokenizer import cached_tokenizer, write_json, write_tokenizer_files

# (HF tensor name, shape, init kind: "normal" or "norm")
_TensorSpec = tuple[str, tuple[int, ...], str]


@dataclass(frozen=True, slots=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float  # std of the normal weight init; sized so logits are not flat
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    num_corpus_words: int = 2000  # distinct pseudo-words; bounds how many BPE merges exist
    num_corpus_sentences: int = 5000


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.08,
    ),
    "small": Preset(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=704,
        vocab_size=2048,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.05,
        num_corpus_words=6000,
        num_corpus_sentences=15000,
    ),
    # The real SmolLM-135M shapes, for memory and speed work with a realistic parameter count.
    "smollm-135m": Preset(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.04,
        num_corpus_words=60000,
        num_corpus_sentences=150000,
    ),
}

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Progress bars only where writing takes long enough to wonder whether it hangs.
_PROGRESS_MIN_PARAMS = 50_000_000
_NORM_NOISE_STD = 0.05  # norms are not all-ones, so an engine that skips their weights is caught


def _check_choice(kind: str, value: str, valid: dict[str, Any]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid {kind}s: {', '.join(sorted(valid))}")


def _is_qwen_style(arch: str) -> bool:
    return arch == "qwen2"


def build_tokenizer(preset_name: str, arch: str, seed: int = 0) -> Tokenizer:
    """The preset's trained tokenizer for `arch` (special tokens and post-processor), cached on disk."""
    _check_choice("preset", preset_name, PRESETS)
    _check_choice("architecture", arch, ARCHITECTURES)
    p = PRESETS[preset_name]
    return cached_tokenizer(
        preset_name, p.vocab_size, p.num_corpus_words, p.num_corpus_sentences, _is_qwen_style(arch), seed
    )


def _tensor_specs(arch: str, preset: Preset, tie: bool) -> list[_TensorSpec]:
    """(name, shape, init kind) in the fixed order that weights are drawn in."""
    h, kv_dim = preset.hidden_size, preset.num_key_value_heads * preset.head_dim
    q_dim = preset.num_attention_heads * preset.head_dim
    specs: list[_TensorSpec] = [("model.embed_tokens.weight", (preset.vocab_size, h), "normal")]
    for i in range(preset.num_hidden_layers):
        p = f"model.layers.{i}"
        specs += [
            (f"{p}.self_attn.q_proj.weight", (q_dim, h), "normal"),
            (f"{p}.self_attn.k_proj.weight", (kv_dim, h), "normal"),
            (f"{p}.self_attn.v_proj.weight", (kv_dim, h), "normal"),
        ]
        if _is_qwen_style(arch):
            specs += [
                (f"{p}.self_attn.q_proj.bias", (q_dim,), "normal"),
                (f"{p}.self_attn.k_proj.bias", (kv_dim,), "normal"),
                (f"{p}.self_attn.v_proj.bias", (kv_dim,), "normal"),
            ]
        specs += [
            (f"{p}.self_attn.o_proj.weight", (h, q_dim), "normal"),
            (f"{p}.mlp.gate_proj.weight", (preset.intermediate_size, h), "normal"),
            (f"{p}.mlp.up_proj.weight", (preset.intermediate_size, h), "normal"),
            (f"{p}.mlp.down_proj.weight", (h, preset.intermediate_size), "normal"),
            (f"{p}.input_layernorm.weight", (h,), "norm"),
            (f"{p}.post_attention_layernorm.weight", (h,), "norm"),
        ]
    specs.append(("model.norm.weight", (h,), "norm"))
    if not tie:
        specs.append(("lm_head.weight", (preset.vocab_size, h), "normal"))
    return specs


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _split_shards(specs: list[_TensorSpec], num_shards: int) -> list[range]:
    """Consecutive groups of tensor indices with roughly equal byte sizes; no group is empty."""
    if num_shards > len(specs):
        raise ValueError(f"num_shards={num_shards} exceeds the model's {len(specs)} tensors")
    sizes_before: list[int] = []
    total = 0
    for _, shape, _ in specs:
        sizes_before.append(total)
        total += _numel(shape)
    bounds = [0]
    for shard in range(1, num_shards):
        target = shard * total / num_shards
        start = next((i for i, size in enumerate(sizes_before) if size >= target), len(specs))
        # Every shard needs at least one tensor, including the ones still to come.
        bounds.append(min(max(start, bounds[-1] + 1), len(specs) - (num_shards - shard)))
    bounds.append(len(specs))
    return [range(bounds[i], bounds[i + 1]) for i in range(num_shards)]


def _config(arch: str, preset: Preset, tie: bool, dtype: str, bos_id: int | None, eos_id: int) -> dict[str, Any]:
    # The classic (transformers 4.x / Hub) field set: rope_theta + rope_scaling rather than the
    # rope_parameters that transformers 5 writes, because that is what real checkpoints carry.
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": preset.initializer_range,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "model_type": arch,
        "num_attention_heads": preset.num_attention_heads,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_key_value_heads": preset.num_key_value_heads,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": preset.rope_theta,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": preset.vocab_size,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "mistral":
        config["sliding_window"] = None
    else:
        config.update(sliding_window=None, use_sliding_window=False, max_window_layers=preset.num_hidden_layers)
    return dict(sorted(config.items()))


def _write_weights(
    out: Path, specs: list[_TensorSpec], preset: Preset, seed: int, dtype: torch.dtype, num_shards: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    groups = _split_shards(specs, num_shards)
    total_params = sum(_numel(shape) for _, shape, _ in specs)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    with tqdm(
        total=total_params,
        unit="param",
        unit_scale=True,
        desc="writing weights",
        disable=total_params < _PROGRESS_MIN_PARAMS,
    ) as progress:
        for shard_index, group in enumerate(groups):
            filename = (
                "model.safetensors"
                if num_shards == 1
                else f"model-{shard_index + 1:05d}-of-{num_shards:05d}.safetensors"
            )
            tensors: dict[str, torch.Tensor] = {}
            for index in group:
                name, shape, kind = specs[index]
                # Drawn in float32 and cast, so every dtype holds (a rounding of) the same values.
                values = torch.randn(shape, generator=generator, dtype=torch.float32)
                scale = _NORM_NOISE_STD if kind == "norm" else preset.initializer_range
                values = values * scale + (1.0 if kind == "norm" else 0.0)
                tensors[name] = values.to(dtype).contiguous()
                weight_map[name] = filename
                total_bytes += tensors[name].numel() * tensors[name].element_size()
                progress.update(values.numel())
            save_file(tensors, str(out / filename), metadata={"format": "pt"})
            # safetensors creates files 0600; an engine running as another user (a pod) must read them.
            (out / filename).chmod(0o644)
            del tensors
    if num_shards > 1:
        index_data = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(out / "model.safetensors.index.json", index_data)


def make_model(
    arch: str,
    preset: str,
    out: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    num_shards: int = 1,
    tie_word_embeddings: bool | None = None,
) -> Path:
    """Writes a random `arch` model of size `preset` to `out` and returns the folder."""
    _check_choice("architecture", arch, ARCHITECTURES)
    _check_choice("preset", preset, PRESETS)
    _check_choice("dtype", dtype, _DTYPES)
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    spec = PRESETS[preset]
    tie = spec.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    # Stale weights from an earlier run with another shard count would be loaded alongside the new ones.
    for stale in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    tokenizer = build_tokenizer(preset, arch, seed)
    bos_id, eos_id, generation_eos_ids = write_tokenizer_files(
        folder, tokenizer, _is_qwen_style(arch), spec.max_position_embeddings
    )
    write_json(folder / "config.json", _config(arch, spec, tie, dtype, bos_id, eos_id))
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": generation_eos_ids,
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
    }
    write_json(folder / "generation_config.json", generation_config)
    _write_weights(folder, _tensor_specs(arch, spec, tie), spec, seed, _DTYPES[dtype], num_shards)
    return folder
