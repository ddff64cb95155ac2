"""2:4 pruning rules (engine/sparsity: wanda, sparsegpt, calibration, sequential) on small tensors and models."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tidepool.engine.sparsity.calibration import (
    InputStats,
    calibration_topics,
    calibration_windows,
    heldout_topics,
    windows,
)
from tidepool.engine.sparsity.format import TARGETS
from tidepool.engine.sparsity.sequential import SHARED_INPUT, prune_model
from tidepool.engine.sparsity.sparsegpt import sparsegpt_prune
from tidepool.engine.sparsity.wanda import magnitude_mask, two_of_four_mask, wanda_mask


def best_pair(scores: list[float]) -> set[int]:
    """Brute force: the 2 positions of 4 with the largest score sum, earlier positions first among ties."""
    pairs = sorted(itertools.combinations(range(4), 2), key=lambda p: (-(scores[p[0]] + scores[p[1]]), p))
    return set(pairs[0])


@given(
    out=st.integers(1, 5),
    groups=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_two_of_four_keeps_the_best_pair_of_every_group(out: int, groups: int, seed: int, ties: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (out, 4 * groups), generator=gen).float() if ties else torch.rand(out, 4 * groups)
    mask = two_of_four_mask(scores)
    assert mask.dtype == torch.bool and bool((mask.view(out, groups, 4).sum(-1) == 2).all())
    for row, group in itertools.product(range(out), range(groups)):
        kept = {int(i) for i in mask[row, 4 * group : 4 * group + 4].nonzero()}
        assert kept == best_pair(scores[row, 4 * group : 4 * group + 4].tolist())


def test_wanda_weighs_magnitudes_by_input_norms() -> None:
    weight = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert magnitude_mask(weight).tolist() == [[True, True, False, False]]
    assert torch.equal(wanda_mask(weight, torch.ones(4)), magnitude_mask(weight))
    # channel norms 0.1, 0.1, 10, 10: |W|·‖X‖ = 0.4, 0.3, 20, 10
    assert wanda_mask(weight, torch.tensor([0.01, 0.01, 100.0, 100.0])).tolist() == [[False, False, True, True]]
    with pytest.raises(ValueError, match=r"q_proj\.weight: input statistics have shape \(3,\)"):
        wanda_mask(weight, torch.ones(3), "q_proj.weight")
    with pytest.raises(ValueError, match=r"up\.weight has 6 input features, not a multiple of 4"):
        magnitude_mask(torch.ones(2, 6), "up.weight")


def test_input_stats_are_means_over_tokens() -> None:
    x = torch.randn(3, 5, 8)
    stats = InputStats(8, with_hessian=True)
    stats.add(x[:1])
    stats.add(x[1:])
    flat = x.reshape(-1, 8)
    assert torch.allclose(stats.sq_norms, flat.square().mean(0), atol=1e-6)
    assert torch.allclose(stats.hessian, flat.T @ flat / 15, atol=1e-5)
    with pytest.raises(RuntimeError, match="without the Hessian"):
        _ = InputStats(8, with_hessian=False).hessian


def test_sparsegpt_with_uncorrelated_inputs_is_magnitude_pruning() -> None:
    weight = torch.randn(6, 16)
    pruned, mask = sparsegpt_prune(weight, torch.eye(16) * 3.0, block_size=8)
    assert torch.equal(mask, magnitude_mask(weight))
    assert torch.allclose(pruned, weight * mask)


def test_sparsegpt_reconstructs_outputs_better_than_masking_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    mixing = torch.randn(32, 32, generator=gen) * 0.3 + torch.eye(32)
    x = torch.randn(512, 32, generator=gen) @ mixing  # correlated input channels
    weight = torch.randn(24, 32, generator=gen)
    hessian = x.T @ x / x.shape[0]
    pruned, mask = sparsegpt_prune(weight, hessian, block_size=16)
    assert bool((mask.view(24, 8, 4).sum(-1) == 2).all())
    assert bool((pruned[~mask] == 0).all())
    wanda = weight * wanda_mask(weight, x.square().mean(0))
    reference = x @ weight.T
    sparsegpt_error = (x @ pruned.T - reference).square().mean()
    wanda_error = (x @ wanda.T - reference).square().mean()
    assert sparsegpt_error < 0.8 * wanda_error


def test_sparsegpt_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"o\.weight: Hessian has shape \(4, 4\)"):
        sparsegpt_prune(torch.ones(2, 8), torch.eye(4), "o.weight")
    with pytest.raises(ValueError, match="block size must be a multiple of 4"):
        sparsegpt_prune(torch.ones(2, 8), torch.eye(8), block_size=6)


def test_calibration_and_heldout_text_are_disjoint() -> None:
    calibration, heldout = calibration_topics(), heldout_topics()
    assert len(calibration) > 20 and len(heldout) > 20
    calibration_paragraphs = {p.strip() for text in calibration for p in text.split("\n\n") if p.strip()}
    heldout_paragraphs = {p.strip() for text in heldout for p in text.split("\n\n") if p.strip()}
    assert len(heldout_paragraphs) > 200
    assert not calibration_paragraphs & heldout_paragraphs


def test_windows_are_even_and_deterministic() -> None:
    stream = torch.arange(100)
    got = windows(stream, 3, 10)
    assert got[:, 0].tolist() == [0, 45, 90] and torch.equal(got[1], torch.arange(45, 55))
    with pytest.raises(ValueError, match="fewer than one window of 200"):
        windows(stream, 1, 200)


def test_shared_inputs_cover_every_target() -> None:
    assert tuple(name.split(".")[-1] for name in SHARED_INPUT) == TARGETS


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_prune_model_prunes_every_projection_2to4(tiny_model_dir: Path, method: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    calib = calibration_windows(tiny_model_dir, "pydoc", 4, 32)
    masks = prune_model(model, method, calib, show_progress=False)
    assert set(masks) == {f"model.layers.{i}.{p}" for i in range(2) for p in SHARED_INPUT}
    for name, mask in masks.items():
        weight = model.get_submodule(name).weight
        assert bool((mask.view(mask.shape[0], -1, 4).sum(-1) == 2).all())
        assert bool((weight[~mask] == 0).all()), name


def test_wanda_calibrates_each_layer_on_the_pruned_layers_before_it(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    weights = {n: p.detach().clone() for n, p in original.named_parameters()}
    calib = calibration_windows(tiny_model_dir, "pydoc", 4, 32)
    masks = prune_model(original, "wanda", calib, show_progress=False)
    # Inputs of every projection in the finished (all pruned) model: layer i sees only pruned layers < i.
    stats = {name: InputStats(original.get_submodule(name).in_features, False) for name in masks}
    hooks = [
        original.get_submodule(name).register_forward_hook(lambda _, a, __, s=s: s.add(a[0]))
        for name, s in stats.items()
    ]
    with torch.no_grad():
        for batch in calib.split(8):
            original(input_ids=batch, use_cache=False)
    for hook in hooks:
        hook.remove()
    # q/k/v read the layer's input; o/gate/up/down were calibrated (as in both papers) on this layer's
    # still-dense attention, so only q/k/v's inputs are the same in the finished model.
    checked = [name for name in masks if name.endswith(("q_proj", "k_proj", "v_proj"))]
    assert any(name.startswith("model.layers.1.") for name in checked)
    for name in checked:
        assert torch.equal(masks[name], wanda_mask(weights[f"{name}.weight"], stats[name].sq_norms)), name


def test_prune_model_needs_calibration_for_data_methods(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="wanda needs calibration windows"):
        prune_model(model, "wanda", None, show_progress=False)
