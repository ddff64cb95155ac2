"""Loading a model folder: every broken folder gives an error that names what is wrong.

Each test copies the tiny random llama (`tiny_model_dir`), breaks one thing (a file, a config
value, a tensor) and checks the error type and that the message names the culprit. A sharded
checkpoint written from the same seed must load into exactly the same weights.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidepool.engine import LLM
from tidepool.engine.config import ModelConfig
from tidepool.engine.loading.loader import load_model
from tidepool.engine.make_model import make_model


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def _edit_config(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _edit_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _load(folder: Path) -> None:
    load_model(folder, show_progress=False)


# ---- files ------------------------------------------------------------------------------------
def test_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        _load(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(missing), show_progress=False)


def test_missing_config_json_is_named(model_copy: Path) -> None:
    (model_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        _load(model_copy)


def test_config_json_that_is_not_json(model_copy: Path) -> None:
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        _load(model_copy)


def test_missing_safetensors_is_named(model_copy: Path) -> None:
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        _load(model_copy)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("llama", "tiny", tmp_path_factory.mktemp("sharded") / "tiny-3-shards", seed=0, num_shards=3)


def test_sharded_checkpoint_loads_identically(tiny_model_dir: Path, sharded_dir: Path) -> None:
    assert not (sharded_dir / "model.safetensors").exists()
    assert len(list(sharded_dir.glob("model-*-of-00003.safetensors"))) == 3
    single, _ = load_model(tiny_model_dir, show_progress=False)
    sharded, _ = load_model(sharded_dir, show_progress=False)
    single_state, sharded_state = single.state_dict(), sharded.state_dict()
    assert single_state.keys() == sharded_state.keys()
    for name, tensor in single_state.items():
        assert torch.equal(tensor, sharded_state[name]), name


def test_index_naming_a_missing_shard(sharded_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(sharded_dir, tmp_path / "sharded"))
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00003\.safetensors"):
        _load(folder)


# ---- config values --------------------------------------------------------------------------------
def test_unsupported_architecture_lists_the_supported_ones(model_copy: Path) -> None:
    _edit_config(model_copy, lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        _load(model_copy)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert arch in str(info.value)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_size": -64}, "hidden_size must be a positive integer"),
        ({"hidden_size": 64.5}, "hidden_size must be a positive integer"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"rope_scaling": {"rope_type": "yarn-ish", "factor": 2.0}}, "'yarn-ish' is not supported; supported: default"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"torch_dtype": "float8"}, "torch_dtype 'float8' is not one of float32, bfloat16, float16"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ],
    ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else "",
)
def test_bad_config_values_name_the_field(model_copy: Path, changes: dict[str, Any], match: str) -> None:
    _edit_config(model_copy, lambda c: c.update(changes))
    with pytest.raises(ValueError, match=match):
        _load(model_copy)


def test_missing_required_config_field(model_copy: Path) -> None:
    _edit_config(model_copy, lambda c: c.pop("num_hidden_layers"))
    with pytest.raises(ValueError, match="required field 'num_hidden_layers' is missing"):
        _load(model_copy)


def test_config_errors_reach_llm_users_as_value_errors(model_copy: Path) -> None:
    _edit_config(model_copy, lambda c: c.update(num_key_value_heads=3))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LLM(str(model_copy), show_progress=False)


def test_config_from_dict_accepts_transformers5_rope_parameters() -> None:
    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 16,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        }
    )
    assert config.rope_theta == 500.0
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "linear"
    assert config.num_key_value_heads == 2 and config.head_dim == 4


# ---- tensors ------------------------------------------------------------------------------------------
def test_missing_tensor_is_an_error_pointing_at_its_layer(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: .*layers\.1\.mlp\.down"):
        _load(model_copy)


def test_missing_norm_tensor_is_named(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.norm\.weight"):
        _load(model_copy)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"])
def test_missing_tensor_error_names_the_checkpoint_tensor(model_copy: Path, name: str) -> None:
    _edit_weights(model_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _load(model_copy)


def test_wrong_tensor_shape_is_named(model_copy: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.embed_tokens.weight"] = torch.zeros(512, 32)

    _edit_weights(model_copy, edit)
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' has shape \(512, 32\), expected \(512, 64\)"):
        _load(model_copy)


def test_wrong_row_count_in_a_fused_projection_is_a_shape_error(model_copy: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        name = "model.layers.0.self_attn.k_proj.weight"
        tensors[name] = torch.cat([tensors[name], tensors[name][:1]])

    _edit_weights(model_copy, edit)
    with pytest.raises(ValueError, match=r"k_proj.* shape"):
        _load(model_copy)


def test_wrong_column_count_in_a_fused_projection_is_a_shape_error(model_copy: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        name = "model.layers.0.self_attn.v_proj.weight"
        tensors[name] = tensors[name][:, :60].contiguous()

    _edit_weights(model_copy, edit)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.v_proj.weight' has shape"):
        _load(model_copy)


def test_unexpected_tensor_is_named(model_copy: Path) -> None:
    _edit_weights(model_copy, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="extra"):
        _load(model_copy)


# ---- formats and layering ---------------------------------------------------------------------------
def test_the_format_registry_names_each_kind_of_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tidepool.engine.loading.formats import FORMATS, detect_format
    from tidepool.engine.loading.quantized_copy import quantize_folder

    assert detect_format(tiny_model_dir).name == "hf" and detect_format(tiny_model_dir).quant is None
    int4 = detect_format(quantize_folder(tiny_model_dir, tmp_path / "int4", "int4"))
    assert int4.name == "tidepool-int4" and int4.quant is not None and int4.quant.group_sizes == {64: 64, 128: 128}
    gguf_file = tmp_path / "model.bin"
    gguf_file.write_bytes(b"GGUF" + bytes(60))  # the magic decides, not the name
    assert detect_format(gguf_file).name == "gguf"
    assert {"hf", "gguf", "tidepool-int8", "tidepool-int4", "gptq", "awq", "tidepool-2:4"} == set(FORMATS)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        detect_format(tmp_path / "no-such-model")


def test_loading_layers_import_one_way() -> None:
    """The loading layer composes formats and models; none of them imports it back (the `tidepool quantize`
    command line excepted), GGUF code never imports the model code, and the config imports no format."""
    import ast

    engine = Path(__file__).resolve().parents[1] / "engine"

    def imports(path: Path) -> set[str]:
        """Engine modules `path` imports (anywhere: in functions too), relative to engine/, e.g. "gguf.detect"."""
        package = list(path.relative_to(engine).parent.parts)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                found.add(".".join([*base, *(node.module or "").split(".")]).strip("."))
            elif isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                found.update(n.removeprefix("tidepool.engine.") for n in names if n.startswith("tidepool.engine."))
        return found

    def reaches(files: list[Path], target: str) -> list[str]:
        return [f"{p.relative_to(engine)} -> {m}" for p in files for m in imports(p) if m.split(".")[0] == target]

    quant = [p for p in (engine / "quant").glob("*.py") if p.name != "cli.py"]
    lower = [*quant, *(engine / "gguf").glob("*.py"), *(engine / "models").glob("*.py"), engine / "config.py"]
    assert reaches(lower, "loading") == []
    assert reaches(list((engine / "gguf").glob("*.py")), "models") == []
    assert reaches([engine / "config.py"], "gguf") == []
    assert reaches(quant, "gguf") == []
