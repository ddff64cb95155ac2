"""Every InferenceService sample in examples/ is admitted and renders engine pods that the engine would start.

For each sample: the API's model and rules (the CRD's CEL twins) accept it; the operator's builders render
its children; each engine container's args go through `tidepool serve`'s own parser and the checks the
engine runs before loading anything (EngineConfig's pydantic validation, the parallel layout, the tensor
split of the weights, the tool flags); a prefill/decode pair renders matching KV geometry flags. A
sample that admits a combination the engine refuses (the disaggregated example once set tensor: 2, which
the engine refused: every pod crash-looped) fails here, naming the sample and pool.
Kubelet `$(VAR)` references in args (multi-node rank and rendezvous) are expanded as the kubelet would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tidepool.contract import serve_flags
from tidepool.engine.distributed.parallel_state import ParallelConfig
from tidepool.engine.distributed.tp import check_tp_weights
from tidepool.engine.kv_transfer import check_handoff_config
from tidepool.engine.server.cli import build_parser, engine_config
from tidepool.engine.server.tools.parsers import check_tool_flags
from tidepool.operator.api import InferenceServiceSpec, ServiceView, validate_spec
from tidepool.operator.builders import ClusterFeatures, desired_state

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# What the kubelet substitutes into a worker pod's args (node 0's values: every node parses the same flags).
KUBELET_VARS = {"$(LWS_WORKER_INDEX)": "0", "$(TIDEPOOL_NODE_RANK)": "0", "$(LWS_LEADER_ADDRESS)": "10.0.0.1",
                "$(TIDEPOOL_MASTER_ADDR)": "10.0.0.1"}  # fmt: skip


def _samples() -> list[Path]:
    return sorted(p for p in EXAMPLES.glob("*.yaml") if yaml.safe_load(p.read_text()).get("kind") == "InferenceService")


def _engine_containers(name: str, spec: dict[str, Any], features: ClusterFeatures) -> list[tuple[str, list[str]]]:
    """(child name, args) of every engine container the builders render."""
    out = []
    for child in desired_state(name, "ns", ServiceView.from_spec(spec), features).children:
        templates = []
        if child["kind"] in ("Deployment", "StatefulSet"):
            templates.append(child["spec"]["template"])
        elif child["kind"] == "LeaderWorkerSet":
            lws = child["spec"]["leaderWorkerTemplate"]
            templates += [t for t in (lws.get("leaderTemplate"), lws.get("workerTemplate")) if t]
        for template in templates:
            for container in template["spec"]["containers"]:
                if container["name"] == "engine":
                    args = [KUBELET_VARS.get(arg, arg) for arg in container["args"]]
                    out.append((child["metadata"]["name"], [_expand(arg) for arg in args]))
    return out


def _expand(arg: str) -> str:
    for var, value in KUBELET_VARS.items():
        arg = arg.replace(var, value)
    return arg


def _engine_checks(args: list[str]) -> Any:
    """What `tidepool serve` checks before it loads the model; returns the EngineConfig."""
    parser = build_parser()
    parsed = serve_flags.resolve_positionals(parser, parser.parse_args(args))
    config = engine_config(parsed)  # pydantic: every flag's bounds and choices
    ParallelConfig.from_engine(config).validate()
    check_tp_weights(config.tensor_parallel_size, config.quantization)
    check_handoff_config(config.role, config.kv_port, config.tensor_parallel_size * config.pipeline_parallel_size)
    check_tool_flags(parsed.enable_auto_tool_choice, parsed.tool_call_parser)
    return config


def test_there_are_samples() -> None:
    assert any(p.name == "inferenceservice-disaggregated.yaml" for p in _samples())


@pytest.mark.parametrize("sample", _samples(), ids=lambda p: p.stem)
@pytest.mark.parametrize("has_lws", [False, True], ids=["statefulset", "lws"])
def test_every_sample_renders_pods_the_engine_accepts(sample: Path, has_lws: bool) -> None:
    body = yaml.safe_load(sample.read_text())
    name = body["metadata"]["name"]
    model = InferenceServiceSpec.model_validate(body["spec"])
    assert validate_spec(model, name) == [], sample.name
    containers = _engine_containers(name, model.to_wire(), ClusterFeatures(has_lws=has_lws))
    assert containers, f"{sample.name}: no engine container rendered"
    configs = {}
    for child, args in containers:
        try:
            configs[child] = _engine_checks(args)
        except (ValueError, SystemExit) as err:
            pytest.fail(f"{sample.name}: the engine would refuse {child}'s args {args}: {err}")
    roles = {config.role for config in configs.values()}
    if model.mode == "disaggregated":
        assert roles == {"prefill", "decode"}, sample.name
        # One KV geometry on both sides (layout.check_compatible): same model, block size and dtype.
        geometry = {(c.model, c.block_size, c.dtype) for c in configs.values()}
        assert len(geometry) == 1, f"{sample.name}: prefill and decode pools render different KV geometry {geometry}"
    else:
        assert roles == {"unified"}, sample.name


def test_a_quantized_tensor_parallel_service_is_refused_by_rule_and_engine() -> None:
    body = yaml.safe_load((EXAMPLES / "inferenceservice-disaggregated.yaml").read_text())
    (_, args), *_ = _engine_containers(body["metadata"]["name"], body["spec"], ClusterFeatures())
    with pytest.raises(ValueError, match="quantization='int8'"):  # the args the operator would have rendered
        _engine_checks([*args, "--quantization", "int8"])
    body["spec"]["model"]["quantization"] = "int8"
    model = InferenceServiceSpec.model_validate(body["spec"])
    errors = [str(e) for e in validate_spec(model, body["metadata"]["name"])]
    assert any("parallelism.tensor > 1 needs model.quantization none" in e for e in errors), errors
