"""The metrics contract module stays torch-free (the operator image has no torch) and names vLLM's metrics."""

from __future__ import annotations

import ast
from pathlib import Path

from tidepool.contract import metrics_names as names

SOURCE = Path(names.__file__)


def test_module_imports_nothing() -> None:
    tree = ast.parse(SOURCE.read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert all(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in imports)


def test_names_are_vllms() -> None:
    every = (*names.GAUGES, *names.COUNTERS, *names.HISTOGRAMS)
    assert len(set(every)) == len(every) == 20
    assert all(name.startswith("vllm:") for name in every)
    assert names.sample_total(names.PROMPT_TOKENS) == "vllm:prompt_tokens_total"
    assert names.ITERATION_TOKENS_TOTAL == "vllm:iteration_tokens_total"  # a histogram despite the suffix, as in vLLM


def test_time_per_output_token_is_exported_beside_itl() -> None:
    assert names.TIME_PER_OUTPUT_TOKEN_SECONDS == "vllm:time_per_output_token_seconds"
    assert {names.TIME_PER_OUTPUT_TOKEN_SECONDS, names.INTER_TOKEN_LATENCY_SECONDS} <= set(names.HISTOGRAMS)
