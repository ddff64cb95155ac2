"""The collector against real `tidepool serve` processes under load from bench/serve.py.

Two tiny-model servers stand for two ready pods of a pool (the pod cache faked, the HTTP is real).
Checks: the window counts exactly the requests of the last load phase (bucket deltas, not lifetime
totals), the ITL histogram counts every streamed token gap, the p95s are consistent with the
client-side measurements of bench/serve.py, and KV usage / running requests show up while loaded:
the engines are held (tests/server/controlled_serve.py) with every request mid-generation, so the
scrape sees them loaded on a fast or a slow machine alike.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tidepool.operator.autoscaler.collector import Collector, PodsSource, snapshots
from tidepool.operator.cache import PodInfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serve_proc import MODEL_NAME, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS, OUTPUT_LEN = 6, 12


def fake_pods(ports: list[int]) -> tuple[list[PodInfo], dict[str, int]]:
    """Ready pods of `svc`'s unified pool, one per server, and each one's port (all on 127.0.0.1)."""
    pods = [PodInfo(f"pod-{i}", "unified", "h", None, 0, True, False, "127.0.0.1", ()) for i in range(len(ports))]
    return pods, {p.name: port for p, port in zip(pods, ports, strict=True)}


def load(url: str, model: Path, out: Path, label: str, input_len: int) -> dict:
    cmd = [
        sys.executable, str(REPO / "bench" / "serve.py"), "--base-url", url, "--tokenizer", str(model),
        "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(input_len), "--random-output-len", str(OUTPUT_LEN),
        "--max-concurrency", "3", "--label", label, "--result-dir", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=out, capture_output=True, timeout=300)
    return json.loads((out / f"{label}.json").read_text())


def stream(url: str) -> None:
    """One streamed completion, read to its end."""
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            pass


def test_collector_windows_on_real_servers(tiny_model_dir: Path, tmp_path: Path):
    controls = [tmp_path / f"control-{i}" for i in range(2)]
    for control in controls:
        control.mkdir()
    servers = [start_server(tiny_model_dir, tmp_path, control_dir=control) for control in controls]
    try:
        asyncio.run(_run(servers, tiny_model_dir, tmp_path))
    finally:
        for server in servers:
            server.stop()


async def _run(servers, model: Path, tmp_path: Path) -> None:
    async with httpx.AsyncClient() as http:
        pods, ports = fake_pods([s.port for s in servers])
        source = PodsSource(lambda ns, name: pods, http, timeout_s=10, port_of=lambda pod: ports[pod.name])
        collector = Collector(source, 3600)
        windows: dict = {}  # the service's own (AutoscaleState.windows in the operator)
        pools = ("unified",)
        # Phase 1 (lifetime history the window must not count), then a baseline scrape.
        await asyncio.to_thread(lambda: [load(s.url, model, tmp_path, f"p1-{i}", 16) for i, s in enumerate(servers)])
        await collector.collect(windows, "ns", "svc", pools, now=0.0)
        # Phase 2 on both servers at once.
        results: dict[int, dict] = {}

        def phase2(i: int, url: str) -> None:
            results[i] = load(url, model, tmp_path, f"p2-{i}", 96)

        threads = [threading.Thread(target=phase2, args=(i, s.url)) for i, s in enumerate(servers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        await collector.collect(windows, "ns", "svc", pools, now=1.0)
        snap = snapshots(windows, pools)["unified"]
        assert snap.num_pods_scraped == 2 and snap.num_pods_failed == 0
        assert snap.num_requests == 2 * NUM_PROMPTS  # phase 2 only: deltas, not lifetime counts
        assert snap.kv_cache_usage == 0.0 and snap.num_running == 0  # idle again

        # Loaded: two streams per server, held mid-generation while the collector scrapes.
        for server in servers:
            server.hold()
        streams = [threading.Thread(target=stream, args=(server.url,)) for server in servers for _ in range(2)]
        for thread in streams:
            thread.start()
        deadline = time.monotonic() + 120
        while any(server.num_held() != 2 for server in servers):
            assert time.monotonic() < deadline, "the engines never held both of their requests"
            await asyncio.sleep(0.05)
        await collector.collect(windows, "ns", "svc", pools, now=2.0)
        loaded = snapshots(windows, pools)["unified"]
        for server in servers:
            server.hold(False)
        for thread in streams:
            thread.join(120)
        assert loaded.kv_cache_usage is not None and loaded.kv_cache_usage > 0.0
        assert loaded.num_running == len(streams)  # summed over both pods
    client_ttfts = sorted(r["ttft"] for res in results.values() for r in res["requests"] if r["ok"])
    client_p95 = client_ttfts[math.ceil(0.95 * len(client_ttfts)) - 1]
    # Server-side TTFT excludes the client's HTTP overhead; the histogram can only place it in a bucket. No
    # lower bound from the client's times: on a fast engine that overhead can be most of what the client sees.
    assert 0.0 < snap.ttft_p95_s <= max(client_ttfts) * 2.5 + 0.1, (snap.ttft_p95_s, client_ttfts, client_p95)
    client_itls = sorted(x for res in results.values() for r in res["requests"] for x in r["itl"])
    assert snap.itl_p95_s is not None and 0.0 < snap.itl_p95_s <= max(client_itls) * 2.5 + 0.05
