"""Draft-model proposer: a small model with the target's tokenizer proposes K tokens per step.

The draft has its own model runner, paged KV cache and block manager (prefix caching off), so
it never touches the target's blocks. Per request it keeps a shadow `Request` whose
`num_computed_tokens` counts the draft KV positions that hold the right tokens.

Sync invariant: the draft's KV holds the request's tokens [0, num_synced) plus `computed_drafts`
(the proposals it fed, all but the last). Before proposing, the longest prefix of those that
the request really has now is kept (accepted proposals match, a rejection cuts there) and the
rest is rolled back: `num_computed_tokens` drops and the tail blocks are freed, so the next
pass overwrites them. A request the draft skipped for a while simply catches up with a chunk.

Proposals: pass 0 feeds the request's uncomputed tokens (a chunk) and samples d1 at the last
one; passes 1..K-1 feed d_j and sample d_{j+1}, batched over requests. Greedy requests take the
argmax; sampled ones draw from q = the target sampler's own processing of the draft logits
(same penalties, temperature, top-k/p, min-p), and q is kept for the rejection sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig
from ..engine_config import resolve_model_path
from ..gguf.detect import is_gguf_file
from ..kv_cache import KVCacheManager
from ..loading.formats import read_model_config
from ..loading.loader import load_model
from ..model_runner import ModelRunner
from ..request import Request
from ..sampler import LogprobEntry, Sampler
from ..sched_output import ScheduledSeq, SchedulerOutput
from ..tokenizer import Tokenizer


class _DraftSampler(Sampler):
    """Samples draft tokens with the target sampler's processing and keeps each row's q."""

    def __init__(self, target: Sampler) -> None:
        super().__init__(device=target.device)
        self.target = target
        self.last_probs: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], dict[str, LogprobEntry]]:
        probs = self.target.probs(logits, requests)
        tokens: list[int] = []
        for row, request in enumerate(requests):
            if request.sampling_params.is_greedy:
                tokens.append(int(probs[row].argmax()))
                continue
            generator = self.target.generator_for(request)
            tokens.append(int(torch.multinomial(probs[row], 1, generator=generator)))
            self.last_probs[request.request_id] = probs[row]
        return tokens, {}


@dataclass(slots=True)
class _DraftState:
    shadow: Request  # the draft's view: same prompt, output + proposals; num_computed_tokens = draft KV
    num_synced: int = 0
    computed_drafts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class DraftProposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # q, [K, vocab]; None for greedy requests (one-hot, not needed)


def check_draft_compatible(draft: str | Path, target_tokenizer: Tokenizer, target_config: ModelConfig) -> ModelConfig:
    """The draft must share the target's vocabulary exactly; raises ValueError naming the mismatch.

    `draft` is what `resolve_model_path` returned: a Hugging Face folder or a GGUF file (dequantized).
    """
    folder = Path(draft)
    config = read_model_config(folder)
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"draft model {folder} has vocab_size {config.vocab_size} but the target has {target_config.vocab_size}; "
            "a draft must use the target's tokenizer and vocabulary (use method 'ngram' otherwise)"
        )
    if not is_gguf_file(folder) and not (folder / "tokenizer.json").is_file():
        raise ValueError(f"draft model {folder} has no tokenizer.json, so its vocabulary cannot be checked")
    draft_vocab = Tokenizer.from_pretrained(folder).backend.get_vocab(with_added_tokens=True)
    target_vocab = target_tokenizer.backend.get_vocab(with_added_tokens=True)
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
        raise ValueError(
            f"draft model {folder} has a different tokenizer from the target (e.g. {differing}); "
            "a draft must use exactly the target's tokenizer"
        )
    return config


class DraftProposer:
    def __init__(
        self,
        path: str | Path,
        target_tokenizer: Tokenizer,
        target_config: ModelConfig,
        target_sampler: Sampler,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        show_progress: bool = True,
    ) -> None:
        try:
            path = resolve_model_path(str(path))  # a folder, a .gguf file or a catalogue name, as for the target
        except FileNotFoundError as err:
            raise ValueError(f"speculative draft_model: {err}") from None
        config = check_draft_compatible(path, target_tokenizer, target_config)
        if config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"draft model {path} supports {config.max_position_embeddings} positions, fewer than "
                f"max_model_len={max_model_len}; lower max_model_len or use a draft with longer context"
            )
        model, model_config = load_model(
            path, dtype=dtype, device=device, max_positions=max_model_len, show_progress=show_progress
        )
        self.model_config = model_config
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.sampler = _DraftSampler(target_sampler)
        self.runner = ModelRunner(model, model_config, block_size, num_blocks, self.sampler, device)
        self.runner.computes_prompt_logprobs = False  # the target's runner computes them
        self.runner.warm_up("draft model")  # its kernels (Triton's JIT, its one-call step) before the first request
        self._states: dict[str, _DraftState] = {}

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.kv.free(state.shadow)

    def propose(self, requests: list[tuple[Request, int]]) -> dict[str, DraftProposal]:
        """K_r tokens for each (request, K_r); a request the draft KV cannot hold gets none this step."""
        active: list[tuple[Request, int, _DraftState]] = []
        for request, num_spec in requests:
            state = self._sync(request)
            num_new = request.num_tokens - state.shadow.num_computed_tokens
            if not self.kv.allocate_slots(state.shadow, num_new + num_spec - 1):
                self.release(request.request_id)  # draft KV full: start over later rather than evict others
                continue
            active.append((request, num_spec, state))
        drafts: dict[str, list[int]] = {request.request_id: [] for request, _, _ in active}
        probs: dict[str, list[torch.Tensor]] = {request.request_id: [] for request, _, _ in active}
        for step in range(max((k for _, k, _ in active), default=0)):
            seqs: list[ScheduledSeq] = []
            for request, num_spec, state in active:
                if num_spec <= step:
                    continue
                shadow = state.shadow
                shadow.output_token_ids = request.output_token_ids + drafts[request.request_id]
                start = shadow.num_computed_tokens
                block_ids = self.kv.block_ids(request.request_id)
                seqs.append(ScheduledSeq(shadow, start, shadow.num_tokens - start, block_ids, True))
            # The runner's token layout puts single-token decodes first.
            seqs.sort(key=lambda seq: seq.num_new_tokens != 1)
            self.sampler.last_probs.clear()
            out = self.runner.execute(SchedulerOutput(scheduled=seqs, num_batched_tokens=0))
            for seq in seqs:
                request_id = seq.request.request_id
                seq.request.num_computed_tokens = seq.num_computed_tokens + seq.num_new_tokens
                drafts[request_id].append(out.sampled_token_ids[request_id])
                if request_id in self.sampler.last_probs:
                    probs[request_id].append(self.sampler.last_probs[request_id])
        proposals: dict[str, DraftProposal] = {}
        for request, _, state in active:
            request_id = request.request_id
            state.num_synced = request.num_tokens
            state.computed_drafts = drafts[request_id][:-1]
            state.shadow.output_token_ids = list(request.output_token_ids)
            rows = probs[request_id]
            proposals[request_id] = DraftProposal(drafts[request_id], torch.stack(rows) if rows else None)
        return proposals

    def _sync(self, request: Request) -> _DraftState:
        """The request's draft state with KV rolled back to what still matches the request's tokens."""
        state = self._states.get(request.request_id)
        if state is None:
            shadow = Request(
                request.request_id, request.prompt_token_ids, request.sampling_params, request.eos_token_ids
            )
            state = self._states[request.request_id] = _DraftState(shadow)
        tail = request.token_ids_slice(state.num_synced, state.num_synced + len(state.computed_drafts))
        num_matching = 0
        for real, proposed in zip(tail, state.computed_drafts, strict=False):
            if real != proposed:
                break
            num_matching += 1
        # At least the last known token is fed again: its logits give the first proposal.
        valid = min(state.num_synced + num_matching, state.shadow.num_computed_tokens, request.num_tokens - 1)
        state.shadow.num_computed_tokens = valid
        state.num_synced, state.computed_drafts = valid, []
        self.kv.free_tail(state.shadow, valid)
        return state
