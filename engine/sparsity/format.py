"""The tidepool-2:4 checkpoint layout: pack, unpack, validate, and the config keys (the one source of truth).

Role: the only module that knows how a 2:4-sparse projection is stored. `tidepool sparsify` writes with
it (`pack_2to4`, `sparsity_config`); the engine's loader reads with it (`validate`, `unpack_2to4`,
`read_sparsity_config`); the quality bench and the exactness tests densify with it.

Layout (config.json key ``sparsity_config``; for every pruned projection ``P`` with dense weight
``W [out, in]``, ``in % 4 == 0``, the folder holds instead of ``P.weight``):
- ``P.values`` ``[out, in // 2]``: the 2 kept values of each group of 4 consecutive input columns, in
  increasing column order (group g holds ``values[:, 2g]``, ``values[:, 2g + 1]``); dtype values_dtype.
- ``P.meta`` ``[out, ceil(in / 8)]`` uint8: group g's in-group indices ``i0 < i1`` as the nibble
  ``i0 | i1 << 2``, in byte ``g // 2`` (low nibble for even g, high for odd g; an unused last high
  nibble is 0). A group whose kept values are zero still names two distinct indices.
- values_dtype int8: also ``P.scales`` ``[out]`` float32, ``W ≈ values * scales[:, None]`` (the
  convention of ``engine/quant/quantize.quantize_int8``).
Every other tensor stays dense under its usual name.

Invariants: every error names the tensor (``P.values``, ``P.meta``, ``P.scales`` or the dense
``P.weight``); `unpack_2to4` validates before it scatters, so corrupt metadata never densifies silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

CONFIG_KEY = "sparsity_config"
FORMAT = "tidepool-2:4"
VERSION = 1
KEY_FORMAT = "format"
KEY_VERSION = "version"
KEY_METHOD = "method"
KEY_VALUES_DTYPE = "values_dtype"
KEY_TARGETS = "targets"
KEY_CALIBRATION = "calibration"
METHODS = ("wanda", "sparsegpt", "magnitude")
VALUES_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VALUES_SUFFIX = ".values"
META_SUFFIX = ".meta"
SCALES_SUFFIX = ".scales"
GROUP = 4  # input columns per group
KEPT = 2  # kept values per group


@dataclass(frozen=True, slots=True)
class SparsityConfig:
    """A checkpoint's ``sparsity_config``, checked."""

    method: str
    values_dtype: str
    targets: tuple[str, ...] = TARGETS
    calibration: dict[str, Any] = field(default_factory=dict)

    @property
    def torch_values_dtype(self) -> torch.dtype:
        return VALUES_DTYPES[self.values_dtype]


def sparsity_config(
    method: str, values_dtype: str, calibration: dict[str, Any] | None = None, targets: tuple[str, ...] = TARGETS
) -> dict[str, Any]:
    """The ``sparsity_config`` dict `tidepool sparsify` writes into config.json."""
    config = {
        KEY_FORMAT: FORMAT,
        KEY_VERSION: VERSION,
        KEY_METHOD: method,
        KEY_VALUES_DTYPE: values_dtype,
        KEY_TARGETS: list(targets),
        KEY_CALIBRATION: dict(calibration or {}),
    }
    read_sparsity_config({CONFIG_KEY: config})  # one set of rules for writing and reading
    return config


def read_sparsity_config(config: dict[str, Any], source: str = "config.json") -> SparsityConfig | None:
    """The checked ``sparsity_config`` of a parsed config.json, or None for a dense checkpoint."""
    raw = config.get(CONFIG_KEY)
    if raw is None:
        return None
    where = f"{source}: {CONFIG_KEY}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
    if raw.get(KEY_FORMAT) != FORMAT or raw.get(KEY_VERSION) != VERSION:
        raise ValueError(
            f"{where} has format {raw.get(KEY_FORMAT)!r} version {raw.get(KEY_VERSION)!r}; "
            f"supported: {FORMAT!r} version {VERSION}"
        )
    method, values_dtype = raw.get(KEY_METHOD), raw.get(KEY_VALUES_DTYPE)
    if method not in METHODS:
        raise ValueError(f"{where}.{KEY_METHOD} is {method!r}; valid: {', '.join(METHODS)}")
    if values_dtype not in VALUES_DTYPES:
        raise ValueError(f"{where}.{KEY_VALUES_DTYPE} is {values_dtype!r}; valid: {', '.join(VALUES_DTYPES)}")
    targets = raw.get(KEY_TARGETS, list(TARGETS))
    if not isinstance(targets, list) or not targets or any(t not in TARGETS for t in targets):
        raise ValueError(f"{where}.{KEY_TARGETS} is {targets!r}; each must be one of {', '.join(TARGETS)}")
    calibration = raw.get(KEY_CALIBRATION, {})
    if not isinstance(calibration, dict):
        raise ValueError(f"{where}.{KEY_CALIBRATION} must be an object, got {type(calibration).__name__}")
    return SparsityConfig(method, values_dtype, tuple(targets), calibration)


def check_divisible(name: str, in_features: int) -> None:
    """Raises ValueError naming `name` unless its `in_features` splits into groups of 4."""
    if in_features <= 0 or in_features % GROUP:
        raise ValueError(
            f"{name} has {in_features} input features, not a multiple of {GROUP}: 2:4 sparsity keeps 2 of "
            f"every {GROUP} consecutive inputs, so this tensor cannot be pruned 2:4"
        )


def kept_indices(dense: torch.Tensor, mask: torch.Tensor | None = None, name: str = "weight") -> torch.Tensor:
    """int64 ``[out, in // 4, 2]``: each group's two kept in-group indices, increasing.

    From `mask` (bool, True = kept, exactly 2 per group) when given, else from the nonzeros of `dense`
    (at most 2 per group; a group with fewer is filled with its lowest zero positions).
    """
    out, in_features = dense.shape
    groups = in_features // GROUP
    keep = (dense != 0) if mask is None else mask.to(torch.bool)
    if tuple(keep.shape) != (out, in_features):
        raise ValueError(f"{name}: mask shape {tuple(keep.shape)} does not match the weight {(out, in_features)}")
    counts = keep.view(out, groups, GROUP).sum(-1)
    bad = (counts != KEPT) if mask is not None else (counts > KEPT)
    if bool(bad.any()):
        row, group = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} is not 2:4 sparse: row {row}, columns {GROUP * group}..{GROUP * group + 3} keep "
            f"{int(counts[row, group])} values (2 expected)"
        )
    position = torch.arange(GROUP - 1, -1, -1, device=dense.device)  # earlier columns win ties
    score = keep.view(out, groups, GROUP).to(torch.int64) * GROUP + position
    return score.topk(KEPT, dim=-1).indices.sort(dim=-1).values


def pack_2to4(
    dense: torch.Tensor, mask: torch.Tensor | None = None, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2:4-sparse ``dense [out, in]`` -> (``values [out, in // 2]`` its dtype, ``meta [out, ceil(in / 8)]`` uint8)."""
    if dense.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out, in], got shape {tuple(dense.shape)}")
    out, in_features = dense.shape
    check_divisible(name, in_features)
    idx = kept_indices(dense, mask, name)
    groups = in_features // GROUP
    values = dense.view(out, groups, GROUP).gather(-1, idx).reshape(out, groups * KEPT).contiguous()
    nibbles = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.uint8)
    if groups % 2:
        nibbles = torch.cat([nibbles, torch.zeros(out, 1, dtype=torch.uint8, device=dense.device)], dim=1)
    meta = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()
    return values, meta


def meta_indices(meta: torch.Tensor, groups: int) -> torch.Tensor:
    """uint8 ``meta [out, ceil(groups / 2)]`` -> int64 ``[out, groups, 2]`` in-group indices (unchecked)."""
    m = meta.to(torch.int64)
    nibbles = torch.stack([m & 0xF, m >> 4], dim=-1).reshape(m.shape[0], -1)[:, :groups]
    return torch.stack([nibbles & 0x3, nibbles >> 2], dim=-1)


def kept_mask(meta: torch.Tensor, in_features: int) -> torch.Tensor:
    """bool ``[out, in]``: True at the positions `meta` names as kept (unchecked; `validate` first)."""
    groups = in_features // GROUP
    mask = torch.zeros(meta.shape[0], groups, GROUP, dtype=torch.bool, device=meta.device)
    return mask.scatter_(-1, meta_indices(meta, groups), True).reshape(meta.shape[0], in_features)


def validate(
    name: str,
    values: torch.Tensor,
    meta: torch.Tensor,
    in_features: int | None = None,
    scales: torch.Tensor | None = None,
) -> None:
    """Raises ValueError naming the tensor unless `values`/`meta`/`scales` of projection `name` are well formed.

    Checks: 2-D shapes that agree (``values [out, in // 2]``, ``meta [out, ceil(in / 8)]`` uint8,
    ``scales [out]`` float32 exactly when values are int8), ``in % 4 == 0``, each group's indices distinct
    and increasing, and the unused high nibble of an odd group count zero.
    """
    if values.dim() != 2:
        raise ValueError(f"{name}{VALUES_SUFFIX} must be 2-D [out, in // 2], got shape {tuple(values.shape)}")
    out, half = values.shape
    in_features = 2 * half if in_features is None else in_features
    check_divisible(f"{name}{VALUES_SUFFIX}", in_features)
    if half * 2 != in_features:
        raise ValueError(
            f"{name}{VALUES_SUFFIX} has shape {tuple(values.shape)}, expected ({out}, {in_features // 2}) "
            f"for {in_features} input features"
        )
    groups = in_features // GROUP
    expected_meta = (out, -(-groups // 2))
    if meta.dtype != torch.uint8 or tuple(meta.shape) != expected_meta:
        raise ValueError(
            f"{name}{META_SUFFIX} is {meta.dtype} {tuple(meta.shape)}, expected uint8 {expected_meta} "
            f"to match {name}{VALUES_SUFFIX} {tuple(values.shape)}"
        )
    _check_indices(name, meta, groups)
    _check_scales(name, values, scales, out)


def _check_indices(name: str, meta: torch.Tensor, groups: int) -> None:
    idx = meta_indices(meta, groups)
    bad = idx[..., 0] >= idx[..., 1]
    if bool(bad.any()):
        row, group = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}{META_SUFFIX}: row {row}, group {group} names indices {idx[row, group].tolist()}; "
            f"the two kept indices of a group must be distinct and increasing"
        )
    if groups % 2 and bool((meta[:, -1] >> 4).any()):
        row = int((meta[:, -1] >> 4).nonzero()[0])
        raise ValueError(f"{name}{META_SUFFIX}: row {row} has a nonzero unused high nibble in its last byte")


def _check_scales(name: str, values: torch.Tensor, scales: torch.Tensor | None, out: int) -> None:
    if values.dtype == torch.int8:
        if scales is None:
            raise ValueError(f"{name}{SCALES_SUFFIX} is missing: int8 {name}{VALUES_SUFFIX} need per-channel scales")
        if scales.dtype != torch.float32 or tuple(scales.shape) != (out,):
            raise ValueError(
                f"{name}{SCALES_SUFFIX} is {scales.dtype} {tuple(scales.shape)}, expected float32 ({out},)"
            )
    elif scales is not None:
        raise ValueError(f"{name}{SCALES_SUFFIX} is present but {name}{VALUES_SUFFIX} are {values.dtype}, not int8")
    elif not values.dtype.is_floating_point:
        raise ValueError(f"{name}{VALUES_SUFFIX} has dtype {values.dtype}; valid: {', '.join(VALUES_DTYPES)}")


def unpack_2to4(
    values: torch.Tensor,
    meta: torch.Tensor,
    in_features: int,
    scales: torch.Tensor | None = None,
    name: str = "weight",
) -> torch.Tensor:
    """The dense ``[out, in]`` weight: values' dtype, or float32 ``values * scales`` for int8 values."""
    validate(name, values, meta, in_features, scales)
    out = values.shape[0]
    groups = in_features // GROUP
    kept = values.float() * scales[:, None] if scales is not None else values
    dense = torch.zeros(out, groups, GROUP, dtype=kept.dtype, device=values.device)
    dense.scatter_(-1, meta_indices(meta, groups).to(values.device), kept.reshape(out, groups, KEPT))
    return dense.reshape(out, in_features)


def sparse_names(prefix: str) -> tuple[str, str, str]:
    """The tensor names of projection `prefix` (``model.layers.0.self_attn.q_proj``): values, meta, scales."""
    return prefix + VALUES_SUFFIX, prefix + META_SUFFIX, prefix + SCALES_SUFFIX


def densify_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A sparse checkpoint's tensors with every ``P.values``/``P.meta`` (``P.scales``) replaced by a dense ``P.weight``.

    A ``P.values`` without ``P.meta`` (or the reverse) raises ValueError naming the missing tensor.
    """
    dense: dict[str, torch.Tensor] = {}
    prefixes = {n[: -len(s)] for n in tensors for s in (VALUES_SUFFIX, META_SUFFIX) if n.endswith(s)}
    for name, tensor in tensors.items():
        if not any(name.startswith(p + ".") and name[len(p) :] in _SPARSE_SUFFIXES for p in prefixes):
            dense[name] = tensor
    for prefix in sorted(prefixes):
        values_name, meta_name, scales_name = sparse_names(prefix)
        for needed in (values_name, meta_name):
            if needed not in tensors:
                raise ValueError(f"{needed} is missing from the checkpoint (its pair is present)")
        values = tensors[values_name]
        dense[prefix + ".weight"] = unpack_2to4(
            values, tensors[meta_name], 2 * values.shape[-1], tensors.get(scales_name), prefix
        )
    return dense


_SPARSE_SUFFIXES = (VALUES_SUFFIX, META_SUFFIX, SCALES_SUFFIX)
