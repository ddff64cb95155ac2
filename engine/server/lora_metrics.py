"""LoRA metrics of an engine started with --enable-lora: the gateway protocol's gauge and per-adapter counters.

Role: `vllm:lora_requests_info` exactly as the Gateway API Inference Extension's model-server
protocol specifies it (and vLLM exports it): labels `max_lora` (device slots),
`running_lora_adapters` and `waiting_lora_adapters` (the adapters of the running and of the
waiting requests, names joined by "," without spaces); value the wall-clock time the label set last
changed (the registry snapshot's `changed_at`), so an endpoint picker takes the sample with the
largest value. Beside it Tidepool's own
`tidepool:lora_requests_total{model_name, adapter}` (engine requests admitted per adapter) and
`tidepool:lora_adapters_loaded` (adapters registered now). Names in `tidepool.contract.metrics_names`.

Invariants:
- Only the engine thread records (after every loop turn, from the registry's snapshot); the
  HTTP thread renders the registry at any time (prometheus-client is thread-safe).
- At most two `lora_requests_info` samples exist: the current label set and, while that one has
  no adapter in it, the last one that had (the endpoint picker skips samples whose two lists are
  empty and keeps the latest busy one, as with vLLM's ever-growing series); the family is there
  from the start, so a scrape never misses it.
- A per-adapter counter goes when its adapter is unloaded (its series would otherwise grow with
  every name ever loaded); a reload starts it from zero, a reset `rate()` handles.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from tidepool.contract import metrics_names as names

from ..lora.types import LoRASnapshot
from .commands import Child

_Labels = tuple[str, str, str]  # max_lora, waiting, running: the info gauge's label order, as vLLM's


class LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_loras: int) -> None:
        self.model_name = model_name
        labels = [names.LORA_MAX_LORA_LABEL, names.LORA_WAITING_ADAPTERS_LABEL, names.LORA_RUNNING_ADAPTERS_LABEL]
        self._info = Gauge(names.LORA_REQUESTS_INFO, "Running stats on lora requests.", labels, registry=registry)
        self._requests = Counter(names.LORA_REQUESTS, "Engine requests admitted per LoRA adapter.",
                                 [names.MODEL_NAME_LABEL, names.LORA_ADAPTER_LABEL], registry=registry)  # fmt: skip
        self._loaded = Gauge(names.LORA_ADAPTERS_LOADED, "LoRA adapters registered on the engine.",
                             [names.MODEL_NAME_LABEL], registry=registry).labels(model_name)  # fmt: skip
        self._exported: set[_Labels] = set()
        self._current: _Labels | None = None
        self._last_busy: _Labels | None = None
        self._adapters: frozenset[str] = frozenset()
        self._counted: set[str] = set()
        self.record(LoRASnapshot(max_loras=max_loras))

    def record(self, snapshot: LoRASnapshot) -> None:
        """The registry's state after a loop turn: a new info sample when the lists changed, the loaded count."""
        adapters = frozenset(snapshot.names())
        if adapters != self._adapters:
            self._loaded.set(len(adapters))
            for gone in self._counted - adapters:
                self._requests.remove(self.model_name, gone)
            self._counted &= adapters
            self._adapters = adapters
        sep = names.LORA_ADAPTER_SEPARATOR
        labels = (str(snapshot.max_loras), sep.join(snapshot.waiting), sep.join(snapshot.running))
        if labels == self._current:
            return
        self._info.labels(*labels).set(snapshot.changed_at or time.time())  # when the registry's view changed
        is_busy = bool(labels[1] or labels[2])
        kept = {labels} if is_busy or self._last_busy is None else {labels, self._last_busy}
        for old in self._exported - kept:
            self._info.remove(*old)
        self._exported, self._current = kept, labels
        if is_busy:
            self._last_busy = labels

    def count_requests(self, children: Iterable[Child]) -> None:
        """Engine requests the engine admitted, by adapter (base-model requests are not counted here)."""
        for child in children:
            if child.lora_name is not None:
                self._requests.labels(self.model_name, child.lora_name).inc()
                self._counted.add(child.lora_name)
