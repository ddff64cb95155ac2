"""Lossless verification of proposals: the rejection sampler of speculative sampling, and matching.

For each proposal d_i drawn from the proposer's distribution q_i, with the target's distribution
p_i at the same position (Leviathan et al. 2023; Chen et al. 2023):
- accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
- at the first rejection, emit a token drawn from norm(max(0, p_i - q_i)) and stop;
- when all K are accepted, emit a bonus token drawn from p_{K+1}.
Every emitted token is then distributed exactly as the target would have sampled it. This is what
proposals sampled from a draft model get (`rejection_sample`).

Deterministic proposals (n-gram lookup, greedy requests) are verified by matching instead
(`verify_choices`): the target chooses its own token at each position the way plain decoding
would (the argmax for greedy rows; the sampler's exponential race with the request's next noise
rows for sampled ones), proposals are accepted while they equal that choice, and the first
mismatch emits the choice. Each emitted token is the target's own choice given the tokens before
it, so the output is the one plain decoding gives, token for token, whatever was proposed. For a
one-hot q, acceptance is p_i(d_i) either way, so matching costs no accepted tokens.

Batched over N independent rows (the engine passes one request at a time; tests pass thousands).
"""

from __future__ import annotations

import torch


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dimension; p itself where p == q (rejection impossible there)."""
    residual = (target_probs - draft_probs).clamp_(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(residual.dtype).tiny), target_probs)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify K proposals per row.

    target_probs: [N, K + 1, V] (the target's processed distributions at each proposal and after the last);
    draft_token_ids: int64 [N, K]; draft_probs: [N, K, V], or None for a deterministic (one-hot) proposer.
    Returns (tokens int64 [N, K + 1], num_accepted int64 [N]): row r emits tokens[r, : num_accepted[r] + 1].
    """
    num_rows, num_spec = draft_token_ids.shape
    device = target_probs.device
    index = draft_token_ids.unsqueeze(-1)
    p_draft = target_probs[:, :num_spec].gather(-1, index).squeeze(-1)
    if draft_probs is None:
        draft_probs = torch.zeros_like(target_probs[:, :num_spec]).scatter_(-1, index, 1.0)
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, index).squeeze(-1)
    uniform = torch.rand(num_rows, num_spec, generator=generator, device=device, dtype=target_probs.dtype)
    accepted = uniform * q_draft < p_draft  # u < p/q without dividing by q
    rejected = ~accepted
    num_accepted = torch.where(rejected.any(dim=1), rejected.to(torch.int8).argmax(dim=1), num_spec)
    final_dists = torch.cat([residual_distribution(target_probs[:, :num_spec], draft_probs), target_probs[:, -1:]], 1)
    rows = torch.arange(num_rows, device=device)
    final = torch.multinomial(final_dists[rows, num_accepted], 1, generator=generator).squeeze(1)
    tokens = torch.cat([draft_token_ids, torch.zeros_like(draft_token_ids[:, :1])], dim=1)
    tokens[rows, num_accepted] = final
    return tokens, num_accepted


def verify_choices(target_choices: list[int], draft_token_ids: list[int]) -> list[int]:
    """Accept proposals while they equal the target's own choice, then emit the choice there.

    target_choices has K + 1 entries (at each proposal and after the last); returns 1..K+1 tokens.
    """
    emitted: list[int] = []
    for draft, choice in zip(draft_token_ids, target_choices, strict=False):
        if draft != choice:
            break
        emitted.append(draft)
    emitted.append(target_choices[len(emitted)])
    return emitted
