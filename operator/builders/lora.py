"""What `spec.lora` adds to an engine pod, and the `lora_path` each declared adapter is loaded from. Pure.

The pod template carries only `spec.lora`'s settings, never the adapter list, so adding or removing an adapter
leaves the spec-hash alone and no pod restarts: the operator loads and unloads adapters on running replicas
through the engine's API (operator/lora/). What the template gets:
- flags: --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras, --allow-runtime-lora-updating;
- env: TIDEPOOL_LORA_DIR (where the engine keeps the hf:// and s3:// adapters it fetches, inside the model cache)
  and spec.lora.credentials' HF_* and AWS_* keys as optional secretKeyRef env (never a value);
- a readiness gate (`LORA_GATE`): a new pod becomes Ready only once the operator has tried every declared
  adapter on it (loaded, or failed with a reason in status.lora and a Degraded condition), so requests for an
  adapter never reach a replica that has not had its chance to load it.

A service without spec.lora gets none of these: its template (and spec-hash) is what it was before LoRA existed.

`lora_path` (contract/lora.py): pvc:// adapters are folders under the claim's mount in the pod (the model's
claim at /models/pvc/<claim>, the model-cache claim at /models); hf:// and s3:// adapters are passed as source URIs that
the engine fetches itself with the pod's credentials (engine/server/lora_fetch.py).
"""

from __future__ import annotations

from typing import Any

from tidepool.contract.lora import LORA_DIR_ENV, source_uri
from tidepool.operator.api.lora import LoraAdapter
from tidepool.operator.api.lora_rules import mounted_claims
from tidepool.operator.api.view import ServiceView, SpecError

from .common import GROUP
from .sources import HF_KEYS, MODELS_DIR, S3_KEYS, credential_env

LORA_GATE = f"{GROUP}/lora-adapters"  # the pod condition the operator sets once it has tried every adapter
LORA_DIR = f"{MODELS_DIR}/lora"


def lora_flags(view: ServiceView) -> dict[str, Any]:
    """`tidepool serve` flags by name; {} without spec.lora."""
    lora = view.lora
    if lora is None:
        return {}
    return {
        "enable-lora": True,
        "allow-runtime-lora-updating": True,
        "max-loras": lora.max_adapters,
        "max-lora-rank": lora.max_rank,
        "max-cpu-loras": lora.max_cpu_adapters,
    }


def lora_env(view: ServiceView) -> dict[str, Any]:
    """The engine container's env for fetching adapters; {} without spec.lora."""
    lora = view.lora
    if lora is None:
        return {}
    secret = lora.credentials.secret_name if lora.credentials else None
    return {LORA_DIR_ENV: LORA_DIR, **credential_env(secret, HF_KEYS + S3_KEYS)}


def readiness_gates(view: ServiceView) -> list[dict[str, str]]:
    return [{"conditionType": LORA_GATE}] if view.lora is not None else []


def adapter_path(view: ServiceView, adapter: LoraAdapter) -> str:
    """The `lora_path` the engine loads `adapter` from (see the module docstring)."""
    if not adapter.source.startswith("pvc://"):
        return source_uri(adapter.source, adapter.revision)
    claim, _, sub = adapter.source.removeprefix("pvc://").partition("/")
    sub = sub.strip("/")
    model_uri = view.model.uri
    if model_uri.startswith(f"pvc://{claim}/"):
        return f"{MODELS_DIR}/pvc/{claim}/{sub}"
    if claim in mounted_claims(view.spec):  # the model-cache claim, mounted at /models
        return f"{MODELS_DIR}/{sub}"
    raise SpecError(f"spec.lora.adapters[{adapter.name!r}].source: claim {claim!r} is not mounted by the engine pods")


def declared_adapters(view: ServiceView) -> dict[str, str]:
    """Adapter name -> lora_path, in spec order; {} without spec.lora."""
    if view.lora is None:
        return {}
    return {a.name: adapter_path(view, a) for a in view.lora.adapters}
