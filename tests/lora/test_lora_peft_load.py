"""`load_adapter` against PEFT itself: the weights and scaling PEFT computes with, and every refusal.

The scaled B the engine keeps must equal PEFT's `lora_B * scaling` for each module (so rank, lora_alpha,
rsLoRA, rank_pattern and alpha_pattern all mean what PEFT means); anything the engine would compute
differently, or cannot read safely, is a 400 `LoRAError` naming the file, tensor or field.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidepool.engine.config import ModelConfig
from tidepool.engine.loading.formats import read_model_config
from tidepool.engine.lora.peft import CONFIG_FILE, WEIGHTS_FILE, load_adapter
from tidepool.engine.lora.types import TARGET_MODULES, LoRAError


@pytest.fixture(scope="module")
def model_config(tiny_model_dir: Path) -> ModelConfig:
    return read_model_config(tiny_model_dir)


@pytest.mark.parametrize("name", ["qv", "all", "mlp"])
def test_weights_and_scaling_are_peft_s(name: str, lora_adapters: dict, model_config: ModelConfig) -> None:
    path, peft_model = lora_adapters[name]
    loaded = load_adapter(name, str(path), model_config, max_rank=16, dtype=torch.float32)
    layers = peft_model.base_model.model.model.layers
    seen = set()
    for index, layer in enumerate(layers):
        for parent in (layer.self_attn, layer.mlp):
            for proj in TARGET_MODULES:
                module = getattr(parent, proj, None)
                if module is None or not hasattr(module, "lora_A"):
                    continue
                ours = loaded.modules[(index, proj)]
                scaling = module.scaling["default"]
                assert ours.scaling == pytest.approx(scaling)
                assert torch.equal(ours.a, module.lora_A["default"].weight)
                torch.testing.assert_close(ours.b, module.lora_B["default"].weight * scaling)
                seen.add((index, proj))
    assert seen == set(loaded.modules)
    info = loaded.info
    assert info.rank == max(m.rank for m in loaded.modules.values())
    assert set(info.targets) == {proj for _, proj in seen}
    assert info.num_bytes == sum(m.a.nbytes + m.b.nbytes for m in loaded.modules.values())


def test_rank_pattern_alpha_pattern_and_rslora_took_effect(lora_adapters: dict, model_config: ModelConfig) -> None:
    qv = load_adapter("qv", str(lora_adapters["qv"][0]), model_config, 16, torch.float32)
    assert (qv.modules[(0, "q_proj")].rank, qv.modules[(0, "v_proj")].rank) == (8, 4)
    assert (qv.modules[(0, "q_proj")].scaling, qv.modules[(0, "v_proj")].scaling) == (2.0, 4.0)
    rs = load_adapter("all", str(lora_adapters["all"][0]), model_config, 16, torch.float32)
    assert rs.modules[(1, "down_proj")].scaling == pytest.approx(8.0 / 2.0)  # alpha / sqrt(r)
    mlp = load_adapter("mlp", str(lora_adapters["mlp"][0]), model_config, 16, torch.float32)
    assert (mlp.modules[(0, "up_proj")].scaling, mlp.modules[(0, "down_proj")].scaling) == (1.0, 2.0)


def _copy(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        data = json.loads((dst / CONFIG_FILE).read_text())
        (dst / CONFIG_FILE).write_text(json.dumps({**data, **config}))
    if tensors is not None:
        save_file(tensors, str(dst / WEIGHTS_FILE))
    return dst


CONFIG_REFUSALS = [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias='all'"),
    ({"lora_bias": True}, "lora_bias"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"peft_type": "PREFIX_TUNING"}, "only LORA"),
    ({"r": 0}, "'r'"),
    ({"r": 4}, "the config says r=4"),
]


@pytest.mark.parametrize(("config", "message"), CONFIG_REFUSALS)
def test_config_refusals(
    config: dict, message: str, lora_adapters: dict, model_config: ModelConfig, tmp_path: Path
) -> None:
    path = _copy(lora_adapters["qv"][0], tmp_path / "bad", config=config)
    with pytest.raises(LoRAError, match=message) as err:
        load_adapter("bad", str(path), model_config, 16, torch.float32)
    assert (err.value.status, err.value.code) == (400, "invalid_lora")


def test_rank_above_max_is_refused(lora_adapters: dict, model_config: ModelConfig) -> None:
    with pytest.raises(LoRAError, match="rank 8 exceeds --max-lora-rank 4") as err:
        load_adapter("qv", str(lora_adapters["qv"][0]), model_config, 4, torch.float32)
    assert (err.value.status, err.value.code) == (400, "lora_rank_too_large")


def test_wrong_base_architecture_is_refused(lora_adapters: dict, model_config: ModelConfig) -> None:
    wider = dataclasses.replace(model_config, intermediate_size=model_config.intermediate_size * 2)
    with pytest.raises(LoRAError, match="another base architecture"):
        load_adapter("mlp", str(lora_adapters["mlp"][0]), wider, 16, torch.float32)
    shallower = dataclasses.replace(model_config, num_hidden_layers=1)
    with pytest.raises(LoRAError, match="only 1 layers"):
        load_adapter("qv", str(lora_adapters["qv"][0]), shallower, 16, torch.float32)


def test_tensor_refusals(lora_adapters: dict, model_config: ModelConfig, tmp_path: Path) -> None:
    src = lora_adapters["qv"][0]
    tensors = load_file(str(src / WEIGHTS_FILE))
    extra = {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}
    with pytest.raises(LoRAError, match=re.escape("lm_head.lora_A.weight")):
        load_adapter("x", str(_copy(src, tmp_path / "extra", tensors=extra)), model_config, 16, torch.float32)
    missing_b = {k: v for k, v in tensors.items() if not k.endswith("layers.1.self_attn.q_proj.lora_B.weight")}
    with pytest.raises(LoRAError, match=re.escape("layer 1 q_proj: lora_B.weight is missing")):
        load_adapter("x", str(_copy(src, tmp_path / "no-b", tensors=missing_b)), model_config, 16, torch.float32)


def test_missing_corrupt_and_pickled_files(lora_adapters: dict, model_config: ModelConfig, tmp_path: Path) -> None:
    src = lora_adapters["qv"][0]

    def refused(path: Path, message: str) -> None:
        with pytest.raises(LoRAError, match=message) as err:
            load_adapter("x", str(path), model_config, 16, torch.float32)
        assert err.value.status == 400

    refused(tmp_path / "nowhere", "is not a folder")
    no_config = _copy(src, tmp_path / "no-config")
    (no_config / CONFIG_FILE).unlink()
    refused(no_config, f"has no {CONFIG_FILE}")
    bad_json = _copy(src, tmp_path / "bad-json")
    (bad_json / CONFIG_FILE).write_text("{not json")
    refused(bad_json, "not valid JSON")
    pickled = _copy(src, tmp_path / "pickled")
    (pickled / WEIGHTS_FILE).rename(pickled / "adapter_model.bin")
    refused(pickled, "convert to safetensors")
    no_weights = _copy(src, tmp_path / "no-weights")
    (no_weights / WEIGHTS_FILE).unlink()
    refused(no_weights, f"has no {WEIGHTS_FILE}")
    corrupt = _copy(src, tmp_path / "corrupt")
    (corrupt / WEIGHTS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    refused(corrupt, "not a readable safetensors file")
    truncated = _copy(src, tmp_path / "truncated")
    data = (truncated / WEIGHTS_FILE).read_bytes()
    (truncated / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    refused(truncated, "not a readable safetensors file")
