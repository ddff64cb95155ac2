"""Input checks and launch heuristics shared by the kernel launchers (torch only, no Triton).

Every check raises ValueError naming the argument and what to change. Device properties are
read at call time (cached per device), never at import, so importing a kernel module works
on a machine without a GPU.

Checks read only tensor metadata (shape, strides, dtype, device) and scalar arguments, never
tensor values (that would wait on the device), so a launcher's `_check` gives the same answer
for every call with the same metadata: `checked_once` runs it once per such signature and
replays the result afterwards, which takes the Python validation off the per-launch path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_R = TypeVar("_R")
MAX_CHECKED_SIGNATURES = 4096  # per check function; the cache restarts empty when full


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype, value.device)
    return value


def checked_once(check: Callable[..., _R]) -> Callable[..., _R]:
    """Memoise a metadata-only check on its arguments' signatures (positional arguments only).

    A failing check raises every time (errors are never cached). Arguments that cannot be hashed
    (a list, say) simply run the check.
    """
    cache: dict[tuple[Any, ...], Any] = {}

    @functools.wraps(check)
    def wrapper(*args: Any) -> _R:
        key = tuple(_signature(a) for a in args)
        try:
            return cache[key]
        except KeyError:
            pass
        except TypeError:  # unhashable argument
            return check(*args)
        result = check(*args)
        if len(cache) >= MAX_CHECKED_SIGNATURES:
            cache.clear()
        cache[key] = result
        return result

    wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
    return wrapper


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # one head row must fit a register tile


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def check_dim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_int(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> None:
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {names}, got {t.dtype}")


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate the paged cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    check_dim("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_float("k_cache", k_cache)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache must match k_cache: k {tuple(k_cache.shape)} {k_cache.dtype}, "
            f"v {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must share strides, got {k_cache.stride()} and {v_cache.stride()}")
    check_last_contiguous("k_cache", k_cache)
    head_dim = k_cache.shape[3]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    return tuple(k_cache.shape)  # type: ignore[return-value]


def check_query_heads(q: torch.Tensor, k_cache: torch.Tensor, layout: str) -> int:
    """q `[tokens, num_heads, head_dim]` against the cache; returns the query group size (heads per KV head)."""
    check_dim("q", q, 3, layout)
    check_last_contiguous("q", q)
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the KV cache ({k_cache.dtype}) must have the same dtype")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} differs from the cache's head_dim {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return q.shape[1] // num_kv_heads


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
    q_layout: str,
) -> int:
    """What the paged attention kernels check alike (cache, q against it, block tables, sequence lengths,
    window); returns the query group size. Each launcher adds what is its own (query offsets, splits)."""
    check_kv_cache(k_cache, v_cache)
    group = check_query_heads(q, k_cache, q_layout)
    check_dim("block_tables", block_tables, 2, "[num_seqs, max_blocks]")
    check_int("block_tables", block_tables)
    check_last_contiguous("block_tables", block_tables)
    check_dim("seq_lens", seq_lens, 1, "[num_seqs]")
    check_int("seq_lens", seq_lens)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    check_sliding_window(sliding_window)
    return group


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The caller's output buffer (same shape/dtype as `like`, last dim contiguous) or a new one."""
    if out is None:
        return torch.empty_like(like)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"out must be {tuple(like.shape)} {like.dtype} on {like.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    check_last_contiguous("out", out)
    return out


def check_sliding_window(sliding_window: int | None) -> int:
    """0 means no window in the kernels (a constexpr switch); a window must be positive."""
    if sliding_window is None:
        return 0
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    return sliding_window


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise run through TF32 tensor cores (10-bit mantissa) on GPUs.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=16)
def _num_sms_cuda(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; on CPU (the interpreter) a stand-in sized so that the
    tests' small problems still take the split-K paths."""
    if device.type == "cuda":
        return _num_sms_cuda(device.index if device.index is not None else torch.cuda.current_device())
    return 16


def check_matmul_input(x: torch.Tensor, k: int, device: torch.device) -> None:
    check_float("x", x)
    check_dim("x", x, 2, "[M, K]")
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]} but the weight expects K={k}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but the weight is on {device}")
