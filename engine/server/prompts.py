"""Prompt text -> token ids (and back) for the HTTP server, off the event loop and bounded in cost.

Role: every tokenizer call of a request (encoding prompts, rendering the chat template,
decoding an echoed token-id prompt or a /detokenize request) runs in a small pool of tokenizer
threads, so a large prompt never stalls `/health`, streaming or other requests. Encoding and
decoding use the `tokenizers` batch entry points, which release the GIL while they work; they
give exactly what `Tokenizer.encode` and `Tokenizer.decode` give (each text on its own).

Invariant: text longer than `max_chars` is refused before any tokenizer work, with a 400 that
says why. Every token covers at most `longest_token_chars` characters of input (a byte-level
token covers at most its own length in bytes, a SentencePiece token its length in characters),
so a text of more than max_model_len x that many characters cannot fit the context; the cap
keeps a further factor of `_NORMALIZER_MARGIN` for normalizers that shrink text. A doomed 10 MB
prompt therefore costs microseconds instead of tens of seconds of tokenizer time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..tokenizer import Tokenizer
from .chat_render import RenderOptions, render
from .protocol import APIError

T = TypeVar("T")

_NORMALIZER_MARGIN = 4  # headroom over the exact bound, for normalizers that shrink the text they are given
_NUM_THREADS = 2  # tokenizer threads: the work is in Rust without the GIL, so two keep a busy server fair


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most input characters one token of this vocabulary can stand for (added tokens included)."""
    return max((len(token) for token in tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, num_threads: int = _NUM_THREADS) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.longest_token_chars = longest_token_chars(tokenizer)
        self.max_chars = _NORMALIZER_MARGIN * max_model_len * self.longest_token_chars
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tidepool-tokenize")

    def check_length(self, num_chars: int, param: str) -> None:
        """400 `context_length_exceeded` when `num_chars` characters certainly exceed the context."""
        if num_chars > self.max_chars:
            raise APIError(
                f"the {param} is {num_chars:,} characters long; this model's context of {self.max_model_len} tokens "
                f"cannot hold more than {self.max_chars:,} characters ({_NORMALIZER_MARGIN} x max_model_len x its "
                f"longest token of {self.longest_token_chars} characters), so it was refused without tokenizing. "
                f"Please shorten the {param}.",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(self, texts: Sequence[str], param: str, add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (each encoded on its own), in a tokenizer thread."""
        for text in texts:
            self.check_length(len(text), param)
        return await self._in_thread(self._encode, list(texts), add_special_tokens)

    async def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, options: RenderOptions
    ) -> str:
        """The chat template applied to `messages` (and `tools`, for a template that renders them) with `options`
        (chat_render.py); a template's own error becomes a 400 on `messages`."""
        # Tools are not counted: a template may leave parts of them out, and the rendered text is checked when encoded.
        self.check_length(sum(len(m["content"]) for m in messages), "messages")
        try:
            return await self._in_thread(render, self.tokenizer, messages, tools, options)
        except Exception as err:  # templates raise their own errors (e.g. roles must alternate)
            raise APIError(f"the chat template rejected the messages: {err}", param="messages") from err

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids` (ids the caller checked are in the vocabulary), in a tokenizer thread."""
        return await self._in_thread(self._decode, token_ids, skip_special_tokens)

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's own string in the vocabulary (e.g. "Ġworld"), as transformers' convert_ids_to_tokens."""
        return await self._in_thread(self._token_strings, token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        # The batch entry point releases the GIL (the single-text one does not); same text as `Tokenizer.decode`.
        [text] = self.tokenizer.backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)
        return text

    def _token_strings(self, token_ids: list[int]) -> list[str]:
        backend = self.tokenizer.backend
        return [backend.id_to_token(i) or "" for i in token_ids]

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        encodings = self.tokenizer.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
