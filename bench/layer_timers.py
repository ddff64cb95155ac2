"""Where one decode step's wall time goes, call by call: timers around each call of a Llama layer.

`bench/profile_decode.py` counts aten ops; it cannot see the compiled CPU ops (foreign calls) nor the
Python between calls. This wraps the decoder layer's forward with `time.perf_counter` around each of
its calls (norm, q/k/v projection, rotary and views, attention with the KV store, o projection,
norm, gate/up, SwiGLU, down) plus the whole forward and the LM head, decodes `--steps` steps of one
batch, and prints milliseconds per step for each. The timers cost ~0.1 µs each.

    python bench/layer_timers.py --model DIR [--batch 1] [--context-len 128]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.layers.activation import silu_mul
from tidepool.engine.layers.attention_metadata import AttentionMetadata
from tidepool.engine.layers.rotary import apply_rotary_
from tidepool.engine.models import llama

totals: dict[str, float] = defaultdict(float)


def timed_layer_forward(
    self: llama.LlamaDecoderLayer,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    now = time.perf_counter
    marks = [now()]

    def mark(name: str) -> None:
        marks.append(now())
        totals[name] += marks[-1] - marks[-2]

    attn, mlp = self.self_attn, self.mlp
    h, residual = self.input_layernorm(x, residual)
    mark("input norm (+ residual add)")
    n = h.shape[0]
    qkv = llama.linear(h, attn.qkv_weight, attn.qkv_bias)
    mark("q/k/v projection")
    qk = qkv[:, : attn.q_size + attn.kv_size].view(n, attn.num_heads + attn.num_kv_heads, attn.head_dim)
    q, k = apply_rotary_(qk, *cos_sin).split([attn.num_heads, attn.num_kv_heads], dim=1)
    v = qkv[:, attn.q_size + attn.kv_size :].view(n, attn.num_kv_heads, attn.head_dim)
    mark("rotary + views")
    out = llama.paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, attn.scale)
    mark("attention (+ KV store)")
    h = llama.linear(out.reshape(n, attn.q_size), attn.o_weight, attn.o_bias)
    mark("o projection")
    h, residual = self.post_attention_layernorm(h, residual)
    mark("post norm (+ residual add)")
    gate_up = llama.linear(h, mlp.gate_up_weight, mlp.gate_up_bias)
    mark("gate/up projection")
    act = silu_mul(gate_up)
    mark("SwiGLU")
    h = llama.linear(act, mlp.down_weight, mlp.down_bias)
    mark("down projection")
    return h, residual


def around(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    llama.LlamaDecoderLayer.forward = timed_layer_forward  # type: ignore[method-assign]
    llama.LlamaForCausalLM.forward = around(llama.LlamaForCausalLM.forward, "whole forward")  # type: ignore[method-assign]
    llama.LlamaForCausalLM.compute_logits = around(llama.LlamaForCausalLM.compute_logits, "LM head")  # type: ignore[method-assign]
    engine = LLM(args.model, show_progress=False, max_model_len=args.context_len + args.steps + 16).engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [3 + (i + j) % 1000 for j in range(args.context_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.step()
    totals.clear()
    steps: list[float] = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    steps.sort()
    print(f"batch {args.batch}, context {args.context_len}: median step {1e3 * steps[len(steps) // 2]:.1f} ms")
    for name, seconds in totals.items():
        print(f"  {name:28s} {1e3 * seconds / len(steps):7.2f} ms/step")


if __name__ == "__main__":
    main()
