"""The engine says where its start-up went: seconds per phase on `EngineParts`, and one INFO line.

No timing is asserted (the machine's speed is not under test): the phases present, their order,
that they are non-negative seconds, and that the log line carries the same numbers as the parts.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from tidepool.engine.engine_builder import build_engine
from tidepool.engine.engine_config import EngineConfig
from tidepool.engine.startup_phases import PHASES, StartupClock, process_age_s


def test_clock_adds_marks_in_phase_order() -> None:
    clock = StartupClock(import_s=1.5)
    clock.mark("weights")
    clock.add("kv_cache", 0.25)
    clock.mark("tokenizer")
    clock.add("weights", 0.5)
    clock.add("warmup", -1.0)  # a clock step backwards never makes a phase negative
    phases = clock.phases
    assert list(phases) == ["import", "tokenizer", "weights", "kv_cache", "warmup"]
    assert phases["import"] == 1.5 and phases["kv_cache"] == 0.25 and phases["warmup"] == 0.0
    assert phases["weights"] >= 0.5 and phases["tokenizer"] >= 0.0
    assert clock.summary().startswith("import 1.50, tokenizer ") and clock.summary().endswith(" s")
    with pytest.raises(ValueError, match="unknown start-up phase 'loading'"):
        clock.mark("loading")


def test_process_age_is_known_on_linux() -> None:
    age = process_age_s()
    if not sys.platform.startswith("linux"):
        assert age is None
        return
    assert age is not None and age > 0.0


def test_build_engine_records_every_phase_and_logs_them(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tidepool.engine.engine_builder"):
        parts = build_engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", show_progress=False))
    expected = [p for p in PHASES if p != "import" or process_age_s() is not None]
    assert list(parts.startup_phases) == expected
    assert all(isinstance(s, float) and s >= 0.0 for s in parts.startup_phases.values())
    records = [r for r in caplog.records if hasattr(r, "startup_phases")]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert records[0].startup_phases == parts.startup_phases
    message = records[0].getMessage()
    assert message.startswith("start-up phases (s): ") and all(f"{p} " in message for p in expected)
