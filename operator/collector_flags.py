"""`tidepool operator`'s --collector-* flags: who the services' NetworkPolicies let scrape /metrics.

The operator itself collects the engines' metrics (the autoscaler's scrapes) and calls their LoRA endpoints, so
every service's NetworkPolicies (builders/netpol.py) admit it by this identity: its pods, selected by
`--collector-pod-labels` in `--collector-namespace` (default: the operator's own namespace, from $POD_NAMESPACE
or the ServiceAccount's namespace file), and/or `--collector-ip-blocks` (an operator running outside the
cluster, whose traffic arrives from a node or host address). The chart passes its namespace and the operator
pods' selector labels. An empty identity (no labels, no blocks) writes no collector rule.

Invariants: the flag names live here only (main.py's parser adds them from `add_collector_args`); every value is
checked at start-up (label keys and values, CIDRs), so the policies the builders write never carry a selector
or block the API server refuses; CIDRs are written in canonical form (a bare address becomes a /32 or /128).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path

from tidepool.operator.api.kube import LABEL_VALUE_RE, is_label_key
from tidepool.operator.api.types import DNS_LABEL_RE
from tidepool.operator.builders.common import Collector
from tidepool.operator.credentials import SA_DIR

NAMESPACE_FLAG = "--collector-namespace"
POD_LABELS_FLAG = "--collector-pod-labels"
IP_BLOCKS_FLAG = "--collector-ip-blocks"


def add_collector_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics collector (the services' NetworkPolicies let it in)")
    group.add_argument(
        NAMESPACE_FLAG, default=None, help="namespace of the operator's pods; default $POD_NAMESPACE or the pod's own"
    )
    group.add_argument(
        POD_LABELS_FLAG, default="", help="k=v,k=v labels of the operator's pods (the chart's selector labels)"
    )
    group.add_argument(
        IP_BLOCKS_FLAG, default="", help="CIDR,CIDR the operator's traffic comes from when it runs outside the cluster"
    )


def own_namespace(env: Mapping[str, str], sa_dir: Path = SA_DIR) -> str | None:
    """The operator's namespace in a pod: $POD_NAMESPACE, else its ServiceAccount's namespace file; else None."""
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        return (sa_dir / "namespace").read_text().strip() or None
    except OSError:
        return None


def parse_labels(text: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k=v` -> sorted pairs; ValueError naming the flag for a malformed pair, key or value."""
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not is_label_key(key):
            raise ValueError(f"{POD_LABELS_FLAG}: {item!r} is not key=value with a label key (e.g. app=tidepool)")
        if len(value) > 63 or re.match(LABEL_VALUE_RE, value) is None:
            raise ValueError(f"{POD_LABELS_FLAG}: {value!r} is not a label value")
        pairs[key] = value
    return tuple(sorted(pairs.items()))


def parse_ip_blocks(text: str) -> tuple[str, ...]:
    """`CIDR,CIDR` -> canonical CIDRs; ValueError naming the flag for an invalid one."""
    blocks = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            blocks.append(str(ipaddress.ip_network(item, strict=True)))
        except ValueError as exc:
            raise ValueError(f"{IP_BLOCKS_FLAG}: {item!r} is not a CIDR ({exc})") from None
    return tuple(dict.fromkeys(blocks))


def collector_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None, sa_dir: Path = SA_DIR
) -> Collector:
    """The collector identity the flags give (`env`: default os.environ); ValueError naming the flag for a bad
    value."""
    labels = parse_labels(args.collector_pod_labels)
    namespace = args.collector_namespace or own_namespace(os.environ if env is None else env, sa_dir)
    if namespace and (len(namespace) > 63 or re.match(DNS_LABEL_RE, namespace) is None):
        raise ValueError(f"{NAMESPACE_FLAG}: {namespace!r} is not a namespace name")
    if labels and not namespace:
        raise ValueError(
            f"{POD_LABELS_FLAG} needs {NAMESPACE_FLAG}: the operator does not run in a pod "
            "(no $POD_NAMESPACE, no ServiceAccount namespace file)"
        )
    return Collector(namespace=namespace, pod_labels=labels, ip_blocks=parse_ip_blocks(args.collector_ip_blocks))
