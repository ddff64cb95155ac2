"""N-gram prompt lookup: longest suffix first, latest match (preferring a full K continuation)."""

from __future__ import annotations

import pytest

from tidepool.engine.spec_decode.ngram import NgramProposer


@pytest.mark.parametrize(
    ("tokens", "k", "proposal"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # 3-gram "1 2 3" seen before
        ([1, 2, 3, 9, 1, 2], 4, [3, 9, 1, 2]),  # 2-gram, continuation runs into the suffix itself
        ([1, 2, 8, 1, 2, 9, 5, 2], 2, [9, 5]),  # only the 1-gram "2" matches; the latest full one wins
        ([5, 6, 7], 2, []),  # nothing repeats
        ([7, 7, 7, 7, 7, 7], 2, [7, 7]),
        ([1, 2, 1, 2], 0, []),
    ],
)
def test_proposals(tokens: list[int], k: int, proposal: list[int]) -> None:
    assert NgramProposer(1, 3).propose(tokens, k) == proposal


def test_min_n_is_respected() -> None:
    assert NgramProposer(2, 3).propose([1, 2, 8, 9, 2], 2) == []


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)
