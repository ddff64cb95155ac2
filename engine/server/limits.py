"""Defaults of the server's request limits: one torch-free source for the CLI flags and `ServerConfig`."""

from __future__ import annotations

DEFAULT_MAX_BODY_BYTES = 32 << 20  # larger request bodies get 413 (a 10 MB prompt still fits)
DEFAULT_BODY_READ_TIMEOUT_S = 30.0  # a client pausing longer between two parts of its body gets 408
