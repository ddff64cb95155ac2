"""A running 2-way tensor-parallel engine (CPU, gloo) seen from a stranger who reaches its rendezvous store.

The store holds the control channel's address and no key (the pickle-era engine published its key
there); with that address alone a stranger's handshake fails, and the engine keeps serving.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from tidepool.contract.wire import CONTROL_KEY_FILE_ENV
from tidepool.engine import LLM, SamplingParams
from tidepool.engine.distributed import comm
from tidepool.engine.distributed.launch import free_port

pytestmark = pytest.mark.slow

OLD_STORE_KEY = "tidepool/control_key"  # where the key used to be published


def test_the_store_holds_no_key_and_its_address_gets_a_stranger_nowhere(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CONTROL_KEY_FILE_ENV, raising=False)  # one machine: a random key, handed over at spawn
    port = free_port()
    llm = LLM(
        str(tiny_model_dir), tensor_parallel_size=2, master_addr="127.0.0.1", master_port=port,
        device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=128, show_progress=False,
    )  # fmt: skip
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        assert not store.check([OLD_STORE_KEY])
        address = store.get(comm.STORE_KEY_ADDRESS).decode()
        with pytest.raises(PermissionError):
            comm.connect(address, os.urandom(32), timeout=2.0)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        [output] = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 4
    finally:
        llm.engine.close()
