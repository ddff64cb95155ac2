"""Lossless verification of proposals: the rejection sampler of speculative sampling.

For each proposal d_i drawn from the proposer's distribution q_i, with the target's distribution
p_i at the same position (Leviathan et al. 2023; Chen et al. 2023):
- accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
- at the first rejection, emit a token drawn from norm(max(0, p_i - q_i)) and stop;
- when all K are accepted, emit a bonus token drawn from p_{K+1}.
Every emitted token is then distributed exactly as the target would have sampled it. A
deterministic proposer (n-gram lookup, a greedy draft) has a one-hot q: acceptance is p_i(d_i),
and the residual is p_i with d_i removed. Greedy requests have a one-hot p: proposals are accepted
while they equal the argmax, and the first mismatch emits the argmax, so greedy output is identical
to decoding without speculation, and no random numbers are consumed.

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


def greedy_verify(target_argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """Greedy rows: accept proposals while they equal the target's argmax, then emit the argmax there.

    target_argmax has K + 1 entries (at each proposal and after the last); returns 1..K+1 tokens.
    """
    emitted: list[int] = []
    for draft, best in zip(draft_token_ids, target_argmax, strict=False):
        if draft != best:
            break
        emitted.append(draft)
    emitted.append(target_argmax[len(emitted)])
    return emitted
