"""`/metrics` says where the engine's start-up went: `tidepool:startup_phase_seconds{phase}`, one sample per phase.

The values are the engine's own record (`LLMEngine.startup_phases`, logged in one line at start);
no timing is asserted, only that every phase the engine timed is exported, once, and is not negative.
"""

from __future__ import annotations

import re

import httpx
from serve_proc import Server

from tidepool.contract.metrics_names import STARTUP_PHASE_SECONDS
from tidepool.engine.startup_phases import PHASES


def test_startup_phases_are_exported(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    samples = re.findall(rf'^{re.escape(STARTUP_PHASE_SECONDS)}{{model_name="{server.model}",phase="(\w+)"}} (\S+)$',
                         text, re.M)  # fmt: skip
    phases = dict(samples)
    assert len(samples) == len(phases), "one sample per phase"
    assert {"resolve", "tokenizer", "weights", "kv_cache", "warmup"} <= set(phases) <= set(PHASES)
    assert all(float(value) >= 0 for value in phases.values())
    logged = re.search(r"start-up phases \(s\): (.*); total", server.log())
    assert logged is not None
    assert [part.split()[0] for part in logged.group(1).split(", ")] == [p for p in PHASES if p in phases]
