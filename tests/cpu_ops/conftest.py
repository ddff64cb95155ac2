"""The compiled CPU attention op, required (TIDEPOOL_CPU_ATTENTION=compiled): a machine that runs these
tests has a C++ compiler (CI does), so a failed build is a failure here, never a skip."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tidepool.engine import cpu_ops


@pytest.fixture
def op(monkeypatch: pytest.MonkeyPatch) -> Iterator[cpu_ops.CpuPagedAttention]:
    monkeypatch.setenv(cpu_ops.MODE_ENV, "compiled")
    cpu_ops.reset()
    compiled = cpu_ops.paged_attention_op()
    assert compiled is not None
    yield compiled
    cpu_ops.reset()  # later tests re-read their own environment


@pytest.fixture
def threads() -> Iterator[None]:
    """Restores torch's intra-op thread count after a test that changes it."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
