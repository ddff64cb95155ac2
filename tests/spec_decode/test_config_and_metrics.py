"""Configuration errors name the fix (LLM(speculative_config=...), tidepool serve --speculative-config), the
per-request K and off-switch rules, and the spec-decode metrics and acceptance log line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tidepool.contract import metrics_names as names
from tidepool.engine import LLM
from tidepool.engine.server.cli import main as serve_main
from tidepool.engine.server.metrics import SPEC_LOG_INTERVAL_S, EngineMetrics
from tidepool.engine.spec_decode.config import SpeculativeConfig, num_spec_tokens_for, speculation_pays
from tidepool.engine.stats import EngineStats


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "draft", "num_speculative_tokens": 3}, "needs draft_model"),
        ({"method": "ngram", "draft_model": "/x", "num_speculative_tokens": 3}, "takes no draft_model"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "k"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
    ],
)
def test_bad_configs_name_the_fix(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.model_validate(raw)


def test_vllm_key_model_is_accepted() -> None:
    config = SpeculativeConfig.model_validate({"method": "draft", "model": "/d", "num_speculative_tokens": 2})
    assert config.draft_model == "/d"


def test_draft_with_another_tokenizer_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tidepool.engine.make_model import make_model

    other = make_model("llama", "tiny", tmp_path / "other", seed=1)  # same sizes, another trained tokenizer
    for draft, message in ((other, "different tokenizer"), (tmp_path / "missing", "does not exist")):
        spec = {"method": "draft", "draft_model": str(draft), "num_speculative_tokens": 2}
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_model_dir), show_progress=False, speculative_config=spec)


def test_draft_with_another_vocab_size_is_refused(tiny_model_dir: Path, small_vocab_model: Any) -> None:
    spec = {"method": "draft", "draft_model": str(small_vocab_model(0)), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(str(tiny_model_dir), show_progress=False, speculative_config=spec)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"method": "draft", "num_speculative_tokens": 2}', "draft_model"),
    ],
)
def test_serve_flag_errors(flag: str, message: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_main(["--model", str(tiny_model_dir), "--speculative-config", flag]) == 2
    assert message in capsys.readouterr().err


def test_per_request_k() -> None:
    assert num_spec_tokens_for(4, 10, 2, 16, 128, False) == 4
    assert num_spec_tokens_for(4, 10, 13, 16, 128, False) == 2  # 3 tokens left: 2 proposals + the bonus
    assert num_spec_tokens_for(4, 126, 2, None, 128, False) == 2  # positions end at max_model_len
    assert num_spec_tokens_for(4, 10, 2, 16, 128, True) == 0  # logprobs requests decode one token a step
    assert num_spec_tokens_for(4, 10, 15, 16, 128, False) == 0


def test_off_switch_rule() -> None:
    assert speculation_pays(1, 4, 2048, 8)
    assert not speculation_pays(8, 4, 2048, 8)  # batch large enough
    assert not speculation_pays(4, 4, 16, 8)  # 4 x 5 tokens exceed the step budget


def _stats(draft: int, accepted: int) -> EngineStats:
    return EngineStats(0, 0, 0.0, 10, 16, 10, 0, 0, 0, spec_num_draft_tokens=draft, spec_num_accepted_tokens=accepted)


def test_metrics_and_acceptance_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = EngineMetrics("m", 128, 2048, {"block_size": "16"})
    clock = [1000.0]
    monkeypatch.setattr("tidepool.engine.server.metrics.time.monotonic", lambda: clock[0])
    metrics._spec_logged = (0, 0, clock[0])
    metrics.record_stats(_stats(40, 30))
    clock[0] += SPEC_LOG_INTERVAL_S + 1
    with caplog.at_level(logging.INFO, logger="tidepool.engine.server.metrics"):
        metrics.record_stats(_stats(100, 60))
    text = metrics.render().decode()
    assert f'{names.sample_total(names.SPEC_DECODE_NUM_DRAFT_TOKENS)}{{model_name="m"}} 100.0' in text
    assert f'{names.sample_total(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS)}{{model_name="m"}} 60.0' in text
    assert "acceptance rate 60.0% (60 of 100 proposed tokens" in caplog.text
