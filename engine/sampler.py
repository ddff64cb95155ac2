"""Turns the step's logits into next tokens, one row per sequence that samples this step.

Order, as in vLLM: logprobs come from the raw model distribution; then `logit_bias` (added to
the logits, as OpenAI defines it), penalties (repetition over prompt+output, presence/frequency
over output), the `min_tokens` mask on EOS/stop tokens, the structured-output mask (one batched
operation for every constrained row, structured_outputs/matchers.py), then greedy argmax (also for a
temperature below `GREEDY_TEMPERATURE`) or temperature → top-k → top-p → min-p → sample.
Sampling is an exponential race (argmax of p / Exp(1) noise) whose noise for a seeded request
comes from that request's own generator, one Exp(1) row per token, so its tokens do not depend on
what else is in the batch. Generators persist across steps and preemptions; `release` drops them
when a request ends. Speculation with deterministic proposals draws the same rows (`race_noise`)
and rewinds the generator to one row per emitted token, so it consumes the stream exactly as
plain decoding does (spec_decode/speculator.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .request import Request
from .structured_outputs import Grammar, GrammarBackend
from .structured_outputs.matchers import GrammarMasks

LogprobEntry = tuple[float, list[tuple[int, float]]]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._biases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # request id -> (token ids, values)
        self.grammar_masks = GrammarMasks()  # constrained requests' grammar state

    def constrain(self, request: Request, grammar: Grammar, backend: GrammarBackend) -> None:
        """Constrain the request's tokens to `grammar` from its next sampled token on, until `release`."""
        self.grammar_masks.add(request, grammar, backend)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._biases.pop(request_id, None)
        self.grammar_masks.release(request_id)

    def generator_for(self, request: Request) -> torch.Generator:
        """The request's own seeded generator (kept across steps), or the shared one when it has no seed."""
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator

    def race_noise(self, request: Request, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Exp(1) noise [rows, vocab] (dtype and device of `like`) for the request's next `rows` tokens,
        each row drawn exactly as `sample` draws one token's, and the generator state after each row:
        a caller that uses only the first e rows calls `rewind(request, states[e - 1])`."""
        generator = self.generator_for(request)
        noise = torch.empty(rows, like.shape[-1], dtype=like.dtype, device=like.device)
        states = []
        for row in range(rows):
            _draw_exponential(noise[row], generator)
            states.append(generator.get_state())
        return noise, states

    def rewind(self, request: Request, state: torch.Tensor) -> None:
        """Put the request's generator back to `state` (one that `race_noise` returned)."""
        self.generator_for(request).set_state(state)

    @torch.inference_mode()
    def probs(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The normalized distribution each row's token is drawn from (one row per request view).

        Exactly the processing `sample` applies: penalties and masks, then one-hot argmax for greedy
        rows, or temperature, top-k, top-p and min-p. The rejection sampler scores proposals
        against it, so speculation keeps the sampler's distribution (one implementation).
        """
        logits = logits.clone()
        for row, request in enumerate(requests):
            self._apply_penalties_and_masks(logits, row, request)
        self.grammar_masks.apply(logits, requests)
        probs = torch.zeros_like(logits)
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=logits.device)
            probs[index] = torch.nn.functional.one_hot(logits[index].argmax(dim=-1), logits.shape[1]).to(probs.dtype)
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            unnormalized = _processed_probs(logits[index], [requests[i] for i in random_rows])
            probs[index] = unnormalized / unnormalized.sum(dim=-1, keepdim=True)
        return probs

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], dict[str, LogprobEntry]]:
        """logits: float32 [num_rows, vocab]; returns token ids (row order) and logprobs by request id."""
        if all(_is_plain_greedy(r) for r in requests):
            # Nothing to apply before the argmax but grammar masks, which go into these logits in place (nothing
            # reads them after the sampler): no copy, one device-to-host transfer.
            self.grammar_masks.apply(logits, requests)
            return logits.argmax(dim=-1).tolist(), {}
        raw = logits
        logits = logits.clone()
        for row, request in enumerate(requests):
            self._apply_penalties_and_masks(logits, row, request)
        self.grammar_masks.apply(logits, requests)

        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=logits.device)
            tokens[index] = logits[index].argmax(dim=-1)
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            chosen = [requests[i] for i in random_rows]
            tokens[index] = self._sample_random(logits[index], chosen)
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, requests, token_list)

    # ---- pieces -------------------------------------------------------------------------------
    def _apply_penalties_and_masks(self, logits: torch.Tensor, row: int, request: Request) -> None:
        params = request.sampling_params
        vocab = logits.shape[1]
        if params.logit_bias:
            ids, values = self._bias_of(request, logits)
            logits[row, ids] += values
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            ids = [t for t in request.all_token_ids if t < vocab]
            seen[torch.tensor(ids, dtype=torch.long, device=logits.device)] = True
            values = logits[row]
            penalised = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
            logits[row] = torch.where(seen, penalised, values)
        if (params.presence_penalty or params.frequency_penalty) and request.output_token_ids:
            ids = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
        if request.num_output_tokens < params.min_tokens and params.structured_outputs is None:
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned |= request.eos_token_ids
            banned_ids = [t for t in banned if t < vocab]
            if banned_ids:
                logits[row, banned_ids] = float("-inf")

    def _bias_of(self, request: Request, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's logit_bias as (token ids, values) tensors, built once per request: a bias may name the
        whole vocabulary, and rebuilding it from the dict every step would cost every request in the batch."""
        cached = self._biases.get(request.request_id)
        if cached is None:
            # The engine refuses ids outside the model's vocabulary; the filter keeps a padded vocab safe.
            bias = [(t, b) for t, b in (request.sampling_params.logit_bias or {}).items() if t < logits.shape[1]]
            ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
            values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
            cached = self._biases[request.request_id] = (ids, values)
        return cached

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = _processed_probs(logits, requests)
        noise = torch.empty_like(probs)
        unseeded = []
        for row, request in enumerate(requests):
            if request.sampling_params.seed is None:
                unseeded.append(row)
                continue
            _draw_exponential(noise[row], self.generator_for(request))
        if unseeded:
            index = torch.tensor(unseeded, device=logits.device)
            noise[index] = torch.empty(len(unseeded), probs.shape[1], device=logits.device).exponential_(
                generator=self.generator
            )
        return (probs / noise).argmax(dim=-1)

    def _logprobs(self, raw: torch.Tensor, requests: Sequence[Request], tokens: list[int]) -> dict[str, LogprobEntry]:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return {}
        logprobs = torch.log_softmax(raw[rows], dim=-1)
        max_n = max(requests[i].sampling_params.logprobs or 0 for i in rows)
        chosen, top_ids_list, top_values_list, _ = token_logprobs(
            logprobs, [tokens[row] for row in rows], max(max_n, 1)
        )
        result: dict[str, LogprobEntry] = {}
        for k, row in enumerate(rows):
            request = requests[row]
            n = request.sampling_params.logprobs or 0
            top = list(zip(top_ids_list[k][:n], top_values_list[k][:n], strict=True))
            result[request.request_id] = (chosen[k], top)
        return result


class TokenLogprobs(NamedTuple):
    chosen: list[float]  # per row: its token's logprob
    top_ids: list[list[int]]  # per row: the `num_top` most likely tokens (empty when 0) ...
    top_values: list[list[float]]  # ... and their logprobs
    ranks: list[int] | None  # per row: its token's 1-based rank (only when asked for)


def token_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], num_top: int, with_ranks: bool = False
) -> TokenLogprobs:
    """Per row of `logprobs` [rows, vocab]: its token's logprob, its `num_top` most likely tokens and,
    if asked, its token's rank. One device transfer per list, not one per row."""
    chosen = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long, device=logprobs.device).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist() if with_ranks else None
    if num_top <= 0:
        return TokenLogprobs(chosen.squeeze(1).tolist(), [[] for _ in token_ids], [[] for _ in token_ids], ranks)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return TokenLogprobs(chosen.squeeze(1).tolist(), top_ids.tolist(), top_values.tolist(), ranks)


def _draw_exponential(row: torch.Tensor, generator: torch.Generator) -> None:
    """One token's race noise from one generator: the draw `sample` (seeded rows) and `race_noise` share."""
    row.exponential_(generator=generator)


def _is_plain_greedy(request: Request) -> bool:
    """Greedy, and nothing would change its logits row first but a grammar's mask: no penalty, `min_tokens`
    mask, bias or logprobs."""
    params = request.sampling_params
    return (
        params.is_greedy
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and request.num_output_tokens >= params.min_tokens
        and not getattr(params, "logit_bias", None)  # a field the server's OpenAI mapping may set
    )


def _processed_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, then min-p; unnormalized after min-p (the race does not need it)."""
    temps = torch.tensor([r.sampling_params.temperature for r in requests], device=logits.device)
    logits = logits / temps.unsqueeze(1)
    top_ks = [r.sampling_params.top_k for r in requests]
    top_ps = [r.sampling_params.top_p for r in requests]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        logits = _top_k_top_p(logits, top_ks, top_ps)
    probs = torch.softmax(logits, dim=-1)
    if any(r.sampling_params.min_p > 0 for r in requests):  # decided on the host: no device sync
        min_ps = torch.tensor([r.sampling_params.min_p for r in requests], device=logits.device)
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device).clamp(max=vocab)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = positions >= ks.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    ps = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
    remove = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= ps
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)
