"""What keeps a pod from starting, read from its status the way the kubelet reports it. Pure.

`container_problems(status)` returns (reason, message) pairs for the pod summary (cache.PodInfo):
- a download init container (named `fetch-*` by builders/sources.py) that exited non-zero, in
  `state.terminated` or, while it waits to be restarted (CrashLoopBackOff) or runs again,
  `lastState.terminated`: reason `ModelDownloadFailed`, message `model download failed: <its
  termination message>` (`tidepool download` writes one actionable line there; aws-cli's log tail
  arrives through FallbackToLogsOnError), or the exit code when the message is empty;
- any other init container that exited non-zero: `InitContainerFailed`;
- a container waiting for a reason in WAITING_PROBLEMS (image pull, crash loop, bad config).

`download_started(status)`: when a running download began (progress for the Progressing condition).

`scheduling_problem(reason, message, spec)` reads a PodScheduled=False condition. The scheduler's
message is "0/N nodes are available: <PreFilter message>." or "0/N nodes are available: <count>
<reason>, ... ." (sorted), then the PostFilter messages (DRA's "no new claims to deallocate,",
"preemption: ..."); the reason is told apart from it, the most
actionable first when nodes refuse for different reasons:
- `UnboundClaim`: the VolumeBinding plugin refused (an unbound immediate claim: a StorageClass that
  does not exist or cannot provision the access mode; a claim that does not exist or is being deleted);
- `InsufficientCapacity`: some node refused for room ("Insufficient <resource>", "Too many pods"):
  nodes that match are full;
- `NoMatchingNode`: otherwise, a node refused for its labels ("didn't match Pod's node
  affinity/selector"): no node matches the selector (a gpuProduct typo);
- `Unschedulable`: anything else (taints, topology spread, a message in another format).
Its message names the cause (the claims, the node selector, the requested amounts) and ends with the
scheduler's per-node counts.

`problems_of(spec, status)`: all of one pod's problems, as cache.PodInfo keeps them; `stopped_at(status)`:
when a finished pod stopped (an eviction is history once a ready pod was created after it, observe.py).

`termination_problem(status)`: a pod in phase Failed because the kubelet evicted it: `Evicted`, with
the kubelet's message (an emptyDir or ephemeral-storage limit, node pressure).

Invariants: at most one problem per container (a failed download's CrashLoopBackOff is reported as
the download's failure, which says what to fix); messages are one line and bounded, and stable while
the failure repeats (no restart counts or timestamps), so an unchanged failure does not re-trigger
the controller. A pod that finished (phase Failed or Succeeded) has at most its termination problem:
its containers' last exits are the kubelet stopping them, not failures of their own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tidepool.operator.builders.sources import INIT_PREFIX

WAITING_PROBLEMS = {"ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError"}
DOWNLOAD_FAILED = "ModelDownloadFailed"
INIT_FAILED = "InitContainerFailed"
MAX_MESSAGE = 1000

# Why a pod cannot start or was stopped (PodInfo.problems reasons; the ScalingLimited condition's reason).
UNSCHEDULABLE = "Unschedulable"  # the scheduler's own reason, for causes not told apart below
UNBOUND_CLAIM = "UnboundClaim"
NO_MATCHING_NODE = "NoMatchingNode"
INSUFFICIENT_CAPACITY = "InsufficientCapacity"
EVICTED = "Evicted"
# Pods that wait for the scheduler (the autoscaler does not grow a pool further while it has them).
SCHEDULING_REASONS = frozenset({UNSCHEDULABLE, UNBOUND_CLAIM, NO_MATCHING_NODE, INSUFFICIENT_CAPACITY})
# Reasons that limit how many replicas run (ScalingLimited), most actionable first: a claim or a
# selector never fixes itself; an eviction names a limit of the spec or the node; room may come.
CAPACITY_REASONS = (UNBOUND_CLAIM, NO_MATCHING_NODE, EVICTED, INSUFFICIENT_CAPACITY, UNSCHEDULABLE)
FINISHED_PHASES = frozenset({"Failed", "Succeeded"})

_FIT = re.compile(r"^0/(\d+) nodes are available:\s*(.*)$", re.DOTALL)
_COUNTED = re.compile(r"^(\d+) (.+)$")
_CLAIM_TEXTS = (
    "unbound immediate persistentvolumeclaims",
    "didn't find available persistent volumes to bind",
    "persistentvolumeclaim",  # "persistentvolumeclaim "x" not found" / "is being deleted" / "bound to non-existent"
    "waiting for ephemeral volume controller",
)
_ROOM_TEXTS = ("insufficient ", "too many pods")
_AFFINITY_TEXT = "didn't match pod's node affinity/selector"


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def _failed_run(cs: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The container's latest non-zero exit: the current state, or the last one while it restarts."""
    for key in ("state", "lastState"):
        terminated = (cs.get(key) or {}).get("terminated")
        if terminated and int(terminated.get("exitCode", 0)) != 0:
            return terminated
    return None


def _init_problem(cs: Mapping[str, Any]) -> tuple[str, str] | None:
    terminated = _failed_run(cs)
    if terminated is None:
        return None
    name = cs.get("name", "")
    detail = _one_line(terminated.get("message") or "")
    if not detail:
        detail = f"exit code {terminated.get('exitCode')}" + (
            f" ({terminated['reason']})" if terminated.get("reason") else ""
        )
    if name.startswith(INIT_PREFIX):
        return DOWNLOAD_FAILED, f"model download failed: {detail}"
    return INIT_FAILED, f"init container {name} failed: {detail}"


def download_started(status: Mapping[str, Any]) -> str | None:
    """When the pod's model download (a `fetch-*` init container) started, while it runs; else None."""
    for cs in status.get("initContainerStatuses") or []:
        running = (cs.get("state") or {}).get("running")
        if running is not None and cs.get("name", "").startswith(INIT_PREFIX):
            return running.get("startedAt") or "?"
    return None


def container_problems(status: Mapping[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for cs in status.get("initContainerStatuses") or []:
        problem = _init_problem(cs)
        if problem is None:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in WAITING_PROBLEMS:
                problem = (waiting["reason"], _one_line(waiting.get("message", "")))
        if problem:
            out.append(problem)
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in WAITING_PROBLEMS:
            out.append((waiting["reason"], _one_line(waiting.get("message", ""))))
    return out


def _histogram(message: str) -> tuple[int | None, list[tuple[int | None, str]], str]:
    """(nodes, [(count or None for a PreFilter message, reason)], the message up to its PostFilter part).

    The filter part ends at the first ". " (or the final "."): reasons contain no such pair ("nvidia.com/gpu"),
    while the PostFilter messages that follow do ("no new claims to deallocate, preemption: 0/2 nodes ...")."""
    fit = _FIT.match(message.strip())
    if fit is None:
        return None, [(None, message)], message
    nodes, rest = int(fit.group(1)), fit.group(2)
    body = re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0].strip()
    items: list[tuple[int | None, str]] = []
    for part in body.split(", "):
        counted = _COUNTED.match(part.strip())
        items.append((int(counted.group(1)), counted.group(2)) if counted else (None, part.strip()))
    return nodes, items, f"0/{nodes} nodes are available: {body}"


def _claims(spec: Mapping[str, Any]) -> list[str]:
    names = []
    for volume in spec.get("volumes") or []:
        if (claim := volume.get("persistentVolumeClaim")) and claim.get("claimName"):
            names.append(claim["claimName"])
        elif volume.get("ephemeral"):
            names.append(f"{volume.get('name', '?')} (ephemeral)")
    return names


def _selector(spec: Mapping[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in sorted((spec.get("nodeSelector") or {}).items())]
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    for term in (required or {}).get("nodeSelectorTerms") or []:
        for expr in term.get("matchExpressions") or []:
            parts.append(f"{expr.get('key')} {expr.get('operator')} {','.join(expr.get('values') or [])}".strip())
    return ", ".join(parts) or "none"


def _requested(spec: Mapping[str, Any], resource: str) -> str | None:
    """What the pod's containers request of `resource`, as written when one container does; else summed."""
    amounts = []
    for c in spec.get("containers") or []:
        res = c.get("resources") or {}
        amount = (res.get("requests") or {}).get(resource) or (res.get("limits") or {}).get(resource)
        if amount is not None:
            amounts.append(str(amount))
    if not amounts:
        return None
    if len(amounts) == 1:
        return amounts[0]
    try:
        return str(sum(int(a) for a in amounts))
    except ValueError:
        return " + ".join(amounts)


def scheduling_problem(reason: str | None, message: str, spec: Mapping[str, Any]) -> tuple[str, str]:
    """(reason, message) of a PodScheduled=False condition; `spec` is the pod's (it names the cause)."""
    message = _one_line(message)
    if reason not in (None, "", UNSCHEDULABLE):  # SchedulingGated, SchedulerError: as the scheduler says
        return reason or UNSCHEDULABLE, message
    nodes, items, detail = _histogram(message)
    texts = [text.lower() for _, text in items]
    if any(claim in text for text in texts for claim in _CLAIM_TEXTS):
        claims = ", ".join(_claims(spec)) or "its claims"
        cause = (
            f"claim {claims} is not bound: a StorageClass that does not exist or cannot provision its access"
            " mode and size, or a claim that does not exist"
        )
        return UNBOUND_CLAIM, _one_line(f"{cause} ({detail})")
    room = sorted({t.split(" ", 1)[1] for _, t in items if t.lower().startswith("insufficient ")})
    if room or any(t.startswith("too many pods") for t in texts):
        asked = [f"{r} {amount}" for r in room if (amount := _requested(spec, r)) is not None]
        wants = f" (the pod requests {', '.join(asked)})" if asked else ""
        cause = f"no node that matches has room{wants}"
        return INSUFFICIENT_CAPACITY, _one_line(f"{cause} ({detail})")
    mismatched = sum(count or (nodes or 0) for count, text in items if _AFFINITY_TEXT in text.lower())
    if mismatched:
        of = f"{mismatched} of {nodes} nodes" if nodes is not None else "nodes"
        cause = f"no node matches the pod's node selector/affinity ({_selector(spec)}): {of} do not"
        return NO_MATCHING_NODE, _one_line(f"{cause} ({detail})")
    return UNSCHEDULABLE, message


def termination_problem(status: Mapping[str, Any]) -> tuple[str, str] | None:
    """(Evicted, the kubelet's message) for a pod the kubelet evicted; None for any other pod."""
    if status.get("phase") != "Failed" or status.get("reason") != EVICTED:
        return None
    detail = _one_line(status.get("message") or "") or "no message"
    return EVICTED, _one_line(f"evicted by the kubelet: {detail}")


def stopped_at(status: Mapping[str, Any]) -> str | None:
    """When a finished pod stopped: its conditions' latest transition (the kubelet moves Ready and
    DisruptionTarget then); None when none has a time."""
    times = [c["lastTransitionTime"] for c in status.get("conditions") or [] if c.get("lastTransitionTime")]
    return max(times, default=None)


def problems_of(spec: Mapping[str, Any], status: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every problem of one pod (cache.PodInfo.problems): scheduling, then containers; a finished pod's
    termination only."""
    if status.get("phase") in FINISHED_PHASES:
        finished = termination_problem(status)
        return [finished] if finished else []
    out = [
        scheduling_problem(c.get("reason"), c.get("message", ""), spec)
        for c in status.get("conditions") or []
        if c.get("type") == "PodScheduled" and c.get("status") == "False"
    ]
    return out + container_problems(status)
