"""Validation rules of InferenceService: each one a CEL rule for the API server plus the same check in Python.

Invariants: a rule's message is written once and says what to fix; the CEL goes into the CRD
(`crdgen` attaches it to the schema of `where`, the model class it is evaluated on) and the Python
`check` mirrors it exactly, so `validate_spec` reports what the API server would refuse (the
control-plane tests compare the two). CEL guards every optional field with `has()`; Python sees
those fields as None. Rules on single values (quantities, int-or-percent) live with their types
in `types.py`; bounds and enums live in the field definitions.
"""

from __future__ import annotations

import re

from pydantic import BaseModel

from tidepool.contract import catalogue
from tidepool.contract.serve_flags import managed_spellings
from tidepool.operator.api import model as m
from tidepool.operator.api import pod as p
from tidepool.operator.api import spec as s
from tidepool.operator.api.auth import AUTH_RULES
from tidepool.operator.api.availability import AVAILABILITY_RULES
from tidepool.operator.api.idle_rules import IDLE_RULES
from tidepool.operator.api.lora_rules import LORA_RULES, ROOT_RULE_MESSAGE, served_name_clash
from tidepool.operator.api.netpol import NETPOL_RULES
from tidepool.operator.api.pod_rules import POD_RULES
from tidepool.operator.api.resource_rules import RESOURCE_RULES
from tidepool.operator.api.router import ROUTER_RULES
from tidepool.operator.api.rule import Rule

# catalogue://NAME: a model of `tidepool pull`'s catalogue (names from the catalogue itself, never copied).
# A CEL string literal takes no backslash escapes such as `\.`, so a dot is written `[.]`.
assert all(re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name) for name in catalogue.names())
_CATALOGUE_RE = "|".join(name.replace(".", "[.]") for name in catalogue.names())
URI_RE = (
    r"^(hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?/.*"
    rf"|s3://[a-z0-9][-a-z0-9.]*[a-z0-9](/.*)?|catalogue://({_CATALOGUE_RE}))$"
)
URI_MESSAGE = (
    "must be hf://org/name, pvc://claim/path, s3://bucket/prefix or catalogue://NAME "
    f"(the catalogue has: {', '.join(catalogue.names())})"
)
# file:// would need a hostPath volume: Pod Security "restricted" forbids it, and the operator would mount any
# node path for whoever may create an InferenceService. A PersistentVolume (local or hostPath, made by an admin)
# bound to a claim gives the same folder through pvc://, and the pods stay "restricted".
FILE_URI_MESSAGE = (
    "model.uri file:// is not supported (it would need a hostPath volume, which Pod Security 'restricted' forbids); "
    "put the folder on a PersistentVolume (a local or hostPath PV bound to a claim) and use pvc://claim/path"
)
EXTRA_ARG_RE = r"^--[a-z0-9][-a-z0-9]*(=.*)?$"
# `tidepool serve` flags the operator sets on every engine pod (generated from the engine's flag table); setting
# them again via extraArgs would fight the spec (the engine's argparse takes the last one, silently).
MANAGED_FLAGS: tuple[str, ...] = tuple(flag.removeprefix("--") for flag in managed_spellings())
MANAGED_FLAG_RE = r"^--(" + "|".join(MANAGED_FLAGS) + r")(=.*)?$"
MAX_NAME_LENGTH = 40
ROUTER_REQUIRED_MESSAGE = (
    "router.enabled: false needs mode unified without autoscaling.scaleToZero (the router hands prefill to decode "
    "and holds requests while a pool scales from zero); set router.enabled: true"
)


def _bounded(pool: s.PoolSpec | None, replicas: int) -> bool:
    return pool is None or pool.min_replicas <= replicas <= pool.max_replicas


def _scale_to_zero_ok(spec: s.InferenceServiceSpec) -> bool:
    pools = (spec.pools.unified, spec.pools.prefill, spec.pools.decode)
    return not spec.autoscaling.scale_to_zero.enabled or all(p is None or p.min_replicas == 0 for p in pools)


def _cel_min_zero(pool: str) -> str:
    return f"(!has(self.pools.{pool}) || self.pools.{pool}.minReplicas == 0)"


def _cel_bounded(pool: str) -> str:
    p = f"self.pools.{pool}"
    return f"(!has({p}) || (self.replicas >= {p}.minReplicas && self.replicas <= {p}.maxReplicas))"


_CORE_RULES: tuple[Rule, ...] = (
    Rule(
        s.InferenceServiceSpec,
        "self.mode != 'unified' || (has(self.pools.unified) && !has(self.pools.prefill) && !has(self.pools.decode))",
        "mode unified needs pools.unified and no pools.prefill/pools.decode (or set mode: disaggregated)",
        lambda x: x.mode != "unified" or (x.pools.unified is not None and x.pools.prefill is x.pools.decode is None),
        ".pools",
    ),
    Rule(
        s.InferenceServiceSpec,
        "self.mode != 'disaggregated' || "
        "(has(self.pools.prefill) && has(self.pools.decode) && !has(self.pools.unified))",
        "mode disaggregated needs pools.prefill and pools.decode and no pools.unified",
        lambda x: (
            x.mode != "disaggregated"
            or (x.pools.prefill is not None and x.pools.decode is not None and x.pools.unified is None)
        ),
        ".pools",
    ),
    Rule(
        s.InferenceServiceSpec,
        "!has(self.replicas) || (self.mode == 'unified' ? "
        + _cel_bounded("unified")
        + " : "
        + _cel_bounded("decode")
        + ")",
        "spec.replicas must lie within minReplicas..maxReplicas of the scaled pool "
        "(pools.unified, or pools.decode in disaggregated mode)",
        lambda x: (
            x.replicas is None or _bounded(x.pools.unified if x.mode == "unified" else x.pools.decode, x.replicas)
        ),
        ".replicas",
    ),
    Rule(  # the API server answers GET .../scale with an error while spec.replicas is unset
        s.InferenceServiceSpec,
        "self.autoscaling.mode != 'external' || has(self.replicas)",
        "autoscaling.mode external needs spec.replicas (the scale subresource's field: an HPA or KEDA reads it "
        "through GET .../scale, which fails while it is unset)",
        lambda x: x.autoscaling.mode != "external" or x.replicas is not None,
        ".replicas",
    ),
    Rule(
        s.InferenceServiceSpec,
        "self.resources.gpusPerReplica == self.parallelism.tensor * self.parallelism.pipeline || "
        "self.resources.gpusPerReplica == 0",
        "resources.gpusPerReplica must equal parallelism.tensor x parallelism.pipeline (or be 0 to run on CPU)",
        lambda x: (
            x.resources.gpus_per_replica == x.parallelism.tensor * x.parallelism.pipeline
            or x.resources.gpus_per_replica == 0
        ),
        ".resources.gpusPerReplica",
    ),
    Rule(  # the engine shards plain layers only (engine/distributed/tp.py): the pods would crash-loop
        s.InferenceServiceSpec,
        "self.parallelism.tensor == 1 || self.model.quantization == 'none'",
        "parallelism.tensor > 1 needs model.quantization none: the engine splits only unquantized layers across "
        "tensor ranks; serve a quantized model with parallelism.tensor 1",
        lambda x: x.parallelism.tensor == 1 or x.model.quantization == "none",
        ".parallelism.tensor",
    ),
    Rule(
        s.InferenceServiceSpec,
        "!self.autoscaling.scaleToZero.enabled || (" + " && ".join(_cel_min_zero(p) for p in s.POOL_NAMES) + ")",
        "autoscaling.scaleToZero.enabled needs minReplicas: 0 on every pool",
        _scale_to_zero_ok,
        ".autoscaling.scaleToZero.enabled",
    ),
    Rule(
        s.InferenceServiceSpec,
        "self.router.enabled || (self.mode == 'unified' && !self.autoscaling.scaleToZero.enabled)",
        ROUTER_REQUIRED_MESSAGE,
        lambda x: x.router.enabled or (x.mode == "unified" and not x.autoscaling.scale_to_zero.enabled),
        ".router.enabled",
    ),
    Rule(
        s.PrefillDecodeRatio,
        "self.min <= self.max",
        "autoscaling.prefillDecodeRatio.min must not exceed autoscaling.prefillDecodeRatio.max",
        lambda r: r.min <= r.max,
        ".min",
    ),
    Rule(
        s.PoolSpec,
        "self.minReplicas <= self.maxReplicas",
        "minReplicas must not exceed maxReplicas",
        lambda p: p.min_replicas <= p.max_replicas,
        ".minReplicas",
    ),
    Rule(
        s.PoolSpec,
        "self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas",
        "replicas must lie between minReplicas and maxReplicas",
        lambda p: p.min_replicas <= p.replicas <= p.max_replicas,
        ".replicas",
    ),
    Rule(
        m.ModelSource,
        "!self.uri.startsWith('file://')",
        FILE_URI_MESSAGE,
        lambda m: not m.uri.startswith("file://"),
        ".uri",
    ),
    Rule(
        m.ModelSource,
        f"self.uri.startsWith('file://') || self.uri.matches('{URI_RE}')",
        f"model.uri {URI_MESSAGE}",
        lambda m: m.uri.startswith("file://") or re.match(URI_RE, m.uri) is not None,
        ".uri",
    ),
    Rule(
        m.ModelSource,
        "!has(self.revision) || self.uri.startsWith('hf://')",
        "model.revision applies only to hf:// URIs; remove it or pin the version in the path",
        lambda m: m.revision is None or m.uri.startswith("hf://"),
        ".revision",
    ),
    Rule(
        s.Speculative,
        "self.method != 'draft' || has(self.draftModel)",
        "speculative.method draft needs speculative.draftModel (the draft model's URI)",
        lambda sp: sp.method != "draft" or sp.draft_model is not None,
        ".draftModel",
    ),
    Rule(
        s.Speculative,
        "self.method == 'draft' || !has(self.draftModel)",
        "speculative.draftModel is only used with method draft; remove it or set method: draft",
        lambda sp: sp.method == "draft" or sp.draft_model is None,
        ".draftModel",
    ),
    Rule(
        s.Speculative,
        f"!has(self.draftModel) || self.draftModel.matches('{URI_RE}')",
        f"speculative.draftModel {URI_MESSAGE}",
        lambda sp: sp.draft_model is None or re.match(URI_RE, sp.draft_model) is not None,
        ".draftModel",
    ),
    Rule(
        s.EngineSpec,
        "!has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= self.maxNumSeqs",
        "engine.maxNumBatchedTokens must be at least engine.maxNumSeqs (every scheduled sequence needs a token)",
        lambda e: e.max_num_batched_tokens is None or e.max_num_batched_tokens >= e.max_num_seqs,
        ".maxNumBatchedTokens",
    ),
    Rule(
        s.EngineSpec,
        "self.chunkedPrefill || !has(self.maxNumBatchedTokens) || !has(self.maxModelLen) || "
        "self.maxNumBatchedTokens >= self.maxModelLen",
        "without chunkedPrefill engine.maxNumBatchedTokens must be at least engine.maxModelLen "
        "(a whole prompt must fit in one step)",
        lambda e: (
            e.chunked_prefill
            or e.max_num_batched_tokens is None
            or e.max_model_len is None
            or e.max_num_batched_tokens >= e.max_model_len
        ),
        ".maxNumBatchedTokens",
    ),
    Rule(
        s.EngineSpec,
        f"self.extraArgs.all(a, a.matches('{EXTRA_ARG_RE}'))",
        "engine.extraArgs entries must each be --flag or --flag=value (lowercase flag names)",
        lambda e: all(re.match(EXTRA_ARG_RE, a) for a in e.extra_args),
        ".extraArgs",
    ),
    Rule(
        s.EngineSpec,
        f"self.extraArgs.all(a, !a.matches('{MANAGED_FLAG_RE}'))",
        "engine.extraArgs must not set flags the operator sets itself (" + ", ".join(managed_spellings()) + "); "
        "use the spec fields",
        lambda e: not any(re.match(MANAGED_FLAG_RE, a) for a in e.extra_args),
        ".extraArgs",
    ),
    Rule(
        s.RolloutSpec,
        "!((self.maxSurge == 0 || self.maxSurge == '0%') && (self.maxUnavailable == 0 || self.maxUnavailable == '0%'))",
        "rollout.maxSurge and rollout.maxUnavailable cannot both be 0 (the rollout could never progress)",
        lambda r: not (r.max_surge in (0, "0%") and r.max_unavailable in (0, "0%")),
    ),
    Rule(
        p.Toleration,
        "(has(self.key) && self.key != '') || self.operator == 'Exists'",
        "a toleration without key must use operator Exists (it then tolerates every taint)",
        lambda t: bool(t.key) or t.operator == "Exists",
        ".operator",
    ),
    Rule(
        p.Toleration,
        "self.operator != 'Exists' || !has(self.value)",
        "a toleration with operator Exists must not set value",
        lambda t: t.operator != "Exists" or t.value is None,
        ".value",
    ),
    Rule(
        p.Toleration,
        "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "tolerationSeconds applies only to effect NoExecute",
        lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
        ".tolerationSeconds",
    ),
    Rule(
        m.ModelSource,
        "!has(self.credentials) || !self.uri.startsWith('pvc://')",
        "model.credentials applies only to hf:// and s3:// URIs (a pvc:// model is not downloaded); remove it",
        lambda m: m.credentials is None or not m.uri.startswith("pvc://"),
        ".credentials",
    ),
    Rule(
        m.ModelCache,
        "has(self.persistentVolumeClaim) != has(self.emptyDir)",
        "modelCache must set exactly one of persistentVolumeClaim (a shared claim) or emptyDir (per pod, with "
        "sizeLimit); remove modelCache for the default emptyDir",
        lambda c: (c.persistent_volume_claim is None) != (c.empty_dir is None),
    ),
    Rule(
        m.CacheClaim,
        "has(self.size) || !has(self.storageClassName)",
        "modelCache.persistentVolumeClaim.storageClassName needs size (it applies only to a claim the operator "
        "creates)",
        lambda c: c.size is not None or c.storage_class_name is None,
        ".storageClassName",
    ),
    Rule(
        m.CacheClaim,
        "has(self.size) || !has(self.accessModes)",
        "modelCache.persistentVolumeClaim.accessModes needs size (it applies only to a claim the operator creates)",
        lambda c: c.size is not None or c.access_modes is None,
        ".accessModes",
    ),
    Rule(
        m.CacheClaim,
        "has(self.size) || !has(self.reclaimPolicy) || self.reclaimPolicy == 'Retain'",
        "modelCache.persistentVolumeClaim.reclaimPolicy Delete needs size (it applies only to a claim the operator "
        "creates; a claim it did not create is never deleted by it)",
        lambda c: c.size is not None or c.reclaim_policy == "Retain",
        ".reclaimPolicy",
    ),
)

# pod_rules.py: what a pod override may not do; resource_rules.py: no request above its limit once merged;
# lora_rules.py: spec.lora (its root rule, adapter names vs metadata.name: checked below, put in the CRD by crdgen)
# availability.py: a pool's disruptionBudget sets exactly one of its two fields; auth.py: the API-key file's name
# router.py: router.replicas is at least 1 (enabled: false runs none);
# netpol.py: networkPolicy.clients peers
# idle_rules.py: autoscaling.idle sleep (instead of scaleToZero; needs the autoscaler and the router)
SPEC_RULES: tuple[Rule, ...] = (
    _CORE_RULES
    + POD_RULES
    + RESOURCE_RULES
    + LORA_RULES
    + AVAILABILITY_RULES
    + AUTH_RULES
    + NETPOL_RULES
    + IDLE_RULES
    + ROUTER_RULES
)

# Root-level rules (self = the whole object); CEL may read metadata.name there.
NAME_RULE_CEL = f"!has(self.metadata.name) || size(self.metadata.name) <= {MAX_NAME_LENGTH}"
NAME_RULE_MESSAGE = (
    f"metadata.name must be at most {MAX_NAME_LENGTH} characters (child Services and pods add suffixes to it)"
)


def rules_for(model: type[BaseModel]) -> list[Rule]:
    """Rules evaluated on objects of this model class: its own and those of its bases (crdgen attaches both)."""
    return [r for r in SPEC_RULES if issubclass(model, r.where)]


def _walk(obj: BaseModel) -> list[BaseModel]:
    found = [obj]
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        items = value if isinstance(value, list) else value.values() if isinstance(value, dict) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                found.extend(_walk(item))
    return found


def validate_spec(spec: s.InferenceServiceSpec, name: str | None = None) -> list[str]:
    """Messages of every rule the spec (and optionally metadata.name) breaks; [] when valid.

    The same messages the API server returns for the CEL rules; use it where objects did not come
    through the API server (dry runs, tests, the reconcile's last line of defence).
    """
    messages = [r.message for obj in _walk(spec) for r in rules_for(type(obj)) if not r.check(obj)]
    if name is not None and len(name) > MAX_NAME_LENGTH:
        messages.append(NAME_RULE_MESSAGE)
    if name is not None and served_name_clash(spec, name):
        messages.append(ROOT_RULE_MESSAGE)
    return list(dict.fromkeys(messages))
