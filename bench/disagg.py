"""Prefill/decode disaggregation vs unified serving at equal process count, behind `tidepool router`.

Two engine processes either way: unified = 2 unified replicas (router least-load); disaggregated =
1 prefill + 1 decode replica (the router hands the KV over, see engine/server/disagg.py). Each
engine process gets one OpenMP thread so both setups use the same CPU. The load mixes long-prompt
requests (summarise-this-document: long input, short output) with chat turns (short input,
longer output), Poisson arrivals; metrics and goodput use `bench/serve.py`'s definitions
(vLLM's): TTFT, TPOT, ITL and requests meeting every SLO per second. Prints one table per setup
and the ratios, writes JSON + a PNG of the latency CDFs.

    python bench/disagg.py --model ~/.cache/tidepool/models/demo-llama-small --num-requests 60 --request-rate 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as serve_bench  # bench/serve.py: load generator and vLLM metric definitions
from procs import free_port, spawn, stop, wait_ready

RESULTS = Path(__file__).resolve().parent / "results"


@contextmanager
def processes(specs: list[tuple[str, list[str], int]], log_dir: Path) -> Iterator[None]:
    """Start `tidepool <args>` processes (name, args, http port), wait until all are ready, stop them after."""
    started: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for name, args, port in specs:
            log = log_dir / f"{name}.log"
            started.append((f"http://127.0.0.1:{port}", spawn(args, port, log), log))
        for url, proc, log in started:
            wait_ready(url, proc, log)
        yield
    finally:
        for _, proc, _ in started:
            stop(proc)


def _engine(model: str, *flags: str) -> list[str]:
    return ["serve", "--model", model, "--served-model-name", "bench", *flags]


def setups(model: str) -> dict[str, list[tuple[str, list[str], int]]]:
    a, b, router, kv = free_port(), free_port(), free_port(), free_port()
    route = ["router"]
    route_unified = [*route, "--policy", "least-load", "--unified-url", f"http://127.0.0.1:{a}"]
    route_unified += ["--unified-url", f"http://127.0.0.1:{b}"]
    route_disagg = [*route, "--policy", "least-load", "--prefill-url", f"http://127.0.0.1:{a}"]
    route_disagg += ["--decode-url", f"http://127.0.0.1:{b},kv=127.0.0.1:{kv}"]
    unified = [
        ("unified-0", _engine(model), a),
        ("unified-1", _engine(model), b),
        ("router-unified", route_unified, router),
    ]
    disagg = [
        ("prefill", _engine(model, "--role", "prefill"), a),
        ("decode", _engine(model, "--role", "decode", "--kv-port", str(kv)), b),
        ("router-disagg", route_disagg, router),
    ]
    return {"unified": unified, "disaggregated": disagg}


def workload(args: argparse.Namespace, vocab_size: int) -> list[serve_bench.Item]:
    """Long-prompt and chat requests, shuffled with a fixed seed; prompts are token ids (exact lengths)."""
    rng = random.Random(args.seed)
    items = []
    for i in range(args.num_requests):
        is_long = i < round(args.num_requests * args.long_fraction)
        n_in, n_out = (args.long_input, args.long_output) if is_long else (args.chat_input, args.chat_output)
        prompt = [rng.randrange(3, vocab_size) for _ in range(n_in)]
        items.append(serve_bench.Item(prompt=prompt, prompt_len=n_in, output_len=n_out))
    rng.shuffle(items)
    return items


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--long-fraction", type=float, default=0.3)
    p.add_argument("--long-input", type=int, default=1024)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--chat-input", type=int, default=64)
    p.add_argument("--chat-output", type=int, default=48)
    p.add_argument("--slo", nargs="*", default=["ttft:3000", "tpot:150"], help="SLOs in ms (ttft, tpot, e2el)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="disagg")
    p.add_argument("--result-dir", type=Path, default=RESULTS)
    args = p.parse_args()
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    items = workload(args, vocab_size)
    summaries: dict[str, Any] = {}
    all_results: dict[str, list[serve_bench.Result]] = {}
    with tempfile.TemporaryDirectory(prefix="tidepool-disagg-") as tmp:
        for name, specs in setups(str(Path(args.model).expanduser())).items():
            router_port = specs[-1][2]
            with processes(specs, Path(tmp)):
                bench_args = argparse.Namespace(
                    base_url=f"http://127.0.0.1:{router_port}", endpoint="/v1/completions", model="bench",
                    num_warmups=2, ignore_eos=True, max_concurrency=None, request_rate=args.request_rate,
                    burstiness=1.0, seed=args.seed, timeout=600.0, goodput=args.slo, percentiles="50,99",
                )  # fmt: skip
                print(f"== {name}: {len(items)} requests at {args.request_rate} req/s", flush=True)
                results, duration = asyncio.run(serve_bench.run(bench_args, items))
            summaries[name] = serve_bench.summarize(results, duration, bench_args)
            all_results[name] = results
            serve_bench.print_table(summaries[name])
    uni, dis = summaries["unified"], summaries["disaggregated"]
    ratios = {
        "goodput": (dis["goodput"] or 0) / uni["goodput"] if uni["goodput"] else float("inf"),
        "ttft_p99": dis["ttft_ms"]["p99"] / uni["ttft_ms"]["p99"] if uni["ttft_ms"]["p99"] else None,
        "itl_p99": dis["itl_ms"]["p99"] / uni["itl_ms"]["p99"] if uni["itl_ms"]["p99"] else None,
    }
    print(f"\n{'':<28}{'unified (2)':>14}{'1P + 1D':>14}{'ratio':>10}")
    for label, key, stat in (("TTFT p99 (ms)", "ttft_ms", "p99"), ("ITL p99 (ms)", "itl_ms", "p99"),
                             ("TPOT p99 (ms)", "tpot_ms", "p99")):  # fmt: skip
        u, d = uni[key][stat], dis[key][stat]
        print(f"{label:<28}{u:>14.1f}{d:>14.1f}{(d / u if u else float('nan')):>10.2f}")
    print(f"{'goodput (req/s) ' + ' '.join(args.slo):<28}{uni['goodput']:>14.3f}{dis['goodput']:>14.3f}"
          f"{ratios['goodput']:>10.2f}")  # fmt: skip
    args.result_dir.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record = {"config": config, "summaries": summaries, "ratios": ratios}
    (args.result_dir / f"{args.label}.json").write_text(json.dumps(record, indent=1))
    for name, results in all_results.items():
        serve_bench.plot_cdfs(results, args.result_dir / f"{args.label}-{name}.png", f"{args.label}: {name}")
    print(f"wrote {args.result_dir / (args.label + '.json')} and the CDF plots")


if __name__ == "__main__":
    main()
