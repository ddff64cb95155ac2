"""The `tidepool` console script: make-model and generate work end to end; a bad model exits 1 with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tidepool.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_make_model_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    assert main(["make-model", "--arch", "qwen2", "--preset", "tiny", "--shards", "2", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert (out / "model.safetensors.index.json").is_file()
    assert main(["generate", "--model", str(out), "--max-tokens", "5", "--prompt", "hello", "--chat"]) == 0
    printed = capsys.readouterr().out
    assert "prompt: 'hello'" in printed
    assert "5 tokens, finish_reason=length" in printed


def test_generate_missing_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "catalogue name" in err[0]


def test_generate_invalid_engine_option_is_one_line(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pydantic's multi-line report becomes one `field: message` line."""
    assert main(["generate", "--model", str(tiny_model_dir), "--max-num-seqs", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tidepool generate: error: max_num_seqs: ")


def test_unknown_preset_rejected_by_argparse() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["make-model", "--arch", "llama", "--preset", "huge", "x"])
    assert exc.value.code == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offline_benchmark_smoke(tmp_path: Path) -> None:
    """The benchmark script runs end to end on the tiny preset and writes its JSON and plot."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "offline_throughput.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "offline_throughput_llama_tiny.json").read_text())
    workloads = data["workloads"]
    for name in ("variable", "uniform"):
        run = workloads[name]
        assert run["tidepool"]["output_tokens"] == run["transformers"]["output_tokens"] > 0, name
        assert run["ratio"] > 0, name
    assert 0 < workloads["uniform"]["attention_share_b64"] < 1
    bs1 = workloads["bs1"]
    assert bs1["read_bandwidth_GBps"] > 0 and bs1["tidepool"]["mbu"] > 0 and bs1["transformers"]["mbu"] > 0
    assert workloads["neighbour"]["best_step_s"]["quiet"] > 0 and data["machine"]["threads"] >= 1
    assert (tmp_path / "offline_throughput_llama_tiny.png").stat().st_size > 1000
