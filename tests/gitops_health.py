"""What GitOps tools conclude from an InferenceService object: Flux's kstatus (a Python port) and Argo CD's
health check (the chart's own health.lua, run in a real Lua runtime).

`kstatus(obj)` is a faithful port of kstatus' generic rules, which are all that apply to a custom resource
(its type-specific rules cover built-in kinds only). Source: kubernetes-sigs/cli-utils,
pkg/kstatus/status/status.go (`Compute`) and pkg/kstatus/status/generic.go (`checkGenericProperties`,
`checkGeneration`), the library Flux's `wait` and health checks use (through fluxcd's fork of cli-utils):
1. metadata.deletionTimestamp set -> Terminating ("Resource scheduled for deletion").
2. metadata.generation present and status.observedGeneration present and different -> InProgress
   ("<Kind> generation is G, but latest observed generation is O").
3. The first condition in list order that is Reconciling=True -> InProgress, or Stalled=True -> Failed,
   with the condition's message.
4. Otherwise -> Current ("Resource is current"): without conditions, a custom resource is Current.

`ArgoHealth()(obj)` runs charts/tidepool/health/health.lua as Argo CD runs a resource health customization:
Lua 5.1 (Argo CD's gopher-lua), the object as nested tables in the global `obj`, the script's return value
`{status=..., message=...}`, in `lupa` (a test dependency: Lua runtimes from PyPI, 5.1 among them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lupa import lua51

REPO = Path(__file__).resolve().parents[1]
HEALTH_LUA = REPO / "charts" / "tidepool" / "health" / "health.lua"

CURRENT, IN_PROGRESS, FAILED, TERMINATING = "Current", "InProgress", "Failed", "Terminating"
ARGO_STATUSES = ("Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown")


@dataclass(frozen=True)
class Verdict:
    status: str
    message: str


def kstatus(obj: dict[str, Any]) -> Verdict:
    """kstatus' Compute() for a custom resource (see the module docstring for the rules and their source)."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return Verdict(TERMINATING, "Resource scheduled for deletion")
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    if generation is not None and observed is not None and int(observed) != int(generation):
        message = f"{obj.get('kind', '')} generation is {generation}, but latest observed generation is {observed}"
        return Verdict(IN_PROGRESS, message)
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Reconciling" and condition.get("status") == "True":
            return Verdict(IN_PROGRESS, condition.get("message", ""))
        if condition.get("type") == "Stalled" and condition.get("status") == "True":
            return Verdict(FAILED, condition.get("message", ""))
    return Verdict(CURRENT, "Resource is current")


class ArgoHealth:
    """health.lua in a Lua 5.1 runtime (Argo CD runs it in gopher-lua, a Lua 5.1); call it with an object."""

    def __init__(self, script: Path = HEALTH_LUA) -> None:
        self._lua = lua51.LuaRuntime(unpack_returned_tuples=True)
        self.script = script.read_text()

    def __call__(self, obj: dict[str, Any]) -> Verdict:
        # As Argo CD hands it over: nested tables, JSON arrays as 1-based sequences, JSON null as absent.
        self._lua.globals().obj = self._lua.table_from(json.loads(json.dumps(obj)), recursive=True)
        result = self._lua.execute(self.script)
        status, message = result["status"], result["message"]
        assert status in ARGO_STATUSES, f"health.lua returned status {status!r}"
        return Verdict(str(status), "" if message is None else str(message))
