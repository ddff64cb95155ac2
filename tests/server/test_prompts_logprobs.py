"""In-process checks of the server's prompt encoder (off the event loop, bounded) and logprob formatting.

The encoder must give exactly `Tokenizer.encode`'s ids, run in its own threads without holding
the GIL (so the event loop keeps serving), and refuse a doomed giant prompt without tokenizing
it. Logprob formatting must report a token's real bytes and never collide two tokens' keys.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from tidepool.engine.outputs import CompletionOutput
from tidepool.engine.server.logprobs import LogprobFormatter
from tidepool.engine.server.prompts import PromptEncoder
from tidepool.engine.server.protocol import APIError
from tidepool.engine.tokenizer import Tokenizer

TEXTS = [
    "hello world",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n",
    "unicode: café, 東京, emoji 🎉, math ∑",
    "<|im_start|>user\nhi<|im_end|>",
    "</s><s> special tokens inside text",
    "def f(x):\n    return x ** 2  # code",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def test_encoder_gives_the_tokenizers_ids(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=1024)
    try:
        for add_special_tokens in (True, False):
            got = asyncio.run(encoder.encode(TEXTS, "prompt", add_special_tokens=add_special_tokens))
            assert got == [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in TEXTS]
    finally:
        encoder.close()


def test_encoding_runs_off_the_event_loop_thread(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=1024)
    seen: list[str] = []
    real = encoder._encode

    def recording(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        seen.append(threading.current_thread().name)
        return real(texts, add_special_tokens)

    encoder._encode = recording  # type: ignore[method-assign]
    try:
        asyncio.run(encoder.encode(["hello"], "prompt"))
    finally:
        encoder.close()
    assert seen and seen[0].startswith("tidepool-tokenize") and seen[0] != threading.main_thread().name


def test_tokenizing_leaves_the_gil_to_other_threads(tokenizer: Tokenizer) -> None:
    """A Python thread keeps running while a large text is encoded: the work happens without the GIL.

    Compared with the same thread's progress over an equally long sleep in one run (a ratio, not a
    time): holding the GIL would leave it at most a few switch intervals out of the whole encode.
    """
    import time

    encoder = PromptEncoder(tokenizer, max_model_len=1 << 20)
    text = "the quick brown fox jumps over the lazy dog. " * 10_000
    count = 0
    stop = False

    def spin() -> None:
        nonlocal count
        while not stop:
            count += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        before = count
        start = time.perf_counter()
        asyncio.run(encoder.encode([text], "prompt"))
        duration = time.perf_counter() - start
        during_encode = count - before
        before = count
        time.sleep(duration)
        during_sleep = count - before
    finally:
        stop = True
        spinner.join()
        encoder.close()
    assert during_encode > 0.1 * during_sleep, (during_encode, during_sleep, duration)


def test_a_doomed_giant_prompt_is_refused_without_tokenizing(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=1024)

    def never(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        raise AssertionError("tokenized a prompt that cannot fit")

    encoder._encode = never  # type: ignore[method-assign]
    try:
        with pytest.raises(APIError) as info:
            asyncio.run(encoder.encode(["x" * (encoder.max_chars + 1)], "prompt"))
    finally:
        encoder.close()
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    assert info.value.param == "prompt" and f"{encoder.max_chars:,}" in info.value.message
    # The bound is sound: a prompt at the cap's edge of one-character tokens would still be far too long.
    assert encoder.max_chars >= 1024 * encoder.longest_token_chars


def _byte_token(tokenizer: Tokenizer, byte: int) -> int:
    """The id of the byte-level token standing for one byte (GPT-2's printable byte alphabet)."""
    from tidepool.engine.server.logprobs import _byte_level_decoding

    char = next(c for c, b in _byte_level_decoding().items() if b == byte)
    token_id = tokenizer.token_to_id(char)
    assert token_id is not None, f"no single-byte token for {byte:#x}"
    return token_id


def test_chat_bytes_are_the_tokens_real_bytes(tokenizer: Tokenizer) -> None:
    ids = [_byte_token(tokenizer, b) for b in "€".encode()]  # one character split over three tokens
    comp = CompletionOutput(0, "€", ids, "length", logprobs=[{t: -1.0} for t in ids])
    content = LogprobFormatter(tokenizer).chat(comp, 0, 3, num_top=1).content
    assert content is not None
    assert b"".join(bytes(entry.bytes or []) for entry in content) == "€".encode()
    assert [entry.token for entry in content] == ["\ufffd"] * 3  # the decoded strings are just U+FFFD


def test_completion_keys_never_collide(tokenizer: Tokenizer) -> None:
    partial = [_byte_token(tokenizer, b) for b in (0xE2, 0x82, 0xAC, 0xF0)]  # all decode to U+FFFD alone
    plain = tokenizer.encode("a", add_special_tokens=False)[0]
    entry = {t: -1.0 - i for i, t in enumerate([plain, *partial])}
    comp = CompletionOutput(0, "a", [plain], "length", logprobs=[entry])
    formatter = LogprobFormatter(tokenizer)
    lp = formatter.completion(comp, 0, 1, 0, num_top=5)
    assert len(lp.top_logprobs[0]) == 5
    assert lp.tokens == ["a"] and lp.top_logprobs[0]["a"] == -1.0  # a faithful, unique token keeps its text
    assert {f"token_id:{t}" for t in partial} <= set(lp.top_logprobs[0])
    as_ids = formatter.completion(comp, 0, 1, 0, num_top=5, as_token_ids=True)
    assert as_ids.tokens == [f"token_id:{plain}"]
