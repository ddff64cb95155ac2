"""Unit tests of the scheduler driven directly, with a fake model runner (no model, no torch).

The fake runner "samples" a token for every scheduled sequence that reached the end of its
known tokens, so these tests exercise exactly the scheduler's loop: the per-step token
budget, `max_num_seqs`, chunked prefill, decodes mixed with prefills (decodes first),
preemption by recompute (least wasted work, no repeated victim, FCFS re-entry), bounded
completion, abort and every stop condition.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tidepool.engine.kv_cache import KVCacheManager
from tidepool.engine.request import Request, RequestStatus
from tidepool.engine.sampling_params import SamplingParams
from tidepool.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tidepool.engine.scheduler import Scheduler

EOS = 2
FILLER = 7  # a token that is never EOS and never a stop token in these tests

TokenFn = Callable[[Request], int]


class Harness:
    """A scheduler plus a fake runner; arrival times are explicit so FCFS order is deterministic."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 4,
        budget: int = 1000,
        max_num_seqs: int = 100,
        max_model_len: int | None = None,
        caching: bool = False,
        chunked: bool = True,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.sched = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len or num_blocks * block_size,
            enable_chunked_prefill=chunked,
        )
        self._clock = 0.0
        # Ids that sampled in the last step, in scheduled order. Recorded at step time because
        # `ScheduledSeq.needs_sample` reads the request's current length, which grows on update.
        self.sampled_ids: list[str] = []

    def add(self, request_id: str, num_prompt: int, first_token: int = 10, **params: object) -> Request:
        params.setdefault("ignore_eos", True)
        params.setdefault("max_tokens", 100)
        self._clock += 1.0
        request = Request(
            request_id,
            [first_token + i for i in range(num_prompt)],
            SamplingParams(**params),  # type: ignore[arg-type]
            eos_token_ids=frozenset({EOS}),
            arrival_time=self._clock,
        )
        self.sched.add_request(request)
        return request

    def step(self, token_fn: TokenFn = lambda _: FILLER) -> tuple[SchedulerOutput, list[Request]]:
        out = self.sched.schedule()
        sampled = {seq.request.request_id: token_fn(seq.request) for seq in out.scheduled if seq.needs_sample}
        self.sampled_ids = list(sampled)
        finished = self.sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        self.kv.pool.check_invariants()
        return out, finished

    def run_to_completion(self, max_steps: int, token_fn: TokenFn = lambda _: FILLER) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished_requests():
            assert len(outs) < max_steps, "requests did not finish in the allowed number of steps"
            outs.append(self.step(token_fn)[0])
        return outs


def _ids(out: SchedulerOutput) -> list[str]:
    return [seq.request.request_id for seq in out.scheduled]


def _chunks(out: SchedulerOutput) -> dict[str, tuple[int, int]]:
    return {seq.request.request_id: (seq.num_computed_tokens, seq.num_new_tokens) for seq in out.scheduled}


# ---- budget, max_num_seqs, chunking, mixing -----------------------------------------------------
def test_token_budget_is_respected_every_step() -> None:
    harness = Harness(num_blocks=64, budget=10)
    rng = random.Random(0)
    for i in range(12):
        harness.add(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 8))
    outs = harness.run_to_completion(max_steps=500)
    for out in outs:
        assert sum(seq.num_new_tokens for seq in out.scheduled) == out.num_batched_tokens <= 10
        assert all(seq.num_new_tokens >= 1 for seq in out.scheduled)
    assert max(out.num_batched_tokens for out in outs) == 10  # the budget is actually used up to its limit


def test_max_num_seqs_is_respected() -> None:
    harness = Harness(num_blocks=64, max_num_seqs=3)
    for i in range(7):
        harness.add(f"r{i}", 3, max_tokens=4)
    outs = harness.run_to_completion(max_steps=100)
    assert all(len(out.scheduled) <= 3 for out in outs)
    assert _ids(outs[0]) == ["r0", "r1", "r2"]  # the earliest arrivals get the seats
    assert max(len(out.scheduled) for out in outs) == 3


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_after_the_last_chunk() -> None:
    harness = Harness(num_blocks=16, budget=8)
    harness.add("long", 25, max_tokens=2)
    chunks, sampled = [], []
    for _ in range(5):
        chunks.append(_chunks(harness.step()[0])["long"])
        sampled.append(harness.sampled_ids == ["long"])
    assert chunks == [(0, 8), (8, 8), (16, 8), (24, 1), (25, 1)]
    assert sampled == [False, False, False, True, True]
    assert not harness.sched.has_unfinished_requests()


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    harness = Harness(num_blocks=16, budget=8, chunked=False)
    harness.add("a", 5, max_tokens=1)
    harness.add("b", 6, max_tokens=1)
    out, _ = harness.step()
    assert _chunks(out) == {"a": (0, 5)}  # 3 tokens of budget left: b is not split
    out, _ = harness.step()
    assert _chunks(out) == {"b": (0, 6)}


def test_decodes_and_prefills_mix_in_one_step_under_one_budget() -> None:
    harness = Harness(num_blocks=32, budget=6)
    harness.add("long", 14, max_tokens=3)  # arrives first, prefills in chunks
    harness.add("short", 2, max_tokens=5)
    assert _chunks(harness.step()[0]) == {"long": (0, 6)}
    assert _chunks(harness.step()[0]) == {"long": (6, 6)}
    assert _chunks(harness.step()[0]) == {"long": (12, 2), "short": (0, 2)}
    assert _chunks(harness.step()[0]) == {"long": (14, 1), "short": (2, 1)}
    harness.add("new", 9, max_tokens=1)
    out, _ = harness.step()
    assert _chunks(out) == {"long": (15, 1), "short": (3, 1), "new": (0, 4)}
    assert harness.sampled_ids == ["long", "short"]  # the chunk of `new` samples nothing yet


def test_decodes_are_listed_before_prefills_of_earlier_arrivals() -> None:
    harness = Harness(num_blocks=32, budget=8)
    late = harness.add("late", 2, max_tokens=20)
    harness.step()
    # A request that arrived earlier (say, it sat in a router queue) reaches the scheduler now;
    # it is queued by its arrival time, so it runs ahead of `late`.
    early = Request("early", list(range(10, 30)), SamplingParams(max_tokens=1), arrival_time=late.arrival_time - 1)
    harness.sched.add_request(early)
    assert _chunks(harness.step()[0]) == {"late": (2, 1), "early": (0, 7)}
    assert [r.request_id for r in harness.sched.running] == ["early", "late"]
    assert _chunks(harness.step()[0]) == {"early": (7, 8)}  # the earlier arrival takes the whole budget
    out, _ = harness.step()
    assert _chunks(out) == {"early": (15, 5), "late": (3, 1)}
    assert _ids(out) == ["late", "early"]  # decodes first, although `early` was served first


# ---- preemption ---------------------------------------------------------------------------------
def test_preemption_picks_the_victim_that_wastes_least_work() -> None:
    harness = Harness(num_blocks=6, block_size=4)
    y = harness.add("Y", 8)
    x = harness.add("X", 2)
    z = harness.add("Z", 11)  # the latest arrival, with the most computed tokens
    out, _ = harness.step()
    assert harness.kv.num_free_blocks == 0
    out, _ = harness.step()  # Y crosses into a third block: someone must go
    assert out.preempted_request_ids == ["X"]
    assert out.num_preemptions == 1
    assert set(_ids(out)) == {"Y", "Z"}
    assert x.status == RequestStatus.PREEMPTED and x.num_computed_tokens == 0 and x.num_preemptions == 1
    assert x.output_token_ids == [FILLER]  # recompute keeps the tokens, only the KV is dropped
    assert y.status == z.status == RequestStatus.RUNNING
    assert harness.kv.block_ids("X") == []
    assert harness.sched.num_preemptions_total == 1


def test_a_request_preempted_once_is_not_chosen_again_while_another_qualifies() -> None:
    # Found by search: at step 7, R0 (never preempted, 8 computed tokens) and R1 (preempted
    # before, 7 computed tokens) are the candidates; least work alone would pick R1 again.
    harness = Harness(num_blocks=4, block_size=4)
    r0 = harness.add("R0", 2, max_tokens=9)
    r1 = harness.add("R1", 4, max_tokens=7)
    r2 = harness.add("R2", 6, max_tokens=9)
    outs = [harness.step()[0] for _ in range(8)]
    assert outs[1].preempted_request_ids == ["R1"]
    assert outs[3].preempted_request_ids == ["R2"]
    assert r1.num_preemptions == 1 and r1.status == RequestStatus.RUNNING
    assert outs[7].preempted_request_ids == ["R0"]
    assert _chunks(outs[7]) == {"R1": (7, 1)}
    assert (r0.num_preemptions, r1.num_preemptions, r2.num_preemptions) == (1, 1, 1)


def test_a_preempted_request_keeps_its_place_in_line() -> None:
    harness = Harness(num_blocks=4, block_size=4)
    harness.add("R0", 2, max_tokens=9)
    harness.add("R1", 4, max_tokens=7)
    harness.add("R2", 6, max_tokens=9)
    outs = [harness.step()[0] for _ in range(5)]
    assert [r.request_id for r in harness.sched.waiting] == ["R2"]
    assert _chunks(outs[4])["R1"] == (0, 5)  # R1 (preempted first, arrived before R2) came back first
    outs += [harness.step()[0] for _ in range(3)]
    # R0 was preempted after R2 but arrived before it, so it waits ahead of R2.
    assert [r.request_id for r in harness.sched.waiting] == ["R0", "R2"]
    outs += harness.run_to_completion(max_steps=50)
    first_seen = {rid: next(i for i, out in enumerate(outs[8:]) if rid in _ids(out)) for rid in ("R0", "R2")}
    assert first_seen["R0"] < first_seen["R2"]


def test_readmitted_request_returns_to_its_arrival_position_in_running() -> None:
    harness = Harness(num_blocks=7, block_size=4)
    harness.add("R0", 6, max_tokens=5)
    harness.add("R1", 3, max_tokens=3)
    harness.add("R2", 1, max_tokens=6)
    harness.add("R3", 8, max_tokens=10)
    outs = [harness.step()[0] for _ in range(3)]
    assert outs[2].preempted_request_ids == ["R2"]  # R1 needed a block; R2 had the least work
    assert [r.request_id for r in harness.sched.running] == ["R0", "R3"]
    out, _ = harness.step()
    assert _chunks(out)["R2"] == (0, 3)
    assert [r.request_id for r in harness.sched.running] == ["R0", "R2", "R3"]


def test_waiting_requests_are_not_admitted_in_a_step_that_preempted() -> None:
    harness = Harness(num_blocks=6, block_size=4)
    harness.add("Y", 8)
    harness.add("X", 2)
    harness.add("Z", 11)
    harness.step()
    harness.add("late", 1)
    out, _ = harness.step()
    assert out.preempted_request_ids == ["X"]
    assert "late" not in _ids(out)


@pytest.mark.parametrize("seed", range(4))
def test_no_starvation_every_request_finishes_in_bounded_steps(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    num_blocks = rng.randint(6, 12)
    capacity = num_blocks * block_size
    harness = Harness(num_blocks, block_size, budget=rng.randint(3, 16), max_num_seqs=rng.randint(2, 6))
    total_tokens = 0
    for i in range(10):
        num_prompt = rng.randint(1, capacity // 2)
        max_tokens = rng.randint(1, capacity - num_prompt)
        harness.add(f"r{i}", num_prompt, max_tokens=max_tokens)
        total_tokens += num_prompt + max_tokens
    # Generous but finite: each token computed, plus recomputing each request at most a few times.
    outs = harness.run_to_completion(max_steps=20 * total_tokens)
    assert harness.kv.num_free_blocks == num_blocks
    assert all(block.ref_cnt == 0 for block in harness.kv.pool.blocks)
    assert sum(len(out.preempted_request_ids) for out in outs) == harness.sched.num_preemptions_total


# ---- abort ----------------------------------------------------------------------------------------
def test_abort_frees_everything_at_once() -> None:
    harness = Harness(num_blocks=8, block_size=4, max_num_seqs=1)
    running = harness.add("running", 9)
    waiting = harness.add("waiting", 3)
    harness.step()
    assert harness.kv.num_free_blocks == 5
    finished = harness.sched.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert finished == [running, waiting]
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert running.status.finish_reason == "abort"
    assert harness.kv.num_free_blocks == 8
    assert not harness.sched.has_unfinished_requests()
    assert harness.sched.requests == {}
    harness.kv.pool.check_invariants()
    assert harness.sched.finish_requests(["running"], RequestStatus.FINISHED_ABORTED) == []


def test_abort_between_schedule_and_update_is_ignored_by_the_update() -> None:
    harness = Harness(num_blocks=8, block_size=4)
    request = harness.add("a", 5)
    out = harness.sched.schedule()
    harness.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    finished = harness.sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": FILLER}))
    assert finished == []
    assert request.output_token_ids == []
    assert harness.kv.num_free_blocks == 8


def test_request_ids_must_be_unique() -> None:
    harness = Harness(num_blocks=8)
    harness.add("a", 2)
    with pytest.raises(ValueError, match="already in use"):
        harness.add("a", 2)


# ---- stop conditions ------------------------------------------------------------------------------
def _scripted(tokens: list[int]) -> TokenFn:
    return lambda request: tokens[request.num_output_tokens] if request.num_output_tokens < len(tokens) else FILLER


def _run_one(tokens: list[int], max_model_len: int | None = None, num_prompt: int = 3, **params: object) -> Request:
    harness = Harness(num_blocks=16, block_size=4, max_model_len=max_model_len)
    request = harness.add("r", num_prompt, **params)
    harness.run_to_completion(max_steps=100, token_fn=_scripted(tokens))
    assert harness.kv.num_free_blocks == 16
    return request


def test_eos_stops_unless_ignore_eos() -> None:
    request = _run_one([5, EOS, 6, 6], ignore_eos=False, max_tokens=10)
    assert request.output_token_ids == [5, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_token_id == EOS
    request = _run_one([5, EOS, 6, 6], ignore_eos=True, max_tokens=4)
    assert request.output_token_ids == [5, EOS, 6, 6]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.stop_token_id is None


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    request = _run_one([5, 9, 6], ignore_eos=True, stop_token_ids=[9], max_tokens=10)
    assert request.output_token_ids == [5, 9]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_token_id == 9


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    request = _run_one([EOS, 9, 5, EOS], ignore_eos=False, stop_token_ids=[9], min_tokens=3, max_tokens=10)
    assert request.output_token_ids == [EOS, 9, 5, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    request = _run_one([EOS, 5, 6, 9], ignore_eos=False, stop_token_ids=[9], min_tokens=3, max_tokens=10)
    assert request.output_token_ids == [EOS, 5, 6, 9]
    assert request.stop_token_id == 9


def test_max_tokens_finishes_with_length() -> None:
    request = _run_one([], max_tokens=5)
    assert request.num_output_tokens == 5
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.status.finish_reason == "length"


def test_eos_on_the_last_allowed_token_is_a_stop_not_length() -> None:
    request = _run_one([5, EOS], ignore_eos=False, max_tokens=2)
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_max_model_len_finishes_with_length() -> None:
    request = _run_one([], max_model_len=8, num_prompt=6, max_tokens=None)
    assert request.num_tokens == 8
    assert request.status == RequestStatus.FINISHED_LENGTH


# ---- scoring: max_tokens=0 and prompt logprobs ------------------------------------------------------
def test_max_tokens_zero_prefills_in_chunks_and_finishes_without_a_token() -> None:
    harness = Harness(num_blocks=16, budget=4)
    request = harness.add("score", 10, max_tokens=0)
    outs = harness.run_to_completion(max_steps=10)
    assert [_chunks(out)["score"] for out in outs] == [(0, 4), (4, 4), (8, 2)]
    assert not any(seq.needs_sample for out in outs for seq in out.scheduled)
    assert request.status == RequestStatus.FINISHED_LENGTH and request.output_token_ids == []
    assert harness.kv.num_free_blocks == 16


def test_prompt_logprobs_take_no_prefix_cache_hits_until_a_token_is_out() -> None:
    harness = Harness(num_blocks=32, caching=True)
    harness.add("first", 12, max_tokens=1)
    harness.run_to_completion(max_steps=5)
    scored = harness.add("scored", 12, max_tokens=1, prompt_logprobs=1)
    out, _ = harness.step()
    assert _chunks(out)["scored"] == (0, 12) and scored.num_cached_tokens == 0
    plain = harness.add("plain", 12, max_tokens=1)
    harness.step()
    assert plain.num_cached_tokens == 8  # the cache itself still serves (two full blocks of 4)
