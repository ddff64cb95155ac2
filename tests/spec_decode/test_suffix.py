"""Suffix decoding's proposer: the longest earlier match of the text's end, continued as most occurrences
continue it, for as many tokens as the match earns; finished outputs are searched too, within a bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidepool.engine.spec_decode.suffix import SuffixProposer


def test_the_longest_match_wins_and_earns_as_many_tokens_as_it_is_long() -> None:
    proposer = SuffixProposer()
    #          a longer match of [7, 1, 2, 3] continues with 9; the short [2, 3] elsewhere continues with 5
    text = [2, 3, 5, 5, 7, 1, 2, 3, 9, 9, 9, 9, 9, 0, 7, 1, 2, 3]
    assert proposer.propose(text, 16) == [9, 9, 9, 9]  # match length 4 -> at most 4 tokens
    assert proposer.propose(text, 2) == [9, 9]  # never more than asked
    assert SuffixProposer(length_per_match=0.5).propose(text, 16) == [9, 9]


def test_the_continuation_follows_the_majority_while_it_has_support() -> None:
    # [1, 2] occurs three times after different tokens: continued by 3, 4 twice and by 3, 8 once -> 3, then 4
    text = [5, 1, 2, 3, 4, 6, 1, 2, 3, 8, 7, 1, 2, 3, 4, 0, 1, 2]
    assert SuffixProposer().propose(text, 16)[:2] == [3, 4]
    # with a support floor above 2/3 the proposal stops where the occurrences disagree
    assert SuffixProposer(min_support=0.9).propose(text, 16) == [3]


def test_no_match_no_proposal_and_never_past_the_end() -> None:
    proposer = SuffixProposer()
    assert proposer.propose([1, 2, 3, 4], 8) == []
    assert proposer.propose([5], 8) == []
    assert proposer.propose([1, 2, 1, 2], 0) == []
    assert proposer.propose([1, 2, 1, 2], 8) == [1, 2]  # the match [1, 2] at 0 is followed by 1, 2 (the end)


def test_finished_outputs_are_searched_and_the_cache_is_bounded() -> None:
    proposer = SuffixProposer(cache_tokens=12)
    proposer.remember([10, 11, 12, 13, 14, 15])
    assert proposer.propose([0, 10, 11, 12], 8) == [13, 14, 15]
    proposer.remember([20, 21, 22, 23, 24, 25, 26, 27])  # 14 tokens > 12: the first output is dropped
    assert proposer.propose([0, 10, 11, 12], 8) == []
    assert proposer.propose([0, 21, 22], 8) == [23, 24]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=2, max_size=60), st.integers(1, 16))
def test_a_proposal_is_a_real_continuation_of_an_occurrence(text: list[int], k: int) -> None:
    """Every proposal continues some earlier occurrence of the text's last token, with at most k tokens."""
    proposal = SuffixProposer(min_support=1e-9).propose(text, k)
    assert len(proposal) <= k
    if proposal:
        tokens = np.asarray(text)
        starts = [i + 1 for i in range(len(text) - 1) if tokens[i] == text[-1]]
        assert any(text[s : s + len(proposal)] == proposal for s in starts) or any(
            text[s : s + 1] == proposal[:1] for s in starts
        )


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="suffix decoding"):
        SuffixProposer(min_support=0)
