"""Suffix decoding (model-free speculation): continue the longest earlier match of the text's end, as often seen.

Sources searched, newest first: the request's own prompt and output, then a bounded cache of the
outputs of requests that finished recently (agentic and multi-turn traffic repeats earlier answers).
The last `match` tokens of the request are looked up in every source; `match` is as long as any
occurrence allows (up to `max_match`). The continuation is built token by token from all occurrences of
that longest match: at each position the token most of the still-agreeing occurrences continue with,
while its share stays at least `min_support` (the most recent occurrence breaks ties). How far to
propose adapts to the evidence, as in SuffixDecoding (Oliaro et al., ArcticInference): at most
`length_per_match` tokens per matched token, so a long match earns a long proposal and a one-token
match a short one. The proposal is deterministic (one-hot q), verified like n-gram proposals.

Invariants: lookups are vectorised over numpy arrays (a few thousand tokens cost microseconds); the
cache holds at most `cache_tokens` tokens (oldest outputs dropped first); proposing never reads a
token past the request's end.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np


class SuffixProposer:
    def __init__(
        self,
        max_match: int = 32,
        min_support: float = 0.1,
        length_per_match: float = 1.0,
        cache_tokens: int = 1 << 16,
    ) -> None:
        if max_match < 1 or not 0 < min_support <= 1 or length_per_match <= 0 or cache_tokens < 0:
            raise ValueError("suffix decoding needs max_match >= 1, min_support in (0, 1], length_per_match > 0")
        self.max_match = max_match
        self.min_support = min_support
        self.length_per_match = length_per_match
        self.cache_tokens = cache_tokens
        self._cache: deque[np.ndarray] = deque()  # finished outputs, newest last
        self._num_cached = 0

    def remember(self, output_token_ids: list[int]) -> None:
        """Add a finished request's output to the cache (oldest outputs go once over `cache_tokens`)."""
        if len(output_token_ids) < 2 or self.cache_tokens == 0:
            return
        tokens = np.asarray(output_token_ids[-self.cache_tokens :], dtype=np.int64)
        self._cache.append(tokens)
        self._num_cached += len(tokens)
        while self._num_cached > self.cache_tokens:
            self._num_cached -= len(self._cache.popleft())

    def propose(self, token_ids: list[int], num_spec_tokens: int) -> list[int]:
        """Up to `num_spec_tokens` tokens continuing the longest earlier match of `token_ids`' end."""
        if num_spec_tokens <= 0 or len(token_ids) < 2:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        suffix = tokens[-self.max_match :][::-1]  # the text's end, read backwards
        # (source, position after the match) of every occurrence of the longest match, newest first.
        best, found = 0, []
        sources = [tokens[:-1], *reversed(self._cache)]  # own text without its last token (the suffix itself)
        for index, source in enumerate(sources):
            length, ends = _longest_matches(source, suffix)
            if length > best:
                best, found = length, [(index, end) for end in ends]
            elif length == best and length > 0:
                found += [(index, end) for end in ends]
        if best == 0:
            return []
        limit = min(num_spec_tokens, max(1, int(best * self.length_per_match)))
        continuations = [_slice(tokens if i == 0 else sources[i], end, limit) for i, end in found]
        return _consensus(continuations, limit, self.min_support)


def _longest_matches(source: np.ndarray, reversed_suffix: np.ndarray) -> tuple[int, list[int]]:
    """The longest match length of the suffix's end in `source`, and where each such match ends (exclusive),
    newest first."""
    if source.size == 0:
        return 0, []
    candidates = np.flatnonzero(source == reversed_suffix[0])  # positions of the last token
    length = 1 if candidates.size else 0
    for k in range(1, reversed_suffix.size):
        if candidates.size == 0:
            break
        previous = candidates - k
        valid = previous >= 0
        extended = candidates[valid][source[previous[valid]] == reversed_suffix[k]]
        if extended.size == 0:
            break
        candidates, length = extended, k + 1
    return length, [int(c) + 1 for c in candidates[::-1]]


def _slice(source: np.ndarray, start: int, limit: int) -> list[int]:
    return source[start : start + limit].tolist()


def _consensus(continuations: list[list[int]], limit: int, min_support: float) -> list[int]:
    """Token by token, what most continuations that agree so far say next, while enough of them say it."""
    total = len(continuations)
    alive = [c for c in continuations if c]
    proposal: list[int] = []
    for depth in range(limit):
        counts = Counter(c[depth] for c in alive if len(c) > depth)
        if not counts:
            break
        first_seen = {}
        for c in alive:  # newest first: ties go to the most recent occurrence
            if len(c) > depth:
                first_seen.setdefault(c[depth], len(first_seen))
        token, count = min(counts.items(), key=lambda item: (-item[1], first_seen[item[0]]))
        if count / total < min_support:
            break
        proposal.append(token)
        alive = [c for c in alive if len(c) > depth and c[depth] == token]
    return proposal
