"""The registry's device slots and host store, and the scheduler's gate, without running a model.

A waiting request whose adapter cannot get a slot waits while base requests and requests of resident
adapters go on; the running batch never holds more than `max_loras` distinct adapters (checked after
every step, with preemption forced by a small KV cache); a host store smaller than the adapter set
re-reads evicted adapters in the background; an unregistered adapter's running requests finish.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch

from tidepool.engine.kv_cache import KVCacheManager
from tidepool.engine.loading.formats import read_model_config
from tidepool.engine.lora.peft import load_adapter
from tidepool.engine.lora.registry import LoRARegistry
from tidepool.engine.lora.slots import LoRASlots
from tidepool.engine.lora.types import LoRAError
from tidepool.engine.request import Request
from tidepool.engine.sampling_params import SamplingParams
from tidepool.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tidepool.engine.scheduler import Scheduler


def _registry(base: Path, adapters: dict, max_loras: int, max_cpu_loras: int | None = None) -> LoRARegistry:
    config = read_model_config(base)
    slots = LoRASlots(config, max_loras, 16, torch.float32, torch.device("cpu"))
    loader = functools.partial(load_adapter, model_config=config, max_rank=16, dtype=torch.float32)
    registry = LoRARegistry(slots, loader, max_cpu_loras)
    for name in sorted(adapters):
        registry.register(registry.read(name, str(adapters[name][0])))
    return registry


def _scheduler(registry: LoRARegistry, num_blocks: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4), max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64,
                     lora_gate=registry)  # fmt: skip


def _add(scheduler: Scheduler, registry: LoRARegistry, rid: str, name: str | None, num_prompt: int = 6) -> Request:
    lora_id = None if name is None else registry.load_id(name)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request = Request(rid, list(range(3, 3 + num_prompt)), params, lora_name=name, lora_id=lora_id)
    if lora_id is not None:
        registry.on_add(request)
    scheduler.add_request(request)
    return request


def _step(scheduler: Scheduler, registry: LoRARegistry) -> SchedulerOutput:
    out = scheduler.schedule()
    _check_slots(scheduler, registry)
    sampled = {s.request.request_id: 7 for s in out.scheduled if s.needs_sample}
    for request in scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled)):
        if request.lora_id is not None:
            registry.on_finish(request)
    return out


def _run_all(scheduler: Scheduler, registry: LoRARegistry) -> None:
    """Step until every request finished (yielding to the background re-read thread between steps)."""
    deadline = time.monotonic() + 120  # a guard against a hang, not a timing check
    while scheduler.has_unfinished_requests() and time.monotonic() < deadline:
        _step(scheduler, registry)
        time.sleep(0.001)
    assert not scheduler.has_unfinished_requests()


def _check_slots(scheduler: Scheduler, registry: LoRARegistry) -> None:
    adapters = {r.lora_id for r in scheduler.running if r.lora_id is not None}
    assert len(adapters) <= registry.max_loras
    for request in scheduler.running:
        assert (request.lora_slot is None) == (request.lora_id is None)
    for request in scheduler.waiting:
        assert request.lora_slot is None


def test_a_request_without_a_slot_waits_and_the_rest_flow(tiny_model_dir: Path, lora_adapters: dict) -> None:
    registry = _registry(tiny_model_dir, lora_adapters, max_loras=2, max_cpu_loras=3)
    scheduler = _scheduler(registry)
    _add(scheduler, registry, "all-0", "all")
    _add(scheduler, registry, "mlp-0", "mlp")
    blocked = _add(scheduler, registry, "qv-0", "qv")
    _add(scheduler, registry, "base-0", None)
    _add(scheduler, registry, "mlp-1", "mlp")
    out = _step(scheduler, registry)
    assert {s.request.request_id for s in out.scheduled} == {"all-0", "mlp-0", "base-0", "mlp-1"}
    assert scheduler.waiting == [blocked]
    snapshot = registry.snapshot()
    assert (snapshot.running, snapshot.waiting, snapshot.max_loras) == (("all", "mlp"), ("qv",), 2)
    _run_all(scheduler, registry)
    assert registry.snapshot().running == registry.snapshot().waiting == ()
    assert registry.slots.ranks.tolist().count(0) == 0  # both slots hold an adapter (the LRU one was replaced)


def test_preemption_releases_slots(tiny_model_dir: Path, lora_adapters: dict) -> None:
    registry = _registry(tiny_model_dir, lora_adapters, max_loras=2)
    scheduler = _scheduler(registry, num_blocks=16)
    names = [None, "qv", "all", "mlp"]
    for i in range(12):
        _add(scheduler, registry, f"r{i}", names[i % 4], num_prompt=10 + i)
    _run_all(scheduler, registry)
    assert scheduler.num_preemptions_total > 0
    assert scheduler.kv_cache.num_free_blocks == 16
    assert registry.snapshot().running == ()


def test_host_store_evicts_and_rereads_in_the_background(tiny_model_dir: Path, lora_adapters: dict) -> None:
    registry = _registry(tiny_model_dir, lora_adapters, max_loras=1, max_cpu_loras=1)
    scheduler = _scheduler(registry)
    first = _add(scheduler, registry, "all-0", "all")  # "qv" was registered last: only its host copy is kept
    deadline = time.monotonic() + 30
    while first.lora_slot is None and time.monotonic() < deadline:
        _step(scheduler, registry)  # waits (nothing runs) until the background re-read lands
        time.sleep(0.01)
    assert first.lora_slot == 0
    _run_all(scheduler, registry)
    assert registry.failed_load_ids() == {}


def test_unregister_lets_admitted_requests_finish(tiny_model_dir: Path, lora_adapters: dict) -> None:
    registry = _registry(tiny_model_dir, lora_adapters, max_loras=2)
    scheduler = _scheduler(registry)
    running = _add(scheduler, registry, "qv-0", "qv")
    _step(scheduler, registry)
    assert registry.slots.ranks.tolist() == [8, 0]
    before = registry.snapshot()
    registry.unregister("qv")
    assert not registry.has("qv") and "qv" not in registry.names()
    assert registry.snapshot().changed_at >= before.changed_at
    with pytest.raises(LoRAError) as err:
        registry.load_id("qv")
    assert (err.value.status, err.value.code) == (404, "model_not_found")
    with pytest.raises(LoRAError) as err:
        registry.unregister("qv")
    assert err.value.status == 404
    _run_all(scheduler, registry)
    assert running.num_output_tokens == 4
    assert registry.slots.ranks.tolist() == [0, 0]  # its slot was cleared once its last request finished


def test_register_twice_is_refused(tiny_model_dir: Path, lora_adapters: dict) -> None:
    registry = _registry(tiny_model_dir, lora_adapters, max_loras=1)
    with pytest.raises(LoRAError, match="already been loaded") as err:
        registry.register(registry.read("qv", str(lora_adapters["qv"][0])))
    assert err.value.status == 400
    assert [a.name for a in registry.snapshot().adapters] == sorted(lora_adapters)
