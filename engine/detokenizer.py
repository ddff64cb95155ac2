"""Streaming detokenization with stop strings, one instance per request.

Role: turns generated token ids into text as they arrive, finds stop strings and decides how much
text is safe to stream to the client.

Invariants:
- `output_text` only ever grows by whole characters: a byte-level BPE token can end in the middle
  of a UTF-8 sequence, so text is produced by decoding a small window `ids[prefix_offset:]` and
  keeping only what goes past `ids[prefix_offset:read_offset]` once it no longer ends in U+FFFD
  (the prefix_offset/read_offset technique of TGI and vLLM). Each token costs O(window), never
  O(all tokens).
- Stop strings are searched only in the newly produced text plus the `len(stop) - 1` characters
  before it, so a stop string split over several tokens is still found.
- `get_delta_text()` never returns text that a later stop string could cut: trailing characters
  that are a prefix of some stop string are held back until they are proven safe or `finish()`.
  How many is tracked per stop string as a KMP automaton state fed each new character, so the
  work per token is linear in its text for every stop string (never quadratic in a long one).
- Concatenating every delta (including the one after `finish()`) gives exactly `output_text`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tokenizer import Tokenizer

# Decoding starts a few prompt tokens back so the first generated token sees its left context
# (SentencePiece-style decoders drop a leading space at the start of a decode).
_NUM_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, and every byte-level token carries at least one byte; a
# window still ending in U+FFFD after this many pending tokens holds genuinely invalid bytes.
_MAX_PENDING_TOKENS = 4
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True, frozen=True)
class StopMatch:
    """A stop string found in the output."""

    stop_str: str  # the stop string that matched (the first in `stop` order at the earliest position)
    num_tokens_used: int  # ids of this `update()` call consumed, the matching one included


class IncrementalDetokenizer:
    """Decodes one request's generated tokens incrementally and applies its stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] | None = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._backend = tokenizer.backend
        self.stop: tuple[str, ...] = tuple(s for s in stop or () if s)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        # Only the decode window is kept, so memory and per-token work stay bounded.
        self._window_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_token_ids: list[int] = []
        self.output_text = ""
        # Per stop string: its KMP failure function, and the length of its longest prefix that ends the text.
        self._stop_failure = [_failure_function(s) for s in self.stop]
        self._stop_state = [0] * len(self.stop)
        self.stop_match: StopMatch | None = None
        self.is_finished = False
        self._num_sent_chars = 0

    # -- decoding --------------------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, force: bool = False) -> str:
        """Returns the complete characters that the pending tokens add, and slides the window."""
        prefix_text = self._decode(self._window_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._window_ids[self._prefix_offset :])
        num_pending = len(self._window_ids) - self._read_offset
        is_incomplete = full_text.endswith(_REPLACEMENT_CHAR) and num_pending <= _MAX_PENDING_TOKENS
        if is_incomplete and not force:
            return ""
        # Tokens that add no text (skipped special tokens) still slide the window, keeping it small.
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._slide_window()
        return delta

    def _slide_window(self) -> None:
        # Drop ids before the new prefix so the window never grows with the sequence.
        self._window_ids = self._window_ids[self._read_offset :]
        self._prefix_offset = 0
        self._read_offset = len(self._window_ids)

    # -- stop strings ----------------------------------------------------------------------------------

    def _find_stop(self, num_new_chars: int) -> tuple[str, int] | None:
        best: tuple[str, int] | None = None
        for stop_str in self.stop:
            start = max(0, len(self.output_text) - num_new_chars - len(stop_str) + 1)
            index = self.output_text.find(stop_str, start)
            if index != -1 and (best is None or index < best[1]):
                best = (stop_str, index)
        return best

    def _num_held_chars(self) -> int:
        """Length of the longest output suffix that is a proper prefix of a stop string."""
        return max(self._stop_state, default=0)

    def _advance_stop_states(self, new_text: str) -> None:
        # No stop string occurs in the text (update() would have ended it), so no state reaches its length.
        for index, stop_str in enumerate(self.stop):
            failure, state = self._stop_failure[index], self._stop_state[index]
            for char in new_text:
                while state and stop_str[state] != char:
                    state = failure[state - 1]
                if stop_str[state] == char:
                    state += 1
            self._stop_state[index] = state

    # -- public API ------------------------------------------------------------------------------------

    def update(self, new_token_ids: Sequence[int]) -> StopMatch | None:
        """Appends tokens; returns the stop match if one occurred (later tokens are then ignored)."""
        if self.is_finished:
            return self.stop_match
        for num_used, token_id in enumerate(new_token_ids, start=1):
            self.output_token_ids.append(token_id)
            self._window_ids.append(token_id)
            delta = self._decode_next()
            if not delta:
                continue
            self.output_text += delta
            found = self._find_stop(len(delta)) if self.stop else None
            if found is not None:
                stop_str, index = found
                end = index + len(stop_str) if self.include_stop_str_in_output else index
                self.output_text = self.output_text[:end]
                self.stop_match = StopMatch(stop_str=stop_str, num_tokens_used=num_used)
                self.is_finished = True
                return self.stop_match
            self._advance_stop_states(delta)
        return None

    def finish(self) -> str:
        """Ends the stream (length limit, EOS or stop): flushes pending bytes and held-back text."""
        if not self.is_finished:
            tail = self._decode_next(force=True)
            self.output_text += tail
            self.is_finished = True
        return self.get_delta_text()

    @property
    def num_sent_chars(self) -> int:
        """Offset into `output_text` up to which text has been streamed."""
        return self._num_sent_chars

    def get_delta_text(self) -> str:
        """Text not yet streamed that no stop string can still cut; advances the streaming offset."""
        end = len(self.output_text) if self.is_finished else len(self.output_text) - self._num_held_chars()
        if end <= self._num_sent_chars:
            return ""
        delta = self.output_text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta


def _failure_function(pattern: str) -> list[int]:
    """KMP: entry i is the length of the longest proper prefix of pattern[: i + 1] that is also its suffix."""
    failure = [0] * len(pattern)
    length = 0
    for i in range(1, len(pattern)):
        while length and pattern[i] != pattern[length]:
            length = failure[length - 1]
        if pattern[i] == pattern[length]:
            length += 1
        failure[i] = length
    return failure
