"""make_model: folders that transformers loads without missing or unexpected keys, deterministic bytes,
exact vocabulary sizes, and random logits that are far from flat (greedy comparisons rely on it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tidepool.engine import make_model_tokenizer
from tidepool.engine.make_model import ARCHITECTURES, PRESETS, build_tokenizer, make_model

transformers = pytest.importorskip("transformers")

ARCHS = sorted(ARCHITECTURES)


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cache = tmp_path_factory.mktemp("tidepool-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIDEPOOL_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, cache_env: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("made")
    return {arch: make_model(arch, "tiny", root / arch, seed=0) for arch in ARCHS}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = handle.get_tensor(name)
    return tensors


def _load_hf(folder: Path) -> tuple[torch.nn.Module, dict[str, object]]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    return model.eval(), info


def _assert_clean_load(info: dict[str, object]) -> None:
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_made_model(tiny_dirs: dict[str, Path], arch: str) -> None:
    folder = tiny_dirs[arch]
    model, info = _load_hf(folder)
    _assert_clean_load(info)
    assert type(model).__name__ == ARCHITECTURES[arch]
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert config.rope_parameters["rope_theta"] == 10000.0  # classic rope_theta is read by transformers 5
    # The made weights (not a fresh init) are what transformers holds.
    ours = _tensors(folder)
    hf_state = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(hf_state[name], tensor), name
    assert ("model.layers.0.self_attn.q_proj.bias" in ours) == (arch == "qwen2")


@pytest.mark.parametrize("arch", ARCHS)
def test_config_fields(tiny_dirs: dict[str, Path], arch: str) -> None:
    config = json.loads((tiny_dirs[arch] / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[arch]] and config["model_type"] == arch
    assert config["rope_theta"] == 10000.0 and "rope_parameters" not in config
    assert config["torch_dtype"] == "float32" and config["vocab_size"] == 512 and config["head_dim"] == 16
    assert config["tie_word_embeddings"] is False
    if arch == "llama":
        assert config["attention_bias"] is False
    if arch == "mistral":
        assert config["sliding_window"] is None
    if arch == "qwen2":
        assert config["use_sliding_window"] is False
    generation = json.loads((tiny_dirs[arch] / "generation_config.json").read_text())
    tokenizer_json = json.loads((tiny_dirs[arch] / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"] | {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    assert len(vocab) == 512 and max(vocab.values()) == 511
    assert vocab["<|im_end|>"] in generation["eos_token_id"]
    tokenizer_config = json.loads((tiny_dirs[arch] / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in tokenizer_config["chat_template"]


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_equals_unsharded(tiny_dirs: dict[str, Path], tmp_path: Path, cache_env: Path, arch: str) -> None:
    folder = make_model(arch, "tiny", tmp_path / "sharded", seed=0, num_shards=3)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    sharded = _tensors(folder)
    assert set(index["weight_map"]) == set(sharded)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sharded.values())
    unsharded = _tensors(tiny_dirs[arch])
    assert sharded.keys() == unsharded.keys()
    assert all(torch.equal(sharded[name], unsharded[name]) for name in sharded)
    _, info = _load_hf(folder)
    _assert_clean_load(info)


def test_tied_embeddings_and_dtype(tmp_path: Path, cache_env: Path) -> None:
    folder = make_model("qwen2", "tiny", tmp_path / "tied", tie_word_embeddings=True, dtype="bfloat16")
    tensors = _tensors(folder)
    assert "lm_head.weight" not in tensors
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, info = _load_hf(folder)
    _assert_clean_load(info)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_same_seed_same_bytes(tmp_path: Path, cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = make_model("llama", "tiny", tmp_path / "a", seed=7, num_shards=2)
    # A fresh cache forces the tokenizer to be trained again, not copied.
    monkeypatch.setenv("TIDEPOOL_CACHE", str(tmp_path / "other-cache"))
    second = make_model("llama", "tiny", tmp_path / "b", seed=7, num_shards=2)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = make_model("llama", "tiny", tmp_path / "c", seed=8)
    assert not torch.equal(_tensors(other)["model.norm.weight"], _tensors(first)["model.norm.weight"])


def test_remaking_into_a_folder_drops_stale_shards(tmp_path: Path, cache_env: Path) -> None:
    folder = make_model("mistral", "tiny", tmp_path / "m", num_shards=2)
    make_model("mistral", "tiny", folder, num_shards=1)
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="llama, mistral, qwen2"):
        make_model("gpt2", "tiny", "/nonexistent")
    with pytest.raises(ValueError, match="small, smollm-135m, tiny"):
        make_model("llama", "huge", "/nonexistent")
    with pytest.raises(ValueError, match="dtype"):
        make_model("llama", "tiny", "/nonexistent", dtype="int3")


def test_small_preset_vocab(cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = build_tokenizer("small", "llama", seed=0)
    assert tokenizer.get_vocab_size() == PRESETS["small"].vocab_size == 2048
    assert (cache_env / "tokenizers").is_dir()

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained again: the cached tokenizer was not used")

    monkeypatch.setattr(make_model_tokenizer, "train_bpe", no_training)
    assert build_tokenizer("small", "llama", seed=0).to_str() == tokenizer.to_str()  # served from the cache


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_are_not_flat(tiny_dirs: dict[str, Path], arch: str) -> None:
    model, _ = _load_hf(tiny_dirs[arch])
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 512, (8, 32), generator=generator)
    with torch.no_grad():
        logits = model(input_ids).logits
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert (gaps > 1e-3).float().mean() > 0.95


def test_make_model_does_not_import_transformers(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from tidepool.engine.make_model import make_model\n"
        f"make_model('qwen2', 'tiny', {str(tmp_path / 'm')!r})\n"
        "assert 'transformers' not in sys.modules, 'make_model imported transformers'\n"
    )
    env = {**os.environ, "TIDEPOOL_CACHE": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path, timeout=120)


@pytest.mark.slow
def test_smollm_135m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEPOOL_CACHE", str(tmp_path / "cache"))  # a real training run (pytest's timeout bounds it)
    tokenizer = build_tokenizer("smollm-135m", "llama", seed=0)
    assert tokenizer.get_vocab_size() == 49152
    folder = make_model("llama", "smollm-135m", tmp_path / "smol", num_shards=2)
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (576, 30, 9)
    assert (config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (
        3,
        1536,
        49152,
    )
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5
    model, info = _load_hf(folder)
    _assert_clean_load(info)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6
