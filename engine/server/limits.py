"""Defaults of the server's request limits: one torch-free source for the CLI flags and `ServerConfig`."""

from __future__ import annotations

# Larger request bodies get 413. A 10 MB prompt still fits; the bound also caps the time the event loop
# spends parsing one body's JSON (worst per byte: long number arrays, about 0.1 s per MB on a slow core).
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_BODY_READ_TIMEOUT_S = 30.0  # a client pausing longer between two parts of its body gets 408
