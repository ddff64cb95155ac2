"""Tidepool's inference engine: paged KV cache with prefix caching, continuous batching with
chunked prefill and preemption, Llama-family models from local Hugging Face folders.

Runs offline, without HTTP or Kubernetes: nothing in the core imports the server or the
operator. Public API mirrors vLLM's: `LLM`, `SamplingParams`, `RequestOutput`. They are
loaded on first use so that torch-free modules of this package (e.g. `metrics_names`, read by
the operator, whose image has no torch) import without pulling torch in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .threads import set_openmp_defaults

set_openmp_defaults()  # before anything in the engine loads torch (and with it the OpenMP runtime)

if TYPE_CHECKING:
    from .llm import LLM
    from .outputs import CompletionOutput, RequestOutput
    from .sampling_params import SamplingParams

_EXPORTS = {
    "LLM": ".llm",
    "CompletionOutput": ".outputs",
    "RequestOutput": ".outputs",
    "SamplingParams": ".sampling_params",
}
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
