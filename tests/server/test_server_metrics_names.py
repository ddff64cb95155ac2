"""A server exports vLLM's metrics under vLLM's names, and the contract module names exactly those.

The expected families are written out below as vLLM (V1) lists them on `/metrics` (`# TYPE`
lines), not read from `tidepool.contract.metrics_names`: dashboards, KEDA scalers and gateways
built for vLLM read these strings, so a rename on either side (the contract or the server's
registration) fails here. The contract module itself stays torch-free and import-free (the
operator image has no torch).
"""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import Server

from tidepool.contract import metrics_names as names

SOURCE = Path(names.__file__)

# vLLM's metric families, as its `/metrics` declares them (a counter's samples are `<name>_total`).
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:spec_decode_num_draft_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",  # vLLM's older name for the same intervals as ITL
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",  # a histogram despite the suffix, as in vLLM
}
TIDEPOOL_FAMILIES = {"tidepool:startup_phase_seconds": "gauge"}


def exported_families(text: str) -> dict[str, str]:
    """Family name -> type from the `# TYPE` lines, less prometheus-client's `*_created` timestamps."""
    families = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            if not (name.endswith("_created") and kind == "gauge"):
                families[name] = kind
    return families


def test_module_imports_nothing() -> None:
    tree = ast.parse(SOURCE.read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert all(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in imports)


def test_the_contract_names_vllms_families() -> None:
    counters = (*names.COUNTERS, *names.SPEC_DECODE_COUNTERS)
    contract = [*names.GAUGES, *map(names.sample_total, counters), *names.HISTOGRAMS]
    assert len(contract) == len(set(contract))
    assert set(contract) == set(VLLM_FAMILIES)
    assert {names.STARTUP_PHASE_SECONDS} == set(TIDEPOOL_FAMILIES)


def test_a_server_exports_vllms_families(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert exported_families(text) == VLLM_FAMILIES | TIDEPOOL_FAMILIES
    for family in text_string_to_metric_families(text):
        if family.name == names.CACHE_CONFIG_INFO:  # labelled by the cache settings alone, as in vLLM
            continue
        assert all(sample.labels.get(names.MODEL_NAME_LABEL) == server.model for sample in family.samples), family.name
