"""Logprobs in OpenAI's two shapes, from the engine's per-token `{token_id: logprob}` entries.

The engine's entry for each generated token holds the top-n alternatives plus the sampled
token (n+1 entries when the sampled token is not among the top n). Completions use the
legacy shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); chat uses
`content: [{token, logprob, bytes, top_logprobs}]`.

Invariants:
- A token's string is the token decoded on its own (with special tokens), as vLLM shows it;
  its `bytes` are the token's real bytes (read from the vocabulary: byte-level BPE, SentencePiece
  byte fallback), so the bytes of a completion's tokens concatenate to its UTF-8 text even where
  a token holds part of a character (its decoded string is then just U+FFFD).
- Completions' `top_logprobs` keys never collide, so `logprobs=k` always gives k entries: a token
  is keyed by its string when that string stands for exactly its bytes and no other token at the
  same position decodes to it; otherwise by vLLM's `token_id:N` form (the one vLLM uses for all
  tokens with `return_tokens_as_token_ids`, which is honoured too). `tokens[i]` is the sampled
  token's key at position i, so it is always found in `top_logprobs[i]` when listed there.
"""

from __future__ import annotations

import codecs
import functools
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..outputs import CompletionOutput
from ..tokenizer import Tokenizer
from .protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

_CACHE_SIZE = 1 << 16


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.token_str = functools.lru_cache(maxsize=_CACHE_SIZE)(self._decode)
        self.token_bytes = functools.lru_cache(maxsize=_CACHE_SIZE)(token_bytes_reader(tokenizer))

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self,
        comp: CompletionOutput,
        start: int,
        stop: int,
        offset: int,
        num_top: int,
        as_token_ids: bool = False,
        skip_special_tokens: bool = True,
    ) -> CompletionLogprobs:
        """Tokens [start, stop) of a completion; `offset` is the first token's character offset in the text."""
        result = CompletionLogprobs()
        chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for token_id, entry in zip(comp.token_ids[start:stop], (comp.logprobs or [])[start:stop], strict=False):
            keys = self._keys([*entry, token_id], as_token_ids)
            result.tokens.append(keys[token_id])
            result.token_logprobs.append(entry.get(token_id))
            # As vLLM: with logprobs=0 the "top" list still holds the sampled token.
            top = top_entries(entry, num_top) if num_top > 0 else [(token_id, entry.get(token_id, float("-inf")))]
            result.top_logprobs.append({keys[t]: lp for t, lp in top})
            result.text_offset.append(offset)
            if not (skip_special_tokens and token_id in self.special_ids):  # skipped special tokens add no text
                offset += len(chars.decode(self.token_bytes(token_id)))
        return result

    def prompt(
        self,
        prompt_ids: list[int],
        entries: list[dict[int, float] | None],
        num_top: int,
        as_token_ids: bool = False,
        skip_special_tokens: bool = True,
    ) -> CompletionLogprobs:
        """An echoed prompt's tokens in the completions shape, from `{token id: logprob}` per position (None
        first: nothing predicts the first token, whose logprob and top_logprobs are then null)."""
        comp = CompletionOutput(index=0, text="", token_ids=prompt_ids, logprobs=[e or {} for e in entries])
        result = self.completion(comp, 0, len(prompt_ids), 0, num_top, as_token_ids, skip_special_tokens)
        for position, entry in enumerate(entries):
            if entry is None:
                result.token_logprobs[position] = None
                result.top_logprobs[position] = None
        return result

    def chat(
        self, comp: CompletionOutput, start: int, stop: int, num_top: int, as_token_ids: bool = False
    ) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(comp.token_ids[start:stop], (comp.logprobs or [])[start:stop], strict=False):
            top = [self._top(t, lp, as_token_ids) for t, lp in top_entries(entry, num_top)]
            sampled = self._top(token_id, entry.get(token_id, float("-inf")), as_token_ids)
            content.append(TokenLogprob(token=sampled.token, logprob=sampled.logprob, bytes=sampled.bytes,
                                        top_logprobs=top))  # fmt: skip
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float, as_token_ids: bool) -> TopLogprob:
        token = f"token_id:{token_id}" if as_token_ids else self.token_str(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(self.token_bytes(token_id)))

    def _keys(self, token_ids: list[int], as_token_ids: bool) -> dict[int, str]:
        """A distinct key per token id (see the module docstring)."""
        if as_token_ids:
            return {t: f"token_id:{t}" for t in token_ids}
        strings = {t: self.token_str(t) for t in token_ids}
        counts = Counter(strings.values())
        return {
            t: s if counts[s] == 1 and s.encode("utf-8", "surrogatepass") == self.token_bytes(t) else f"token_id:{t}"
            for t, s in strings.items()
        }


def top_entries(entry: dict[int, float], num: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:num]


# ---- a token's bytes ------------------------------------------------------------------------------


def token_bytes_reader(tokenizer: Tokenizer) -> Callable[[int], bytes]:
    """A function giving a token id's bytes, chosen from the tokenizer's decoder.

    Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): a token's string spells its bytes in GPT-2's
    printable byte alphabet. SentencePiece (Llama 2, Mistral): `<0xNN>` byte-fallback tokens are
    one byte and U+2581 stands for a space. Added tokens are their own text. Anything else falls
    back to the token's decoded text.
    """
    backend = tokenizer.backend
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    kinds = _decoder_kinds(json.loads(backend.to_str()).get("decoder"))

    def decoded(token_id: int) -> bytes:
        return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8", "surrogatepass")

    if "ByteLevel" in kinds:
        table = _byte_level_decoding()

        def byte_level(token_id: int) -> bytes:
            piece = backend.id_to_token(token_id)
            if token_id in added or piece is None or any(c not in table for c in piece):
                return decoded(token_id)
            return bytes(table[c] for c in piece)

        return byte_level
    if kinds & {"ByteFallback", "Metaspace", "Replace"}:

        def sentencepiece(token_id: int) -> bytes:
            piece = backend.id_to_token(token_id)
            if token_id in added or piece is None:
                return decoded(token_id)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("\u2581", " ").encode("utf-8", "surrogatepass")

        return sentencepiece
    return decoded


def _decoder_kinds(spec: Any) -> set[str]:
    """Every decoder type named in a tokenizer.json `decoder` entry (nested Sequences included)."""
    if not isinstance(spec, dict):
        return set()
    kinds = {str(spec.get("type"))}
    for child in spec.get("decoders") or ():
        kinds |= _decoder_kinds(child)
    return kinds


@functools.cache
def _byte_level_decoding() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted: printable bytes stand for themselves,
    the others (controls, space, DEL, NBSP, soft hyphen) are shifted to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table
