"""Tidepool's Triton kernels on a GPU: check each against its torch reference, then time it against a baseline.

Timings (median of per-launch CUDA-event times, L2 flushed before each launch):
- flash prefill (varlen over the paged cache) vs torch ``scaled_dot_product_attention`` (causal,
  K/V pre-expanded to all heads so SDPA gets its fastest kernel), TFLOP/s, seq 512-8k, head_dim 128, bf16;
- paged decode as % of the device-to-device copy bandwidth measured in the same run
  (bytes = the K/V rows the batch must read), batch 1-256, context 1k-32k;
- int8 / int4 matmul vs bf16 ``torch.matmul`` at decode shapes (Llama-3-8B projections);
- fused residual + RMSNorm vs the torch ops it replaces;
- fused rotary (q and k in place, one launch) vs the torch ops it replaces.
Prints one table, writes JSON to bench/results/gpu_kernels.json. Targets (H200) in the table.

    python bench/gpu_kernels.py            # on a CUDA machine (< 5 min on an H200)
    python bench/gpu_kernels.py --smoke    # tiny shapes; without CUDA, under Triton's CPU interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
HQ, HKV, HD, BLOCK = 32, 8, 128, 16  # Llama-3-8B attention shape, 16-token cache blocks
TOL = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


class Bench:
    def __init__(self, device: torch.device, reps: int) -> None:
        self.device = device
        self.reps = reps
        is_cuda = device.type == "cuda"
        self.flush_buf = torch.empty(256 << 20 if is_cuda else 1 << 10, dtype=torch.int8, device=device)

    def time_s(self, fn: Callable[[], object]) -> float:
        """Median seconds of one call."""
        fn()  # compile / warm up
        if self.device.type != "cuda":
            times = []
            for _ in range(self.reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)
        ]
        for start, end in events:
            self.flush_buf.zero_()  # evict the previous launch's operands from L2
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3

    def copy_bandwidth(self, num_bytes: int) -> float:
        """Device-to-device copy, bytes/s counting the read and the write."""
        src = torch.ones(num_bytes // 4, dtype=torch.float32, device=self.device)
        dst = torch.empty_like(src)
        return 2 * num_bytes / self.time_s(lambda: dst.copy_(src))


def paged_cache(num_blocks: int, dtype: torch.dtype, device: torch.device, head_dim: int = HD):
    shape = (num_blocks, BLOCK, HKV, head_dim)
    k = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
    return k, torch.empty_like(k).uniform_(-1, 1)


def block_tables_for(seq_lens: list[int], num_blocks: int, device: torch.device) -> torch.Tensor:
    """Each sequence gets a random (non-contiguous) set of distinct blocks."""
    needed = [-(-n // BLOCK) for n in seq_lens]
    perm = torch.randperm(num_blocks, device=device)[: sum(needed)].to(torch.int32)
    table = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32, device=device)
    offset = 0
    for row, count in enumerate(needed):
        table[row, :count] = perm[offset : offset + count]
        offset += count
    return table


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def check_all(k, device: torch.device, smoke: bool) -> list[dict]:
    """Each launcher vs its reference, the same calls the tests make, on this device's compiled kernels."""
    checks = []

    def record(name: str, dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor) -> None:
        err = max_rel_err(got, want)
        checks.append({"kernel": name, "dtype": str(dtype), "max_rel_err": err, "ok": err <= TOL[dtype]})

    ctx = 40 if smoke else 3000
    dtypes = (torch.bfloat16,) if smoke else (torch.bfloat16, torch.float16, torch.float32)
    for dtype in dtypes:
        head_dims = (64, 80, 96, 128) if dtype == torch.bfloat16 and not smoke else (80 if smoke else 128,)
        for head_dim in head_dims:
            kc, vc = paged_cache(4 * -(-ctx // BLOCK) + 8, dtype, device, head_dim)
            lens = [ctx, 17, ctx // 3, 1]
            tables = block_tables_for(lens, kc.shape[0], device)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            q = torch.randn(4, HQ, head_dim, dtype=dtype, device=device)
            args = (q, kc, vc, tables, seq_lens, head_dim**-0.5)
            record(f"paged_decode hd{head_dim}", dtype, k.decode(*args), k.decode_ref(*args))
            # Per sequence: new tokens after a cached prefix (full prefill, short, chunk, decode-like).
            chunks = lens
            news = [ctx, 17, min(40, ctx // 3), 1]
            cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32, device=device)
            qv = torch.randn(sum(news), HQ, head_dim, dtype=dtype, device=device)
            args = (qv, kc, vc, cu, torch.tensor(chunks, dtype=torch.int32, device=device), tables, head_dim**-0.5)
            record(f"flash_varlen hd{head_dim}", dtype, k.varlen(*args), k.varlen_ref(*args))
        kc, vc = paged_cache(64, dtype, device)
        new_k, new_v = torch.randn(2, 37, HKV, HD, dtype=dtype, device=device).unbind(0)
        slots = torch.randperm(64 * BLOCK, device=device)[:37]
        k_ref, v_ref = kc.clone(), vc.clone()
        k.store_kv(new_k, new_v, kc, vc, slots)
        k.store_kv_ref(new_k, new_v, k_ref, v_ref, slots)
        record("store_kv", dtype, torch.stack([kc, vc]), torch.stack([k_ref, v_ref]))
        x, res = torch.randn(2, 33, 4096, dtype=dtype, device=device).unbind(0)
        w = torch.randn(4096, dtype=dtype, device=device)
        record("rms_norm", dtype, torch.stack(k.rms(x, w, 1e-5, res)), torch.stack(k.rms_ref(x, w, 1e-5, res)))
        for head_dim in (64, 80, 128):
            qkv, cos, sin = rotary_inputs(33, head_dim, dtype, device)
            got, want = qkv.clone(), qkv.clone()
            k.rotary(got[:, : (HQ + HKV) * head_dim].view(33, HQ + HKV, head_dim), cos, sin)
            k.rotary_ref(want[:, : (HQ + HKV) * head_dim].view(33, HQ + HKV, head_dim), cos, sin)
            record(f"rotary hd{head_dim}", dtype, got, want)
        for m in (1, 33):
            x = torch.randn(m, 4096, dtype=dtype, device=device)
            w8 = torch.randint(-127, 128, (1024, 4096), dtype=torch.int8, device=device)
            s8 = torch.rand(1024, dtype=dtype, device=device) * 0.01
            record(f"int8_matmul m{m}", dtype, k.int8(x, w8, s8), k.int8_ref(x, w8, s8))
            qw = k.pack_int4(torch.randint(0, 16, (4096, 1024), device=device))
            s4 = torch.rand(32, 1024, dtype=dtype, device=device) * 0.01
            z4 = torch.rand(32, 1024, dtype=dtype, device=device) * 15
            record(f"int4_matmul m{m}", dtype, k.int4(x, qw, s4, z4, 128), k.int4_ref(x, qw, s4, z4, 128))
    return checks


def rotary_inputs(num_tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """A fused qkv row per token (q, k, v heads of the Llama-3-8B shape) and cos / sign-folded sin rows."""
    qkv = torch.randn(num_tokens, (HQ + 2 * HKV) * head_dim, dtype=dtype, device=device)
    angles = torch.rand(num_tokens, head_dim // 2, device=device) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(dtype)
    return qkv, cos, sin


def bench_prefill(k, b: Bench, seqs: list[int]) -> list[dict]:
    rows = []
    for seq in seqs:
        kc, vc = paged_cache(-(-seq // BLOCK), torch.bfloat16, b.device)
        tables = block_tables_for([seq], kc.shape[0], b.device)
        seq_lens = torch.tensor([seq], dtype=torch.int32, device=b.device)
        cu = torch.tensor([0, seq], dtype=torch.int32, device=b.device)
        q = torch.randn(seq, HQ, HD, dtype=torch.bfloat16, device=b.device)
        out = torch.empty_like(q)
        ours = b.time_s(partial(k.varlen, q, kc, vc, cu, seq_lens, tables, HD**-0.5, out=out))
        # SDPA on dense [1, heads, seq, hd] tensors (what the paged kernel reads, gathered in advance).
        dense_k = kc[tables[0].long()].reshape(-1, HKV, HD)[:seq].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        dense_v = vc[tables[0].long()].reshape(-1, HKV, HD)[:seq].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        qs, ks, vs = q.transpose(0, 1)[None].contiguous(), dense_k[None].contiguous(), dense_v[None].contiguous()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        base = b.time_s(partial(sdpa, qs, ks, vs, is_causal=True))
        flops = 2 * 2 * HQ * HD * seq * seq / 2  # QK^T and PV, causal half
        rows.append(
            {
                "bench": "flash prefill vs SDPA",
                "shape": f"seq {seq} hd{HD} {HQ}/{HKV} heads bf16",
                "ours": f"{flops / ours / 1e12:.1f} TFLOP/s",
                "baseline": f"{flops / base / 1e12:.1f} TFLOP/s",
                "ratio": base / ours,
                "target": 0.9,
            }
        )
    return rows


def bench_decode(k, b: Bench, batches: list[int], contexts: list[int], copy_bw: float) -> list[dict]:
    rows = []
    max_blocks = max(batches) * max(contexts) // BLOCK
    kc, vc = paged_cache(max_blocks, torch.bfloat16, b.device)
    for batch in batches:
        for ctx in contexts:
            tables = block_tables_for([ctx] * batch, max_blocks, b.device)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=b.device)
            q = torch.randn(batch, HQ, HD, dtype=torch.bfloat16, device=b.device)
            out = torch.empty_like(q)
            t = b.time_s(partial(k.decode, q, kc, vc, tables, seq_lens, HD**-0.5, out=out))
            kv_bytes = 2 * batch * ctx * HKV * HD * kc.element_size()
            frac = kv_bytes / t / copy_bw
            target = 0.7 if (batch, ctx) == (64, 4096) else None
            rows.append(
                {
                    "bench": "paged decode vs copy bandwidth",
                    "shape": f"batch {batch} ctx {ctx} bf16",
                    "ours": f"{kv_bytes / t / 1e9:.0f} GB/s ({t * 1e6:.0f} us)",
                    "baseline": f"{copy_bw / 1e9:.0f} GB/s copy",
                    "ratio": frac,
                    "target": target,
                }
            )
    return rows


def bench_matmul(k, b: Bench, ms: list[int], shapes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for kdim, n in shapes:
        w = torch.randn(kdim, n, dtype=torch.bfloat16, device=b.device)
        w8 = torch.randint(-127, 128, (n, kdim), dtype=torch.int8, device=b.device)
        s8 = torch.rand(n, dtype=torch.bfloat16, device=b.device) * 0.01
        qw = k.pack_int4(torch.randint(0, 16, (kdim, n), device=b.device))
        s4 = torch.rand(kdim // 128, n, dtype=torch.bfloat16, device=b.device) * 0.01
        z4 = torch.rand(kdim // 128, n, dtype=torch.bfloat16, device=b.device) * 15
        for m in ms:
            x = torch.randn(m, kdim, dtype=torch.bfloat16, device=b.device)
            base = b.time_s(partial(torch.matmul, x, w))
            for name, fn in (("int8", partial(k.int8, x, w8, s8)), ("int4", partial(k.int4, x, qw, s4, z4, 128))):
                t = b.time_s(fn)
                rows.append(
                    {
                        "bench": f"{name} matmul vs bf16",
                        "shape": f"M {m} K {kdim} N {n}",
                        "ours": f"{t * 1e6:.1f} us",
                        "baseline": f"{base * 1e6:.1f} us",
                        "ratio": base / t,
                        "target": 2.5 if (name, m) == ("int4", 1) else None,
                    }
                )
    return rows


def bench_rms_norm(k, b: Bench, tokens: list[int]) -> list[dict]:
    rows = []
    for num_tokens in tokens:
        x, res = torch.randn(2, num_tokens, 4096, dtype=torch.bfloat16, device=b.device).unbind(0)
        w = torch.randn(4096, dtype=torch.bfloat16, device=b.device)
        t = b.time_s(partial(k.rms, x, w, 1e-5, res))
        base = b.time_s(partial(k.rms_ref, x, w, 1e-5, res))
        rows.append(
            {
                "bench": "fused add+RMSNorm vs torch",
                "shape": f"{num_tokens} x 4096 bf16",
                "ours": f"{t * 1e6:.1f} us",
                "baseline": f"{base * 1e6:.1f} us",
                "ratio": base / t,
                "target": None,
            }
        )
    return rows


def torch_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk.copy_(qk * cos + rotated * sin)


def bench_rotary(k, b: Bench, tokens: list[int]) -> list[dict]:
    """One in-place launch for q and k vs the torch form it replaces (neg, cat, two multiplies, add, copy back)."""
    rows = []
    for num_tokens in tokens:
        qkv, cos, sin = rotary_inputs(num_tokens, HD, torch.bfloat16, b.device)
        qk = qkv[:, : (HQ + HKV) * HD].view(num_tokens, HQ + HKV, HD)
        unsigned = torch.cat((sin[:, HD // 2 :], sin[:, HD // 2 :]), dim=-1)  # Hugging Face's sin table
        t = b.time_s(partial(k.rotary, qk, cos, sin))
        base = b.time_s(partial(torch_rotary, qk, cos.unsqueeze(1), unsigned.unsqueeze(1)))
        rows.append(
            {
                "bench": "fused rotary vs torch",
                "shape": f"{num_tokens} tokens {HQ}+{HKV} heads hd{HD} bf16",
                "ours": f"{t * 1e6:.1f} us",
                "baseline": f"{base * 1e6:.1f} us",
                "ratio": base / t,
                "target": None,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    header = ("bench", "shape", "ours", "baseline", "ratio", "target")
    cells = [header] + [
        (
            r["bench"],
            r["shape"],
            r["ours"],
            r["baseline"],
            f"{r['ratio']:.2f}",
            "" if r["target"] is None else f">= {r['target']} {'MET' if r['ratio'] >= r['target'] else 'MISSED'}",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    for index, c in enumerate(cells):
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter) to test the script")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_kernels.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("bench/gpu_kernels.py: no CUDA device here; nothing to measure (use --smoke to exercise the script).")
        return 0
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules decorate their kernels
    k = load_kernels()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    started = time.perf_counter()
    checks = check_all(k, device, args.smoke)
    failed = [c for c in checks if not c["ok"]]
    for c in failed:
        print(f"CHECK FAILED: {c['kernel']} {c['dtype']}: max relative error {c['max_rel_err']:.3g}")
    print(f"correctness: {len(checks) - len(failed)}/{len(checks)} kernel checks passed")
    b = Bench(device, reps=3 if args.smoke else 30)
    copy_bw = b.copy_bandwidth(1 << 20 if args.smoke else 2 << 30)
    if args.smoke:
        rows = bench_prefill(k, b, [64]) + bench_decode(k, b, [2], [128], copy_bw)
        rows += bench_matmul(k, b, [1], [(256, 128)]) + bench_rms_norm(k, b, [4]) + bench_rotary(k, b, [4])
    else:
        rows = bench_prefill(k, b, [512, 1024, 2048, 4096, 8192])
        rows += bench_decode(k, b, [1, 8, 64, 256], [1024, 4096, 16384, 32768], copy_bw)
        rows += bench_matmul(k, b, [1, 16, 64], [(4096, 4096), (4096, 14336), (14336, 4096)])
        rows += bench_rms_norm(k, b, [1, 64, 4096]) + bench_rotary(k, b, [1, 64, 4096])
    print_table(rows)
    elapsed = time.perf_counter() - started
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; total {elapsed:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": k.triton_version,
        "smoke": args.smoke,
        "copy_bandwidth_gbps": copy_bw / 1e9,
        "checks": checks,
        "rows": rows,
        "seconds": elapsed,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 1 if failed else 0


def load_kernels() -> argparse.Namespace:
    """The launchers and references, imported only after TRITON_INTERPRET is settled."""
    import triton

    from tidepool.kernels import flash_attention_varlen as fv
    from tidepool.kernels import int4_matmul as i4
    from tidepool.kernels import int8_matmul as i8
    from tidepool.kernels import paged_attention_decode as pd
    from tidepool.kernels import rms_norm as rn
    from tidepool.kernels import rotary as ro
    from tidepool.kernels import store_kv as sk
    from tidepool.kernels.int4_packing import pack_int4

    return argparse.Namespace(
        decode=pd.paged_attention_decode,
        decode_ref=pd.paged_attention_decode_ref,
        varlen=fv.flash_attention_varlen,
        varlen_ref=fv.flash_attention_varlen_ref,
        store_kv=sk.store_kv,
        store_kv_ref=sk.store_kv_ref,
        rms=rn.rms_norm,
        rms_ref=rn.rms_norm_ref,
        rotary=ro.rotary_,
        rotary_ref=ro.rotary_ref,
        int8=i8.int8_matmul,
        int8_ref=i8.int8_matmul_ref,
        int4=i4.int4_matmul,
        int4_ref=i4.int4_matmul_ref,
        pack_int4=pack_int4,
        triton_version=triton.__version__,
    )


if __name__ == "__main__":
    sys.exit(main())
