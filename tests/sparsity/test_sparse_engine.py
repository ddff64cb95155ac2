"""A tidepool-2:4 checkpoint through the engine: detected, loaded as `SparseWeight`s, decoded by the one-call
compiled step, and the same greedy tokens as transformers running the same pruned weights densely (a tiny random
model here; the real SmolLM2, slow-marked, below). Bad input: metadata that does not match its values, a model
width that does not divide by 4, a half-sparse fused projection, and the `--sparsity`/`--quantization` requests
a checkpoint cannot serve, each one error naming the tensor or the flag.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.loading.formats import detect_format
from tidepool.engine.loading.loader import load_model
from tidepool.engine.quant.spec import tidepool_config
from tidepool.engine.sparsity.format import FORMAT
from tidepool.engine.sparsity.load import check_sparsity_request
from tidepool.engine.sparsity.prune import cached_sparse_checkpoint, densify_folder, sparsify_folder
from tidepool.engine.sparsity.weight import SparseWeight

PROMPTS = [[5, 17, 99, 3, 250], [7], [400, 401, 402, 403, 404, 405, 406, 407, 408, 12, 13]]
NUM_NEW = 8


@pytest.fixture(scope="module")
def sparse_dirs(tmp_path_factory: pytest.TempPathFactory, hf_model_dir: Callable[[str], Path]) -> dict[str, Path]:
    """A tiny Llama (GQA) pruned 2:4 by magnitude: float32 and int8 kept values, and the float32 one densified."""
    src, root = hf_model_dir("llama-gqa"), tmp_path_factory.mktemp("sparse")
    sparse = sparsify_folder(src, root / "sparse", "magnitude", "float32", show_progress=False)
    return {
        "sparse": sparse,
        "int8": sparsify_folder(src, root / "int8", "magnitude", "int8", show_progress=False),
        "dense": densify_folder(sparse, root / "dense"),
    }


def hf_greedy(path: Path, prompt: list[int], num_new: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_new):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def engine_greedy(llm: LLM, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_detected_and_loaded_as_sparse_weights(sparse_dirs: dict[str, Path]) -> None:
    assert detect_format(sparse_dirs["sparse"]).name == FORMAT
    model, _ = load_model(sparse_dirs["sparse"], show_progress=False)
    weights = [m for m in model.modules() if isinstance(m, SparseWeight)]
    assert len(weights) == 4 * len(model.layers)  # qkv, o, gate_up, down per layer, fused
    assert not any(name.endswith(("qkv_weight", "down_weight")) for name, _ in model.named_parameters())


@pytest.mark.parametrize("kind", ["sparse", "int8"])
def test_greedy_tokens_equal_transformers_on_the_same_pruned_weights(sparse_dirs: dict[str, Path], kind: str) -> None:
    path = sparse_dirs[kind]
    reference = path if kind == "int8" else sparse_dirs["dense"]
    if kind == "int8":
        reference = densify_folder(path, path.parent / "int8-dense")
    llm = LLM(str(path), show_progress=False, max_num_seqs=4, quantization="int8" if kind == "int8" else None)
    got = engine_greedy(llm, PROMPTS, NUM_NEW)
    state = llm.engine.model._decoder_state
    assert state is not None and state.prepared is not None  # the decode steps ran in the one-call compiled op
    assert got == [hf_greedy(reference, p, NUM_NEW) for p in PROMPTS]


def test_sparsity_flag_on_a_dense_checkpoint_says_to_sparsify(sparse_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"--sparsity 2:4: .* is not a 2:4 checkpoint.*tidepool sparsify"):
        LLM(str(sparse_dirs["dense"]), sparsity="2:4", show_progress=False)
    check_sparsity_request(str(sparse_dirs["sparse"]), "2:4", None)  # asked of a 2:4 checkpoint: fine


@pytest.mark.parametrize("method", ["int4", "gptq", "awq", "gguf"])
def test_sparsity_with_an_unsupported_quantization_names_the_flags(sparse_dirs: dict[str, Path], method: str) -> None:
    with pytest.raises(ValueError, match=rf"--sparsity 2:4 with --quantization {method}: .*only with int8"):
        check_sparsity_request(str(sparse_dirs["sparse"]), "2:4", method)
    with pytest.raises(ValueError, match=rf"--quantization {method}: .* is a 2:4 checkpoint"):
        check_sparsity_request(str(sparse_dirs["sparse"]), None, method)


def test_int8_asked_of_float_kept_values_names_the_flag(sparse_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"--quantization int8: .* float32 kept values"):
        check_sparsity_request(str(sparse_dirs["sparse"]), None, "int8")


def corrupt_copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_metadata_that_does_not_match_its_values_is_named(sparse_dirs: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj"

    def wrong_shape(t: dict[str, torch.Tensor]) -> None:
        t[f"{name}.meta"] = t[f"{name}.meta"][:, :-1].contiguous()

    def repeated_index(t: dict[str, torch.Tensor]) -> None:
        t[f"{name}.meta"][2, 0] = 0x55

    def missing(t: dict[str, torch.Tensor]) -> None:
        del t[f"{name}.meta"]

    for edit, message in (
        (wrong_shape, rf"{name}\.meta is torch.uint8 \(\d+, \d+\), expected uint8"),
        (repeated_index, rf"{name}\.meta: row 2, group 0 names indices \[1, 1\]"),
        (missing, rf"missing tensor {name}\.meta"),
    ):
        bad = corrupt_copy(sparse_dirs["sparse"], tmp_path / edit.__name__, edit)
        with pytest.raises(ValueError, match=message):
            load_model(bad, show_progress=False)


def test_half_sparse_fused_projection_is_named(sparse_dirs: dict[str, Path], tmp_path: Path) -> None:
    def densify_v(t: dict[str, torch.Tensor]) -> None:
        v = "model.layers.0.self_attn.v_proj"
        t[f"{v}.weight"] = torch.zeros(t[f"{v}.values"].shape[0], 2 * t[f"{v}.values"].shape[1])
        del t[f"{v}.values"], t[f"{v}.meta"]

    bad = corrupt_copy(sparse_dirs["sparse"], tmp_path / "half", densify_v)
    with pytest.raises(ValueError, match=r"v_proj not 2:4-sparse while fused partners .*q_proj.* are"):
        load_model(bad, show_progress=False)


def test_a_width_that_does_not_divide_by_4_is_named(sparse_dirs: dict[str, Path], tmp_path: Path) -> None:
    def narrower(t: dict[str, torch.Tensor]) -> None:
        for key in [k for k in t if ".mlp." in k]:
            del t[key]

    bad = corrupt_copy(sparse_dirs["sparse"], tmp_path / "odd", narrower)
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = 158  # down_proj's 158 inputs: not a multiple of 4
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(bad / "model.safetensors")
    hidden = config["hidden_size"]
    for layer in range(config["num_hidden_layers"]):
        mlp = f"model.layers.{layer}.mlp"
        for proj in ("gate_proj", "up_proj"):
            tensors[f"{mlp}.{proj}.values"] = torch.zeros(158, hidden // 2)
            tensors[f"{mlp}.{proj}.meta"] = torch.full((158, hidden // 8), 0x44, dtype=torch.uint8)
        tensors[f"{mlp}.down_proj.values"] = torch.zeros(hidden, 79)
        tensors[f"{mlp}.down_proj.meta"] = torch.full((hidden, 20), 0x44, dtype=torch.uint8)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj\.values has 158 input features, not a multiple of 4"):
        load_model(bad, show_progress=False)


def test_quantization_and_sparsity_configs_together_are_refused(sparse_dirs: dict[str, Path], tmp_path: Path) -> None:
    both = tmp_path / "both"
    shutil.copytree(sparse_dirs["sparse"], both)
    config = json.loads((both / "config.json").read_text())
    config["quantization_config"] = tidepool_config("int8", {})
    (both / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"both a quantization_config .* and a sparsity_config"):
        detect_format(both)


@pytest.mark.slow
def test_real_smollm2_pruned_greedy_equals_transformers_dense(smollm_f32: Path) -> None:
    sparse = cached_sparse_checkpoint(smollm_f32, "magnitude")  # no calibration: seconds on a fresh machine
    dense = sparse.parent / f"{sparse.name}-densified"
    if not (dense / "config.json").is_file():
        densify_folder(sparse, dense)
    llm = LLM(str(sparse), show_progress=False, max_num_seqs=4)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 8, 19, 2000, 40, 41]]
    assert engine_greedy(llm, prompts, 16) == [hf_greedy(dense, p, 16) for p in prompts]


def test_one_call_step_and_layer_by_layer_give_the_same_logprobs(
    sparse_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode step's sparse projections (decoder.cpp) are the per-call op's (sparse24.cpp), bit for bit."""
    from tidepool.engine import cpu_ops

    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=2)

    def run() -> list[tuple[list[int], object]]:
        cpu_ops.reset()
        llm = LLM(str(sparse_dirs["sparse"]), show_progress=False, max_num_seqs=4)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params)]

    one_call = run()
    monkeypatch.setenv(cpu_ops.DECODER_MODE_ENV, "torch")
    layer_by_layer = run()
    cpu_ops.reset()
    assert one_call == layer_by_layer
