"""Speculative decoding as an engine step hook (step_hooks.py): propose before scheduling, verify in the run.

`propose` runs before `Scheduler.schedule`: for every running request that is decoding (its
next token is the one to sample), the proposer suggests K_r tokens, K_r derived per request
(`num_spec_tokens_for`) and zero for everyone while the batch is too large to pay
(`speculation_pays`). The scheduler feeds them after the pending token (dropping them when the
budget or KV memory is short), the runner returns the target logits at each position, and
`verify` turns those into emitted tokens, using the target sampler's own processing of each
position's logits (penalties see the proposals before that position): proposals sampled from a
draft model go through the rejection sampler, so the emitted tokens have exactly the distribution
plain decoding would give; deterministic ones (n-gram, and any greedy request) are matched
against the target's own choice, with a seeded request's own noise rows, so the emitted tokens
are the ones plain decoding would give, whatever the batch or budget did to the proposals.

Proposers: suffix decoding (suffix.py, the model-free default: the request's text and recent
outputs, which join its cache as their requests finish), n-gram lookup (ngram.py) or a draft model.

Backoff on measured acceptance, per request: after m verification steps in a row that accepted
nothing, the request gets no proposals for min(2^m - 1, MAX_BACKOFF_STEPS) steps (a proposer that
keeps missing, e.g. n-gram lookup on free text, then costs almost nothing); one accepted token
resets it. The decision uses only the past, so every emitted token keeps the target's distribution.
Counters feed
`vllm:spec_decode_num_draft_tokens` / `vllm:spec_decode_num_accepted_tokens` through `stats()`.
`verify` runs as the hook's `after_run`, inside the engine's isolated run: a request whose
verification raises fails alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from ..request import Request
from ..sampler import Sampler
from ..sched_output import ModelRunnerOutput, SchedulerOutput
from ..step_hooks import BeforeSchedule, HookContext, StepHook, StepView
from .config import SpeculativeConfig, num_spec_tokens_for, speculation_pays
from .draft import DraftProposer
from .ngram import NgramProposer
from .rejection_sampler import rejection_sample, verify_choices
from .suffix import SuffixProposer

logger = logging.getLogger(__name__)

MAX_BACKOFF_STEPS = 15


class Speculator(StepHook):
    """Speculative decoding as a step hook: propose before scheduling, verify in the run, release on finish."""

    def __init__(
        self,
        config: SpeculativeConfig,
        sampler: Sampler,
        max_model_len: int,
        max_num_batched_tokens: int,
        draft: DraftProposer | None = None,
    ) -> None:
        self.config = config
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.ngram = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if config.method == "ngram" else None
        )
        self.suffix = SuffixProposer() if config.method == "suffix" else None
        self._running: dict[str, Request] = {}  # suffix decoding: each request's output joins the cache when it ends
        self.draft = draft
        self._draft_probs: dict[str, torch.Tensor | None] = {}
        self._misses: dict[str, int] = {}  # consecutive verification steps that accepted nothing
        self._cooldown: dict[str, int] = {}  # steps left without proposals
        self.num_draft_tokens = 0  # proposals verified (cumulative)
        self.num_accepted_tokens = 0  # of which accepted
        self.num_verified_seqs = 0  # verification rows (one per request per step with proposals)

    @classmethod
    def build(cls, config: SpeculativeConfig, ctx: HookContext) -> Speculator:
        draft = None
        if config.method == "draft" and config.draft_model is not None:
            # As many blocks as the target plus each request's K proposals: the draft is smaller, so
            # this costs less memory than the target's cache and never runs out before it does.
            extra = ctx.max_num_seqs * -(-config.num_speculative_tokens // ctx.block_size)
            draft = DraftProposer(
                config.draft_model,
                ctx.tokenizer,
                ctx.model_config,
                ctx.sampler,
                ctx.dtype,
                ctx.device,
                ctx.max_model_len,
                ctx.block_size,
                ctx.num_kv_blocks + extra,
                ctx.show_progress,
            )
        logger.info(
            "speculative decoding: method=%s, K=%d, off at >= %d running requests",
            config.method,
            config.num_speculative_tokens,
            config.disable_by_batch_size,
        )
        return cls(config, ctx.sampler, ctx.max_model_len, ctx.max_num_batched_tokens, draft)

    # ---- the step hook ------------------------------------------------------------------------
    def before_schedule(self, view: StepView) -> BeforeSchedule:
        return BeforeSchedule(spec_token_ids=self.propose(view.running))

    def after_run(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        self.verify(sched_out, runner_out)

    def on_finish(self, request_id: str) -> None:
        self.release(request_id)

    def stats(self) -> dict[str, int]:
        return {"spec_num_draft_tokens": self.num_draft_tokens, "spec_num_accepted_tokens": self.num_accepted_tokens}

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def release(self, request_id: str) -> None:
        request = self._running.pop(request_id, None)
        if request is not None and self.suffix is not None:
            self.suffix.remember(request.output_token_ids)
        self._draft_probs.pop(request_id, None)
        self._misses.pop(request_id, None)
        self._cooldown.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(request_id)

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Proposals for this step's decoding requests (request id -> tokens); empty when speculation is off."""
        self._draft_probs.clear()
        if self.suffix is not None:
            for request in running:
                self._running.setdefault(request.request_id, request)
        k = self.config.num_speculative_tokens
        if not running or not speculation_pays(
            len(running), k, self.max_num_batched_tokens, self.config.disable_by_batch_size
        ):
            return {}
        wanted: list[tuple[Request, int]] = []
        for request in running:
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # still prefilling: its next step samples no proposal-able position
            cooldown = self._cooldown.get(request.request_id, 0)
            if cooldown:
                self._cooldown[request.request_id] = cooldown - 1
                continue
            params = request.sampling_params
            num_spec = num_spec_tokens_for(
                k,
                request.num_tokens,
                request.num_output_tokens,
                params.max_tokens,
                self.max_model_len,
                params.logprobs is not None,
            )
            if num_spec > 0:
                wanted.append((request, num_spec))
        lookup = self.ngram or self.suffix  # the model-free proposers
        if lookup is not None:
            proposals = {}
            for request, num_spec in wanted:
                tokens = lookup.propose(request.all_token_ids, num_spec)
                if tokens:
                    proposals[request.request_id] = tokens
            return proposals
        if self.draft is None:
            return {}
        drafted = self.draft.propose(wanted)
        self._draft_probs = {request_id: proposal.probs for request_id, proposal in drafted.items()}
        return {request_id: proposal.token_ids for request_id, proposal in drafted.items()}

    @torch.inference_mode()
    def verify(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """Fill `runner_out.spec_token_ids` for every sequence that was scheduled with proposals."""
        for seq in sched_out.scheduled:
            if not (seq.spec_token_ids and seq.needs_sample):
                continue
            request = seq.request
            request_id = request.request_id
            logits = runner_out.spec_logits.pop(request_id)
            proposed = seq.spec_token_ids  # possibly fewer than proposed: the scheduler trims to the budget
            num_spec = len(proposed)
            # Row i is the distribution after the request's tokens plus proposals [0, i).
            views = [request] + [
                dataclasses.replace(request, output_token_ids=request.output_token_ids + proposed[:i])
                for i in range(1, num_spec + 1)
            ]
            target_probs = self.sampler.probs(logits, views)
            draft_probs = self._draft_probs.get(request_id)
            if request.sampling_params.is_greedy:
                emitted = verify_choices(target_probs.argmax(dim=-1).tolist(), proposed)
            elif draft_probs is None:  # deterministic proposals: the target races as plain decoding does
                noise, states = self.sampler.race_noise(request, num_spec + 1, target_probs)
                emitted = verify_choices((target_probs / noise).argmax(dim=-1).tolist(), proposed)
                self.sampler.rewind(request, states[len(emitted) - 1])  # one noise row per emitted token
            else:
                tokens, num_accepted = rejection_sample(
                    target_probs.unsqueeze(0),
                    torch.tensor([proposed], dtype=torch.long, device=target_probs.device),
                    draft_probs[:num_spec].unsqueeze(0),
                    self.sampler.generator_for(request),
                )
                emitted = tokens[0, : int(num_accepted[0]) + 1].tolist()
            runner_out.spec_token_ids[request_id] = emitted
            if len(emitted) > 1:
                self._misses.pop(request_id, None)
            else:
                misses = self._misses[request_id] = self._misses.get(request_id, 0) + 1
                self._cooldown[request_id] = min(2**misses - 1, MAX_BACKOFF_STEPS)
            self.num_draft_tokens += num_spec
            self.num_accepted_tokens += len(emitted) - 1
            self.num_verified_seqs += 1
