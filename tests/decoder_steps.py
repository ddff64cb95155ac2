"""Test helper: count the decode steps the compiled one-call step ran (`CpuDecoder.run` returning a result).

`count_decoder_steps(monkeypatch)` wraps `CpuDecoder.run` for the test's duration and returns the dict whose
"ran" entry counts the steps that ran in the op; a refused step (None: the layers ran) does not count.
"widest" is the most sequences one of those steps decoded.
"""

from __future__ import annotations

import pytest
import torch

from tidepool.engine import cpu_ops
from tidepool.engine.cpu_ops import decoder as decoder_module


def count_decoder_steps(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"ran": 0, "widest": 0}
    run = decoder_module.CpuDecoder.run

    def counted(self: cpu_ops.CpuDecoder, *args: object, **kwargs: object) -> torch.Tensor | None:
        out = run(self, *args, **kwargs)  # type: ignore[arg-type]
        if out is not None:
            counts["ran"] += 1
            counts["widest"] = max(counts["widest"], out.shape[0])  # one query row per sequence
        return out

    monkeypatch.setattr(decoder_module.CpuDecoder, "run", counted)
    return counts
