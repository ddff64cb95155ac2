"""Fuzz the InferenceService CRD against a real API server: `python e2e/fuzz/crd_fuzz.py [-n N] [--seed S]`.

For each random spec (spec_gen.py): the API server's verdict (a dry-run create), the operator's own (the
models, the rules, the builders: `desire()`), and, when both accept, a dry-run server-side apply of every
child the builders make. Anything else than "both refuse" or "both accept and every child is accepted" is a
finding, written as one JSON line to --out with the spec: an InferenceService the API server accepts but
whose pods it would refuse (the operator would be Degraded at every reconcile), one the models refuse
after admission (InvalidSpec only at reconcile time), or a crash of the builders.

Starts its own dev cluster (e2e/controlplane; the binaries must be built) and stops it at the end. A
finding becomes a case in tests/api_cases_pod.py (or tests/operator/test_api_cases.py) once understood.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controlplane"))
import devcluster_addons
from pydantic import ValidationError
from spec_gen import CRD_FILE, MODES, SpecGen
from tqdm import tqdm

import devcluster
from tidepool.operator.builders import ClusterFeatures, ServiceView, SpecError
from tidepool.operator.credentials import load_credentials
from tidepool.operator.features import detect_features
from tidepool.operator.k8s import ApiError, KubeClient, object_path, resource_path
from tidepool.operator.reconcile import desire

NAMESPACE = "fuzz"
DRY_RUN = {"dryRun": "All"}


async def api_verdict(client: KubeClient, body: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(verdict, message, the object as the API server would store it: defaults applied, nulls pruned)."""
    try:
        stored = await client.request("POST", resource_path("InferenceService", NAMESPACE), body=body, params=DRY_RUN)
    except ApiError as exc:
        return f"refused {exc.status}", exc.message, body
    return "accepted", "", stored


def local_verdict(body: dict[str, Any], features: ClusterFeatures) -> tuple[str, Any]:
    stored = copy.deepcopy(body)
    stored["metadata"].setdefault("uid", "00000000-0000-0000-0000-000000000001")
    try:
        return "accepted", desire(ServiceView.from_body(stored), stored["metadata"], features, None).children
    except (ValidationError, SpecError) as exc:
        return "refused", str(exc)[:600]
    except Exception:  # a crash of the builders: always a finding
        return "crashed", traceback.format_exc()[-2000:]


async def refused_children(client: KubeClient, children: list[dict[str, Any]]) -> list[str]:
    refused = []
    for child in children:
        params = {"fieldManager": "crd-fuzz", "force": "true", **DRY_RUN}
        try:
            await client.request(
                "PATCH", object_path(child), body=child, params=params, content_type="application/apply-patch+yaml"
            )
        except ApiError as exc:
            refused.append(f"{child['kind']}/{child['metadata']['name']}: {exc.status} {exc.message[:500]}")
    return refused


async def fuzz(cluster: Any, gen: SpecGen, count: int, out: Path) -> Counter[str]:
    creds = load_credentials(str(cluster.kubeconfig))
    tally: Counter[str] = Counter()
    async with KubeClient(creds) as client:
        features = await detect_features(client, ClusterFeatures())
        with out.open("w") as findings:
            for i in tqdm(range(count), desc="specs", unit="spec"):
                body = gen.body(f"f{i}", NAMESPACE)
                api, api_message, stored = await api_verdict(client, body)
                local, detail = local_verdict(stored, features)
                children = await refused_children(client, detail) if api == local == "accepted" else []
                outcome = f"api {api}, models {local}" + (", children refused" if children else "")
                tally[outcome] += 1
                if children or local == "crashed" or (api == "accepted") != (local == "accepted"):
                    finding = {"outcome": outcome, "api": api_message, "models": detail if local != "accepted" else ""}
                    findings.write(json.dumps({**finding, "children": children, "spec": body["spec"]}) + "\n")
                    findings.flush()
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=1000, help="specs to try (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=MODES, default="", help="which fields to edit (spec_gen.py)")
    parser.add_argument("--out", type=Path, default=Path("crd-fuzz-findings.jsonl"))
    args = parser.parse_args(argv)
    gen = SpecGen(random.Random(args.seed), args.mode)
    bin_dir = devcluster.find_bin_dir()
    with devcluster.DevCluster(num_nodes=1, bin_dir=bin_dir) as cluster:
        devcluster_addons.install_crds(cluster, [CRD_FILE, *devcluster_addons.inference_pool_crd_files(bin_dir)])
        cluster.kubectl("create", "namespace", NAMESPACE)
        tally = asyncio.run(fuzz(cluster, gen, args.n, args.out))
    for outcome, n in tally.most_common():
        print(f"{n:6d}  {outcome}")
    findings = sum(n for outcome, n in tally.items() if outcome not in ("api accepted, models accepted",
                                                                        "api refused 422, models refused"))  # fmt: skip
    print(f"{findings} findings in {args.out}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
