"""What the dev cluster runs beside the control plane: LeaderWorkerSet, CoreDNS, extra CRDs, the dev env.

- **LeaderWorkerSet** (`lws-controller`, built from sigs.k8s.io/lws by build.sh): the real controller,
  on the host, with the admin kubeconfig. Its webhooks (LWS defaulting/validation, and the pod
  webhook that injects LWS_LEADER_ADDRESS / LWS_WORKER_INDEX) are served on 127.0.0.1 with a
  certificate from the dev cluster's own CA; its internal cert rotation (which wants a Secret and a
  Service in-cluster) is off, and the webhook configurations shipped in the module are registered
  with `clientConfig.url` instead of a Service (the apiserver runs on the same host).
- **CoreDNS** (our own main with the kubernetes plugin, see coredns/main.go): cluster DNS for the
  real node's pods, on the host side of the node's veth, so `<pod>.<headless svc>.<ns>` names resolve
  (pipeline-parallel ranks find rank 0 that way).
- **InferencePool CRDs** from sigs.k8s.io/gateway-api-inference-extension (`install_inference_pool_crds`).
- **The dev env** (DEV ONLY): pods rendered by the operator get the project's Python, venv and clone
  mounted read-only at their host paths, so the dev image (e2e/images/build.py) runs this checkout.
  A MutatingAdmissionPolicy adds them to pods labelled `app.kubernetes.io/managed-by:
  tidepool-operator` in namespaces labelled `tidepool.dev/dev-env=enabled`, as PersistentVolumeClaims
  bound to read-only hostPath PersistentVolumes (PVC volumes are allowed by Pod Security "restricted";
  hostPath volumes are not), so the operator's builders stay untouched and pods stay restricted.
  The compiled CPU ops are prebuilt on the host for its CPU (`tidepool build-ops --isa auto`, into
  `$TIDEPOOL_CACHE/cpu-ops-prebuilt/<venv key>`), mounted the same way and named by TIDEPOOL_CPU_OPS_DIR,
  which the policy sets on the containers: the pods load them as from an engine image and never compile.
"""

from __future__ import annotations

import ast
import base64
import copy
import hashlib
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from devcluster_pki import Pki, sign

from tidepool.contract.cpu_ops import PREBUILT_DIR_ENV  # stdlib only: the dev cluster's tools stay torch-free

LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
DEV_ENV_LABEL = ("tidepool.dev/dev-env", "enabled")
DEV_ENV_POLICY = "tidepool-dev-env"
MODELS_CLAIM = "tidepool-dev-models"
MANAGED_BY = ("app.kubernetes.io/managed-by", "tidepool-operator")
CPU_OPS_CLAIM = "tidepool-dev-cpu-ops"
BUILD_OPS_TIMEOUT_S = 1800  # 7 ops on a busy 2-core machine take minutes; cached afterwards


def manifests_dir(bin_dir: Path) -> Path:
    """build.sh copies manifests shipped in Go modules beside bin/."""
    return bin_dir.parent / "manifests"


# ---- LeaderWorkerSet ---------------------------------------------------------------------------
def lws_crd_files(bin_dir: Path) -> list[Path]:
    return sorted((manifests_dir(bin_dir) / "lws").glob("leaderworkerset.x-k8s.io_*.yaml"))


def lws_controller_args(state_dir: Path, pki: Pki, kubeconfig: Path, webhook_port: int, health_port: int) -> list[str]:
    """Config for the LWS controller: no leader election, no internal cert rotation, no metrics
    server (its default :8443 would collide between clusters), webhooks on 127.0.0.1 with our CA."""
    cert_dir = state_dir / "lws-certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    crt, key = sign(pki, "lws-webhook", "lws-webhook", server=True, dns=("localhost",), ips=("127.0.0.1",))
    (cert_dir / "tls.crt").write_bytes(crt.read_bytes())
    (cert_dir / "tls.key").write_bytes(key.read_bytes())
    (cert_dir / "tls.key").chmod(0o600)
    config = {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
    }
    path = state_dir / "lws-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return [f"--config={path}", f"--kubeconfig={kubeconfig}", "--zap-log-level=info"]


def lws_webhook_configs(bin_dir: Path, ca_crt: Path, webhook_port: int) -> list[dict[str, Any]]:
    """The module's webhook configurations with its own kustomize patches applied (the pod webhooks
    only see pods labelled `leaderworkerset.sigs.k8s.io/name`) and the `lws-` name prefix, pointed
    at the controller on 127.0.0.1."""
    folder = manifests_dir(bin_dir) / "lws"
    docs = [d for d in yaml.safe_load_all((folder / "webhooks.yaml").read_text()) if d]
    patches = {
        "MutatingWebhookConfiguration": yaml.safe_load((folder / "mutating-patch.yaml").read_text()),
        "ValidatingWebhookConfiguration": yaml.safe_load((folder / "validating-patch.yaml").read_text()),
    }
    ca_bundle = base64.b64encode(ca_crt.read_bytes()).decode()
    out = []
    for doc in docs:
        doc = copy.deepcopy(doc)
        for op in patches[doc["kind"]]:
            if op["op"] != "replace" or not op["path"].startswith("/webhooks/"):
                raise ValueError(f"unexpected patch in the LWS module: {op}")
            doc["webhooks"][int(op["path"].split("/")[2])] = op["value"]
        doc["metadata"]["name"] = "lws-" + doc["metadata"]["name"]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{webhook_port}{path}", "caBundle": ca_bundle}
            hook["timeoutSeconds"] = 10
        out.append(doc)
    return out


# ---- CoreDNS -------------------------------------------------------------------------------------
def coredns_args(state_dir: Path, listen_ip: str, kubeconfig: Path, health_port: int, ready_port: int) -> list[str]:
    corefile = "\n".join(
        [
            ".:53 {",
            f"    bind {listen_ip}",
            "    errors",
            f"    health 127.0.0.1:{health_port}",
            f"    ready 127.0.0.1:{ready_port}",
            "    kubernetes cluster.local in-addr.arpa ip6.arpa {",
            f"        kubeconfig {kubeconfig}",
            "        pods insecure",
            "        fallthrough in-addr.arpa ip6.arpa",
            "    }",
            "    template ANY ANY {",  # offline: every other name does not exist (not SERVFAIL)
            "        rcode NXDOMAIN",
            "    }",
            "    cache 5",
            "}",
            "",
        ]
    )
    path = state_dir / "Corefile"
    path.write_text(corefile)
    return [f"-conf={path}"]


# ---- InferencePool CRDs ----------------------------------------------------------------------------
def inference_pool_crd_files(bin_dir: Path) -> list[Path]:
    """InferencePool (inference.networking.k8s.io/v1 and the x-k8s.io alpha) and InferenceObjective CRDs."""
    return sorted((manifests_dir(bin_dir) / "inference-extension").glob("*.yaml"))


def install_inference_pool_crds(cluster) -> list[str]:
    """Apply the Gateway API Inference Extension CRDs to a DevCluster and wait until they are
    Established; returns the CRD names."""
    files = inference_pool_crd_files(cluster.bin_dir)
    if not files:
        raise FileNotFoundError(
            f"no InferencePool CRDs in {manifests_dir(cluster.bin_dir)}: run e2e/controlplane/build.sh"
        )
    return install_crds(cluster, files)


def install_crds(cluster, files: list[Path], timeout_s: float = 60.0) -> list[str]:
    """Apply CRDs server-side and wait until each is Established. (`kubectl wait` fails outright on a
    CRD created a moment ago: it has no status.conditions yet.)"""
    names = [yaml.safe_load(f.read_text())["metadata"]["name"] for f in files]
    args = ["apply", "--server-side", "--force-conflicts"]
    for f in files:
        args += ["-f", str(f)]
    cluster.kubectl(*args)
    deadline = time.monotonic() + timeout_s
    while True:
        out = cluster.kubectl("get", "crd", "-o", "json", check=False)
        items = json.loads(out.stdout)["items"] if out.returncode == 0 else []
        established = {c["metadata"]["name"] for c in items if _has_condition(c, "Established")}
        if established >= set(names):
            return names
        if time.monotonic() > deadline:
            raise RuntimeError(f"CRDs not Established after {timeout_s}s: {sorted(set(names) - established)}")
        time.sleep(0.2)


def _has_condition(obj: dict[str, Any], type_: str) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == type_ and c["status"] == "True" for c in conditions)


# ---- the dev env ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DevEnv:
    """Host folders mounted read-only into operator-rendered pods, at the same paths (claim -> path)."""

    mounts: dict[str, str]

    @classmethod
    def for_venv(cls, venv: Path) -> DevEnv:
        """The venv, the clone its editable install of tidepool points at (if editable), and the Python
        the venv was made from, unless that is Debian's own under /usr (the dev image ships python3.11)."""
        venv = venv.resolve()
        lines = (venv / "pyvenv.cfg").read_text().splitlines()
        cfg = {k.strip(): v.strip() for k, _, v in (line.partition("=") for line in lines) if v}
        prefix = Path(cfg["home"]).resolve().parent
        mounts = {"tidepool-dev-venv": str(venv)}
        clone = editable_source(venv)
        if clone is not None:
            mounts["tidepool-dev-src"] = str(clone)
        if not str(prefix).startswith("/usr"):
            mounts["tidepool-dev-python"] = str(prefix)
        mounts[CPU_OPS_CLAIM] = str(prebuild_cpu_ops(venv))
        return cls(mounts)


def prebuild_cpu_ops(venv: Path) -> Path:
    """Build the CPU ops for this host's CPU with the venv's `tidepool build-ops` (incremental: seconds when
    nothing changed) into a directory of the host's cache keyed on the venv; returns it. RuntimeError with the
    command's output when the build fails (the tier's pods would otherwise compile at start)."""
    cache = Path(os.environ.get("TIDEPOOL_CACHE", Path.home() / ".cache" / "tidepool")).expanduser()
    out = cache / "cpu-ops-prebuilt" / hashlib.sha256(str(venv).encode()).hexdigest()[:12]
    cmd = [str(venv / "bin" / "tidepool"), "build-ops", "--isa", "auto", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_OPS_TIMEOUT_S, cwd="/tmp", check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return out  # world-readable (build-ops' modes): the pods' non-root uid reads it through the mount


def editable_source(venv: Path) -> Path | None:
    """The folder an editable install of tidepool maps its packages to (setuptools' finder module)."""
    for finder in venv.glob("lib/python*/site-packages/__editable___tidepool*_finder.py"):
        match = re.search(r"^MAPPING[^=]*=\s*(\{.*?\})\s*$", finder.read_text(), re.MULTILINE)
        if match:
            paths = list(ast.literal_eval(match.group(1)).values())
            return Path(os.path.commonpath(paths)) if paths else None
    return None


def dev_env_policy(env: DevEnv) -> list[dict[str, Any]]:
    """A MutatingAdmissionPolicy (+ binding) adding the dev env's claims to Tidepool's pods."""
    volumes = ", ".join(
        f'Object.spec.volumes{{name: "{c}", persistentVolumeClaim: '
        f'Object.spec.volumes.persistentVolumeClaim{{claimName: "{c}", readOnly: true}}}}'
        for c in sorted(env.mounts)
    )
    mounts = ", ".join(
        f'Object.spec.containers.volumeMounts{{name: "{c}", mountPath: "{p}", readOnly: true}}'
        for c, p in sorted(env.mounts.items())
    )
    env_vars = ""
    if ops_dir := env.mounts.get(CPU_OPS_CLAIM):  # named as an engine image names its prebuilt ops
        env_vars = f', env: [Object.spec.containers.env{{name: "{PREBUILT_DIR_ENV}", value: "{ops_dir}"}}]'
    per_container = f"Object.spec.containers{{name: c.name, volumeMounts: [{mounts}]{env_vars}}}"
    expression = (
        f"Object{{spec: Object.spec{{volumes: [{volumes}], "
        f"containers: object.spec.containers.map(c, {per_container})}}}}"
    )
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": DEV_ENV_POLICY},
        "spec": {
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
                ]
            },
            "failurePolicy": "Fail",
            "reinvocationPolicy": "Never",
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": expression}}],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": DEV_ENV_POLICY},
        "spec": {
            "policyName": DEV_ENV_POLICY,
            "matchResources": {
                "namespaceSelector": {"matchLabels": dict([DEV_ENV_LABEL])},
                "objectSelector": {"matchLabels": dict([MANAGED_BY])},
            },
        },
    }
    return [policy, binding]


def dev_env_volumes(env: DevEnv, namespace: str, models_dir: Path | None = None) -> list[dict[str, Any]]:
    """Read-only hostPath PersistentVolumes pre-bound to claims in `namespace` (the dev env's, and
    `tidepool-dev-models` for `pvc://tidepool-dev-models/<folder>` model URIs when models_dir is given)."""
    claims = dict(env.mounts)
    if models_dir is not None:
        claims[MODELS_CLAIM] = str(models_dir.resolve())
    docs: list[dict[str, Any]] = []
    for claim, host_path in sorted(claims.items()):
        pv_name = f"{claim}-{namespace}"[:253]
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": pv_name, "labels": {DEV_ENV_LABEL[0]: namespace[:63]}},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "claimRef": {"namespace": namespace, "name": claim},
                    "hostPath": {"path": host_path, "type": "Directory"},
                },
            }
        )
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim, "namespace": namespace},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "volumeName": pv_name,
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }
        )
    return docs
