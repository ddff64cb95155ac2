"""Held-out perplexity of a loaded Tidepool model, through the engine's own forward pass.

Role: the quality measure for quantization (bench/quant.py, tests/quant). Each window of
``seq_len + 1`` tokens is run as one causal prefill over a scratch paged KV cache, exactly as the
engine's model runner would run it, and the next-token negative log-likelihood is averaged.

Invariants: windows do not overlap and are taken from the start of the token stream, so two
models evaluated on the same stream and window count see exactly the same tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..layers.attention_metadata import AttentionMetadata, PrefillChunk

_BLOCK_SIZE = 16


def _prefill_metadata(num_tokens: int, device: torch.device) -> AttentionMetadata:
    num_blocks = -(-num_tokens // _BLOCK_SIZE)
    chunk = PrefillChunk(
        query_start=0,
        num_query_tokens=num_tokens,
        context_len=num_tokens,
        block_ids=torch.arange(num_blocks, device=device),
        mask=None,  # plain causal attention over the chunk itself
    )
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        num_decode_seqs=0,
        decode_block_tables=torch.zeros((0, 1), dtype=torch.int64, device=device),
        decode_mask=None,
        prefills=[chunk],
    )


@torch.inference_mode()
def perplexity(model: nn.Module, token_ids: torch.Tensor, seq_len: int = 256, max_windows: int = 32) -> float:
    """exp(mean next-token NLL) over up to `max_windows` non-overlapping windows of `token_ids`."""
    num_windows = min(max_windows, (token_ids.numel() - 1) // seq_len)
    if num_windows < 1:
        raise ValueError(f"need at least {seq_len + 1} tokens for one window, got {token_ids.numel()}")
    caches = _scratch_caches(model, seq_len)
    total_nll = 0.0
    for w in range(num_windows):
        window = token_ids[w * seq_len : (w + 1) * seq_len + 1]
        logits = prefill_logits(model, window[:-1], caches)
        total_nll += float(torch.nn.functional.cross_entropy(logits, window[1:].to(logits.device), reduction="sum"))
    return math.exp(total_nll / (num_windows * seq_len))


def _scratch_caches(model: nn.Module, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = model.config
    device = model.embed_tokens.device
    shape = (-(-num_tokens // _BLOCK_SIZE), _BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=config.torch_dtype, device=device),
            torch.zeros(shape, dtype=config.torch_dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]


@torch.inference_mode()
def prefill_logits(
    model: nn.Module, input_ids: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> torch.Tensor:
    """float32 logits ``[T, vocab]`` of one causal prefill of ``input_ids`` (1-D) from an empty cache."""
    num_tokens = input_ids.numel()
    device = model.embed_tokens.device
    if caches is None:
        caches = _scratch_caches(model, num_tokens)
    meta = _prefill_metadata(num_tokens, device)
    hidden = model(input_ids.to(device), torch.arange(num_tokens, device=device), caches, meta)
    return model.compute_logits(hidden)
