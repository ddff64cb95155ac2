"""The LoRA server parts that need no server: --lora-modules parsing, adapter names, the model check, the metrics.

The gateway metric is read back with prometheus-client's own text parser, and checked the way the
Gateway API Inference Extension's endpoint picker reads it (pkg/epp/backend/metrics, vLLM's
mapping): among the `vllm:lora_requests_info` samples, skip those whose running and waiting lists
are both empty, take the one with the largest value, split its lists on ",".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tidepool.contract import metrics_names as names
from tidepool.engine.lora.types import AdapterInfo, LoRASnapshot
from tidepool.engine.sampling_params import SamplingParams
from tidepool.engine.server import cli
from tidepool.engine.server.checks import check_model
from tidepool.engine.server.commands import Child
from tidepool.engine.server.lora_metrics import LoRAMetrics
from tidepool.engine.server.lora_modules import LoRAModule, parse_lora_modules
from tidepool.engine.server.protocol import APIError

SERVED = ["tiny", "/models/tiny"]


def test_lora_modules_in_both_of_vllms_forms() -> None:
    values = ["sql=/a/sql", json.dumps({"name": "chat", "path": "/a/chat", "base_model_name": "tiny"}), "eq=/p=q"]
    assert parse_lora_modules(values, SERVED) == [
        LoRAModule("sql", "/a/sql"),
        LoRAModule("chat", "/a/chat"),
        LoRAModule("eq", "/p=q"),  # split at the first "=": a path may hold one
    ]
    assert parse_lora_modules(None, SERVED) == []


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("sql", "expected name=path"),
        ("sql=", "expected name=path"),
        ("=/a", "must not be empty"),
        ("a,b=/a", "comma"),
        ("a b=/a", "whitespace"),
        ("tiny=/a", "served model's own name"),
        ('{"name": "x"', "not valid JSON"),
        ('{"name": "x", "path": "/a", "rank": 8}', "unknown key(s) rank"),
        ('{"name": "x", "path": 3}', "must be strings"),
        ('{"name": "x", "path": "/a", "base_model_name": "other"}', "base_model_name 'other' is not the model"),
    ],
)
def test_a_bad_lora_module_says_what_to_fix(value: str, says: str) -> None:
    with pytest.raises(ValueError, match="--lora-modules") as err:
        parse_lora_modules([value], SERVED)
    assert says in str(err.value)


def test_an_adapter_named_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="names the adapter 'sql' twice"):
        parse_lora_modules(["sql=/a", "sql=/b"], SERVED)


@pytest.mark.parametrize("flags", [["--lora-modules", "sql=/a"], ["--allow-runtime-lora-updating"]])
def test_adapter_flags_need_enable_lora(
    flags: list[str], tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--model", str(tiny_model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} needs --enable-lora" in err


def test_check_model_selects_the_base_or_an_adapter() -> None:
    assert check_model(None, "tiny", ["sql"]) is None
    assert check_model("tiny", "tiny", ["sql"]) is None
    assert check_model("sql", "tiny", ["sql"]) == "sql"
    with pytest.raises(APIError) as err:
        check_model("chat", "tiny", ["sql"])
    assert (err.value.status_code, err.value.code, err.value.param) == (404, "model_not_found", "model")


def _info(name: str) -> AdapterInfo:
    return AdapterInfo(name, f"/a/{name}", 8, ("q_proj",), 2.0, 1024, 0.01)


def _snapshot(running: tuple[str, ...], waiting: tuple[str, ...], when: float) -> LoRASnapshot:
    return LoRASnapshot((_info("a"), _info("b"), _info("c")), running, waiting, 2, when)


def _info_samples(registry: CollectorRegistry) -> list[tuple[dict[str, str], float]]:
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families[names.LORA_REQUESTS_INFO]
    assert family.type == "gauge"
    return [(s.labels, s.value) for s in family.samples]


def _picked(samples: list[tuple[dict[str, str], float]]) -> tuple[set[str], set[str], int] | None:
    """What the GIE endpoint picker reads: the busy sample with the largest value (None: keep what it had)."""
    busy = [(labels, value) for labels, value in samples
            if labels[names.LORA_RUNNING_ADAPTERS_LABEL] or labels[names.LORA_WAITING_ADAPTERS_LABEL]]  # fmt: skip
    if not busy:
        return None
    labels = max(busy, key=lambda item: item[1])[0]
    running, waiting = labels[names.LORA_RUNNING_ADAPTERS_LABEL], labels[names.LORA_WAITING_ADAPTERS_LABEL]
    split = names.LORA_ADAPTER_SEPARATOR
    return set(filter(None, running.split(split))), set(filter(None, waiting.split(split))), int(labels["max_lora"])


def test_the_gateway_metric_as_the_endpoint_picker_reads_it() -> None:
    registry = CollectorRegistry()
    metrics = LoRAMetrics(registry, "tiny", max_loras=2)
    [(labels, _)] = _info_samples(registry)  # present from the start, idle
    assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert _picked(_info_samples(registry)) is None

    metrics.record(_snapshot(("a", "b"), ("c",), 100.0))
    samples = _info_samples(registry)
    assert [value for _, value in samples] == [100.0]  # the idle sample went: one busy sample is current
    assert _picked(samples) == ({"a", "b"}, {"c"}, 2)
    assert samples[0][0]["running_lora_adapters"] == "a,b"  # no spaces: the picker splits on "," alone

    metrics.record(_snapshot(("a", "b"), ("c",), 150.0))  # the same lists: no new sample, the value stays
    assert [value for _, value in _info_samples(registry)] == [100.0]

    metrics.record(_snapshot(("c",), (), 200.0))
    assert _picked(_info_samples(registry)) == ({"c"}, set(), 2)
    assert len(_info_samples(registry)) == 1

    metrics.record(_snapshot((), (), 300.0))  # idle again: the last busy set stays beside the idle one
    samples = _info_samples(registry)
    assert sorted(value for _, value in samples) == [200.0, 300.0]
    assert _picked(samples) == ({"c"}, set(), 2)


def test_per_adapter_counters_follow_the_loaded_adapters() -> None:
    registry = CollectorRegistry()
    metrics = LoRAMetrics(registry, "tiny", max_loras=2)
    metrics.record(_snapshot((), (), 1.0))
    params = SamplingParams()
    metrics.count_requests([Child("r1", [1], params, lora_name="a"), Child("r2", [1], params, lora_name="a"),
                            Child("r3", [1], params)])  # fmt: skip

    def counts() -> dict[str, float]:
        text = generate_latest(registry).decode()
        family = next(f for f in text_string_to_metric_families(text) if f.name == names.LORA_REQUESTS)
        return {s.labels[names.LORA_ADAPTER_LABEL]: s.value for s in family.samples if s.name.endswith("_total")}

    assert counts() == {"a": 2.0}
    loaded = LoRASnapshot((_info("b"),), (), (), 2, 2.0)  # "a" unloaded: its counter goes
    metrics.record(loaded)
    assert counts() == {}
    text = generate_latest(registry).decode()
    assert f'{names.LORA_ADAPTERS_LOADED}{{model_name="tiny"}} 1.0' in text
