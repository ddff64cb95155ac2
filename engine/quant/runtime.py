"""Runtime quantized weights: drop-in replacements for a built model's dense linear weights.

Role: the "swap" half of quantization. The Llama code computes every projection as
``F.linear(x, self.<name>_weight, bias)`` on a parameter; `swap_weight` replaces that parameter
with a small module that holds the quantized tensors as buffers and implements
``__torch_function__`` for ``F.linear`` only, routing it to ``tidepool.kernels.dispatch``
(`int8_linear` / `int4_linear`: Triton on CUDA, torch elsewhere); on CPU an int4 weight goes to the
compiled op (`engine/cpu_ops/int4_gemv.py`) where it is available: `prepare_for_cpu` (the model runner
calls it once, at load) re-lays its buffers in that op's tiles; an int8 weight goes to the compiled
GEMV (`engine/cpu_ops/gemv.py`, float32 scales) where that takes the call. The model file is untouched.

Invariants:
- A quantized weight answers ``F.linear`` and nothing else (any other torch op raises TypeError
  naming it), so a code path that would silently read a dense weight fails loudly instead.
- Buffers move with ``model.to(device)`` and count in `weight_bytes`.
- A tiled int4 weight (``tiled``) holds its buffers in the CPU op's layout, not `int4_packing`'s, and
  refuses to run anywhere but on the CPU with that op; tiling happens only on a CPU model.
- A fused projection (q/k/v, gate/up) whose parts share one input permutation (or none) is one
  `Int4Weight` concatenated along N; parts with different act-order permutations stay separate
  inside a `ConcatWeight` (their outputs are concatenated). Group boundaries run along K, so
  concatenating along N never splits a group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.dispatch import int4_linear, int8_linear
from ...kernels.int4_packing import check_int4_shapes, offset_args
from .. import cpu_ops
from ..cpu_ops.int4_gemv import Int4Tiles, tile_weight
from .formats import Int4Parts


class QuantizedWeight(nn.Module):
    """Base: a weight that ``F.linear`` can take in place of a dense ``[N, K]`` tensor."""

    out_features: int
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement linear")  # every subclass does

    def prepare_for_cpu(self) -> bool:
        """Lay the buffers out for the compiled CPU ops where they are available; whether it is ready for them."""
        return False

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], QuantizedWeight):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return args[1].linear(args[0], bias)
        raise TypeError(
            f"{cls.__name__} only supports F.linear(x, weight, bias); got {getattr(func, '__name__', func)}"
        )


class Int8Weight(QuantizedWeight):
    """Per-output-channel int8: ``W[n, k] = w_int8[n, k] * scales[n]``."""

    def __init__(self, w_int8: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        if w_int8.dtype != torch.int8 or w_int8.dim() != 2 or tuple(scales.shape) != (w_int8.shape[0],):
            raise ValueError(
                f"int8 weight must be int8 [N, K] with scales [N]; got {w_int8.dtype} {tuple(w_int8.shape)}, "
                f"scales {tuple(scales.shape)}"
            )
        self.out_features, self.in_features = w_int8.shape
        self.register_buffer("w_int8", w_int8)
        self.register_buffer("scales", scales)

    def prepare_for_cpu(self) -> bool:
        """Float32 scales (a file's may be float16), which the compiled CPU GEMV and the one-call decode step read,
        when that GEMV is available here; returns whether the weight is ready for them."""
        if cpu_ops.gemv_op() is None or self.w_int8.device.type != "cpu" or not self.w_int8.is_contiguous():
            return False
        if self.scales.dtype != torch.float32 or not self.scales.is_contiguous():
            self.scales = self.scales.to(torch.float32).contiguous()  # [N]: exact widening, tiny
        return True

    def cpu_int8(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(w_int8, scales)`` as the one-call decode step reads them, or None where it cannot."""
        ready = self.w_int8.device.type == "cpu" and self.w_int8.is_contiguous() and self.scales.dtype == torch.float32
        return (self.w_int8, self.scales) if ready and self.scales.is_contiguous() else None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        op = cpu_ops.gemv_op() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        y = None if op is None else op.int8(x.reshape(-1, self.in_features), self.w_int8, self.scales)
        if y is None:
            return int8_linear(x, self.w_int8, self.scales, bias)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias


class Int4Weight(QuantizedWeight):
    """Group-wise int4 in the `int4_packing` layout, with an optional act-order input permutation."""

    def __init__(self, parts: Int4Parts) -> None:
        super().__init__()
        offset, _ = offset_args(parts.zeros, parts.mins)
        self.in_features = check_int4_shapes(parts.qweight, parts.scales, offset, parts.group_size)
        self.out_features = parts.qweight.shape[1]
        self.group_size = parts.group_size
        self.register_buffer("qweight", parts.qweight)
        self.register_buffer("scales", parts.scales)
        self.register_buffer("zeros", parts.zeros)
        self.register_buffer("mins", parts.mins)
        self.register_buffer("perm", parts.perm)
        self.tiled = False  # True once `prepare_for_cpu` re-laid the buffers for the compiled CPU op

    def prepare_for_cpu(self) -> bool:
        """Re-lay the buffers in the compiled CPU op's tiles (`cpu_ops.int4_gemv.tile_weight`), in place of the
        [K/8, N] layout, when that op is available here and reads these scales; returns whether it did."""
        op = cpu_ops.int4_op()
        if self.tiled or op is None or not op.takes_scales(self.scales.dtype) or self.qweight.device.type != "cpu":
            return self.tiled
        tiles = tile_weight(self.qweight, self.scales, self.zeros, self.group_size, self.mins)
        self.qweight, self.scales = tiles.qweight, tiles.scales
        if tiles.mins:
            self.mins = tiles.offset
        else:
            self.zeros = tiles.offset
        self.tiled = True
        return True

    def cpu_tiles(self) -> Int4Tiles | None:
        """The tiled buffers as the compiled CPU ops take them (the one-call decode step reads them), or None
        when not tiled or when an act-order permutation must first reorder the input."""
        return self._tiles() if self.tiled and self.perm is None else None

    def _tiles(self) -> Int4Tiles:
        offset, is_min = (self.mins, True) if self.mins is not None else (self.zeros, False)
        n, k = self.out_features, self.in_features
        return Int4Tiles(self.qweight, self.scales, offset, is_min, n, k, self.group_size)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if not self.tiled:
            return int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size, bias, mins=self.mins)
        op = cpu_ops.int4_op()
        if op is None or x.device.type != "cpu":
            raise RuntimeError("this int4 weight was tiled for the compiled CPU op and runs on the CPU only")
        y = op(x.reshape(-1, self.in_features), self._tiles()).to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias


class ConcatWeight(QuantizedWeight):
    """Several quantized weights side by side along N (fused parts that cannot share one layout)."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.cat([part.linear(x, None) for part in self.parts], dim=-1)
        return y if bias is None else y + bias


def fuse_int4(parts: list[Int4Parts]) -> QuantizedWeight:
    """One module for the parts of a fused projection, concatenated along N in the given order."""
    first = parts[0]
    if any(p.group_size != first.group_size for p in parts):
        raise ValueError("fused projection parts have different group sizes")
    same_perm = all(
        (p.perm is None and first.perm is None)
        or (p.perm is not None and first.perm is not None and torch.equal(p.perm, first.perm))
        for p in parts
    )
    # One offset form and one scale dtype for all parts, else they cannot share one buffer each.
    same_offsets = all((p.mins is None) == (first.mins is None) for p in parts)
    same_dtype = all(p.scales.dtype == first.scales.dtype for p in parts)
    if not (same_perm and same_offsets and same_dtype):
        return ConcatWeight([Int4Weight(p) for p in parts])

    zeros = [p.zeros for p in parts if p.zeros is not None]
    mins = [p.mins for p in parts if p.mins is not None]
    fused = Int4Parts(
        torch.cat([p.qweight for p in parts], dim=1),
        torch.cat([p.scales for p in parts], dim=1),
        torch.cat(zeros, dim=1) if zeros else None,
        first.group_size,
        first.perm,
        torch.cat(mins, dim=1) if mins else None,
    )
    return Int4Weight(fused)


def fuse_int8(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> Int8Weight:
    """int8 parts ``(w_int8 [N_i, K], scales [N_i])`` stacked along N."""
    return Int8Weight(torch.cat([w for w, _ in parts], dim=0), torch.cat([s for _, s in parts], dim=0))


def prepare_for_cpu(model: nn.Module) -> int:
    """Lay out every quantized weight of a CPU model for the compiled ops (int4: tiles; int8: float32 scales);
    returns how many are ready for them (a ConcatWeight's parts count one by one)."""
    return sum(module.prepare_for_cpu() for module in model.modules() if isinstance(module, QuantizedWeight))


def swap_weight(model: nn.Module, param_name: str, weight: QuantizedWeight) -> None:
    """Replace dense parameter `param_name` (e.g. ``layers.0.self_attn.qkv_weight``) by `weight`."""
    owner_name, _, attr = param_name.rpartition(".")
    owner = model.get_submodule(owner_name)
    dense = owner._parameters.get(attr)
    if dense is None:
        raise ValueError(f"{param_name} is not a dense parameter of the model")
    if tuple(dense.shape) != tuple(weight.shape):
        raise ValueError(f"quantized {param_name} is {tuple(weight.shape)}, the model expects {tuple(dense.shape)}")
    del owner._parameters[attr]
    owner.add_module(attr, weight.to(dense.device))


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (the rotary cos/sin cache excluded)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for name, buffer in model.named_buffers():
        if "rotary" not in name:
            total += buffer.numel() * buffer.element_size()
    return total
