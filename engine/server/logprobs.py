"""Logprobs in OpenAI's two shapes, from the engine's per-token `{token_id: logprob}` entries.

The engine's entry for each generated token holds the top-n alternatives plus the sampled
token (n+1 entries when the sampled token is not among the top n). Completions use the
legacy shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); chat uses
`content: [{token, logprob, bytes, top_logprobs}]`. Token strings are each token decoded on
its own (with special tokens), cached, as vLLM shows them.
"""

from __future__ import annotations

import functools

from ..outputs import CompletionOutput
from ..tokenizer import Tokenizer
from .protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_str = functools.lru_cache(maxsize=1 << 16)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, comp: CompletionOutput, start: int, stop: int, offset: int, num_top: int
    ) -> CompletionLogprobs:
        """Tokens [start, stop) of a completion; `offset` is the first token's character offset in the text."""
        result = CompletionLogprobs()
        for token_id, entry in zip(comp.token_ids[start:stop], (comp.logprobs or [])[start:stop], strict=False):
            token = self.token_str(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(entry.get(token_id))
            # As vLLM: with logprobs=0 the "top" list still holds the sampled token.
            top = top_entries(entry, num_top) if num_top > 0 else [(token_id, entry.get(token_id, float("-inf")))]
            result.top_logprobs.append({self.token_str(t): lp for t, lp in top})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def chat(self, comp: CompletionOutput, start: int, stop: int, num_top: int) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(comp.token_ids[start:stop], (comp.logprobs or [])[start:stop], strict=False):
            token = self.token_str(token_id)
            top = [self._top(t, lp) for t, lp in top_entries(entry, num_top)]
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=entry.get(token_id, float("-inf")),
                    bytes=list(token.encode()),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_str(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))


def top_entries(entry: dict[int, float], num: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:num]
