"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV cache.

One class serves the three architectures: they differ only in config (GQA/MQA, rope scaling,
qkv bias, sliding window, tied embeddings), all read from `ModelConfig`. q/k/v and gate/up
are stored fused (one matmul each); `load_weights` maps Hugging Face tensor names onto them.
The forward takes the step's flattened tokens and an `AttentionMetadata`; it never builds
batch tensors itself (that is the model runner's job). Parameters are created uninitialised:
every one must be filled by `load_weights`, which reports any that were not.

A float32 CPU step of 1..8 decodes runs every layer and the final norm in one compiled call
(`cpu_ops.decoder_op()`, the same arithmetic as the layers' own compiled ops, bit for bit) when the
op is available and nothing hooks into the layers (tensor parallelism's all-reduce hooks do): at
that size the per-layer calls cost a quarter to a third of the step (bench/README.md).

LoRA (engine/lora): each projection site (qkv, o, gate_up, down) adds its adapters' deltas right after
its base projection (`SiteSlots.apply`, set on the modules by `LoRASlots.attach`) when the step passes
`lora_slots`; a step without adapter tokens passes None and runs exactly as before (compiled path included).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_ops
from ..config import ModelConfig
from ..cpu_ops.decoder import DecoderShape, PreparedDecoder
from ..layers.activation import silu_mul
from ..layers.attention_backend import paged_attention
from ..layers.attention_metadata import AttentionMetadata
from ..layers.linear import linear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, apply_rotary_

if TYPE_CHECKING:
    from ..lora.slots import SiteSlots


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
        self.lora_qkv: SiteSlots | None = None  # set by LoRASlots.attach when the engine serves adapters
        self.lora_o: SiteSlots | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        if lora_slots is not None and self.lora_qkv is not None:
            self.lora_qkv.apply(qkv, x, lora_slots)
        # q and k are adjacent in the fused output: rotate both heads at once, in place.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_(qk, *cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale).reshape(num_tokens, self.q_size)
        out = linear(attn, self.o_weight, self.o_bias)
        if lora_slots is not None and self.lora_o is not None:
            self.lora_o.apply(out, attn, lora_slots)
        return out


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        dt = config.torch_dtype
        self.intermediate_size = config.intermediate_size
        self.gate_up_weight = _param(2 * config.intermediate_size, config.hidden_size, dtype=dt, device=device)
        self.gate_up_bias = _param(2 * config.intermediate_size, dtype=dt, device=device) if config.mlp_bias else None
        self.down_weight = _param(config.hidden_size, config.intermediate_size, dtype=dt, device=device)
        self.down_bias = _param(config.hidden_size, dtype=dt, device=device) if config.mlp_bias else None
        self.lora_gate_up: SiteSlots | None = None  # set by LoRASlots.attach when the engine serves adapters
        self.lora_down: SiteSlots | None = None

    def forward(self, x: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        if lora_slots is None:
            return linear(silu_mul(linear(x, self.gate_up_weight, self.gate_up_bias)), self.down_weight, self.down_bias)
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
        if self.lora_gate_up is not None:
            self.lora_gate_up.apply(gate_up, x, lora_slots)
        h = silu_mul(gate_up)
        out = linear(h, self.down_weight, self.down_bias)
        if self.lora_down is not None:
            self.lora_down.apply(out, h, lora_slots)
        return out


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
        lora_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`lora_slots` [num_tokens] int32: each token's adapter slot (-1: base model); None: no adapter token."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin, kv_cache, meta, lora_slots)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, lora_slots), residual

    def decode_tensors(self) -> dict[str, torch.Tensor | None]:
        """This layer's weights by `cpu_ops.decoder.LAYER_FIELDS` name (what the one-call decode step reads)."""
        attn, mlp = self.self_attn, self.mlp
        return {
            "input_norm": self.input_layernorm.weight,
            "qkv_weight": attn.qkv_weight,
            "qkv_bias": attn.qkv_bias,
            "o_weight": attn.o_weight,
            "o_bias": attn.o_bias,
            "post_norm": self.post_attention_layernorm.weight,
            "gate_up_weight": mlp.gate_up_weight,
            "gate_up_bias": mlp.gate_up_bias,
            "down_weight": mlp.down_weight,
            "down_bias": mlp.down_bias,
        }


@dataclass(slots=True)
class _DecoderState:
    """What the one-call decode step was prepared from, and the cheap per-step checks that it still holds.

    The layer modules are fixed once the model decodes; their parameters may still be swapped for new
    ones or moved to new storage (a reload, a re-quantization): `holds` notices both (the op reads raw
    pointers). Hooks (tensor parallelism's all-reduce, instrumentation) may come and go: checked each step.
    """

    modules: list[nn.Module]
    bindings: list[tuple[dict[str, Any], str, torch.Tensor, int]]  # (_parameters or _buffers, name, tensor, ptr)
    prepared: PreparedDecoder | None

    @classmethod
    def of(cls, model: LlamaForCausalLM, op: cpu_ops.CpuDecoder) -> _DecoderState:
        tensors = [layer.decode_tensors() for layer in model.layers]
        c = model.config
        scale = model.layers[0].self_attn.scale if len(model.layers) else c.head_dim**-0.5
        shape = DecoderShape(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
            float(model.norm.eps), scale,
        )  # fmt: skip
        bindings = [
            (owner, name, t, t.data_ptr())
            for module in [*model.layers.modules(), model.norm]
            for owner in (module._parameters, module._buffers)  # buffers: a quantized weight's tensors
            for name, t in owner.items()
            if t is not None
        ]
        modules = list(model.layers.modules())
        return cls(modules, bindings, op.prepare(shape, tensors, model.norm.weight))

    def holds(self) -> bool:
        return all(owner.get(name) is t and t.data_ptr() == ptr for owner, name, t, ptr in self.bindings)

    def hooked(self) -> bool:
        hooks = torch.nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)


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
        self._decoder_state: _DecoderState | None = None  # the one-call CPU decode step's, built on first use

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm. `lora_slots`: each token's adapter slot
        (int32, -1 = base model), only for a step with adapter tokens (a step without stays on every fast path)."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        if lora_slots is None:
            compiled = self._compiled_decode_step(x, cos_sin, kv_caches, meta)
            if compiled is not None:
                return compiled
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kv_cache, meta, lora_slots)
        x, _ = self.norm(x, residual)
        return x

    def _compiled_decode_step(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The layers and the final norm in one compiled call, or None where the step or model does not qualify."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or meta.prefills or meta.num_decode_seqs != x.shape[0]:
            return None
        if meta.block_tables is None or meta.seq_lens is None or meta.cu_seqlens_q is None:
            return None
        op = cpu_ops.decoder_op()
        if op is None or not 1 <= x.shape[0] <= op.max_batch:
            return None
        state = self._decoder_state
        if state is None or not state.holds():
            state = self._decoder_state = _DecoderState.of(self, op)
        if state.prepared is None or state.hooked():
            return None
        return op.run(
            state.prepared, x, *cos_sin, kv_caches, meta.slot_mapping, meta.block_tables, meta.seq_lens,
            meta.cu_seqlens_q, meta.sliding_window,
        )  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head_weight).float()

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters.

        Raises ValueError naming the checkpoint tensor for a wrong shape, an unknown name or a
        tensor the checkpoint lacks.
        """
        params = dict(self.named_parameters())
        layout = self.checkpoint_layout()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = layout.get(hf_name)
            if target is None:
                if "rotary_emb" in hf_name or (hf_name == "lm_head.weight" and self.lm_head is None):
                    continue  # buffers some checkpoints carry; a tied model's redundant lm_head copy
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}")
            name, offset, rows = target
            dest = params[name].data[offset : offset + rows]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(hf_name)
        missing = sorted(set(layout) - loaded)
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:8])}{more}")

    def checkpoint_layout(self) -> dict[str, tuple[str, int, int]]:
        """Hugging Face tensor name -> (parameter name, first row, number of rows) in the fused layout."""
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
        params = dict(self.named_parameters())
        layout: dict[str, tuple[str, int, int]] = {}

        def put(hf_name: str, name: str, offset: int = 0, rows: int | None = None) -> None:
            if name in params:
                layout[hf_name] = (name, offset, params[name].shape[0] if rows is None else rows)

        put("model.embed_tokens.weight", "embed_tokens")
        put("model.norm.weight", "norm.weight")
        put("lm_head.weight", "lm_head")
        for i in range(len(self.layers)):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(f"{hf}.{norm}.weight", f"{ours}.{norm}.weight")
            for kind in ("weight", "bias"):
                put(f"{hf}.self_attn.q_proj.{kind}", f"{ours}.self_attn.qkv_{kind}", 0, q)
                put(f"{hf}.self_attn.k_proj.{kind}", f"{ours}.self_attn.qkv_{kind}", q, kv)
                put(f"{hf}.self_attn.v_proj.{kind}", f"{ours}.self_attn.qkv_{kind}", q + kv, kv)
                put(f"{hf}.self_attn.o_proj.{kind}", f"{ours}.self_attn.o_{kind}")
                put(f"{hf}.mlp.gate_proj.{kind}", f"{ours}.mlp.gate_up_{kind}", 0, inter)
                put(f"{hf}.mlp.up_proj.{kind}", f"{ours}.mlp.gate_up_{kind}", inter, inter)
                put(f"{hf}.mlp.down_proj.{kind}", f"{ours}.mlp.down_{kind}")
        return layout
