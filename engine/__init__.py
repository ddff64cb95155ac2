"""Tidepool's inference engine: paged KV cache with prefix caching, continuous batching with
chunked prefill and preemption, Llama-family models from local Hugging Face folders.

Runs offline, without HTTP or Kubernetes: nothing here imports the server or the operator.
Public API mirrors vLLM's: `LLM`, `SamplingParams`, `RequestOutput`.
"""

from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
