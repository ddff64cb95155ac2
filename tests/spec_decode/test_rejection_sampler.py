"""The rejection sampler on fixed p/q: emitted tokens follow the target distribution (chi-square), and a
deliberately wrong residual rule is caught by the same test, so the test can fail."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import chi_square_p_value

from tidepool.engine.spec_decode import rejection_sampler
from tidepool.engine.spec_decode.rejection_sampler import rejection_sample, verify_choices

NUM_SAMPLES = 60_000
VOCAB = 6
ALPHA = 1e-3  # a correct sampler fails one run in a thousand; the wrong one below gives p-values ~1e-100


def _fixed_distributions(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, VOCAB, generator=gen) * 1.5, dim=-1)  # K=2 proposals + bonus position
    q = torch.softmax(torch.randn(2, VOCAB, generator=gen) * 1.5, dim=-1)
    return p, q


def _run(p: torch.Tensor, q: torch.Tensor | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_spec = p.shape[0] - 1
    if q is None:  # deterministic proposer: the same proposal on every row
        draft = torch.tensor([[1, 4][:num_spec]]).expand(NUM_SAMPLES, num_spec)
    else:
        draft = torch.stack(
            [torch.multinomial(q[i], NUM_SAMPLES, replacement=True, generator=gen) for i in range(2)], 1
        )
    target = p.unsqueeze(0).expand(NUM_SAMPLES, -1, -1)
    drafts_q = None if q is None else q.unsqueeze(0).expand(NUM_SAMPLES, -1, -1)
    return rejection_sample(target, draft, drafts_q, gen)


@pytest.mark.parametrize("proposer", ["sampled-draft", "one-hot"])
def test_emitted_tokens_follow_the_target(proposer: str) -> None:
    p, q = _fixed_distributions()
    tokens, num_accepted = _run(p, q if proposer == "sampled-draft" else None, seed=1)
    first = torch.bincount(tokens[:, 0], minlength=VOCAB)
    assert chi_square_p_value(first, p[0]) > ALPHA
    # Given the first proposal was accepted, the second emitted token again follows the target at that position.
    second = torch.bincount(tokens[num_accepted >= 1, 1], minlength=VOCAB)
    assert chi_square_p_value(second, p[1]) > ALPHA
    # Acceptance has its known rate sum_x min(p, q): proposals are neither always nor never taken.
    q0 = q[0] if proposer == "sampled-draft" else torch.nn.functional.one_hot(torch.tensor(1), VOCAB).float()
    expected_rate = float(torch.minimum(p[0], q0).sum())
    assert abs(float((num_accepted >= 1).float().mean()) - expected_rate) < 0.01


def test_a_wrong_residual_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resampling from p instead of norm(max(0, p - q)) after a rejection skews the output: the test sees it."""
    monkeypatch.setattr(rejection_sampler, "residual_distribution", lambda p, q: p)
    p, q = _fixed_distributions()
    tokens, _ = _run(p, q, seed=1)
    assert chi_square_p_value(torch.bincount(tokens[:, 0], minlength=VOCAB), p[0]) < 1e-12


def test_accepting_every_proposal_is_caught() -> None:
    """The acceptance rule matters too: taking every draft token gives q's distribution, not p's."""
    p, q = _fixed_distributions()
    gen = torch.Generator().manual_seed(2)
    draft = torch.multinomial(q[0], NUM_SAMPLES, replacement=True, generator=gen)
    assert chi_square_p_value(torch.bincount(draft, minlength=VOCAB), p[0]) < 1e-12


def test_equal_p_and_q_accept_everything() -> None:
    p, _ = _fixed_distributions()
    tokens, num_accepted = _run(p, p[:2], seed=3)
    assert bool((num_accepted == 2).all())
    assert chi_square_p_value(torch.bincount(tokens[:, 2], minlength=VOCAB), p[2]) > ALPHA


@pytest.mark.parametrize(
    ("argmax", "draft", "emitted"),
    [
        ([5, 6, 7], [5, 6], [5, 6, 7]),  # all accepted, bonus token
        ([5, 6, 7], [5, 9], [5, 6]),  # second rejected: the target's argmax replaces it
        ([5, 6, 7], [1, 6], [5]),  # first rejected
        ([5, 6], [5], [5, 6]),
    ],
)
def test_verify_choices(argmax: list[int], draft: list[int], emitted: list[int]) -> None:
    assert verify_choices(argmax, draft) == emitted
