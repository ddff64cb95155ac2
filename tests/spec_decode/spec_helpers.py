"""Helpers for the speculative-decoding tests: a small-vocabulary model, draft models, a chi-square test.

`write_small_vocab_model(out, seed)` writes a 24-token Llama (word-level tokenizer "t0".."t23", one layer)
whose next-token distributions at temperature 1 are spread over many tokens, so a chi-square
test over its vocabulary has power. `perturbed_copy(src, out, scale)` is a draft with the
target's exact tokenizer and perturbed weights: it agrees with the target often, not always, so
both acceptance and rejection are exercised.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SMALL_VOCAB = 24


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with tiny expectation are pooled (expected count >= 5)."""
    total = float(observed.sum())
    expected = expected_probs.double() * total
    order = torch.argsort(expected, descending=True)
    observed, expected = observed.double()[order], expected[order]
    keep = expected >= 5
    obs_cells = [*observed[keep].tolist()]
    exp_cells = [*expected[keep].tolist()]
    if (~keep).any():
        obs_cells.append(float(observed[~keep].sum()))
        exp_cells.append(float(expected[~keep].sum()))
    obs_t, exp_t = torch.tensor(obs_cells), torch.tensor(exp_cells).clamp(min=1e-9)
    statistic = float(((obs_t - exp_t) ** 2 / exp_t).sum())
    dof = len(obs_cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def write_small_vocab_model(out: Path, seed: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(SMALL_VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    hidden, inter, heads = 32, 64, 2
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden // heads,
        "vocab_size": SMALL_VOCAB,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "hidden_act": "silu",
    }
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text("{}")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    p = "model.layers.0"
    tensors = {
        "model.embed_tokens.weight": randn(SMALL_VOCAB, hidden, std=1.0),
        f"{p}.self_attn.q_proj.weight": randn(hidden, hidden, std=0.2),
        f"{p}.self_attn.k_proj.weight": randn(hidden, hidden, std=0.2),
        f"{p}.self_attn.v_proj.weight": randn(hidden, hidden, std=0.2),
        f"{p}.self_attn.o_proj.weight": randn(hidden, hidden, std=0.2),
        f"{p}.mlp.gate_proj.weight": randn(inter, hidden, std=0.2),
        f"{p}.mlp.up_proj.weight": randn(inter, hidden, std=0.2),
        f"{p}.mlp.down_proj.weight": randn(hidden, inter, std=0.2),
        f"{p}.input_layernorm.weight": torch.ones(hidden),
        f"{p}.post_attention_layernorm.weight": torch.ones(hidden),
        "model.norm.weight": torch.ones(hidden),
        # Scaled so the temperature-1 distributions are neither flat nor one-hot.
        "lm_head.weight": randn(SMALL_VOCAB, hidden, std=0.25),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def perturbed_copy(src: Path, out: Path, scale: float, seed: int = 1) -> Path:
    """A draft: the source folder with every weight matrix perturbed by `scale` x its std."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "model.safetensors"))
    noisy = {}
    for name, value in tensors.items():
        if value.dim() == 2:
            value = value + torch.randn(value.shape, generator=gen, dtype=value.dtype) * value.std() * scale
        noisy[name] = value.contiguous()
    save_file(noisy, str(out / "model.safetensors"))
    return out
