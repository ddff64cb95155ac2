"""`checked_once`: a launcher's metadata checks run once per argument signature, errors every time."""

from __future__ import annotations

import pytest
import torch

from tidepool.kernels._checks import checked_once


def test_checks_run_once_per_signature_and_errors_are_not_cached() -> None:
    calls: list[tuple[int, ...]] = []

    @checked_once
    def check(x: torch.Tensor, window: int | None) -> int:
        calls.append(tuple(x.shape))
        if x.dtype != torch.float32:
            raise ValueError("x must be float32")
        return x.shape[0]

    a = torch.zeros(4, 8)
    assert check(a, None) == 4 and check(torch.ones(4, 8), None) == 4  # same metadata, other values
    assert len(calls) == 1
    assert check(torch.zeros(5, 8), None) == 5  # new shape
    assert check(a.t().contiguous().t(), None) == 4  # new strides
    assert check(a, 16) == 4  # new scalar argument
    assert len(calls) == 4
    bad = torch.zeros(4, 8, dtype=torch.float64)
    for _ in range(2):
        with pytest.raises(ValueError, match="float32"):
            check(bad, None)
    assert len(calls) == 6


def test_real_launcher_check_still_rejects_after_a_cached_success() -> None:
    from tidepool.kernels.rms_norm import rms_norm_ref

    x, w = torch.randn(2, 8), torch.ones(8)
    rms_norm_ref(x, w, 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_ref(x, torch.ones(7), 1e-6)
