"""The sampler's greedy fast path: taken only when nothing would change a row, same tokens as the full path."""

from __future__ import annotations

import pytest
import torch

from tidepool.engine.request import Request
from tidepool.engine.sampler import Sampler
from tidepool.engine.sampling_params import SamplingParams


def _request(request_id: str, params: SamplingParams, output: list[int] | None = None) -> Request:
    request = Request(request_id, [0, 1], params, eos_token_ids=frozenset({2}))
    request.output_token_ids = list(output or [])
    return request


def _logits(rows: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))


def test_plain_greedy_batch_skips_penalties_and_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = Sampler()

    def forbidden(*_: object) -> None:
        raise AssertionError("the greedy fast path must not process rows")

    monkeypatch.setattr(sampler, "_apply_penalties_and_masks", forbidden)
    logits = _logits(6)
    before = logits.clone()
    requests = [_request(f"r{i}", SamplingParams(temperature=0.0), output=[5] * i) for i in range(6)]
    tokens, logprobs = sampler.sample(logits, requests)
    assert tokens == logits.argmax(dim=-1).tolist() and logprobs == {}
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7, seed=3),
    ],
    ids=["repetition", "presence", "frequency", "min_tokens", "logprobs", "sampled"],
)
def test_any_processed_row_takes_the_full_path_with_unchanged_results(params: SamplingParams) -> None:
    logits = _logits(3)
    logits[:, 2] = 50.0  # EOS is everyone's argmax: min_tokens must mask it
    logits[:, 7] = 49.0  # a token already generated: penalties must push it down
    requests = [
        _request("plain0", SamplingParams(temperature=0.0), output=[7]),
        _request("special", params, output=[7]),
        _request("plain1", SamplingParams(temperature=0.0), output=[7]),
    ]
    tokens, logprobs = Sampler(seed=1).sample(logits, requests)
    assert tokens[0] == tokens[2] == 2
    if params.min_tokens:
        assert tokens[1] == 7  # EOS masked, the next best
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        assert tokens[1] == 2
    if params.logprobs is not None:
        want = torch.log_softmax(logits[1], dim=-1)
        chosen, top = logprobs["special"]
        assert chosen == pytest.approx(float(want[tokens[1]]))
        assert [t for t, _ in top] == want.topk(2).indices.tolist()


def test_logit_bias_is_built_once_per_request_and_dropped_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bias over the whole vocabulary is turned into tensors once, not at every step of every row
    (the server saw a full-vocabulary bias slow every request in the batch ~5x); it still applies each step."""
    sampler = Sampler()
    bias = {t: (-100.0 if t != 7 else 0.0) for t in range(50)}  # only token 7 can win
    requests = [_request(f"r{i}", SamplingParams(temperature=0.0, logit_bias=bias)) for i in range(3)]
    conversions = []
    real_tensor = torch.tensor
    monkeypatch.setattr(
        torch, "tensor", lambda data, *a, **k: conversions.append(len(data)) or real_tensor(data, *a, **k)
    )
    for step in range(4):
        tokens, _ = sampler.sample(_logits(3), requests)
        assert tokens == [7, 7, 7], step
    assert conversions.count(50) == 6  # ids and values converted once per request, not 24 times (3 rows x 4 steps)
    for request in requests:
        sampler.release(request.request_id)
    assert sampler._biases == {}
