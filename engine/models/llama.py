"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV cache.

One class serves the three architectures: they differ only in config (GQA/MQA, rope scaling,
qkv bias, sliding window, tied embeddings), all read from `ModelConfig`. q/k/v and gate/up
are stored fused (one matmul each); `load_weights` maps Hugging Face tensor names onto them.
The forward takes the step's flattened tokens and an `AttentionMetadata`; it never builds
batch tensors itself (that is the model runner's job). Parameters are created uninitialised:
every one must be filled by `load_weights`, which reports any that were not.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..layers.attention_backend import paged_attention
from ..layers.attention_metadata import AttentionMetadata
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, apply_rotary


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, device: torch.device | str) -> None:
        super().__init__()
        dt = config.torch_dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.rotary = rotary
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dt, device=device)
        self.qkv_bias = (
            _param(self.q_size + 2 * self.kv_size, dtype=dt, device=device) if config.attention_bias else None
        )
        self.o_weight = _param(config.hidden_size, self.q_size, dtype=dt, device=device)
        self.o_bias = _param(config.hidden_size, dtype=dt, device=device) if config.o_proj_bias else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        # q and k are adjacent in the fused output: rotate both heads at once.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(qk, *cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return F.linear(attn.reshape(num_tokens, self.q_size), self.o_weight, self.o_bias)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        dt = config.torch_dtype
        self.intermediate_size = config.intermediate_size
        self.gate_up_weight = _param(2 * config.intermediate_size, config.hidden_size, dtype=dt, device=device)
        self.gate_up_bias = _param(2 * config.intermediate_size, dtype=dt, device=device) if config.mlp_bias else None
        self.down_weight = _param(config.hidden_size, config.intermediate_size, dtype=dt, device=device)
        self.down_bias = _param(config.hidden_size, dtype=dt, device=device) if config.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_weight, self.down_bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, device: torch.device | str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype, device)
        self.self_attn = LlamaAttention(config, rotary, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype, device)
        self.mlp = LlamaMLP(config, device)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, device: torch.device | str = "cpu", max_positions: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        dt = config.torch_dtype
        self.rotary = RotaryEmbedding(
            config.head_dim,
            max_positions or config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            device,
        )
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dt, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, device) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt, device)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, dtype=dt, device=device)
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight).float()

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; raise on anything missing or unknown."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}  # rows copied per parameter (fused ones are filled in parts)
        for hf_name, tensor in weights:
            target = self._map_name(hf_name)
            if target is None:
                continue  # e.g. rotary inv_freq buffers some checkpoints carry
            name, row_offset = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}")
            param = params[name]
            rows = tensor.shape[0]
            dest = param.data[row_offset : row_offset + rows] if row_offset is not None else param.data
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[name] = filled.get(name, 0) + rows
        missing = [name for name, param in params.items() if filled.get(name, 0) != param.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(sorted(missing)[:8])}")

    def _map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        if "rotary_emb" in hf_name:
            return None
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight":
            if self.lm_head is None:
                return None  # tied: some checkpoints still ship a copy
            return "lm_head", None
        if name == "embed_tokens.weight":
            return "embed_tokens", None
        if not name.startswith("layers."):
            return name, None  # norm.weight
        attn = self.layers[0].self_attn
        offsets = {"q_proj": 0, "k_proj": attn.q_size, "v_proj": attn.q_size + attn.kv_size}
        for proj, offset in offsets.items():
            for kind in ("weight", "bias"):
                suffix = f"self_attn.{proj}.{kind}"
                if name.endswith(suffix):
                    return name[: -len(suffix)] + f"self_attn.qkv_{kind}", offset
        for proj, kind_name in (("o_proj", "o"), ("down_proj", "down")):
            for kind in ("weight", "bias"):
                parent = "self_attn" if proj == "o_proj" else "mlp"
                suffix = f"{parent}.{proj}.{kind}"
                if name.endswith(suffix):
                    return name[: -len(suffix)] + f"{parent}.{kind_name}_{kind}", None
        mlp = self.layers[0].mlp
        for proj, offset in (("gate_proj", 0), ("up_proj", mlp.intermediate_size)):
            for kind in ("weight", "bias"):
                suffix = f"mlp.{proj}.{kind}"
                if name.endswith(suffix):
                    return name[: -len(suffix)] + f"mlp.gate_up_{kind}", offset
        return name, None
