"""Where one decode step's wall time goes, call by call: timers around each call a Llama layer makes.

`bench/profile_decode.py` counts aten ops; it cannot see the compiled CPU ops (foreign calls) nor the
Python between calls. This wraps, in `engine/models/llama.py`'s namespace, the functions a decoder
layer calls (`linear`, labelled by the weight it multiplies: q/k/v, o, gate/up, down, LM head;
`apply_rotary_`; `paged_attention` with the KV store; `silu_mul`) and the norms, with
`time.perf_counter`, decodes `--steps` steps of one batch, and prints milliseconds per step for
each, plus the whole forward and what the forward spends between those calls (views, module calls,
embedding, rotary tables). The model's own code runs unchanged. The timers cost ~0.1 µs each.
It times the layer-by-layer path: the one-call decode step (`cpu_ops.decoder_op()`) makes none of
these calls, so it is switched off here unless TIDEPOOL_CPU_DECODER is set.

    python bench/layer_timers.py --model DIR [--batch 1] [--context-len 128]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from tidepool.engine import LLM, SamplingParams, cpu_ops
from tidepool.engine.layers.norm import RMSNorm
from tidepool.engine.models import llama

totals: dict[str, float] = defaultdict(float)
WEIGHT_LABELS = {
    "qkv_weight": "q/k/v projection",
    "o_weight": "o projection",
    "gate_up_weight": "gate/up projection",
    "down_weight": "down projection",
}


def around(fn: Callable[..., Any], name: str | Callable[..., str]) -> Callable[..., Any]:
    """`fn` with its wall time added to `totals[name]` (`name` may be a function of the call's arguments)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name if isinstance(name, str) else name(*args)] += time.perf_counter() - start

    return wrapper


def instrument(model: llama.LlamaForCausalLM) -> None:
    """Time the calls the model makes (module attributes of llama.py and the norms), labelled by role."""
    labels = {id(param): WEIGHT_LABELS[name.rsplit(".", 1)[-1]] for name, param in model.named_parameters()
              if name.rsplit(".", 1)[-1] in WEIGHT_LABELS}  # fmt: skip
    labels[id(model.lm_head_weight)] = "LM head"
    llama.linear = around(llama.linear, lambda x, weight, *rest: labels.get(id(weight), "other projection"))
    llama.apply_rotary_ = around(llama.apply_rotary_, "rotary")
    llama.paged_attention = around(llama.paged_attention, "attention (+ KV store)")
    llama.silu_mul = around(llama.silu_mul, "SwiGLU")
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = around(module.forward, "norms (+ residual add)")  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    os.environ.setdefault(cpu_ops.DECODER_MODE_ENV, "torch")  # the calls timed here are the layer-by-layer path's
    # Decodes start while later prompts still prefill (2,048-token steps), so the early ones need that many
    # more tokens to still be running when the timed steps start.
    max_new = args.steps + 2 + -(-args.batch * args.context_len // 2048) + 2
    engine = LLM(args.model, show_progress=False, max_model_len=args.context_len + max_new + 16,
                 max_num_seqs=max(256, args.batch)).engine  # fmt: skip
    if not isinstance(engine.model, llama.LlamaForCausalLM):
        raise SystemExit(f"{args.model}: layer timers know the Llama family only, not {type(engine.model).__name__}")
    instrument(engine.model)
    engine.model.forward = around(engine.model.forward, "whole forward")  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [3 + (i + j) % 1000 for j in range(args.context_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.step()
    if len(engine.scheduler.running) != args.batch:  # the KV cache held fewer: the steps would time a smaller batch
        raise SystemExit(f"only {len(engine.scheduler.running)} of {args.batch} sequences of {args.context_len} "
                         "tokens run at once here (KV cache capacity); lower --batch or --context-len")  # fmt: skip
    totals.clear()
    steps: list[float] = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    steps.sort()
    print(f"batch {args.batch}, context {args.context_len}: median step {1e3 * steps[len(steps) // 2]:.1f} ms")
    inside = sum(seconds for name, seconds in totals.items() if name not in ("whole forward", "LM head"))
    totals["forward, between those calls"] = totals["whole forward"] - inside
    for name, seconds in totals.items():
        print(f"  {name:30s} {1e3 * seconds / len(steps):7.2f} ms/step")


if __name__ == "__main__":
    main()
