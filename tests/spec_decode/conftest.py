"""Fixtures for the speculative-decoding tests (helpers live in `spec_helpers`: a module named
`conftest` is ambiguous on the shared `tests` import path)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from spec_helpers import perturbed_copy, write_small_vocab_model


@pytest.fixture(scope="session")
def small_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    made: dict[int, Path] = {}

    def build(seed: int) -> Path:
        if seed not in made:
            made[seed] = write_small_vocab_model(tmp_path_factory.mktemp("small-vocab") / f"m{seed}", seed)
        return made[seed]

    return build


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    # The tiny random model is sensitive: 8% noise keeps roughly a third of proposals accepted.
    return perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("draft") / "tiny-draft", scale=0.08)
