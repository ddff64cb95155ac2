"""examples/inferenceservice-tool-calling.yaml: the API accepts it, and its engine pods start `tidepool serve`
with tool calling on (`--enable-auto-tool-choice`, `--tool-call-parser hermes`), flags the server accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tidepool.engine.server.cli import build_parser
from tidepool.engine.server.tools.parsers import check_tool_flags
from tidepool.operator.api import InferenceServiceSpec, ServiceView, validate_spec
from tidepool.operator.builders import ClusterFeatures, desired_state

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/inferenceservice-tool-calling.yaml"


def _engine_args(name: str, spec: dict[str, Any]) -> list[list[str]]:
    out = []
    for child in desired_state(name, "ns", ServiceView.from_spec(spec), ClusterFeatures()).children:
        if child["kind"] == "Deployment" and child["spec"]["template"]["spec"]["containers"][0]["name"] == "engine":
            out.append(child["spec"]["template"]["spec"]["containers"][0]["args"])
    return out


def test_the_tool_calling_example_is_valid_and_turns_tool_calling_on() -> None:
    body = yaml.safe_load(EXAMPLE.read_text())
    model = InferenceServiceSpec.model_validate(body["spec"])
    assert validate_spec(model, body["metadata"]["name"]) == []  # the CRD's rules, extraArgs' included
    (args,) = _engine_args(body["metadata"]["name"], model.to_wire())
    assert args[-2:] == ["--enable-auto-tool-choice", "--tool-call-parser=hermes"]
    parsed = build_parser().parse_args(args)
    assert parsed.enable_auto_tool_choice and parsed.tool_call_parser == "hermes"
    check_tool_flags(parsed.enable_auto_tool_choice, parsed.tool_call_parser)  # what `tidepool serve` checks at start


def test_a_flag_value_in_its_own_extra_args_entry_is_refused() -> None:
    """vLLM's `--tool-call-parser hermes` spelling must be one entry in extraArgs (`--tool-call-parser=hermes`)."""
    body = yaml.safe_load(EXAMPLE.read_text())
    body["spec"]["engine"]["extraArgs"] = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    errors = validate_spec(InferenceServiceSpec.model_validate(body["spec"]), body["metadata"]["name"])
    assert any("--flag=value" in str(error) for error in errors), errors
