"""Is this path a GGUF file? Stdlib only (no numpy, no torch, no `gguf` import), so model resolution and the
operator can ask cheaply. A file is GGUF when it is named *.gguf or starts with the magic bytes ``GGUF``.
"""

from __future__ import annotations

from pathlib import Path

MAGIC = b"GGUF"


def is_gguf_file(path: str | Path) -> bool:
    """A file named *.gguf, or any file that starts with the GGUF magic."""
    file = Path(path)
    if not file.is_file():
        return False
    if file.suffix.lower() == ".gguf":
        return True
    with file.open("rb") as handle:
        return handle.read(4) == MAGIC
