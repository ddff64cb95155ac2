"""Loading a tidepool-2:4 checkpoint: its sparse projections made into `SparseWeight`s and swapped in, as quantization.

Role: the bridge between the loading layer and the runtime weights (`weight.py`). `formats.detect_format` names
a folder whose config.json has a ``sparsity_config`` "tidepool-2:4", `open_checkpoint` returns
`loading/sparse_checkpoint.SparseCheckpoint`, and that calls `sparse_weights` here (this module imports nothing
from the loading layer). `sparse_weights` converts the checkpoint's ``P.values``/``P.meta`` (``P.scales``) into
one `SparseWeight` per dense parameter, fused as the model fuses (`quant.load.projection_targets`);
`loader.load_model` then swaps them in (`quant.load.apply_quantized`) and loads every other tensor densely.
`check_sparsity_request` is what ``--sparsity`` / ``LLM(sparsity=...)`` checks before anything loads.

Invariants:
- Every error names the tensor (or the flag): metadata that does not match its values (shape, dtype, indices
  that are not two distinct increasing ones), values whose input width is not the model's or not a multiple
  of 4, a projection whose row count is not the model's, a fused parameter half sparse and half dense.
- A projection the checkpoint keeps dense (not in its targets) stays a dense parameter.
- Kept values that are float16/bfloat16/float32 take the model's dtype; int8 values keep theirs, with float32
  scales (the format's).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from tidepool.contract.serve_flags import FLAGS

from ..config import read_config_json
from ..quant.load import projection_targets
from ..quant.runtime import QuantizedWeight
from .format import FORMAT, META_SUFFIX, SCALES_SUFFIX, VALUES_SUFFIX, SparsityConfig, read_sparsity_config
from .weight import SparseWeight, fuse_sparse

SPARSITY_CHOICES: tuple[str, ...] = FLAGS["sparsity"].choices or ()  # `--sparsity` values (the flag table's)
# --quantization values a 2:4 checkpoint can be served with: int8 when its kept values are int8 (sparse + int8).
_COMBINES = {"int8": "int8"}


def read_folder_sparsity(path: str | Path) -> SparsityConfig | None:
    """The checked ``sparsity_config`` of a model folder's config.json, or None (dense, or not a folder)."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    return read_sparsity_config(read_config_json(folder), str(folder / "config.json"))


def check_sparsity_request(model: str, sparsity: str | None, quantization: str | None) -> None:
    """Raises ValueError naming the flag when ``--sparsity``/``--quantization`` cannot serve `model` as asked:
    2:4 asked of a dense checkpoint (run `tidepool sparsify`), or a quantization a 2:4 checkpoint cannot take."""
    if sparsity is not None and sparsity not in SPARSITY_CHOICES:
        raise ValueError(f"--sparsity {sparsity!r}: expected one of {', '.join(SPARSITY_CHOICES)}")
    found = read_folder_sparsity(model)
    if sparsity is not None and quantization is not None and quantization not in _COMBINES:
        raise ValueError(
            f"--sparsity {sparsity} with --quantization {quantization}: 2:4 sparsity combines only with int8 "
            f"(int8 kept values: `tidepool sparsify --values-dtype int8`), not {quantization}"
        )
    if found is None:
        if sparsity is not None:
            raise ValueError(
                f"--sparsity {sparsity}: {model} is not a 2:4 checkpoint (no {FORMAT!r} sparsity_config in its "
                f"config.json); write one with `tidepool sparsify {model} OUT` and serve OUT"
            )
        return
    if quantization is not None and _COMBINES.get(quantization) != found.values_dtype:
        raise ValueError(
            f"--quantization {quantization}: {model} is a 2:4 checkpoint with {found.values_dtype} kept values; "
            f"2:4 sparsity combines only with int8, from a checkpoint written with int8 kept values "
            "(`tidepool sparsify --values-dtype int8`); drop --quantization to serve this one"
        )


def _part(
    prefix: str, rows: int, in_features: int, read: Callable[[str], torch.Tensor], keys: set[str], dtype: torch.dtype
) -> tuple[SparseWeight, set[str]]:
    values_name, meta_name, scales_name = (prefix + s for s in (VALUES_SUFFIX, META_SUFFIX, SCALES_SUFFIX))
    if meta_name not in keys:
        raise ValueError(f"checkpoint is missing tensor {meta_name} (its {values_name} is present)")
    values, meta = read(values_name), read(meta_name)
    scales = read(scales_name) if scales_name in keys else None
    if values.dim() != 2 or values.shape[0] != rows:
        raise ValueError(
            f"{values_name} has shape {tuple(values.shape)}; the model's {prefix} has {rows} output rows "
            f"(expected ({rows}, {in_features // 2}))"
        )
    if values.dtype.is_floating_point:
        values = values.to(dtype)
    weight = SparseWeight(values, meta, in_features, scales, prefix)  # validates, naming the tensor
    return weight, {values_name, meta_name} | ({scales_name} if scales is not None else set())


def sparse_weights(
    model: nn.Module,
    keys: set[str],
    read: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    show_progress: bool = True,
) -> tuple[dict[str, QuantizedWeight], set[str]]:
    """`(weights, consumed)`: a `SparseWeight` per dense parameter the checkpoint holds 2:4-sparse, and the keys
    they were made from. `keys` are the checkpoint's tensor names, `read` reads one."""
    layout = model.checkpoint_layout()
    params = dict(model.named_parameters())
    consumed: set[str] = set()
    weights: dict[str, QuantizedWeight] = {}
    targets = projection_targets(model)
    for param, prefixes in tqdm(targets.items(), desc="Loading 2:4 weights", disable=not show_progress):
        present = [p for p in prefixes if p + VALUES_SUFFIX in keys]
        if not present:
            continue  # kept dense in the checkpoint
        if len(present) != len(prefixes):
            missing = sorted(set(prefixes) - set(present))
            raise ValueError(f"{', '.join(missing)} not 2:4-sparse while fused partners {', '.join(present)} are")
        in_features = params[param].shape[1]
        parts = []
        for prefix in prefixes:
            weight, used = _part(prefix, layout[prefix + ".weight"][2], in_features, read, keys, dtype)
            parts.append(weight)
            consumed |= used
        weights[param] = fuse_sparse(parts, param)
    if not weights:
        raise ValueError(f"the checkpoint is marked {FORMAT} but holds no sparse projection (*{VALUES_SUFFIX})")
    return weights, consumed
