"""Property test (hypothesis, stateful) of the block pool, KV cache manager and scheduler together.

Random sequences of add / step / abort on small pools, random block sizes, budgets, seat
counts, prefix caching on or off, prompts sharing prefixes, and fake sampled tokens that
include EOS and stop tokens. After every rule:
- the pool's own invariants hold, and each block's reference count equals the number of live
  requests holding it (so no block leaks or is freed twice); waiting requests hold nothing;
- a shadow copy of the KV cache, written the way the model runner writes it, holds each
  running request's own tokens at every computed position (shared prefix blocks never alias
  different tokens);
- each step stays within the token budget and `max_num_seqs`.
At the end every request is driven to completion in a bounded number of steps, after which
every block is free and every reference count is zero.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tidepool.engine.kv_cache import KVCacheManager
from tidepool.engine.request import Request, RequestStatus
from tidepool.engine.sampling_params import SamplingParams
from tidepool.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tidepool.engine.scheduler import Scheduler

EOS = 2
STOP = 3
TOKENS = st.sampled_from([EOS, STOP, 5, 6, 7, 8, 9])
# Prompts start with a slice of one of these, so prefix-cache hits (and misses after a shared
# first block) happen often.
PREFIXES = ([5, 6, 7, 8] * 8, [5, 6, 7, 9] * 8, [9, 8, 7, 6, 5] * 6)
PREFIX_INDEX = st.integers(0, len(PREFIXES) - 1)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.integers(1, 6),
        num_blocks=st.integers(2, 10),
        budget=st.integers(1, 16),
        max_num_seqs=st.integers(1, 5),
        caching=st.booleans(),
        chunked=st.booleans(),
        data=st.data(),
    )
    def setup(
        self,
        block_size: int,
        num_blocks: int,
        budget: int,
        max_num_seqs: int,
        caching: bool,
        chunked: bool,
        data: st.DataObject,
    ) -> None:
        capacity = num_blocks * block_size
        # The engine guarantees both: the cache holds one max-length request, and without chunked
        # prefill the budget holds one max-length prompt.
        self.max_model_len = data.draw(st.integers(min(2, capacity), capacity), label="max_model_len")
        if not chunked:
            budget = max(budget, self.max_model_len)
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.kv, max_num_seqs, budget, self.max_model_len, enable_chunked_prefill=chunked)
        self.shadow: dict[int, list[int | None]] = {b: [None] * block_size for b in range(num_blocks)}
        self.num_added = 0
        self.clock = 0.0

    # ---- rules ------------------------------------------------------------------------------
    @rule(
        prefix_index=PREFIX_INDEX,
        num_prefix=st.integers(0, 32),
        suffix=st.lists(TOKENS, max_size=12),
        max_tokens=st.one_of(st.none(), st.integers(1, 24)),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        use_stop=st.booleans(),
    )
    def add(
        self,
        prefix_index: int,
        num_prefix: int,
        suffix: list[int],
        max_tokens: int | None,
        min_tokens: int,
        ignore_eos: bool,
        use_stop: bool,
    ) -> None:
        prompt = (PREFIXES[prefix_index][:num_prefix] + suffix)[: self.max_model_len] or [5]
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=[STOP] if use_stop else [],
        )
        self.clock += 1.0
        request = Request(f"r{self.num_added}", prompt, params, frozenset({EOS}), arrival_time=self.clock)
        self.num_added += 1
        self.sched.add_request(request)

    # No preconditions: rules that are often disabled make hypothesis discard whole runs. A step
    # with nothing to do must schedule nothing; aborting an unknown id must change nothing.
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self._step(lambda: data.draw(TOKENS, label="sampled token"))

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if not self.sched.requests:
            assert self.sched.finish_requests(["r-unknown"], RequestStatus.FINISHED_ABORTED) == []
            return
        request_id = data.draw(st.sampled_from(sorted(self.sched.requests)), label="abort")
        request = self.sched.requests[request_id]
        assert self.sched.finish_requests([request_id], RequestStatus.FINISHED_ABORTED) == [request]
        assert request.status == RequestStatus.FINISHED_ABORTED
        assert self.kv.block_ids(request_id) == []

    # ---- checks -----------------------------------------------------------------------------
    @invariant()
    def blocks_are_accounted_for(self) -> None:
        if not hasattr(self, "kv"):
            return
        pool = self.kv.pool
        pool.check_invariants()
        holders = [0] * pool.num_blocks
        for request in self.sched.requests.values():
            block_ids = self.kv.block_ids(request.request_id)
            if request.status != RequestStatus.RUNNING:
                assert block_ids == [], f"{request.request_id} is {request.status} but holds blocks"
                continue
            assert len(set(block_ids)) == len(block_ids)
            assert len(block_ids) * self.kv.block_size >= request.num_computed_tokens
            for block_id in block_ids:
                holders[block_id] += 1
        assert [block.ref_cnt for block in pool.blocks] == holders
        assert pool.num_free_blocks == holders.count(0)
        assert len(self.sched.running) <= self.max_num_seqs
        assert set(self.sched.requests) == {r.request_id for r in self.sched.running + self.sched.waiting}

    @invariant()
    def running_requests_see_their_own_kv(self) -> None:
        if not hasattr(self, "kv"):
            return
        for request in self.sched.running:
            self._check_kv(request, self.kv.block_ids(request.request_id), request.num_computed_tokens)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        live = self.sched.requests.values()
        total = sum(r.num_prompt_tokens + (r.sampling_params.max_tokens or self.max_model_len) for r in live)
        max_steps = 50 + 30 * total  # recompute after preemption may repeat work, but not forever
        num_steps = 0
        while self.sched.has_unfinished_requests():
            assert num_steps < max_steps, "requests did not finish: starvation or livelock"
            self._step(lambda: 7)
            self.blocks_are_accounted_for()
            num_steps += 1
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks
        assert all(block.ref_cnt == 0 for block in self.kv.pool.blocks)
        assert self.kv.usage == 0.0
        self.kv.pool.check_invariants()

    # ---- helpers ----------------------------------------------------------------------------
    def _step(self, draw_token: object) -> None:
        out: SchedulerOutput = self.sched.schedule()
        if not self.sched.has_unfinished_requests():
            assert out.is_empty and out.num_batched_tokens == 0
        assert out.num_batched_tokens == sum(seq.num_new_tokens for seq in out.scheduled) <= self.budget
        assert len(out.scheduled) <= self.max_num_seqs
        assert len({seq.request.request_id for seq in out.scheduled}) == len(out.scheduled)
        bs = self.kv.block_size
        for seq in out.scheduled:  # the runner writes every new token's KV before attention reads
            assert seq.num_new_tokens >= 1
            end = seq.num_computed_tokens + seq.num_new_tokens
            assert end <= seq.request.num_tokens
            tokens = seq.request.token_ids_slice(seq.num_computed_tokens, end)
            for pos, token in zip(range(seq.num_computed_tokens, end), tokens, strict=True):
                self.shadow[seq.block_ids[pos // bs]][pos % bs] = token
        for seq in out.scheduled:
            self._check_kv(seq.request, seq.block_ids, seq.num_computed_tokens + seq.num_new_tokens)
        sampled = {seq.request.request_id: draw_token() for seq in out.scheduled if seq.needs_sample}  # type: ignore[operator]
        finished = self.sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        # Statistics only (`--hypothesis-show-statistics`): shows the runs reach the interesting paths.
        if out.preempted_request_ids:
            event("preemption")
        if any(seq.request.num_cached_tokens for seq in out.scheduled):
            event("prefix cache hit")
        if any(not seq.num_computed_tokens and seq.num_new_tokens < seq.request.num_tokens for seq in out.scheduled):
            event("chunked prefill")
        for request in finished:
            assert request.is_finished and self.kv.block_ids(request.request_id) == []
            params = request.sampling_params
            assert params.max_tokens is None or request.num_output_tokens <= params.max_tokens
            # A prompt of exactly max_model_len tokens still gets its one token (sampled from the
            # last position's logits; its own KV is never needed).
            assert request.num_tokens <= max(self.max_model_len, request.num_prompt_tokens + 1)
            assert request.num_computed_tokens <= self.max_model_len

    def _check_kv(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        bs = self.kv.block_size
        written = [self.shadow[block_ids[pos // bs]][pos % bs] for pos in range(num_tokens)]
        assert written == request.token_ids_slice(0, num_tokens), f"{request.request_id} would read foreign KV"


SchedulerMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_property = SchedulerMachine.TestCase
