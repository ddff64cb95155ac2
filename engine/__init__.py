"""Tidepool's inference engine: paged KV cache with prefix caching, continuous batching with
chunked prefill and preemption, Llama-family models from local Hugging Face folders.

Runs offline, without HTTP or Kubernetes: nothing in the core imports the server or the
operator. Public API mirrors vLLM's: `LLM`, `SamplingParams`, `RequestOutput`. They are
loaded on first use, so importing a light module of this package (e.g. `gguf.pull` for
`tidepool pull`) does not load torch.

One import side effect, on purpose: `set_openmp_defaults()` (threads.py) defaults
`OMP_WAIT_POLICY` to PASSIVE in this process's environment (a user's choice is kept). libgomp
reads it once, when torch loads it, so it must run before the first `import torch` of every
engine process: `tidepool serve` / `generate`, a user's script doing `from tidepool.engine import
LLM` (llm.py imports torch, so `LLM.__init__` would be too late), and spawned worker ranks (they
inherit the variable). This package's `__init__` is the one place all of them pass first. It
stays out of processes that are not engines: what the operator and the router share with the
engine lives in torch-free `tidepool.contract` (which imports nothing from here), and the
`tidepool` console script imports the engine only for engine commands.
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
