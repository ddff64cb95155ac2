"""The one small interface between Tidepool and a grammar engine: compile a constraint, match tokens, fill masks.

Role: everything outside this package sees only these protocols, so another engine (xgrammar,
outlines-core) can replace llguidance (llguidance_backend.py) by implementing them.

Invariants a backend keeps:
- `compile` raises `GrammarError` (a `ValueError`) whose message names what is wrong with the
  constraint; it never returns a grammar that fails on its first mask.
- A `Grammar` is immutable and shared by every request that asks for the same constraint;
  `Grammar.matcher()` gives each request its own state.
- A `Matcher` consumes only tokens its grammar allows: `consume` returns how many of the given
  tokens it took (stopping before the first one the grammar refuses) and stays usable; `rollback`
  undoes the last tokens taken, so speculation and re-synchronisation never rebuild state.
- Masks are bitmasks, one bit per token id (bit i of 32-bit word i // 32), written in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .params import StructuredOutputsParams


class GrammarError(ValueError):
    """A constraint that cannot be compiled (invalid schema, regex or grammar; over the time or size limit)."""


class Matcher(Protocol):
    def consume(self, token_ids: Sequence[int]) -> int:
        """Take the longest allowed prefix of `token_ids`; returns its length."""
        ...

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` tokens taken; False if the backend cannot (the caller rebuilds)."""
        ...

    def is_terminated(self) -> bool:
        """Nothing but an end-of-sequence token may follow."""
        ...

    def error(self) -> str | None:
        """Why the matcher can go no further (an internal limit hit), or None."""
        ...


class Grammar(Protocol):
    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredOutputsParams) -> Grammar: ...

    def fill_bitmasks(self, rows: Sequence[tuple[Matcher, int]], data_ptr: int, row_bytes: int, num_rows: int) -> None:
        """Write each matcher's next-token mask into row `index` of a C-contiguous int32 [num_rows, words] buffer."""
        ...
