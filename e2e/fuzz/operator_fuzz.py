"""Fuzz the operator on a dev cluster: `python e2e/fuzz/operator_fuzz.py [-n N] [--seed S]`.

Creates N random InferenceServices the API server accepts (spec_gen.py, "leaf" mode: fields of the samples,
which share cache claim names), edits half of them three times with other accepted edits, then lets the
operator (a subprocess with its production defaults, as the chart's ServiceAccount) settle for up to five
minutes. Reports what every object ended as: which did not reach observedGeneration == generation, every
Degraded condition (an ApplyFailed is a finding: the API server refused what the operator applied; a
WorkloadFailure naming a PriorityClass, RuntimeClass or ServiceAccount that does not exist is the spec's),
traceback or ERROR lines in the operator's log, and its API requests in the last minute (a quiet operator
makes few once nothing changes). Exit status 1 when there is a finding.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controlplane"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "controlplane"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import devcluster_addons
from kubernetes import client
from kubernetes.client.rest import ApiException
from operator_kit import (
    CRD_FILE,
    OperatorProcess,
    bind_claims,
    claims_in,
    operator_identity,
    wait_until,
)
from spec_gen import SIMPLE, SpecGen

import devcluster

NAMESPACE = "operator-fuzz"
GROUP, VERSION, PLURAL = "tidepool.dev", "v1alpha1", "inferenceservices"


def create_accepted(api: client.CustomObjectsApi, cluster: Any, gen: SpecGen, count: int) -> list[str]:
    names: list[str] = []
    tries = 0
    while len(names) < count and tries < count * 60:
        tries += 1
        body = gen.body(f"s{len(names)}", NAMESPACE)
        try:
            api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body, dry_run="All")
        except ApiException:
            continue
        bind_claims(cluster, NAMESPACE, claims_in(body["spec"]))
        api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
        names.append(body["metadata"]["name"])
    print(f"created {len(names)} InferenceServices ({tries} tries)")
    return names


def edit_accepted(api: client.CustomObjectsApi, cluster: Any, gen: SpecGen, name: str) -> bool:
    """Replace `name`'s spec with an accepted edit of a sample; False when 30 tries found none."""
    leaves = [p for p in gen.paths if p[1].get("type") in SIMPLE]
    for _ in range(30):
        current = api.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
        body = copy.deepcopy(gen.rng.choice(gen.samples))
        body["metadata"] = {
            "name": name,
            "namespace": NAMESPACE,
            "resourceVersion": current["metadata"]["resourceVersion"],
        }
        for _ in range(gen.rng.choice([1, 2])):
            where, node = gen.rng.choice(leaves)
            gen.set_field(body["spec"], where, gen.value(node))
        try:
            api.replace_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, body, dry_run="All")
        except ApiException:
            continue
        bind_claims(cluster, NAMESPACE, claims_in(body["spec"]))
        try:
            api.replace_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, body)
        except ApiException as exc:
            if exc.status == 409:  # the operator wrote status in between: try again from the fresh object
                continue
            raise
        return True
    return False


def report(objs: list[dict[str, Any]], log: str) -> int:
    findings = 0
    unsettled = [o["metadata"]["name"] for o in objs
                 if (o.get("status") or {}).get("observedGeneration") != o["metadata"]["generation"]]  # fmt: skip
    print(f"not at their generation: {unsettled}")
    for obj in objs:
        for cond in (obj.get("status") or {}).get("conditions", []):
            if cond["type"] == "Degraded" and cond["status"] == "True":
                finding = cond["reason"] != "WorkloadFailure"
                findings += finding
                print(f"{'FINDING ' if finding else ''}{obj['metadata']['name']} Degraded {cond['reason']}: "
                      f"{cond['message'][:300]}")  # fmt: skip
    bad = [line for line in log.splitlines() if "Traceback" in line or "ERROR" in line]
    print(f"{len(bad)} traceback/ERROR lines in the operator's log")
    stats = [line for line in log.splitlines() if " syncs (" in line]
    print("the operator's last minute:", stats[-1].split("] ", 1)[-1] if stats else "(no stats line yet)")
    return findings + len(bad) + len(unsettled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=40, help="InferenceServices (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dir", type=Path, default=Path("operator-fuzz"), help="cluster state and logs")
    args = parser.parse_args(argv)
    gen = SpecGen(random.Random(args.seed), "leaf")
    args.state_dir.mkdir(parents=True, exist_ok=True)
    with devcluster.DevCluster(num_nodes=2, state_dir=args.state_dir / "cluster") as cluster:
        devcluster_addons.install_crds(cluster, [CRD_FILE])
        cluster.kubectl("create", "namespace", NAMESPACE)
        identity = operator_identity(cluster, args.state_dir)
        operator = OperatorProcess(identity.kubeconfig, [NAMESPACE], args.state_dir / "operator.log")
        operator.start()
        try:
            api = client.CustomObjectsApi(cluster.api_client())
            names = create_accepted(api, cluster, gen, args.n)
            edits = 0
            for _round in range(3):
                edits += sum(
                    edit_accepted(api, cluster, gen, n) for n in gen.rng.sample(names, max(1, len(names) // 2))
                )
                time.sleep(10)
            print(f"{edits} edits")

            def settled() -> bool:
                items = api.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)["items"]
                return all((o.get("status") or {}).get("observedGeneration") == o["metadata"]["generation"]
                           for o in items)  # fmt: skip

            try:
                wait_until(settled, 300, "every object at its generation", interval_s=5)
            except AssertionError as exc:
                print(exc)
            time.sleep(65)  # one more stats line, from a minute in which nothing was edited
            objs = api.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)["items"]
            findings = report(objs, operator.log_text())
            findings += 0 if operator.is_alive() else 1
        finally:
            operator.stop()
    print(f"{findings} findings; the operator's log: {args.state_dir / 'operator.log'}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
