"""Kernel tests run the Triton kernels on the GPU when there is one, else on the CPU under Triton's interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, i.e. when a kernel module
is imported. The engine and ``kernels.dispatch`` import kernel modules lazily (only for CUDA
tensors), so normally none is imported yet; if an earlier test module did import one, it is
reloaded here so its kernels are decorated for the interpreter.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

# Dependency order: helpers first, so a reloaded kernel module picks up reloaded helpers.
_KERNEL_MODULES = (
    "_dot",
    "_paged_tile",
    "_split_k",
    "store_kv",
    "rms_norm",
    "rotary",
    "flash_attention_varlen",
    "paged_attention_decode",
    "int8_matmul",
    "int4_matmul",
    "lora_shrink_expand",
)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for _name in _KERNEL_MODULES:
        _module = sys.modules.get(f"tidepool.kernels.{_name}")
        if _module is not None:
            importlib.reload(_module)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
