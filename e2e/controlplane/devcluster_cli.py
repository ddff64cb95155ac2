"""`e2e/dev-cluster`: start a detached DevCluster, print its env, report, stop it, and dev helpers.

    up [--nodes N] [--state-dir DIR] [--no-real-node] [--inference-pool]
    down | env | status
    inference-pool-crds            apply the Gateway API Inference Extension CRDs (InferencePool, ...)
    dev-env NAMESPACE [--models DIR]
                                   let Tidepool's pods in NAMESPACE run this checkout on the real node
                                   (DEV ONLY; `pvc://tidepool-dev-models/<folder>` then names DIR/<folder>)

State lives in `<state-dir>/state.json` (pids and executables of every component, ports, the real
node's slot): `down` stops exactly those processes (never a recycled pid), then the node's pods,
namespaces and cgroups, even when `up` ran in another shell.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import devcluster_addons as addons
import devcluster_node as node
import devcluster_procs as procs

from devcluster import STATE_FILE, BinariesMissingError, ClusterStartError, DevCluster, default_cache


class Attached:
    """Enough of a DevCluster, rebuilt from state.json, to run kubectl against it."""

    def __init__(self, state: dict) -> None:
        self.bin_dir = Path(state["bin_dir"])
        self.kubeconfig = Path(state["kubeconfig"])
        self.dev_env = addons.DevEnv(state["dev_env"]) if state.get("dev_env") else None

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        cmd = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=120)
        if check and out.returncode != 0:
            raise subprocess.CalledProcessError(out.returncode, cmd, out.stdout, out.stderr)
        return out


def _dev_env() -> addons.DevEnv | None:
    """The venv running this CLI (e2e/dev-cluster runs it with the project's), if it is one."""
    if sys.prefix == sys.base_prefix:
        return None
    return addons.DevEnv.for_venv(Path(sys.prefix))


def _load(args: argparse.Namespace) -> dict | None:
    path = args.state_dir / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _cmd_up(args: argparse.Namespace) -> int:
    state_file = args.state_dir / STATE_FILE
    if state_file.exists():
        print(f"a cluster is already recorded in {state_file}; run `down` first", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    real = not args.no_real_node
    cluster = DevCluster(
        num_nodes=args.nodes, state_dir=args.state_dir, detached=True, real_node=real,
        dev_env=_dev_env() if real else None, network_policies=not args.no_network_policies,
    )  # fmt: skip
    cluster.start()
    state_file.write_text(json.dumps(cluster.state(), indent=2))
    if args.inference_pool:
        addons.install_inference_pool_crds(cluster)
    what = f"{args.nodes} GPU node(s)" + (f" + real node {node.NODE_NAME}" if real else "")
    print(
        f"cluster up in {time.monotonic() - t0:.1f}s: {cluster.server}, {what}; logs in {args.state_dir}",
        file=sys.stderr,
    )
    print(f"ready after (s): {cluster.timings}", file=sys.stderr)
    if cluster.dev_image:
        print(f"dev engine image: {cluster.dev_image} (e2e/dev-cluster dev-env NAMESPACE to use it)", file=sys.stderr)
    _print_env(cluster.state())
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    state = _load(args)
    if state is None:
        print(f"no cluster recorded in {args.state_dir / STATE_FILE}", file=sys.stderr)
        return 0
    pids, binaries = dict(state["pids"]), state["binaries"]

    def stop(names: list[str]) -> None:
        procs.stop_processes({n: pids.pop(n) for n in names if n in pids}, binaries=binaries)

    try:
        if state.get("node"):
            node.teardown(state["node"], stop)
    finally:
        stop(list(pids))
    if state.get("etcd_dir", "None") != "None":
        shutil.rmtree(state["etcd_dir"], ignore_errors=True)
    (args.state_dir / STATE_FILE).unlink()
    print("cluster down", file=sys.stderr)
    return 0


def _print_env(state: dict) -> None:
    print(f"export KUBECONFIG={state['kubeconfig']}")
    print(f"export PATH={state['bin_dir']}:$PATH")


def _cmd_env(args: argparse.Namespace) -> int:
    state = _load(args)
    if state is None:
        print(f"no cluster recorded in {args.state_dir / STATE_FILE}; run `up` first", file=sys.stderr)
        return 1
    _print_env(state)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    state = _load(args)
    if state is None:
        print("down")
        return 1
    alive = {n: procs.pid_alive(p) and procs.is_binary(p, state["binaries"][n]) for n, p in state["pids"].items()}
    for name, ok in alive.items():
        print(f"{name:24} pid {state['pids'][name]:>7}  {'running' if ok else 'DEAD'}")
    return 0 if all(alive.values()) else 1


def _cmd_inference_pool_crds(args: argparse.Namespace) -> int:
    state = _load(args)
    if state is None:
        print("no cluster; run `up` first", file=sys.stderr)
        return 1
    print("\n".join(addons.install_inference_pool_crds(Attached(state))))
    return 0


def _cmd_dev_env(args: argparse.Namespace) -> int:
    state = _load(args)
    cluster = Attached(state) if state else None
    if cluster is None or cluster.dev_env is None:
        print("no cluster with a real node and a dev env; run `up` (with the project's venv)", file=sys.stderr)
        return 1
    docs = addons.dev_env_volumes(cluster.dev_env, args.namespace, args.models)
    cluster.kubectl("create", "namespace", args.namespace, check=False)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    cluster.kubectl("label", "namespace", args.namespace, "=".join(addons.DEV_ENV_LABEL), "--overwrite")
    print(f"namespace {args.namespace}: dev env bound; engine image {state['dev_image']}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verb", choices=("up", "down", "env", "status", "inference-pool-crds", "dev-env"))
    parser.add_argument("namespace", nargs="?", help="dev-env: the namespace")
    parser.add_argument("--nodes", type=int, default=2, help="fake GPU nodes (default 2)")
    parser.add_argument("--no-real-node", action="store_true", help="KWOK nodes only (needs no root)")
    parser.add_argument(
        "--no-network-policies", action="store_true", help="up: the real node enforces no NetworkPolicy"
    )
    parser.add_argument("--inference-pool", action="store_true", help="up: also install the InferencePool CRDs")
    parser.add_argument("--models", type=Path, help="dev-env: folder behind pvc://tidepool-dev-models/")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=default_cache() / "dev-cluster",
        help="pids, kubeconfig, certs and logs (default %(default)s)",
    )
    args = parser.parse_args(argv)
    args.state_dir = args.state_dir.resolve()
    if args.verb == "dev-env" and not args.namespace:
        parser.error("dev-env needs a NAMESPACE")
    verbs = {
        "up": _cmd_up, "down": _cmd_down, "env": _cmd_env, "status": _cmd_status,
        "inference-pool-crds": _cmd_inference_pool_crds, "dev-env": _cmd_dev_env,
    }  # fmt: skip
    try:
        return verbs[args.verb](args)
    except (BinariesMissingError, ClusterStartError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
