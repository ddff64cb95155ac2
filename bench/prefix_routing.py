"""Prefix-aware vs round-robin routing: prefix-cache hit rate and TTFT with N local replicas behind `tidepool router`.

Workload: `--groups` prompt families, each a shared text prefix of `--prefix-chars` characters
(a "system prompt" or document) followed by a unique question of `--question-chars`; every
family gets `--requests-per-group` requests, sent in a seeded shuffled order with at most
`--concurrency` in flight, streamed, `--max-tokens` output tokens (prefill dominates).
Each policy gets its own, freshly drawn families (same sizes), so no run profits from the
cache another one left behind; the replicas stay up between runs (warmed up once).

Measured per policy: the prefix-cache hit rate over the run (sum over replicas of the
engines' `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` deltas, in
tokens), client-side TTFT (send -> first streamed event; mean, median, p90, p99), duration,
and requests per replica (the router's `x-tidepool-replica` header). Each replica's KV
cache is `--num-kv-blocks` blocks: by default enough for about a quarter of the families'
prefixes, the regime where routing matters (round-robin makes every replica hold every family).

    nice -n 19 python bench/prefix_routing.py --preset small --replicas 4

Writes bench/results/<label>.json and bench/results/<label>.png (TTFT CDFs, hit rates).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from procs import free_port, spawn, stop, wait_ready

from common import bench_model

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = [
    "alpha",
    "river",
    "stone",
    "cloud",
    "market",
    "signal",
    "harbor",
    "winter",
    "copper",
    "garden",
    "lantern",
    "engine",
    "meadow",
    "orbit",
    "pixel",
    "quartz",
    "saddle",
    "timber",
    "velvet",
    "willow",
    "yonder",
    "zephyr",
    "basin",
    "cedar",
    "delta",
    "ember",
]


@dataclass(slots=True)
class Result:
    group: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2el: float = 0.0
    replica: str = ""


def text(rng: random.Random, num_chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < num_chars:
        words.append(rng.choice(WORDS) + str(rng.randrange(100)))
    return " ".join(words)[:num_chars]


def workload(args: argparse.Namespace, seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    prefixes = [text(rng, args.prefix_chars) for _ in range(args.groups)]
    items = [
        (g, f"{prefixes[g]}\nQuestion {i}: {text(rng, args.question_chars)}?")
        for g in range(args.groups)
        for i in range(args.requests_per_group)
    ]
    rng.shuffle(items)
    return items


def prefix_counters(urls: list[str]) -> dict[str, float]:
    totals = {"queries": 0.0, "hits": 0.0}
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            for name in totals:
                if line.startswith(f"vllm:prefix_cache_{name}_total"):
                    totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


async def send(http: httpx.AsyncClient, url: str, group: int, prompt: str, max_tokens: int) -> Result:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    result = Result(group)
    start = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            result.replica = resp.headers.get("x-tidepool-replica", "")
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]" and result.ttft == 0.0:
                    result.ttft = time.perf_counter() - start
        result.e2el = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError as err:
        result.error = repr(err)
    return result


async def run(url: str, items: list[tuple[int, str]], args: argparse.Namespace) -> tuple[list[Result], float]:
    semaphore = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as http:

        async def limited(group: int, prompt: str) -> Result:
            async with semaphore:
                return await send(http, url, group, prompt, args.max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(g, p) for g, p in items))
        return list(results), time.perf_counter() - start


def ms_stats(values: list[float]) -> dict[str, float]:
    ms = np.asarray(values) * 1000 if values else np.zeros(1)
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def measure(args: argparse.Namespace, policy: str, seed: int, engine_urls: list[str], log_dir: Path) -> dict[str, Any]:
    port = free_port()
    flags = [f for url in engine_urls for f in ("--unified-url", url)]
    log = log_dir / f"router-{policy}.log"
    router = spawn(["router", *flags, "--policy", policy, "--health-interval", "0.5"], port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, router, log)
        while sum(r["state"] == "ready" for r in httpx.get(f"{url}/debug/replicas").json()["unified"]) < len(
            engine_urls
        ):
            time.sleep(0.2)
        items = workload(args, seed)
        before = prefix_counters(engine_urls)
        results, duration = asyncio.run(run(url, items, args))
        after = prefix_counters(engine_urls)
    finally:
        stop(router)
    ok = [r for r in results if r.ok]
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    per_replica: dict[str, int] = {}
    groups_per_replica: dict[str, set[int]] = {}
    for r in ok:
        per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
        groups_per_replica.setdefault(r.replica, set()).add(r.group)
    return {
        "policy": policy,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_queries_tokens": queries,
        "prefix_cache_hits_tokens": hits,
        "ttft_ms": ms_stats([r.ttft for r in ok]),
        "e2el_ms": ms_stats([r.e2el for r in ok]),
        "requests_per_replica": dict(sorted(per_replica.items())),
        "families_per_replica": {k: len(v) for k, v in sorted(groups_per_replica.items())},
        "requests": [asdict(r) for r in results],
    }


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2, 1]})
    for run_ in runs:
        ttfts = np.sort([r["ttft"] * 1000 for r in run_["requests"] if r["ok"]])
        cdf.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), label=run_["policy"])
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms, log scale)")
    cdf.set_ylabel("CDF")
    cdf.grid(alpha=0.3)
    cdf.legend()
    names = [r["policy"] for r in runs]
    rates = [r["prefix_cache_hit_rate"] for r in runs]
    bars.bar(names, rates, color=["tab:blue", "tab:orange", "tab:green"][: len(runs)])
    bars.set_ylim(0, 1)
    bars.set_ylabel("prefix-cache hit rate (tokens)")
    for i, rate in enumerate(rates):
        bars.text(i, rate + 0.02, f"{rate:.2f}", ha="center")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=["tiny", "small", "smollm-135m"])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--groups", type=int, default=12, help="prompt families (distinct shared prefixes)")
    p.add_argument("--requests-per-group", type=int, default=8)
    p.add_argument("--prefix-chars", type=int, default=1000)
    p.add_argument("--question-chars", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=192, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--policies", nargs="+", default=["round-robin", "prefix-aware"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="prefix_routing")
    p.add_argument("--result-dir", type=Path, default=RESULTS)
    args = p.parse_args()

    model = bench_model("llama", args.preset)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"prefix_routing_logs_{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(args.replicas)]
    engine_args = [
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        "bench",
        "--num-kv-blocks",
        str(args.num_kv_blocks),
    ]
    logs = [log_dir / f"engine-{port}.log" for port in ports]
    engines = [spawn(engine_args, port, log) for port, log in zip(ports, logs, strict=True)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url, proc, log in zip(urls, engines, logs, strict=True):
            wait_ready(url, proc, log)
        for url in urls:  # warm-up: first-request costs (allocations, lazy init) out of the measurement
            httpx.post(f"{url}/v1/completions", json={"prompt": "warm up " * 50, "max_tokens": 2}, timeout=300)
        runs = []
        for index, policy in enumerate(args.policies):
            print(f"measuring {policy} ...", flush=True)
            runs.append(measure(args, policy, args.seed * 1000 + index + 1, urls, log_dir))
    finally:
        for proc in engines:
            stop(proc)
    print(
        f"{'policy':<14} {'hit rate':>9} {'TTFT median':>12} {'TTFT p90':>10} {'TTFT mean':>10} {'duration':>9}",
        " per replica",
    )
    for r in runs:
        t = r["ttft_ms"]
        print(
            f"{r['policy']:<14} {r['prefix_cache_hit_rate']:>9.3f} {t['median']:>10.1f}ms {t['p90']:>8.1f}ms "
            f"{t['mean']:>8.1f}ms {r['duration_s']:>8.1f}s  {list(r['requests_per_replica'].values())}"
        )
    by_policy = {r["policy"]: r for r in runs}
    ratios = {}
    if {"round-robin", "prefix-aware"} <= by_policy.keys():
        rr, pa = by_policy["round-robin"], by_policy["prefix-aware"]
        ratios = {
            f"ttft_{s}_round_robin_over_prefix_aware": rr["ttft_ms"][s] / pa["ttft_ms"][s]
            for s in ("mean", "median", "p90")
        }
        ratios["duration_round_robin_over_prefix_aware"] = rr["duration_s"] / pa["duration_s"]
        print("ratios:", json.dumps(ratios, indent=1))
    args.result_dir.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record = {"config": config, "ratios": ratios, "runs": runs, "command": " ".join(sys.argv)}
    json_path = args.result_dir / f"{args.label}.json"
    json_path.write_text(json.dumps(record, indent=1))
    png_path = args.result_dir / f"{args.label}.png"
    title = (
        f"{args.replicas} replicas ({args.preset}), {args.groups} prefix families x {args.requests_per_group} "
        f"requests, {args.num_kv_blocks} KV blocks/replica"
    )
    plot(runs, png_path, title)
    print(f"wrote {json_path} and {png_path} (logs in {log_dir})")


if __name__ == "__main__":
    main()
