"""Weight-only quantization of dense weights into Tidepool's runtime layouts (round-to-nearest).

Role: the "convert" half of quantization. `quantize_int8` and `quantize_int4` turn one
``torch.nn.Linear``-style weight ``[N, K]`` into the layouts the dispatch layer computes with
(``tidepool.kernels.dispatch``); `quantize_tensors` does it for every decoder projection of a
Hugging Face state dict, under the checkpoint names `tidepool quantize` writes.

Invariants:
- int8: symmetric, one scale per output channel: ``w_int8 [N, K]`` in -127..127, ``scales [N]``.
- int4: asymmetric, one (scale, zero) per group of ``group_size`` input features and output
  channel (`int4_group_size`: where the size is a default rather than the user's, a projection whose
  inputs it does not divide gets the largest multiple of 8 below it that does), packed with
  `tidepool.kernels.int4_packing.pack_int4`. The zero is a real number (the layout allows it), so
  each group's clipped range maps exactly onto 0..15. Each group's clipping range is searched
  (shrinking min/max by a grid of ratios and keeping the one with the smallest squared
  reconstruction error, as AWQ's clip search and GPTQ-lite do, but on the weights alone: no
  calibration data); this recovers most of plain min/max RTN's loss.
- Quantization math runs in float32; scales/zeros are stored in ``scale_dtype``.
- Only decoder projections are quantized (`is_quantizable`); embeddings, norms, the LM head and
  biases stay as they are, as in published GPTQ/AWQ checkpoints.
"""

from __future__ import annotations

import logging
import re

import torch
from tqdm.auto import tqdm

from ...kernels.int4_packing import PACK_FACTOR, pack_int4

logger = logging.getLogger(__name__)

METHODS = ("int8", "int4")
INT4_MAX = 15
INT8_MAX = 127
DEFAULT_GROUP_SIZE = 128  # int4 at load (folders and GGUF files) and `tidepool quantize` without --group-size
# Shrink ratios tried for each int4 group's [min, max]; 1.0 (plain min/max) is always a candidate.
CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(13))  # 1.0 .. 0.7
_PROGRESS_MIN_TENSORS = 64  # a bar only where quantizing takes long enough to wonder
_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")


def is_quantizable(name: str) -> bool:
    """True for the decoder's linear projection weights (q/k/v/o, gate/up/down)."""
    return _PROJECTION.match(name) is not None


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; valid methods: {', '.join(METHODS)}")


def check_group_size(group_size: int, in_features: int, name: str = "weight") -> None:
    """Raises ValueError unless int4 groups tile `in_features` (and pack into whole int32 rows)."""
    if group_size <= 0 or group_size % PACK_FACTOR:
        raise ValueError(f"group size must be a positive multiple of {PACK_FACTOR}, got {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"group size {group_size} does not divide {name}'s {in_features} input features; "
            f"pick a group size that divides it (e.g. {int4_group_size(in_features, group_size, name)})"
        )


def int4_group_size(in_features: int, at_most: int, name: str = "weight") -> int:
    """The int4 group size of a projection with `in_features` inputs when the asked size is `at_most`.

    `at_most` itself where it divides the inputs, else the largest multiple of 8 below it that does
    (SmolLM2's 576 inputs at 128 -> 96; 1536 -> 128). Quantizing at load and loading a Tidepool int4
    folder both use this rule, so a folder records one group size and each projection's follows from
    its shape. Raises ValueError where no group fits: int4 packs 8 inputs per int32.
    """
    if at_most <= 0 or at_most % PACK_FACTOR:
        raise ValueError(f"group size must be a positive multiple of {PACK_FACTOR}, got {at_most}")
    if in_features <= 0 or in_features % PACK_FACTOR:
        raise ValueError(
            f"{name} has {in_features} input features, not a multiple of {PACK_FACTOR}: int4 packs "
            f"{PACK_FACTOR} inputs per int32, so this model cannot be int4; use int8"
        )
    return next(g for g in range(at_most, 0, -PACK_FACTOR) if in_features % g == 0)


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (``w_int8 [N, K]`` int8, ``scales [N]``) with ``W ≈ w_int8 * scales[:, None]``."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    w = weight.float()
    # An all-zero row would give scale 0 and a 0/0; any positive scale represents it exactly.
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    w_int8 = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return w_int8, scales.to(scale_dtype or weight.dtype)


def quantize_int4(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype | None = None, clip_search: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (``qweight [K // 8, N]`` int32, ``scales``, ``zeros`` ``[K // group_size, N]``)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    check_group_size(group_size, k)
    groups = weight.float().t().reshape(k // group_size, group_size, n)  # [G, g, N]: groups run along K
    w_min = groups.amin(dim=1).clamp(max=0.0)  # keeping 0 representable keeps small weights small
    w_max = groups.amax(dim=1).clamp(min=0.0)
    best_err = torch.full_like(w_min, float("inf"))
    best_scale = torch.ones_like(w_min)
    best_zero = torch.zeros_like(w_min)
    for ratio in CLIP_RATIOS if clip_search else (1.0,):
        lo, hi = w_min * ratio, w_max * ratio
        scale = ((hi - lo) / INT4_MAX).clamp_min(1e-12)
        zero = -lo / scale
        q = torch.round(groups / scale[:, None] + zero[:, None]).clamp_(0, INT4_MAX)
        err = ((q - zero[:, None]) * scale[:, None] - groups).square_().sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    out_dtype = scale_dtype or weight.dtype
    # Round the stored scale/zero first, so the integer codes are chosen for the values actually kept.
    scale_kept, zero_kept = best_scale.to(out_dtype).float(), best_zero.to(out_dtype).float()
    q = torch.round(groups / scale_kept[:, None] + zero_kept[:, None]).clamp_(0, INT4_MAX)
    qweight = pack_int4(q.reshape(k, n).to(torch.uint8))
    return qweight, scale_kept.to(out_dtype), zero_kept.to(out_dtype)


def int4_group_sizes(
    tensors: dict[str, torch.Tensor], names: list[str], group_size: int, adapt_group_size: bool
) -> dict[int, int]:
    """Input width -> int4 group size for the projections `names`, every shape validated before any work.

    `group_size` must divide every projection's inputs, unless `adapt_group_size` (a default size, not the
    user's): then each width gets `int4_group_size`. A projection's size depends on its width alone.
    """
    sizes: dict[int, int] = {}
    for name in names:
        k = tensors[name].shape[1]
        if adapt_group_size:
            sizes[k] = int4_group_size(k, group_size, name)
        else:
            check_group_size(group_size, k, name)
            sizes[k] = group_size
    narrower = {k: size for k, size in sizes.items() if size != group_size}
    if narrower:
        logger.info(
            "int4: groups of %d, narrower where %d does not divide a projection's inputs (%s)",
            group_size,
            group_size,
            ", ".join(f"{k} inputs: {size}" for k, size in sorted(narrower.items())),
        )
    return sizes


def quantize_tensors(
    tensors: dict[str, torch.Tensor],
    method: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    scale_dtype: torch.dtype | None = None,
    *,
    adapt_group_size: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """Quantize every decoder projection of a Hugging Face state dict; other tensors pass through.

    Returns the new state dict and, for int4, the group size used per input width (`int4_group_sizes`;
    empty for int8). A projection ``P.weight`` becomes ``P.qweight`` + ``P.scales`` (int8: ``qweight`` is
    the ``[N, K]`` int8 weight, ``scales`` ``[N]``) or ``P.qweight`` + ``P.scales`` + ``P.zeros`` (int4, in
    the `int4_packing` layout).
    """
    check_method(method)
    names = [name for name in tensors if is_quantizable(name)]
    if not names:
        raise ValueError("no decoder projection weights (model.layers.N.*_proj.weight) to quantize")
    sizes = int4_group_sizes(tensors, names, group_size, adapt_group_size) if method == "int4" else {}
    targets = set(names)
    out = {name: tensor for name, tensor in tensors.items() if name not in targets}
    for name in tqdm(names, desc=f"quantizing to {method}", unit="tensor", disable=len(names) < _PROGRESS_MIN_TENSORS):
        tensor = tensors[name]
        prefix = name.removesuffix(".weight")
        if method == "int8":
            out[f"{prefix}.qweight"], out[f"{prefix}.scales"] = quantize_int8(tensor, scale_dtype)
        else:
            qweight, scales, zeros = quantize_int4(tensor, sizes[tensor.shape[1]], scale_dtype)
            out[f"{prefix}.qweight"], out[f"{prefix}.scales"], out[f"{prefix}.zeros"] = qweight, scales, zeros
    return out, sizes
