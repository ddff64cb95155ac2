"""The engine's adapter registry: names, device slots (LRU), the host store (LRU), the scheduler gate.

Role: `LLMEngine.lora`. Used only on the engine thread, except `snapshot()` (an immutable
`LoRASnapshot`, replaced whole on every change, so any thread may read it) and `read()` (pure).

- Names: `register` a `LoadedAdapter` under its name (a new *load id* each time: the prefix cache
  keys a request's first block by it, so a reload never reuses stale KV); `unregister` hides the
  name at once, while requests already added with it finish normally (their entry lives on until
  the last one finishes).
- Device slots (`max_loras`): `acquire(request)` (the scheduler's `LoRAGate`, when a request enters
  the running batch) gives the request its adapter's slot, loading the adapter into a free slot or
  the least recently used slot no running request uses; False when there is none, or the host copy
  is not in memory yet: the request then waits, the step goes on. So the running batch never holds
  more than `max_loras` distinct adapters. `release(request)` when it leaves the batch.
- Host store (`max_cpu_loras`): at most that many adapters keep their weights in host memory (LRU);
  an evicted one is re-read from its path in a background thread when a request needs it.
Load ids and request counts are also what the GIE metric reports: running adapters are those of
running requests, waiting adapters those of requests added and not running.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..request import Request
from .peft import LoadedAdapter
from .slots import LoRASlots
from .types import AdapterInfo, LoRAError, LoRASnapshot

logger = logging.getLogger(__name__)

Loader = Callable[[str, str], LoadedAdapter]
"""(name, path) -> LoadedAdapter: `peft.load_adapter` bound to the engine's model config, rank and dtype."""


@dataclass(slots=True, eq=False)
class _Entry:
    load_id: int
    info: AdapterInfo
    host: LoadedAdapter | None  # the weights in host memory; None once evicted from the host store
    retired: bool = False  # unregistered: no new requests; dropped when num_requests reaches 0
    num_requests: int = 0  # added and not finished
    num_running: int = 0  # in the running batch (holding the slot)
    slot: int | None = None
    reread: Future[LoadedAdapter] | None = None
    error: str | None = None  # a failed re-read: its requests are failed by the engine


class LoRARegistry:
    def __init__(self, slots: LoRASlots, loader: Loader, max_cpu_loras: int | None = None) -> None:
        self.slots = slots
        self.max_loras = slots.num_slots
        self.max_cpu_loras = max(max_cpu_loras or slots.num_slots, 1)
        self._loader = loader
        self._by_name: dict[str, _Entry] = {}
        self._entries: dict[int, _Entry] = {}  # by load id, retired ones included
        self._host_lru: OrderedDict[int, None] = OrderedDict()  # load ids with host copies, LRU first
        self._slot_owner: list[_Entry | None] = [None] * slots.num_slots
        self._slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(slots.num_slots))
        self._ids = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None
        self._snapshot = LoRASnapshot(max_loras=self.max_loras, changed_at=time.time())

    # ---- names ----------------------------------------------------------------------------------
    def register(self, adapter: LoadedAdapter) -> AdapterInfo:
        """Make `adapter` servable under its name; LoRAError(400) when the name is already loaded."""
        if adapter.name in self._by_name:
            raise LoRAError(
                f"The lora adapter '{adapter.name}' has already been loaded.", code="invalid_lora", param="lora_name"
            )
        entry = _Entry(next(self._ids), adapter.info, adapter)
        self._by_name[adapter.name] = self._entries[entry.load_id] = entry
        self._keep_on_host(entry)
        self._changed()
        return adapter.info

    def read(self, name: str, path: str) -> LoadedAdapter:
        """Read and validate the adapter at `path` (`peft.load_adapter` for this engine's model): pure, so unlike
        the rest of the registry it may run on any thread (the server reads off the engine thread)."""
        return self._loader(name, path)

    def unregister(self, name: str) -> None:
        """Hide `name` (LoRAError 404 when unknown); requests already added with it finish normally."""
        entry = self._by_name.pop(name, None)
        if entry is None:
            raise LoRAError.not_found(name, param="lora_name")
        entry.retired = True
        self._drop_if_unused(entry)
        self._changed()

    def names(self) -> list[str]:
        return list(self._by_name)

    def has(self, name: str) -> bool:
        return name in self._by_name

    def info(self, name: str) -> AdapterInfo:
        return self._named(name).info

    def load_id(self, name: str) -> int:
        """The current load of `name` (LoRAError 404 model_not_found when unknown)."""
        return self._named(name).load_id

    def running_names(self) -> list[str]:
        return list(self._snapshot.running)

    def waiting_names(self) -> list[str]:
        return list(self._snapshot.waiting)

    def snapshot(self) -> LoRASnapshot:
        """The latest consistent view; safe from any thread (an immutable object swapped whole)."""
        return self._snapshot

    # ---- request lifetime (LLMEngine) ----------------------------------------------------------------
    def on_add(self, request: Request) -> None:
        """A request with `lora_id` was queued: it counts as waiting for its adapter."""
        self._entries[_load_id(request)].num_requests += 1
        self._changed()

    def on_finish(self, request: Request) -> None:
        """A request with `lora_id` finished (any way); the last one of a retired adapter drops it."""
        entry = self._entries.get(_load_id(request))
        if entry is None:
            return
        entry.num_requests -= 1
        self._drop_if_unused(entry)
        self._changed()

    def failed_load_ids(self) -> dict[int, str]:
        """Adapters whose host copy could not be re-read (load id -> why): their waiting requests cannot run."""
        return {e.load_id: e.error for e in self._entries.values() if e.error is not None}

    # ---- the scheduler's gate -----------------------------------------------------------------------
    def acquire(self, request: Request) -> bool:
        """Give the request its adapter's device slot (sets `request.lora_slot`); False: it waits this step."""
        entry = self._entries[_load_id(request)]
        if entry.slot is None and not self._place(entry):
            return False
        entry.num_running += 1
        request.lora_slot = entry.slot
        self._slot_lru.move_to_end(entry.slot)
        self._changed()
        return True

    def release(self, request: Request) -> None:
        """The request left the running batch (preempted or finished)."""
        entry = self._entries.get(_load_id(request))
        request.lora_slot = None
        if entry is not None:
            entry.num_running -= 1
            self._changed()

    # ---- internals ----------------------------------------------------------------------------
    def _named(self, name: str) -> _Entry:
        entry = self._by_name.get(name)
        if entry is None:
            raise LoRAError.not_found(name)
        return entry

    def _place(self, entry: _Entry) -> bool:
        """Load the entry into a free slot or the LRU slot nobody runs with; False when none or not in memory."""
        slot = next((s for s in self._slot_lru if self._slot_owner[s] is None), None)
        if slot is None:
            slot = next((s for s in self._slot_lru if self._slot_owner[s].num_running == 0), None)  # type: ignore[union-attr]
        if slot is None or not self._host_copy(entry):
            return False
        previous = self._slot_owner[slot]
        if previous is not None:
            previous.slot = None
        self.slots.load(slot, entry.host)
        self._slot_owner[slot], entry.slot = entry, slot
        self._host_lru.move_to_end(entry.load_id)
        return True

    def _host_copy(self, entry: _Entry) -> bool:
        """Whether the weights are in host memory; starts (or collects) a background re-read when they are not."""
        if entry.host is not None:
            return True
        if entry.error is not None:
            return False
        if entry.reread is None:
            self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="lora-reread")
            entry.reread = self._pool.submit(self._loader, entry.info.name, entry.info.path)
            return False
        if not entry.reread.done():
            return False
        future, entry.reread = entry.reread, None
        try:
            entry.host = future.result()
        except Exception as err:  # the files changed or vanished since the adapter was registered
            entry.error = f"re-reading LoRA adapter {entry.info.name!r} from {entry.info.path!r} failed: {err}"
            logger.error("%s", entry.error)
            return False
        self._keep_on_host(entry)
        return True

    def _keep_on_host(self, entry: _Entry) -> None:
        """Mark the entry's host copy most recently used; evict the least recently used beyond max_cpu_loras."""
        self._host_lru[entry.load_id] = None
        self._host_lru.move_to_end(entry.load_id)
        while len(self._host_lru) > self.max_cpu_loras:
            load_id, _ = self._host_lru.popitem(last=False)
            self._entries[load_id].host = None

    def _drop_if_unused(self, entry: _Entry) -> None:
        if not entry.retired or entry.num_requests > 0:
            return
        del self._entries[entry.load_id]
        self._host_lru.pop(entry.load_id, None)
        entry.host = None
        if entry.slot is not None:
            self.slots.load(entry.slot, None)
            self._slot_owner[entry.slot] = None
            self._slot_lru.move_to_end(entry.slot, last=False)
            entry.slot = None

    def _changed(self) -> None:
        """Replace the snapshot when what it reports changed (its timestamp is the GIE metric's value)."""
        live = tuple(e.info for e in self._by_name.values())
        running = tuple(sorted({e.info.name for e in self._entries.values() if e.num_running > 0}))
        waiting = tuple(sorted({e.info.name for e in self._entries.values() if e.num_requests > e.num_running}))
        old = self._snapshot
        if (live, running, waiting) != (old.adapters, old.running, old.waiting):
            self._snapshot = LoRASnapshot(live, running, waiting, self.max_loras, time.time())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def load_id_of(registry: LoRARegistry | None, lora_name: str | None) -> int | None:
    """The current load id of adapter `lora_name` (None: the base model); LoRAError 404 when unknown or LoRA is off."""
    if lora_name is None:
        return None
    if registry is None:
        raise LoRAError.not_found(lora_name)
    return registry.load_id(lora_name)


def _load_id(request: Request) -> int:
    if request.lora_id is None:
        raise RuntimeError(f"request {request.request_id!r} has no adapter")
    return request.lora_id
