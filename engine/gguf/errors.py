"""The exception a bad GGUF file raises.

Invariant: every problem with a GGUF file's contents (wrong magic, truncation, an unsupported tensor
type or architecture, missing metadata) surfaces as one `GGUFError` whose message names the file and
the problem and, where it applies, what is supported; library exceptions never escape past it.
"""

from __future__ import annotations


class GGUFError(ValueError):
    """A GGUF file Tidepool cannot load, with the reason in the message."""
