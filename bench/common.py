"""Shared pieces of the benchmarks: cached benchmark models, seeded workloads, memory bandwidth, MBU.

MBU (model bandwidth utilisation) = bytes a decode step must read (weights + KV cache) /
step time / read bandwidth, where the read bandwidth is a streaming read (a sum) of a buffer far
larger than the last-level cache, measured in the same run with the same thread count
(`read_bandwidth`). The engine keeps its weights and KV cache in memory advised for huge pages
(`tidepool.engine.hugepages`), which streams faster than 4 KiB pages, so the read is measured over
both kinds of buffer and the higher figure is the ceiling. `copy_bandwidth` (read + write, STREAM's
copy) is kept for reference only: a decode step reads its weights, it does not copy them.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def cache_dir() -> Path:
    return Path(os.environ.get("TIDEPOOL_CACHE", Path.home() / ".cache" / "tidepool"))


def bench_model(arch: str = "llama", preset: str = "smollm-135m", seed: int = 0) -> Path:
    """Make (once) and return a seeded random model folder kept in the cache outside the clone."""
    from tidepool.engine.make_model import make_model

    path = cache_dir() / "models" / f"{arch}-{preset}-seed{seed}"
    if not (path / "config.json").is_file():
        make_model(arch, preset, path, seed=seed)
    return path


@dataclass(slots=True)
class WorkItem:
    prompt_token_ids: list[int]
    num_output_tokens: int


def random_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    first_id: int = 3,
) -> list[WorkItem]:
    rng = random.Random(seed)
    return [
        WorkItem(
            [rng.randrange(first_id, vocab_size) for _ in range(rng.randint(*input_len))],
            rng.randint(*output_len),
        )
        for _ in range(num_requests)
    ]


def decode_prompts(batch: int, context_len: int) -> list[list[int]]:
    """`batch` distinct prompts of `context_len` token ids (no shared prefix beyond a token)."""
    return [[3 + (i + j) % 500 for j in range(context_len)] for i in range(batch)]


def add_decode_arguments(
    parser: argparse.ArgumentParser, batches: str, steps: int, rounds: int, out: Path
) -> argparse.ArgumentParser:
    """The arguments of the in-process decode A/B benchmarks (weight_pages.py, decode_batches.py)."""
    parser.add_argument("--model", required=True, help="a Hugging Face folder or a .gguf file")
    parser.add_argument("--batches", default=batches, help="comma-separated numbers of sequences decoding")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=steps, help="decode steps timed per measurement")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", type=Path, default=out)
    return parser


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-N copy bandwidth in bytes/s, counting the read and the write."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def read_bandwidths(num_bytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Best-of-N streaming read bandwidth in bytes/s (torch.sum over `num_bytes` of float32, torch's threads),
    over an ordinary buffer ("4k") and one advised for huge pages ("huge", absent where they are off)."""
    from tidepool.engine import hugepages

    buffers = {"4k": torch.ones(num_bytes // 4, dtype=torch.float32)}
    if hugepages.unavailable_reason() is None:
        buffers["huge"] = hugepages.advised_empty(num_bytes).view(torch.float32).fill_(1.0)
    result = {}
    for name, src in buffers.items():
        src.sum()  # fault the pages in and warm the thread pool
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            src.sum()
            best = min(best, time.perf_counter() - start)
        result[name] = num_bytes / best
    return result


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """The machine's read ceiling in bytes/s: the higher of `read_bandwidths`."""
    return max(read_bandwidths(num_bytes, repeats).values())


def decode_bytes_per_step(model: torch.nn.Module, config: Any, context_len: int) -> int:
    """Bytes one bs=1 decode step reads: weights + the KV cache at `context_len`.

    `config` is Tidepool's `ModelConfig` or a transformers config (same field names). An untied
    embedding table counts one row (a lookup); a tied one is read whole as the LM head.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    total = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if not config.tie_word_embeddings and "embed_tokens" in name:
            size = param.shape[1] * param.element_size()
        total += size
    for name, buffer in model.named_buffers():  # quantized weights are buffers; the rotary table is not read whole
        if "rotary" not in name:
            total += buffer.numel() * buffer.element_size()
    element = next(model.parameters()).element_size()
    return total + 2 * config.num_hidden_layers * context_len * config.num_key_value_heads * head_dim * element
