"""Layer-by-layer one-shot 2:4 pruning of a transformers Llama-family model (as Wanda and SparseGPT run it).

Role: `prune_model` walks the decoder layers in order. For each layer it runs the calibration hidden
states through it with hooks on the projections' inputs (`calibration.InputStats`), prunes the layer's
seven projections in place (`wanda.py`, `sparsegpt.py`, or by magnitude, which needs no data), then runs
the calibration states through the pruned layer to get the next layer's inputs, so every layer is
calibrated on what the already-pruned layers before it produce.

Invariants: the model is modified in place (pruned weights written into ``Linear.weight``) and the
returned masks (bool, True = kept, exactly 2 per group of 4) are what the checkpoint stores; the
projections that share an input (q/k/v, gate/up) share one set of statistics; no gradients.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .calibration import InputStats
from .sparsegpt import sparsegpt_prune
from .wanda import magnitude_mask, wanda_mask

logger = logging.getLogger(__name__)

# projection (under its layer) -> the projection whose input it shares (the one hooked)
SHARED_INPUT = {
    "self_attn.q_proj": "self_attn.q_proj",
    "self_attn.k_proj": "self_attn.q_proj",
    "self_attn.v_proj": "self_attn.q_proj",
    "self_attn.o_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.gate_proj",
    "mlp.down_proj": "mlp.down_proj",
}
_BATCH = 8  # calibration windows per forward


class _Captured(Exception):
    """Raised by the first layer's pre-hook once its inputs are recorded (the rest of the model is not run)."""


def _first_layer_inputs(model: nn.Module, windows: torch.Tensor) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """(hidden states, keyword arguments) the first decoder layer receives, per batch of windows."""
    layers = model.model.layers
    captured: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append((hidden.detach(), {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        raise _Captured

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for batch in windows.split(_BATCH):
            with contextlib.suppress(_Captured):
                model(input_ids=batch, use_cache=False)
    finally:
        handle.remove()
    return captured


def _run_layer(layer: nn.Module, inputs: list[tuple[torch.Tensor, dict[str, Any]]]) -> list[torch.Tensor]:
    outputs = []
    for hidden, kwargs in inputs:
        out = layer(hidden, **kwargs)
        outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


def _collect_stats(
    layer: nn.Module, inputs: list[tuple[torch.Tensor, dict[str, Any]]], with_hessian: bool
) -> dict[str, InputStats]:
    stats: dict[str, InputStats] = {}
    handles = []
    for hooked in sorted(set(SHARED_INPUT.values())):
        linear = layer.get_submodule(hooked)
        stats[hooked] = InputStats(linear.in_features, with_hessian)

        def hook(
            _: nn.Module, args: tuple[torch.Tensor, ...], __: torch.Tensor, acc: InputStats = stats[hooked]
        ) -> None:
            acc.add(args[0])

        handles.append(linear.register_forward_hook(hook))
    try:
        _run_layer(layer, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return stats


def _pruner(method: str) -> Callable[[torch.Tensor, InputStats | None, str], tuple[torch.Tensor, torch.Tensor]]:
    """(weight, input statistics, tensor name) -> (pruned weight, kept mask) for `method`."""

    def magnitude(w: torch.Tensor, _: InputStats | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        mask = magnitude_mask(w, name)
        return w * mask, mask

    def wanda(w: torch.Tensor, stats: InputStats | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        assert stats is not None
        mask = wanda_mask(w, stats.sq_norms, name)
        return w * mask, mask

    def sparsegpt(w: torch.Tensor, stats: InputStats | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        assert stats is not None
        return sparsegpt_prune(w, stats.hessian, name)

    return {"magnitude": magnitude, "wanda": wanda, "sparsegpt": sparsegpt}[method]


@torch.no_grad()
def prune_model(
    model: nn.Module, method: str, windows: torch.Tensor | None, show_progress: bool = True
) -> dict[str, torch.Tensor]:
    """Prune every decoder projection of `model` 2:4 in place; returns ``{"model.layers.i.<proj>": kept mask}``.

    `windows` ``[num_samples, seq_len]`` calibration token ids (unused, may be None, for magnitude).
    """
    prune = _pruner(method)
    needs_data = method != "magnitude"
    if needs_data and windows is None:
        raise ValueError(f"method {method} needs calibration windows")
    inputs = _first_layer_inputs(model, windows) if needs_data else []
    masks: dict[str, torch.Tensor] = {}
    layers = model.model.layers
    for index in tqdm(range(len(layers)), desc=f"sparsify ({method})", unit="layer", disable=not show_progress):
        layer = layers[index]
        stats = _collect_stats(layer, inputs, method == "sparsegpt") if needs_data else {}
        for proj, hooked in SHARED_INPUT.items():
            linear = layer.get_submodule(proj)
            name = f"model.layers.{index}.{proj}"
            pruned, mask = prune(linear.weight.data, stats.get(hooked), f"{name}.weight")
            linear.weight.data.copy_(pruned.to(linear.weight.dtype))
            masks[name] = mask
        if needs_data:
            outputs = _run_layer(layer, inputs)
            inputs = [(out, kwargs) for out, (_, kwargs) in zip(outputs, inputs, strict=True)]
        logger.debug("pruned layer %d", index)
    return masks
