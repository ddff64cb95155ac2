"""Per-step attention metadata, built once by the model runner and shared by every layer.

Token layout of a step: the decode tokens (one per sequence) first, then each prefill chunk's
tokens in order. Every tensor the kernels need (`block_tables`, `seq_lens`, `cu_seqlens_q`:
the Triton kernels on CUDA, the compiled op on the CPU) is here, as is what the torch path
precomputes once per step (masks, scratch). The runner's backend (`engine/runner_backend.py`,
chosen once per runner) fills the kernel views (`attach_kernel_views`) on CUDA, and on the CPU
when the compiled op is in use, in which case it leaves `decode_mask` and `decode_kv_scratch`
unset; without views the layers take the torch path, so a torch-path CPU step pays nothing for
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the step's token layout
    num_query_tokens: int
    context_len: int  # tokens in the cache after this step (cached prefix + this chunk)
    block_ids: torch.Tensor  # int64 [num_blocks_for(context_len)] on the model's device
    mask: torch.Tensor | None  # bool [num_query_tokens, context_len]; None means plain causal, no prefix


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: flat cache slot of each new token
    num_decode_seqs: int  # the first num_decode_seqs tokens are decodes, one per sequence
    decode_block_tables: torch.Tensor  # int64 [num_decode_seqs, max_blocks] (padded with block 0)
    # bool [num_decode_seqs, 1, 1, max_blocks * block_size]; None with CPU kernel views (the torch
    # path then derives it from `seq_lens` if it runs after all).
    decode_mask: torch.Tensor | None
    # Scratch for the torch path's gathered decode K/V, allocated once per step and reused by every
    # layer (a fresh large tensor per layer costs page faults that dwarf the copy itself).
    decode_kv_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Kernel-facing views over all sequences (decodes then prefills).
    block_tables: torch.Tensor | None = None  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor | None = None  # int32 [num_seqs], context length after this step
    cu_seqlens_q: torch.Tensor | None = None  # int32 [num_seqs + 1]
    sliding_window: int | None = None  # keys kept per query (HF semantics); the kernel path applies it
