"""Builders for spec.model.credentials and spec.modelCache: what the download init containers and the cache
volume look like, and that no secret value can be rendered (only secretKeyRef to the Secret's name)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_builders import UNIFIED, build, by_key, spec

from tidepool.contract.download import SECRET_NAME_ENV
from tidepool.engine.download.cli import build_parser as download_parser
from tidepool.operator.api.model import CREDENTIAL_KEYS, DEFAULT_CACHE_SIZE_LIMIT

CREDS = {"credentials": {"secretName": "hf-token"}}


def pod_of(s: dict[str, Any]) -> dict[str, Any]:
    return by_key(build(s))[("Deployment", "svc-unified")]["spec"]["template"]["spec"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container["env"]}


def test_hf_init_container_runs_tidepool_download_with_the_secret_by_reference():
    s = spec(UNIFIED, model={"uri": "hf://org/gated", "revision": "v1.0", **CREDS})
    pod = pod_of(s)
    (init,) = pod["initContainers"]
    assert init["name"] == "fetch-model" and init["command"] == ["tidepool", "download"]
    assert init["terminationMessagePolicy"] == "File"
    args = download_parser().parse_args(init["args"])  # the real CLI accepts what the builder renders
    assert (args.uri, args.revision, args.dest) == ("hf://org/gated", "v1.0", "/models/hf/org/gated/v1.0")
    engine_args = pod["containers"][0]["args"]
    assert engine_args[engine_args.index("--model") + 1] == args.dest
    env = env_of(init)
    for key in ("HF_TOKEN", "HF_ENDPOINT"):
        assert env[key] == {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": key, "optional": True}},
        }
    assert env[SECRET_NAME_ENV] == {"name": SECRET_NAME_ENV, "value": "hf-token"}  # the name, for messages
    assert not any(k.startswith("AWS_") for k in env)  # only the keys its scheme reads
    assert not any("secretKeyRef" in json.dumps(e) for e in pod["containers"][0]["env"])  # never the engine
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_s3_init_container_gets_aws_keys_and_falls_back_to_logs():
    pod = pod_of(spec(UNIFIED, model={"uri": "s3://bucket/models/m", **CREDS}))
    (init,) = pod["initContainers"]
    assert init["command"] == ["aws"] and init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = env_of(init)
    aws = [k for k in CREDENTIAL_KEYS if k.startswith("AWS_")]
    assert sorted(k for k in env if k.startswith("AWS_")) == sorted(aws)
    assert all(env[k]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": k, "optional": True} for k in aws)
    assert "HF_TOKEN" not in env


def test_catalogue_uri_is_pulled_into_the_cache_and_served_from_its_gguf():
    from tidepool.contract import catalogue

    name = catalogue.names()[0]
    entry = catalogue.CATALOGUE[name]
    pod = pod_of(spec(UNIFIED, model={"uri": f"catalogue://{name}"}))
    (init,) = pod["initContainers"]
    assert init["command"] == ["tidepool", "pull"] and init["args"] == [name]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    cache = env_of(init)["TIDEPOOL_CACHE"]["value"]
    assert cache.startswith("/models/")  # on the cache volume, so one pull serves every pod of a shared cache
    engine_args = pod["containers"][0]["args"]
    # where `tidepool pull` leaves the file with that TIDEPOOL_CACHE (catalogue.cached_path's layout)
    assert engine_args[engine_args.index("--model") + 1] == f"{cache}/models/{entry.name}/{entry.file_name}"


def test_no_credentials_no_secret_refs():
    pod = pod_of(spec(UNIFIED))
    assert "secretKeyRef" not in json.dumps(pod) and SECRET_NAME_ENV not in json.dumps(pod)


def test_draft_model_is_fetched_with_the_same_credentials():
    s = spec(
        UNIFIED,
        model={"uri": "hf://org/m", **CREDS},
        engine__speculative={"method": "draft", "draftModel": "hf://org/d"},
    )
    inits = {c["name"]: c for c in pod_of(s)["initContainers"]}
    assert set(inits) == {"fetch-model", "fetch-draft"}
    assert env_of(inits["fetch-draft"])["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"


def test_revisions_get_their_own_folders():
    def dest(revision: str | None) -> str:
        model = {"uri": "hf://org/m", **({"revision": revision} if revision else {})}
        return download_parser().parse_args(pod_of(spec(UNIFIED, model=model))["initContainers"][0]["args"]).dest

    assert dest(None) == dest("main") == "/models/hf/org/m/main"
    assert dest("refs/pr/1") == "/models/hf/org/m/refs-pr-1"


@pytest.mark.parametrize(
    ("cache", "volume"),
    [
        (None, {"emptyDir": {"sizeLimit": DEFAULT_CACHE_SIZE_LIMIT}}),
        ({"emptyDir": {}}, {"emptyDir": {"sizeLimit": DEFAULT_CACHE_SIZE_LIMIT}}),
        ({"emptyDir": {"sizeLimit": "204800Mi"}}, {"emptyDir": {"sizeLimit": "200Gi"}}),  # canonical form
        ({"persistentVolumeClaim": {"claimName": "shared"}}, {"persistentVolumeClaim": {"claimName": "shared"}}),
    ],
    ids=["default", "emptydir-default-limit", "emptydir-limit", "existing-claim"],
)
def test_cache_volume_kinds(cache, volume):
    s = spec(UNIFIED, **({"modelCache": cache} if cache else {}))
    children = by_key(build(s))
    vol = next(v for v in pod_of(s)["volumes"] if v["name"] == "model-cache")
    assert {k: v for k, v in vol.items() if k != "name"} == volume
    assert not any(kind == "PersistentVolumeClaim" for kind, _ in children)  # nothing to create


def test_created_claim_honours_access_modes_and_class():
    cache = {"claimName": "w", "size": "50Gi", "storageClassName": "nfs", "accessModes": ["ReadWriteOnce"]}
    claim = by_key(build(spec(UNIFIED, modelCache={"persistentVolumeClaim": cache})))[("PersistentVolumeClaim", "w")]
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "50Gi"}},
        "storageClassName": "nfs",
    }
    default = by_key(build(spec(UNIFIED, modelCache={"persistentVolumeClaim": {"claimName": "w", "size": "1Gi"}})))
    assert default[("PersistentVolumeClaim", "w")]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_pod_security_context_skips_recursive_chown():
    assert pod_of(spec(UNIFIED))["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
