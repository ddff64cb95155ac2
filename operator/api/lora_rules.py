"""Validation rules of `spec.lora`: each a CEL rule for the API server plus the same check in Python (rules.py's way).

Invariants: every message says what to fix; each Python `check` mirrors its CEL exactly (CEL guards optional
fields with `has()`, Python sees them as None). The root rule (adapter names differ from metadata.name, the
base model's id) reads metadata, so crdgen attaches it at the object's root and `validate_spec` checks it when
given the name.
"""

from __future__ import annotations

import re

from tidepool.operator.api import lora as lo
from tidepool.operator.api import spec as s
from tidepool.operator.api.rule import Rule

# The sources an adapter may come from: the Hub or S3 (the engine fetches them itself with the pod's credentials,
# engine/server/lora_fetch.py; the bucket as the base model's rule spells it) or a folder on a claim the pods
# mount. Not catalogue:// (GGUF base models).
LORA_URI_RE = (
    r"^(hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*|s3://[a-z0-9][-a-z0-9.]*[a-z0-9](/.*)?"
    r"|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?/.+)$"
)
PVC_CLAIM_MESSAGE = (
    "spec.lora.adapters[].source pvc://claim/path must name a claim the engine pods already mount: spec.model's "
    "pvc:// claim or spec.modelCache.persistentVolumeClaim.claimName (a running pod cannot gain a volume); copy "
    "the adapter there or use hf://"
)
ROOT_RULE_CEL = "!has(self.spec.lora) || self.spec.lora.adapters.all(a, a.name != self.metadata.name)"
ROOT_RULE_MESSAGE = (
    "spec.lora.adapters[].name must differ from metadata.name: the InferenceService's name is the base model's id "
    "(what clients send for the base model); rename the adapter"
)


def _claim_of(uri: str) -> str | None:
    """'pvc://claim/...' -> 'claim' (None for another scheme)."""
    if not uri.startswith("pvc://"):
        return None
    return uri.removeprefix("pvc://").partition("/")[0]


def mounted_claims(spec: s.InferenceServiceSpec) -> set[str]:
    """The claims every engine pod mounts: spec.model's pvc:// claim and the model cache's claim."""
    claims = {c for c in (_claim_of(spec.model.uri),) if c}
    cache = spec.model_cache
    if cache is not None and cache.persistent_volume_claim is not None:
        claims.add(cache.persistent_volume_claim.claim_name)
    return claims


def _pvc_mounted(spec: s.InferenceServiceSpec) -> bool:
    if spec.lora is None:
        return True
    claims = mounted_claims(spec)
    return all(_claim_of(a.source) in claims for a in spec.lora.adapters if a.source.startswith("pvc://"))


def served_name_clash(spec: s.InferenceServiceSpec, name: str) -> bool:
    """True when an adapter is named like the InferenceService (the root rule, broken)."""
    return spec.lora is not None and any(a.name == name for a in spec.lora.adapters)


_MODEL_CLAIM_PREFIX = "self.model.uri.substring(0, self.model.uri.indexOf('/', 6) + 1)"  # 'pvc://claim/'
_CACHE_CLAIM = "self.modelCache.persistentVolumeClaim"

LORA_RULES: tuple[Rule, ...] = (
    Rule(
        lo.LoraSpec,
        "self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
        "spec.lora.adapters[].name must be unique (each name is a model id clients send); rename or remove the "
        "duplicate",
        lambda x: len({a.name for a in x.adapters}) == len(x.adapters),
        ".adapters",
    ),
    Rule(
        lo.LoraSpec,
        "!has(self.maxCpuAdapters) || self.maxCpuAdapters >= self.maxAdapters",
        "spec.lora.maxCpuAdapters must be at least spec.lora.maxAdapters (the host store holds every resident "
        "adapter); raise it or leave it unset",
        lambda x: x.max_cpu_adapters is None or x.max_cpu_adapters >= x.max_adapters,
        ".maxCpuAdapters",
    ),
    Rule(
        lo.LoraAdapter,
        f"self.source.matches('{LORA_URI_RE}')",
        "spec.lora.adapters[].source must be hf://org/name, s3://bucket/prefix or pvc://claim/path (a folder or "
        "prefix holding adapter_config.json and adapter_model.safetensors)",
        lambda a: re.match(LORA_URI_RE, a.source) is not None,
        ".source",
    ),
    Rule(
        lo.LoraAdapter,
        "!has(self.revision) || self.source.startsWith('hf://')",
        "spec.lora.adapters[].revision applies only to hf:// sources; remove it",
        lambda a: a.revision is None or a.source.startswith("hf://"),
        ".revision",
    ),
    Rule(
        s.InferenceServiceSpec,
        "!has(self.lora) || !has(self.engine) || !has(self.engine.extraArgs) || "
        "self.engine.extraArgs.all(a, !a.startsWith('--lora-modules'))",
        "spec.lora takes no --lora-modules in engine.extraArgs (the operator unloads adapters it does not declare); "
        "list the adapters in spec.lora.adapters",
        lambda x: x.lora is None or not any(a.startswith("--lora-modules") for a in x.engine.extra_args),
        ".engine.extraArgs",
    ),
    Rule(
        s.InferenceServiceSpec,
        "!has(self.lora) || self.lora.adapters.all(a, !a.source.startsWith('pvc://') || "
        f"(self.model.uri.startsWith('pvc://') && a.source.startsWith({_MODEL_CLAIM_PREFIX})) || "
        f"(has(self.modelCache) && has({_CACHE_CLAIM}) && a.source.startsWith('pvc://' + {_CACHE_CLAIM}.claimName + "
        "'/')))",
        PVC_CLAIM_MESSAGE,
        _pvc_mounted,
        ".lora.adapters",
    ),
)
