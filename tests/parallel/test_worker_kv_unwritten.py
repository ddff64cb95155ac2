"""A TP/PP worker's CPU KV cache is reserved, not written, at start (issue #43), as the unified engine's is: each
layer's key and value tensor is a fresh kernel-zeroed mapping (hugepages.zeros), so a worker's start does not
pay for touching its whole KV budget, and every byte still reads as zero until a block is written.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from test_hugepages import _resident_bytes

from tidepool.engine import hugepages
from tidepool.engine.distributed.worker import _Worker


def test_cpu_worker_kv_cache_is_reserved_not_touched() -> None:
    worker = SimpleNamespace(
        model_config=SimpleNamespace(torch_dtype=torch.float32),
        device=torch.device("cpu"),
        stage=SimpleNamespace(num_local_layers=3),
    )
    shape = (64, 16, 2, 64)  # 512 KiB per tensor: 64 blocks of 16 slots, 2 KV heads of 64
    caches = _Worker._zeros_cache(worker, shape)
    assert len(caches) == 3
    tensors = [t for pair in caches for t in pair]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 6  # each its own mapping
    for tensor in tensors:
        assert tensor.shape == shape and tensor.dtype == torch.float32
        assert tensor.data_ptr() % hugepages.HUGE_PAGE == 0
        assert _resident_bytes(tensor) == 0  # nothing faulted in at start
    key, value = caches[1]
    key[7, 3] = 1.5  # one slot written: one page resident, the rest still the kernel's zeros
    assert 0 < _resident_bytes(key) <= hugepages.HUGE_PAGE
    assert key.sum().item() == 1.5 * 2 * 64 and value.abs().sum().item() == 0.0
