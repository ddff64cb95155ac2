"""The compiled CPU attention op, required (TIDEPOOL_CPU_ATTENTION=compiled): a machine that runs these
tests has a C++ compiler (CI does), so a failed build is a failure here, never a skip.

`vector_width`: the arithmetic tests (`pytestmark = pytest.mark.usefixtures("vector_width")`) run once per
SIMD width the ops are built with (TIDEPOOL_CPU_VECTOR_WIDTH 8 and 16), whatever this CPU has: a width
it lacks compiles to narrower instructions, so both code paths are checked on every machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tidepool.engine import cpu_ops
from tidepool.engine.cpu_ops import build


@pytest.fixture(scope="module", params=build.VECTOR_WIDTHS, ids=lambda width: f"w{width}")
def vector_width(request: pytest.FixtureRequest) -> Iterator[int]:
    """Module-scoped, so a module's own module-scoped op fixture (`gemv`, `int4_gemv`, `fused`: each takes this
    one) is built per width too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.VECTOR_WIDTH_ENV, str(request.param))
        cpu_ops.reset()  # the ops resolved next are built (or found in the cache) with this width
        yield request.param
    cpu_ops.reset()


@pytest.fixture
def paged_attention(monkeypatch: pytest.MonkeyPatch) -> Iterator[cpu_ops.CpuPagedAttention]:
    """The compiled paged-attention op (TIDEPOOL_CPU_ATTENTION=compiled), required."""
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
