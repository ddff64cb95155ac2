"""Bad GGUF input: one clear `GGUFError` (a ValueError) naming the file and the problem, never a library traceback.

Each case starts from a valid synthetic file and breaks one thing: truncation (inside the tensor
data and inside the header), the magic, an empty file, an unsupported tensor type (IQ4_NL, written
with gguf's writer), a tensor type id unknown to the gguf package, missing tokenizer metadata, an
unsupported architecture, an unknown pre-tokenizer. The CLI prints that message as one line and exits 1.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import hf_to_gguf

from tidepool.cli import main
from tidepool.engine import LLM
from tidepool.engine.gguf.errors import GGUFError
from tidepool.engine.loading.formats import read_model_config
from tidepool.engine.loading.loader import load_model
from tidepool.engine.tokenizer import Tokenizer


def _raises(path: Path, match: str) -> GGUFError:
    """Every entry point raises the same clean error, with no chained library exception."""
    for load in (lambda: LLM(str(path), show_progress=False), lambda: load_model(path, show_progress=False)):
        with pytest.raises(GGUFError, match=match) as excinfo:
            load()
        error = excinfo.value
        assert str(path.name) in str(error) and "\n" not in str(error)
        assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    return error


@pytest.fixture()
def good(gguf_model, tmp_path: Path) -> Path:
    return Path(shutil.copy(gguf_model("llama-gqa", "Q8_0"), tmp_path / "model.gguf"))


def test_truncated_in_the_tensor_data(good: Path) -> None:
    data = good.read_bytes()
    good.write_bytes(data[: len(data) * 2 // 3])
    _raises(good, r"truncated")


def test_truncated_in_the_header(good: Path) -> None:
    good.write_bytes(good.read_bytes()[:300])
    _raises(good, r"not a valid GGUF file: the file is truncated or corrupt")


@pytest.mark.parametrize("content", [b"PK\x03\x04" + b"\0" * 64, b""], ids=["zip", "empty"])
def test_wrong_magic(good: Path, content: bytes) -> None:
    good.write_bytes(content)
    _raises(good, r"is not a GGUF file: it starts with .*not the GGUF magic")


def test_unsupported_tensor_type(hf_model_dir, tmp_path: Path) -> None:
    def iq4_for_q(name: str, shape: tuple[int, ...]) -> str:
        return "IQ4_NL" if name == "blk.1.attn_q.weight" else ("F32" if len(shape) == 1 else "F16")

    # gguf cannot quantize IQ4_NL, so write raw IQ4_NL blocks (18 bytes per 32 values) for that tensor.
    original = gguf.quants.quantize

    def quantize(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
        if kind == gguf.GGMLQuantizationType.IQ4_NL:
            return np.zeros((values.shape[0], values.shape[1] // 32 * 18), dtype=np.uint8)
        return original(values, kind)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.quants, "quantize", quantize)
        file = hf_to_gguf(hf_model_dir("llama-gqa"), tmp_path / "iq4.gguf", iq4_for_q)
    error = _raises(file, r"tensor 'blk\.1\.attn_q\.weight' has type IQ4_NL, which Tidepool cannot load")
    assert "supported tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1" in str(error)


def test_tensor_type_unknown_to_the_gguf_package(good: Path) -> None:
    data = bytearray(good.read_bytes())
    name = b"token_embd.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = (99).to_bytes(4, "little")
    good.write_bytes(bytes(data))
    _raises(good, r"type id 99, unknown to the gguf package")


def test_missing_tokenizer_metadata(hf_model_dir, tmp_path: Path) -> None:
    file = hf_to_gguf(hf_model_dir("llama-gqa"), tmp_path / "no-tokenizer.gguf", tokenizer=False)
    assert read_model_config(file).vocab_size == 512  # the weights alone are fine
    with pytest.raises(GGUFError, match=r"no tokenizer metadata \(tokenizer\.ggml\.model is missing\)"):
        Tokenizer.from_pretrained(file)
    with pytest.raises(GGUFError, match="no tokenizer metadata"):
        LLM(str(file), show_progress=False)


def test_unsupported_architecture(hf_model_dir, tmp_path: Path) -> None:
    file = hf_to_gguf(hf_model_dir("llama-gqa"), tmp_path / "phi3.gguf", arch="phi3")
    _raises(file, r"GGUF architecture 'phi3' is not supported; supported: llama, qwen2")


def test_unknown_pre_tokenizer(hf_model_dir, tmp_path: Path) -> None:
    file = hf_to_gguf(hf_model_dir("llama-gqa"), tmp_path / "pre.gguf", pre="made-up-v9")
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.pre 'made-up-v9' is not a pre-tokenizer Tidepool knows"):
        Tokenizer.from_pretrained(file)


def test_generate_prints_one_line_and_exits_1(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good.write_bytes(good.read_bytes()[:300])
    assert main(["--log-level", "WARNING", "generate", "--model", str(good)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tidepool generate: error: ") and "truncated or corrupt" in err[0]


@pytest.mark.slow
def test_cli_process_prints_one_line(good: Path) -> None:
    """The console script itself: no traceback on stderr, exit status 1."""
    good.write_bytes(b"GGUX" + good.read_bytes()[4:])
    script = Path(sys.executable).with_name("tidepool")
    proc = subprocess.run(
        [str(script), "--log-level", "WARNING", "generate", "--model", str(good)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=good.parent,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a GGUF file" in lines[0] and "Traceback" not in proc.stderr
