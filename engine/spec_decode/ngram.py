"""N-gram prompt lookup: proposals copied from the request's own text, no extra model.

For n from `max_n` down to `min_n`, the last n tokens of prompt + output are searched for
earlier in the same sequence; at the most recent earlier occurrence (preferring one followed by
K tokens), the up-to-K tokens that followed it are proposed. Input-grounded generation (editing
code, quoting, summarising with copied spans) repeats long runs of its input, which is when
this pays. The proposal is deterministic, so its q is one-hot (`draft_probs` None for the
rejection sampler). numpy does the window compare, so a lookup over a few thousand tokens
costs microseconds, not a Python loop.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], num_spec_tokens: int) -> list[int]:
        """Up to `num_spec_tokens` tokens that followed the latest earlier match of the longest suffix n-gram."""
        num_tokens = len(token_ids)
        if num_spec_tokens <= 0 or num_tokens < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n :]
            # Windows starting at 0 .. num_tokens - n - 1: every earlier occurrence, excluding the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: num_tokens - 1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if matches.size:
                # The latest match with a full K-token continuation, else the latest (shorter) one.
                full = matches[matches + n + num_spec_tokens <= num_tokens]
                start = int(full[-1] if full.size else matches[-1]) + n
                return token_ids[start : start + num_spec_tokens]
        return []
