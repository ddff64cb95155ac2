"""The `tidepool` console script: make-model and generate work end to end; a bad model exits 1 with one line;
generate's engine flags are `tidepool serve`'s."""

from __future__ import annotations

import argparse
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
    """pydantic's multi-line report becomes one `field: message` line; JSON the table cannot decode, one line too."""
    bad_k = '{"method": "ngram", "num_speculative_tokens": 0}'
    assert main(["generate", str(tiny_model_dir), "--speculative-config", bad_k]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tidepool generate: error: speculative_config.num_speculative_tokens: ")
    assert main(["generate", str(tiny_model_dir), "--speculative-config", "{method"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--speculative-config is not valid JSON" in err[0]


GENERATE_OWN_OPTIONS = {"-h", "--help", "--prompt", "--chat", "--max-tokens", "--temperature", "--top-p", "--top-k"}


def test_generate_takes_the_engine_flags_as_serve_spells_them(capsys: pytest.CaptureFixture[str]) -> None:
    """Besides its own prompt and sampling options, `tidepool generate` has exactly the table's engine flags
    (generated, so `--no-enable-prefix-caching` as in `tidepool serve`); out-of-range values exit 2 as there."""
    from tidepool.cli import build_parser
    from tidepool.contract.serve_flags import GENERATE_FLAGS

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = {s for action in subparsers.choices["generate"]._actions for s in action.option_strings}
    assert options - GENERATE_OWN_OPTIONS == {s for f in GENERATE_FLAGS for s in (*f.spellings(), *f.aliases)}
    assert {"--model", "--no-enable-prefix-caching", "--speculative-config", "--seed"} <= options
    for argv in (["m", "--no-prefix-caching"], ["m", "--max-num-seqs", "0"], []):
        with pytest.raises(SystemExit) as exc:
            main(["generate", *argv])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-prefix-caching" in err and "argument --max-num-seqs: must be >= 1" in err
    assert "--model (or bare: MODEL) is required" in err


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
