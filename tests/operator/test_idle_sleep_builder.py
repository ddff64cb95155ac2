"""`autoscaling.idle: sleep` in the engine pods: `--enable-sleep-mode` on every engine of every pool, and only then.

The flag's spelling comes from the engine's contract (tidepool.contract.sleep), the same name the engine's parser
reads; the table marks it managed, so `engine.extraArgs` cannot set it behind the spec's back.
"""

from __future__ import annotations

from typing import Any

import pytest

from tidepool.contract.serve_flags import FLAGS
from tidepool.contract.sleep import SLEEP_MODE_FLAG
from tidepool.operator.api import InferenceServiceSpec, ServiceView, validate_spec
from tidepool.operator.builders import ClusterFeatures, desired_state

BASE: dict[str, Any] = {"model": {"uri": "hf://org/m"}, "pools": {"unified": {"replicas": 1}}}
DISAGG: dict[str, Any] = {**BASE, "mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}}
SLEEP = {"enabled": True, "idle": "sleep"}


def engine_args(spec: dict[str, Any]) -> dict[str, list[str]]:
    """Each engine workload's container args, by workload name."""
    view = ServiceView.from_spec(spec)
    assert validate_spec(view.spec) == []
    out = {}
    for child in desired_state("svc", "ns", view, ClusterFeatures()).children:
        if child["kind"] != "Deployment":
            continue
        container = child["spec"]["template"]["spec"]["containers"][0]
        if container["name"] == "engine":
            out[child["metadata"]["name"]] = container["args"]
    return out


@pytest.mark.parametrize("base", [BASE, DISAGG], ids=["unified", "disaggregated"])
def test_idle_sleep_enables_sleep_mode_on_every_engine(base: dict[str, Any]) -> None:
    args = engine_args({**base, "autoscaling": SLEEP})
    assert args and all(f"--{SLEEP_MODE_FLAG}" in a for a in args.values())


@pytest.mark.parametrize(
    "autoscaling",
    [{}, {"enabled": True}, {"enabled": True, "idle": "scaleToZero"}, {"enabled": True, "mode": "advisory"}],
    ids=["default", "autoscaled", "scale-to-zero", "advisory"],
)
def test_sleep_mode_only_with_idle_sleep(autoscaling: dict[str, Any]) -> None:
    args = engine_args({**BASE, "autoscaling": autoscaling})
    assert args and not any(f"--{SLEEP_MODE_FLAG}" in a for a in args.values())


def test_the_flag_is_managed_so_extra_args_cannot_set_it() -> None:
    assert FLAGS[SLEEP_MODE_FLAG].managed
    spec = {**BASE, "engine": {"extraArgs": [f"--{SLEEP_MODE_FLAG}"]}}
    problems = validate_spec(InferenceServiceSpec.model_validate(spec))
    assert any("extraArgs must not set flags" in m for m in problems)
