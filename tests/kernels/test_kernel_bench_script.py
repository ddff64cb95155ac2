"""bench/gpu_kernels.py on a machine without CUDA: a clear message and exit status 0 (the GPU run needs a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the full GPU benchmark")
def test_without_cuda_it_explains_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("gpu_kernels_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
