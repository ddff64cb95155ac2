"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar.

`params.py` (the constraint, torch-free), `backend.py` (the grammar-engine interface) with
`llguidance_backend.py` (its one implementation), `compiler.py` (compile off the engine thread,
cached) and `matchers.py` (per-request state and the sampler's batched mask). `build_compiler`
wires a compiler to an engine's tokenizer and vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .backend import Grammar, GrammarBackend, GrammarError, Matcher
from .compiler import GrammarCompiler
from .params import StructuredOutputsParams

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

__all__ = [
    "Grammar",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarError",
    "Matcher",
    "StructuredOutputsParams",
    "build_compiler",
]


def build_compiler(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> GrammarCompiler:
    """A compiler for this engine's tokens; the grammar engine is imported and its tokenizer built on first use."""
    eos = sorted(set(eos_token_ids))

    def backend() -> GrammarBackend:
        from .llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer.backend.to_str(), vocab_size, eos)

    return GrammarCompiler(backend)
