"""Compile every kernel variant the launchers produce for an H100/H200 (sm_90) without a GPU.

The interpreter tests prove the kernels compute the right thing; they do not run Triton's
compiler. This script does: it replaces ``JITFunction.run`` so each launch is compiled ahead
of time for ``GPUTarget("cuda", 90, 32)`` with the ptxas bundled in the Triton wheel, and prints
each variant's shared-memory use (an H100/H200 block may use up to 227 KiB). Not collected by
pytest (slow: about a minute per attention variant on a small CPU); run by hand:

    python tests/kernels/compile_for_sm90.py [decode] [varlen] [misc] [matmul] [lora]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile for real

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
}
MAX_SHARED = 227 * 1024


def compile_launch(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    bound = dict(zip(self.arg_names, args, strict=False)) | kwargs
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param, name in zip(self.params, self.arg_names, strict=True):
        value = bound[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPE_NAMES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if abs(int(value)) >= 2**31 else "i32"
    started = time.perf_counter()
    kernel = triton.compile(ASTSource(self, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
    shared = kernel.metadata.shared
    status = "ok" if shared <= MAX_SHARED else "TOO MUCH SHARED MEMORY"
    shown = {k: v for k, v in constexprs.items() if k.isupper()}
    print(f"{self.__name__} {shown}: shared {shared} B, {time.perf_counter() - started:.0f} s, {status}", flush=True)


def main(groups: list[str]) -> None:
    JITFunction.run = compile_launch  # type: ignore[method-assign]
    from tidepool.kernels.flash_attention_varlen import flash_attention_varlen
    from tidepool.kernels.int4_matmul import int4_matmul
    from tidepool.kernels.int8_matmul import int8_matmul
    from tidepool.kernels.lora_shrink_expand import lora_apply
    from tidepool.kernels.paged_attention_decode import paged_attention_decode
    from tidepool.kernels.rms_norm import rms_norm
    from tidepool.kernels.rotary import rotary_
    from tidepool.kernels.store_kv import store_kv

    i32 = torch.int32
    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.zeros(64, 16, 8, 128, dtype=dtype)
        if "decode" in groups:
            q = torch.zeros(4, 32, 128, dtype=dtype)
            tables, lens = torch.zeros(4, 40, dtype=i32), torch.ones(4, dtype=i32)
            paged_attention_decode(q, cache, cache, tables, lens, 0.1, num_splits=4)
        if "varlen" in groups:
            q = torch.zeros(300, 32, 128, dtype=dtype)
            cu, lens = torch.tensor([0, 100, 300], dtype=i32), torch.tensor([100, 300], dtype=i32)
            for window in (None, 64):
                flash_attention_varlen(
                    q, cache, cache, cu, lens, torch.zeros(2, 20, dtype=i32), 0.1, sliding_window=window
                )
        if "misc" in groups:
            new = torch.zeros(5, 8, 128, dtype=dtype)
            store_kv(new, new, cache, cache, torch.arange(5))
            x = torch.zeros(5, 4096, dtype=dtype)
            rms_norm(x, torch.zeros(4096, dtype=dtype), 1e-5, x)
            qkv = torch.zeros(5, 48 * 128, dtype=dtype)  # 32 q + 8 k heads rotated, 8 v heads left alone
            rotary_(qkv[:, : 40 * 128].view(5, 40, 128), torch.zeros(5, 128, dtype=dtype), torch.zeros(5, 128))
        if "matmul" in groups:
            for m in (1, 64):
                x = torch.zeros(m, 4096, dtype=dtype)
                int8_matmul(x, torch.zeros(1024, 4096, dtype=torch.int8), torch.ones(1024, dtype=dtype))
                group = torch.ones(32, 1024, dtype=dtype)
                int4_matmul(x, torch.zeros(512, 1024, dtype=i32), group, group, 128)
                gguf_group = torch.ones(128, 1024, dtype=torch.float16)  # Q4_1 kept as int4: 32-wide, mins form
                int4_matmul(x, torch.zeros(512, 1024, dtype=i32), gguf_group, None, 32, mins=gguf_group)
        if "lora" in groups:
            a, b = torch.zeros(8, 3 * 16, 576, dtype=dtype), torch.zeros(8, 960, 16, dtype=dtype)
            for tokens in (32, 300):  # per-token gather (decode) and segmented (prefill) forms
                y, x = torch.zeros(tokens, 960, dtype=dtype), torch.zeros(tokens, 576, dtype=dtype)
                slots = torch.zeros(tokens, dtype=i32)
                lora_apply(y, x, a, b, (0, 576, 768, 960), slots, torch.full((8,), 16, dtype=i32))


if __name__ == "__main__":
    main(sys.argv[1:] or ["decode", "varlen", "misc", "matmul", "lora"])
