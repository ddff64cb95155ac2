"""What the HTTP side may know about the engine: a read-only snapshot built once, before the engine thread runs.

Role: the server talks to the engine only through `AsyncEngine`'s queue and this object. It
holds the facts requests are checked against (vocabulary size, context length), what the
metrics and `/v1/models` report, the tokenizer (whose encode/decode are thread-safe and run in
the server's tokenizer threads) and, on a prefill or decode engine, the KV connector's two
event-loop entry points (made for the event loop: they wait without holding a thread). With
--enable-lora it also holds the adapter registry's thread-safe `snapshot` (which adapters a
request's `model` may name, what `/v1/models` lists) and `load_lora` (`LoRARegistry.read`), the
pure, thread-safe adapter reader bound to this model (the server runs it in a worker thread;
registering goes through the engine thread's inbox).

Invariant: frozen, built before the engine thread starts and never updated; nothing here lets
the HTTP thread reach into `LLMEngine`'s mutable state.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..kv_transfer import KVPayload
from ..llm_engine import LLMEngine
from ..tokenizer import Tokenizer

if TYPE_CHECKING:
    from ..lora.peft import LoadedAdapter
    from ..lora.types import LoRASnapshot


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str  # the model folder or file the engine loaded
    max_model_len: int  # prompt + completion tokens per request
    vocab_size: int  # the model's vocabulary: token ids lie in [0, vocab_size)
    block_size: int  # tokens per KV block
    num_kv_blocks: int
    max_num_batched_tokens: int  # the per-step token budget
    device: str
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    tokenizer: Tokenizer
    role: str  # "unified", "prefill" or "decode"
    kv_transfer_timeout: float  # seconds
    # Decode role: waits for a transfer's KV (KVReceiver.take_async); prefill role: waits for the
    # decode engine's acknowledgement of a sent transfer (KVSender.wait_sent_async).
    kv_receive: Callable[[str, float], Awaitable[KVPayload]] | None = None
    kv_wait_sent: Callable[[str], Awaitable[None]] | None = None
    # --enable-lora: the registry's snapshot (any thread) and the adapter reader (name, path) -> LoadedAdapter.
    lora_snapshot: Callable[[], LoRASnapshot] | None = None
    load_lora: Callable[[str, str], LoadedAdapter] | None = None

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> EngineInfo:
        config, resolved, connector = engine.config, engine.resolved, engine.kv_connector
        receiver = connector.receiver if connector is not None else None
        sender = connector.sender if connector is not None else None
        return cls(
            model=config.model,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            block_size=config.block_size,
            num_kv_blocks=engine.num_kv_blocks,
            max_num_batched_tokens=resolved.max_num_batched_tokens,
            device=str(resolved.device),
            enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tokenizer=engine.tokenizer,
            role=config.role,
            kv_transfer_timeout=config.kv_transfer_timeout,
            kv_receive=receiver.take_async if receiver is not None else None,
            kv_wait_sent=sender.wait_sent_async if sender is not None else None,
            lora_snapshot=engine.lora.snapshot if engine.lora is not None else None,
            load_lora=engine.lora.read if engine.lora is not None else None,
        )

    @property
    def cache_config(self) -> dict[str, str]:
        """The labels of vLLM's `cache_config_info` metric."""
        return {
            "block_size": str(self.block_size),
            "num_gpu_blocks": str(self.num_kv_blocks),
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(self.gpu_memory_utilization),
            "cache_dtype": "auto",
            "device": self.device,
        }
