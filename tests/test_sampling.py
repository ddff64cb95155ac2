"""Sampling: seeded reproducibility, temperature/top-k/top-p/min-p, penalties, stops, logprobs, n, chat.

Two levels: the `Sampler` on hand-made logits with fake requests (exact, fast), and the whole
engine on the tiny random llama (`tiny_model_dir`) for behaviour users see through `LLM`.
Greedy outputs of the tiny model are the reference wherever a test needs "what would happen
otherwise" (a stop string, a stop token, the logprobs of the chosen tokens).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.request import Request
from tidepool.engine.sampler import Sampler, _top_k_top_p

PROMPT = "the quick brown fox"
OTHER_PROMPTS = ["a", "hello there, how are you today my friend", "1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.fixture(scope="module")
def sampling_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), show_progress=False, num_kv_blocks=96, max_model_len=256, max_num_batched_tokens=64)


def _tokens(sampling_llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in sampling_llm.generate(prompts, params, use_tqdm=False)]


def _greedy(max_tokens: int = 12, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def greedy_tokens(sampling_llm: LLM) -> list[int]:
    return _tokens(sampling_llm, [PROMPT], [_greedy(24)])[0]


# ---- engine level: seeds ------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_whatever_the_batch(sampling_llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = _tokens(sampling_llm, [PROMPT], [seeded])[0]
    batch_a = _tokens(
        sampling_llm,
        [OTHER_PROMPTS[0], PROMPT, OTHER_PROMPTS[1]],
        [SamplingParams(temperature=0.8, max_tokens=14, ignore_eos=True), seeded, _greedy(6)],
    )
    batch_b = _tokens(
        sampling_llm,
        [*OTHER_PROMPTS, PROMPT],
        [
            SamplingParams(temperature=1.0, seed=7, top_k=5, max_tokens=3, ignore_eos=True),
            _greedy(9),
            SamplingParams(temperature=1.3, top_p=0.9, max_tokens=12, ignore_eos=True),
            seeded,
        ],
    )
    assert len(alone) == 10
    assert batch_a[1] == alone
    assert batch_b[3] == alone


def test_seeds_across_the_whole_int64_range_sample(sampling_llm: LLM) -> None:
    # The n completions use seed, seed+1, ...: at the top of the range they wrap around instead of overflowing.
    for seed in (-(2**63), -1, 2**63 - 1):
        outputs = sampling_llm.generate(
            [PROMPT], SamplingParams(n=2, seed=seed, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        assert [len(c.token_ids) for c in outputs[0].outputs] == [4, 4]
    assert SamplingParams(seed=2**63 - 1).for_completion(1).seed == -(2**63)


def test_different_seeds_give_different_tokens(sampling_llm: LLM) -> None:
    params = [SamplingParams(temperature=2.0, seed=seed, max_tokens=12, ignore_eos=True) for seed in (1, 2)]
    first, second = _tokens(sampling_llm, [PROMPT, PROMPT], params)
    assert first != second


# ---- engine level: temperature / top-k / top-p / min-p ---------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1e-4, max_tokens=12, ignore_eos=True),
        # Below the greedy floor: dividing logits by these overflowed to garbage (every token id 0) before.
        SamplingParams(temperature=1e-39, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=5e-324, max_tokens=12, ignore_eos=True),
    ],
    ids=["top_k=1", "top_p=tiny", "min_p=1", "temperature=tiny", "temperature=1e-39", "temperature=subnormal"],
)
def test_degenerate_sampling_equals_greedy(sampling_llm: LLM, greedy_tokens: list[int], params: SamplingParams) -> None:
    assert _tokens(sampling_llm, [PROMPT], [params])[0] == greedy_tokens[:12]


def test_top_k_top_p_keeps_exactly_the_right_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    masked = _top_k_top_p(logits, [3, 0, 0], [1.0, 0.5, 1.0])
    order = logits.argsort(dim=-1, descending=True)
    # Row 0: top-3 only, values untouched.
    kept = torch.isfinite(masked[0]).nonzero().flatten()
    assert set(kept.tolist()) == set(order[0, :3].tolist())
    assert torch.equal(masked[0, kept], logits[0, kept])
    # Row 1: the smallest set of most likely tokens whose mass reaches 0.5.
    probs = torch.softmax(logits[1], dim=-1)[order[1]]
    num_needed = int((probs.cumsum(0) < 0.5).sum()) + 1
    assert set(torch.isfinite(masked[1]).nonzero().flatten().tolist()) == set(order[1, :num_needed].tolist())
    # Row 2: nothing removed.
    assert torch.equal(masked[2], logits[2])


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    masked = _top_k_top_p(logits, [0], [1e-9])
    assert torch.isfinite(masked).tolist() == [[True, False, False]]


def _fake(
    request_id: str, params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> Request:
    request = Request(request_id, prompt or [0], params, eos_token_ids=frozenset({2}))
    request.output_token_ids = list(output or [])
    return request


def test_sampled_tokens_are_always_inside_the_top_k_and_top_p_sets() -> None:
    torch.manual_seed(1)
    row = torch.randn(64) * 2
    logits = row.repeat(200, 1)
    top5 = set(row.topk(5).indices.tolist())
    sampler = Sampler(seed=0)
    requests = [_fake(f"k{i}", SamplingParams(temperature=1.5, top_k=5)) for i in range(100)]
    requests += [_fake(f"p{i}", SamplingParams(temperature=1.0, top_p=0.3)) for i in range(100)]
    tokens, _ = sampler.sample(logits, requests)
    order = row.argsort(descending=True)
    probs = torch.softmax(row, dim=-1)[order]
    nucleus = set(order[: int((probs.cumsum(0) < 0.3).sum()) + 1].tolist())
    assert set(tokens[:100]) <= top5
    assert len(set(tokens[:100])) > 1  # really sampled, not greedy
    assert set(tokens[100:]) <= nucleus


def test_temperature_sharpens_and_flattens() -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    sampler = Sampler(seed=0)

    def num_argmax(temperature: float) -> int:
        requests = [_fake(f"t{i}", SamplingParams(temperature=temperature)) for i in range(400)]
        tokens, _ = sampler.sample(row.repeat(400, 1), requests)
        return tokens.count(0)

    cold, warm, hot = num_argmax(0.2), num_argmax(1.0), num_argmax(5.0)
    assert cold > warm > hot


# ---- sampler level: penalties and min_tokens -----------------------------------------------------
def _penalised(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    row = torch.tensor([logits])
    Sampler()._apply_penalties_and_masks(row, 0, _fake("r", params, prompt, output))
    return row[0].tolist()


def test_presence_and_frequency_penalties_apply_to_output_tokens_only() -> None:
    logits = [1.0, 1.0, 1.0, 1.0]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Token 1 only in the prompt; token 2 generated once, token 3 three times.
    result = _penalised(logits, params, prompt=[1], output=[2, 3, 3, 3])
    assert result == pytest.approx([1.0, 1.0, 1.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.75])
    encouraged = _penalised(logits, SamplingParams(presence_penalty=-1.0), prompt=[1], output=[2])
    assert encouraged == pytest.approx([1.0, 1.0, 2.0, 1.0])


def test_repetition_penalty_pushes_seen_tokens_down_whatever_their_sign() -> None:
    logits = [2.0, -1.0, 2.0, -1.0]
    result = _penalised(logits, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert result == pytest.approx([1.0, -2.0, 2.0, -1.0])
    rewarded = _penalised(logits, SamplingParams(repetition_penalty=0.5), prompt=[0], output=[1])
    assert rewarded == pytest.approx([4.0, -0.5, 2.0, -1.0])


def test_penalties_change_what_greedy_picks() -> None:
    sampler = Sampler()
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]]).repeat(3, 1)
    requests = [
        _fake("plain", SamplingParams(temperature=0.0), output=[0]),
        _fake("presence", SamplingParams(temperature=0.0, presence_penalty=0.5), output=[0]),
        _fake("repetition", SamplingParams(temperature=0.0, repetition_penalty=1.2), prompt=[0]),
    ]
    tokens, _ = sampler.sample(logits, requests)
    assert tokens == [0, 1, 1]


def test_frequency_penalty_lowers_the_sampled_share_of_repeated_tokens() -> None:
    row = torch.zeros(4)
    sampler = Sampler(seed=3)
    plain = [_fake(f"a{i}", SamplingParams(), output=[0, 0]) for i in range(400)]
    penalised = [_fake(f"b{i}", SamplingParams(frequency_penalty=1.0), output=[0, 0]) for i in range(400)]
    tokens, _ = sampler.sample(row.repeat(800, 1), plain + penalised)
    assert tokens[400:].count(0) < tokens[:400].count(0) / 2


def test_logit_bias_is_added_before_penalties_and_sampling() -> None:
    logits = [1.0, 2.0, 3.0, 0.5]
    assert _penalised(logits, SamplingParams(logit_bias={0: 5.0, 3: -100.0}), prompt=[1], output=[]) == pytest.approx(
        [6.0, 2.0, 3.0, -99.5]
    )
    sampler = Sampler(seed=0)
    forced = [_fake(f"f{i}", SamplingParams(temperature=1.0, logit_bias={1: 100.0})) for i in range(50)]
    tokens, _ = sampler.sample(torch.tensor([logits]).repeat(50, 1), forced)
    assert tokens == [1] * 50
    greedy = [_fake("g", SamplingParams(temperature=0.0, logit_bias={2: -100.0}))]
    assert sampler.sample(torch.tensor([logits]), greedy)[0] == [1]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = [0.0, 0.0, 9.0, 8.0, 1.0]  # EOS (2) then stop token 3 are the most likely
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    early = _penalised(logits, params, prompt=[0], output=[4])
    assert early[2] == float("-inf") and early[3] == float("-inf") and early[4] == 1.0
    assert _penalised(logits, params, prompt=[0], output=[4, 4]) == logits
    eos_ignored = SamplingParams(min_tokens=2, ignore_eos=True)
    assert _penalised(logits, eos_ignored, prompt=[0], output=[]) == logits  # EOS is not a stop then


# ---- engine level: stops --------------------------------------------------------------------------
def _stop_string(text: str) -> tuple[str, int]:
    """A short ASCII-letter substring of the text whose first occurrence is not at the start."""
    for start in range(3, len(text) - 2):
        candidate = text[start : start + 2]
        if all(c in string.ascii_letters for c in candidate) and text.find(candidate) == start:
            return candidate, start
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_is_cut_from_the_text(sampling_llm: LLM) -> None:
    full = sampling_llm.generate(PROMPT, _greedy(24), use_tqdm=False)[0].outputs[0].text
    stop, start = _stop_string(full)
    out = sampling_llm.generate(PROMPT, _greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:start]
    assert stop not in out.text
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    kept = sampling_llm.generate(PROMPT, _greedy(24, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == full[: start + len(stop)]
    assert kept.outputs[0].stop_reason == stop


def test_stop_token_ids_end_generation_and_stay_in_the_ids(sampling_llm: LLM, greedy_tokens: list[int]) -> None:
    index = next(i for i in range(2, len(greedy_tokens)) if greedy_tokens[i] not in greedy_tokens[:i])
    stop_token = greedy_tokens[index]
    out = sampling_llm.generate(PROMPT, _greedy(24, stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_tokens[: index + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_token


def test_min_tokens_defers_a_stop_token(sampling_llm: LLM, greedy_tokens: list[int]) -> None:
    first = greedy_tokens[0]
    stopped = sampling_llm.generate(PROMPT, _greedy(8, stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first]
    deferred = sampling_llm.generate(PROMPT, _greedy(8, stop_token_ids=[first], min_tokens=3), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(deferred.token_ids) >= 3
    assert first not in deferred.token_ids[:3]


def test_max_tokens_finishes_with_length(sampling_llm: LLM) -> None:
    out = sampling_llm.generate(PROMPT, _greedy(5), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"
    assert out.stop_reason is None


def test_eos_stops_unless_ignore_eos(tiny_model_dir: Path, greedy_tokens: list[int]) -> None:
    engine_llm = LLM(str(tiny_model_dir), show_progress=False, num_kv_blocks=32, max_model_len=128)
    index = next(i for i in range(2, len(greedy_tokens)) if greedy_tokens[i] not in greedy_tokens[:i])
    # The random model rarely emits its real EOS, so declare one of its greedy tokens to be EOS.
    engine_llm.engine.eos_token_ids = frozenset({greedy_tokens[index]})
    params = SamplingParams(temperature=0.0, max_tokens=index + 4)
    stopped = engine_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == greedy_tokens[: index + 1]
    assert stopped.finish_reason == "stop"
    ignored = engine_llm.generate(PROMPT, _greedy(index + 4), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == greedy_tokens[: index + 4]
    assert ignored.finish_reason == "length"
    masked = SamplingParams(temperature=0.0, max_tokens=index + 4, min_tokens=index + 2)
    assert (
        greedy_tokens[index]
        not in engine_llm.generate(PROMPT, masked, use_tqdm=False)[0].outputs[0].token_ids[: index + 2]
    )


# ---- engine level: logprobs, n, chat -----------------------------------------------------------------
def test_logprobs_match_the_model_distribution(sampling_llm: LLM) -> None:
    out = sampling_llm.generate(PROMPT, _greedy(6, logprobs=5), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 6
    logits = sampling_llm.engine.runner.prompt_logits(out.prompt_token_ids + completion.token_ids)
    expected = torch.log_softmax(logits.float(), dim=-1)
    num_prompt = len(out.prompt_token_ids)
    total = 0.0
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert token in entry
        assert len(entry) == 5  # greedy: the sampled token is the top one
        assert all(value <= 0 for value in entry.values())
        row = expected[num_prompt - 1 + i]
        top_ids = row.topk(5).indices.tolist()
        assert set(entry) == set(top_ids)
        for token_id, value in entry.items():
            assert value == pytest.approx(float(row[token_id]), abs=1e-4)
        total += entry[token]
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_logprobs_zero_still_reports_the_sampled_token(sampling_llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=4, ignore_eos=True, logprobs=0)
    completion = sampling_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert completion.logprobs is not None
    assert [list(entry) for entry in completion.logprobs] == [[t] for t in completion.token_ids]
    assert sampling_llm.generate(PROMPT, _greedy(2), use_tqdm=False)[0].outputs[0].logprobs is None


def test_n_returns_that_many_completions(sampling_llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=2.0, seed=11, max_tokens=8, ignore_eos=True)
    [result] = sampling_llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in result.outputs] == [0, 1]
    assert all(len(c.token_ids) == 8 for c in result.outputs)
    assert result.outputs[0].token_ids != result.outputs[1].token_ids
    again = sampling_llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in result.outputs]


def test_chat_applies_the_template(sampling_llm: LLM) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    [result] = sampling_llm.chat(messages, _greedy(4), use_tqdm=False)
    tokenizer = sampling_llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert "hi there" in text and text != "hi there"
    assert result.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(result.prompt_token_ids, skip_special_tokens=False) == text
    plain = sampling_llm.generate(tokenizer.encode(text, add_special_tokens=False), _greedy(4), use_tqdm=False)[0]
    assert result.outputs[0].token_ids == plain.outputs[0].token_ids


# ---- stop strings: the held-back text, exactly and in linear time ------------------------------------
def _held_reference(text: str, stops: list[str]) -> int:
    """The longest suffix of `text` that is a proper prefix of a stop string (the definition, by brute force)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.sampled_from(list("aab \n")), max_size=40),
    stops=st.lists(st.text(alphabet=st.sampled_from(list("ab ")), min_size=1, max_size=6), min_size=1, max_size=3),
)
def test_held_back_text_is_the_longest_stop_prefix(tiny_model_dir: Path, text: str, stops: list[str]) -> None:
    from tidepool.engine.detokenizer import IncrementalDetokenizer

    tokenizer = _tokenizer(tiny_model_dir)
    detok = IncrementalDetokenizer(tokenizer, [], stops)
    fed: list[int] = []
    match = None
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        fed.append(token_id)
        match = detok.update([token_id])
        if match is not None:
            break
        assert detok._num_held_chars() == _held_reference(detok.output_text, stops), (detok.output_text, stops)
    # The held-back check above compared against `output_text`: it must be the real text (an empty or stale one
    # would hold back nothing and pass), i.e. what the tokenizer decodes, cut before the first stop string.
    decoded = tokenizer.decode(fed)
    if match is None:
        detok.finish()
        assert detok.output_text == decoded
    else:
        assert decoded.startswith(detok.output_text + match.stop_str) and match.stop_str in stops
        assert not any(stop in detok.output_text for stop in stops)


def test_long_repetitive_stop_strings_hold_back_exactly(tiny_model_dir: Path) -> None:
    # The server's limits (64 stop strings of up to 1024 characters), all sharing a repetitive prefix.
    from tidepool.engine.detokenizer import IncrementalDetokenizer

    tokenizer = _tokenizer(tiny_model_dir)
    stops = ["a" * 1023 + str(i % 10) for i in range(64)]
    detok = IncrementalDetokenizer(tokenizer, [], stops)
    [a] = tokenizer.encode("a", add_special_tokens=False)
    for n in range(1, 1100):
        assert detok.update([a]) is None
        assert detok._num_held_chars() == min(n, 1023)
    [one] = tokenizer.encode("1", add_special_tokens=False)
    match = detok.update([one])
    assert match is not None and match.stop_str == stops[1] and detok.output_text == "a" * 76


_TOKENIZERS: dict[Path, object] = {}


def _tokenizer(model_dir: Path) -> Any:
    from tidepool.engine.tokenizer import Tokenizer

    if model_dir not in _TOKENIZERS:
        _TOKENIZERS[model_dir] = Tokenizer.from_pretrained(model_dir)
    return _TOKENIZERS[model_dir]
