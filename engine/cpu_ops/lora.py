"""Python binding of the compiled multi-LoRA apply (`lora.cpp`): `engine/lora/ops.py`'s CPU path.

`CpuLora(path)` loads a built library with ctypes. `try_apply(y, x, A, B, sub_offsets, slots, ranks)` adds
the LoRA deltas to `y` in place in one call (the layout of `kernels.lora_ref`: tokens grouped by slot, each
present slot's A and B read once, rank columns beyond `ranks[s]` skipped) with torch's intra-op thread count
and the GIL released, and returns True; it returns False (nothing done) for calls it does not take: tensors
not float32 or not on the CPU, A/B/slots/ranks not contiguous, more sub-targets than the library fuses. A
layout that breaks the contract raises ValueError (the reference's checks). A site's fixed tensors (A, B,
ranks) are checked once and remembered by identity; a call then checks its own tensors (y, x, slots) in a
few attribute reads, since the engine makes 4 calls per layer per step.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tidepool.kernels._checks import checked_once
from tidepool.kernels.lora_ref import check_lora_apply

from .build import open_library

_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
MAX_SUB_TARGETS = 8  # lora.cpp's MAX_SUB
MAX_SITES = 4096  # fixed (A, B, ranks) triples remembered; a model has 4 per layer

_check = checked_once(check_lora_apply)


class CpuLora:
    """The loaded op (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = open_library(path, "tp_lora_apply_f32")
        lib.tp_lora_apply_f32.argtypes = (_ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i32)
        self._fn = lib.tp_lora_apply_f32
        self.has_openmp = bool(lib.tp_has_openmp())
        self._sites: dict[tuple[int, int, int, tuple[int, ...]], _Site] = {}

    def try_apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        sub_offsets: tuple[int, ...],
        slots: torch.Tensor,
        ranks: torch.Tensor,
    ) -> bool:
        """`y += delta` (see the module docstring); False when the call does not qualify."""
        site = self._sites.get((id(a), id(b), id(ranks), sub_offsets))
        if site is None or site.a is not a or site.b is not b or site.ranks is not ranks or not site.current():
            site = self._site(y, x, a, b, sub_offsets, slots, ranks)
            if site is None:
                return False
        num_tokens = x.shape[0]
        if not site.takes(y, x, slots, num_tokens):  # the full checks say why, or the kinds do not qualify
            _check(y, x, a, b, sub_offsets, slots, ranks)
            return False
        if num_tokens == 0:
            return True
        code = self._fn(
            site.args, y.data_ptr(), y.stride(0) if num_tokens > 1 else site.out, x.data_ptr(),
            x.stride(0) if num_tokens > 1 else site.width_in, slots.data_ptr(), num_tokens, torch.get_num_threads(),
        )  # fmt: skip
        if code == -2:
            raise ValueError(f"slots must lie in [-1, {a.shape[0]}) (the device slots), got {slots.tolist()}")
        if code != 0:
            raise RuntimeError(f"tp_lora_apply_f32 refused its arguments (code {code})")
        return True

    def _site(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        sub_offsets: tuple[int, ...],
        slots: torch.Tensor,
        ranks: torch.Tensor,
    ) -> _Site | None:
        """Check a site's fixed tensors once (the contract's checks, then the kinds this op takes) and keep them."""
        num_sub, rank = _check(y, x, a, b, sub_offsets, slots, ranks)
        fixed = (a, b, ranks)
        if num_sub > MAX_SUB_TARGETS or not all(t.is_cpu and not t.requires_grad and t.is_contiguous() for t in fixed):
            return None
        if a.dtype != torch.float32:
            return None
        if len(self._sites) >= MAX_SITES:
            self._sites.clear()
        site = _Site(a, b, ranks, sub_offsets, rank)
        self._sites[(id(a), id(b), id(ranks), sub_offsets)] = site
        return site


class _SiteArgs(ctypes.Structure):
    """lora.cpp's TpLoraSite."""

    _fields_ = [
        *((name, _ptr) for name in ("a", "b", "offsets", "ranks")),
        *(
            (name, _i64)
            for name in ("ranks_int64", "ranks_per_sub", "num_sub", "num_slots", "rank_max", "in_features", "out")
        ),
    ]


class _Site:
    """A projection site's fixed tensors (checked once, kept alive so their ids stay theirs) and the struct the
    call passes for them; `takes` checks a call's own tensors (y, x, slots) in a few attribute reads."""

    __slots__ = ("a", "args", "b", "fields", "offsets", "out", "pointers", "ranks", "width_in")

    def __init__(self, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, sub_offsets: tuple[int, ...],
                 rank: int) -> None:  # fmt: skip
        self.a, self.b, self.ranks = a, b, ranks
        self.offsets = (ctypes.c_int64 * len(sub_offsets))(*sub_offsets)
        self.width_in, self.out = a.shape[2], b.shape[1]
        self.pointers = (a.data_ptr(), b.data_ptr(), ranks.data_ptr())
        self.fields = _SiteArgs(
            a.data_ptr(), b.data_ptr(), ctypes.addressof(self.offsets), ranks.data_ptr(), ranks.dtype == torch.int64,
            ranks.dim() == 2, len(sub_offsets) - 1, a.shape[0], rank, self.width_in, self.out,
        )  # fmt: skip
        self.args = ctypes.byref(self.fields)

    def current(self) -> bool:
        """False when a tensor's storage was swapped under the same object (`set_`): the site is rebuilt."""
        return self.pointers == (self.a.data_ptr(), self.b.data_ptr(), self.ranks.data_ptr())

    def takes(self, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, num_tokens: int) -> bool:
        return (
            x.dtype is torch.float32 and y.dtype is torch.float32 and slots.dtype is torch.int32
            and x.is_cpu and y.is_cpu and slots.is_cpu and not y.requires_grad
            and y.shape == (num_tokens, self.out) and x.shape == (num_tokens, self.width_in)
            and slots.shape == (num_tokens,) and slots.is_contiguous()
            and (num_tokens <= 1 or (x.stride(1) == 1 and y.stride(1) == 1))
        )  # fmt: skip
