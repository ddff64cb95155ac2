"""The step-hook protocol as the engine loop calls it (engine/step_hooks.py).

A recording hook registered on a tiny random-model engine proves the order of the lifecycle
points within a step, registration order across hooks, and that `on_finish` comes exactly once
for every request that was added — finished by length or a stop string, aborted while waiting
or running, failed in the run (the hook's own `after_run` raising for one request) or in its
detokenization — and never for an id the engine did not know. Also: `on_add` comes for every
request before it is queued, may refuse it or hold it outside the scheduler (a `kv_transfer` no
hook takes part in is refused); a hook's `on_abort` return is finished by the engine,
`has_pending` keeps the loop going, `stats()` reaches EngineStats.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tidepool.engine import SamplingParams
from tidepool.engine.engine_config import EngineConfig
from tidepool.engine.kv_transfer import KVPayload, ProducerParams
from tidepool.engine.llm_engine import LLMEngine
from tidepool.engine.outputs import RequestOutput
from tidepool.engine.request import Request
from tidepool.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tidepool.engine.step_hooks import BeforeSchedule, OnAdd, StepHook, StepView

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class Recorder(StepHook):
    """Records every call as (hook name, point, detail) into a log shared by several recorders."""

    def __init__(
        self, name: str, log: list[tuple[str, str, Any]], fail_for: str | None = None, hold: str | None = None
    ) -> None:
        self.name, self.log, self.fail_for, self.hold = name, log, fail_for, hold
        self.held: dict[str, Request] = {}
        self.pending = False

    def on_add(self, request: Request, kv_transfer: ProducerParams | KVPayload | None) -> OnAdd | None:
        self.log.append((self.name, "on_add", request.request_id))
        if request.request_id == "refused":
            raise ValueError("refused by the hook")
        if request.request_id != self.hold:
            return None
        self.held[request.request_id] = request  # as the KV hand-off holds a received request waiting for room
        self.pending = True
        return OnAdd(held=True)

    def before_schedule(self, view: StepView) -> BeforeSchedule | None:
        self.log.append((self.name, "before_schedule", sorted(r.request_id for r in view.running)))
        return None

    def after_run(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        ids = sorted(seq.request.request_id for seq in sched_out.scheduled)
        self.log.append((self.name, "after_run", ids))
        if self.fail_for in ids:
            raise RuntimeError(f"hook failure injected for {self.fail_for}")

    def before_update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        self.log.append((self.name, "before_update", sorted(runner_out.sampled_token_ids)))

    def on_abort(self, request_id: str) -> Request | None:
        self.log.append((self.name, "on_abort", request_id))
        return self.held.pop(request_id, None)

    def on_finish(self, request_id: str) -> None:
        self.log.append((self.name, "on_finish", request_id))

    def has_pending(self) -> bool:
        return self.pending

    def stats(self) -> dict[str, int]:
        return {"spec_num_draft_tokens": 7}

    def close(self) -> None:
        self.log.append((self.name, "close", None))


@pytest.fixture
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=16, max_model_len=64))


def _drain(engine: LLMEngine, limit: int = 100) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finals, "two final outputs for one request"
                finals[output.request_id] = output
    assert not engine.has_unfinished_requests()
    return finals


def _points(log: list[tuple[str, str, Any]], name: str = "a") -> list[str]:
    return [point for hook, point, _ in log if hook == name]


def _finished_ids(log: list[tuple[str, str, Any]], name: str = "a") -> Counter[str]:
    return Counter(detail for hook, point, detail in log if hook == name and point == "on_finish")


def test_points_run_in_step_order_and_hooks_in_registration_order(engine: LLMEngine) -> None:
    log: list[tuple[str, str, Any]] = []
    engine.hooks.extend([Recorder("a", log), Recorder("b", log)])
    engine.add_request("r", "hello there", GREEDY)
    finals = _drain(engine)
    assert len(finals["r"].outputs[0].token_ids) == 6
    # Every call of hook a is immediately followed by the same call of hook b.
    assert [(p, d) for h, p, d in log[0::2]] == [(p, d) for h, p, d in log[1::2]]
    assert [h for h, _, _ in log] == ["a", "b"] * (len(log) // 2)
    points = _points(log)
    # The add; one prefill step and five decode steps, each schedule -> run -> update; then the finish.
    assert points == ["on_add"] + ["before_schedule", "after_run", "before_update"] * 6 + ["on_finish"]
    assert log[2][2] == [] and log[4][2] == ["r"]  # nothing running before the first schedule; then r
    assert _finished_ids(log) == Counter({"r": 1})
    engine.close()
    assert _points(log)[-1] == "close" and _points(log, "b")[-1] == "close"


def test_on_finish_once_for_length_stop_string_and_aborts(engine: LLMEngine) -> None:
    log: list[tuple[str, str, Any]] = []
    engine.hooks.append(Recorder("a", log))
    engine.add_request("length", "one two", GREEDY)
    clean = LLMEngine(engine.config)  # the text the stop string is taken from
    clean.add_request("probe", "three four", GREEDY)
    text = _drain(clean)["probe"].outputs[0].text
    stop = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[text[len(text) // 2 :]])
    engine.add_request("stopped", "three four", stop)
    engine.add_request("aborted-running", "five six", GREEDY)
    engine.step()
    engine.step()
    aborted = engine.abort_request(["aborted-running", "never-added"])
    assert [o.request_id for o in aborted] == ["aborted-running"]
    engine.add_request("aborted-waiting", "seven", GREEDY)
    assert engine.abort_request("aborted-waiting")[0].outputs[0].finish_reason == "abort"
    finals = _drain(engine)
    assert finals["stopped"].outputs[0].finish_reason == "stop"
    assert finals["length"].outputs[0].finish_reason == "length"
    names = ["length", "stopped", "aborted-running", "aborted-waiting"]
    assert _finished_ids(log) == Counter(names)  # once each, and nothing for "never-added"
    assert [d for _, p, d in log if p == "on_abort"] == ["aborted-running", "never-added", "aborted-waiting"]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.pool.num_blocks


@pytest.mark.parametrize("where", ["after_run", "detokenizer"])
def test_a_failed_request_is_finished_once_and_the_others_carry_on(engine: LLMEngine, where: str) -> None:
    log: list[tuple[str, str, Any]] = []
    engine.hooks.append(Recorder("a", log, fail_for="victim" if where == "after_run" else None))
    for request_id in ("x", "victim", "y"):
        engine.add_request(request_id, f"prompt of {request_id}", GREEDY)
    if where == "detokenizer":

        def boom(*_: Any) -> Any:
            raise RuntimeError("detokenizer failure injected")

        engine._tracked["victim"].detokenizer.update = boom  # type: ignore[method-assign]
    finals = _drain(engine)
    assert finals["victim"].error is not None and "injected" in finals["victim"].error
    assert finals["victim"].outputs[0].finish_reason == "abort"
    assert {finals[r].outputs[0].finish_reason for r in ("x", "y")} == {"length"}
    assert _finished_ids(log) == Counter(["x", "victim", "y"])
    if where == "after_run":  # the batch failed, then each sequence ran alone: after_run once per run
        first_step = [d for _, p, d in log if p == "after_run"][:4]
        assert first_step == [["victim", "x", "y"], ["x"], ["victim"], ["y"]]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.pool.num_blocks


def test_a_request_a_hook_holds_is_finished_by_the_engine_on_abort(engine: LLMEngine) -> None:
    log: list[tuple[str, str, Any]] = []
    hook = Recorder("a", log, hold="held")
    engine.hooks.append(hook)
    request = engine.add_request("held", "held outside the scheduler", GREEDY)
    assert request not in engine.scheduler.waiting and "held" not in engine.scheduler.requests
    assert engine.has_unfinished_requests()
    outputs = engine.abort_request("held")
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("held", "abort")]
    assert _finished_ids(log) == Counter(["held"])
    hook.pending = False
    assert not engine.has_unfinished_requests()


def test_on_add_may_refuse_a_request_and_an_untaken_hand_off_is_refused(engine: LLMEngine) -> None:
    log: list[tuple[str, str, Any]] = []
    engine.hooks.append(Recorder("a", log))
    with pytest.raises(ValueError, match="refused by the hook"):
        engine.add_request("refused", "hello", GREEDY)
    with pytest.raises(ValueError, match="role='unified'"):  # no hook takes part in the hand-off
        engine.add_request("hand-off", "hello", GREEDY, kv_transfer=ProducerParams("t", "127.0.0.1:1"))
    assert _points(log) == ["on_add", "on_add"] and not engine.has_unfinished_requests()
    assert engine.scheduler.num_waiting == 0 and not engine._tracked
    engine.add_request("accepted", "hello", GREEDY)  # the refused ids were never taken
    assert set(_drain(engine)) == {"accepted"}


def test_hook_stats_reach_engine_stats(engine: LLMEngine) -> None:
    assert engine.get_stats().spec_num_draft_tokens == 0
    engine.hooks.append(Recorder("a", []))
    assert engine.get_stats().spec_num_draft_tokens == 7


def test_the_builder_registers_feature_hooks(tiny_model_dir: Path, engine: LLMEngine) -> None:
    assert engine.hooks == [] and engine.speculator is None and engine.kv_connector is None
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    speculating = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), show_progress=False, max_model_len=64, speculative_config=spec)
    )
    assert speculating.hooks == [speculating.speculator] and isinstance(speculating.speculator, StepHook)
