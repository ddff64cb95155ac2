"""Serving benchmark for any OpenAI-compatible endpoint, with `vllm bench serve` definitions.

Load: a seeded random dataset (prompt and output lengths drawn uniformly in
len*(1 ± range_ratio), an optional shared prefix of fixed length at the front of every
prompt), sent to `/v1/completions` with `stream=true`, arrivals a gamma process of mean rate
`--request-rate` (burstiness 1 = Poisson; lower is burstier), at most `--max-concurrency`
requests in flight. Prompts go as token ids by default (exact lengths; Tidepool and vLLM
accept them), or as text (`--prompt-format text`: random ids decoded with the tokenizer, so
lengths are approximate, as in vLLM's random dataset).

Definitions (as vLLM's): TTFT = first streamed chunk - send; ITL = gaps between chunks;
TPOT = (E2EL - TTFT) / (output tokens - 1); E2EL = last byte - send; request throughput =
completed / duration; output throughput = output tokens / duration; goodput = completed
requests meeting every SLO in `--goodput` (ms) / duration. Writes JSON and a PNG of latency
CDFs; no torch and no Tidepool import, so it runs anywhere with httpx (and matplotlib for
the plot).

    python bench/serve.py --base-url http://127.0.0.1:8000 --tokenizer MODEL_DIR \\
        --num-prompts 40 --random-input-len 128 --random-output-len 32 --request-rate 1 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class Item:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def make_dataset(args: argparse.Namespace, vocab_size: int, tokenizer: Any | None) -> list[Item]:
    rng = random.Random(args.seed)
    first = args.first_token_id
    prefix = [rng.randrange(first, vocab_size) for _ in range(args.shared_prefix_len)]
    inputs = _lengths(rng, args.random_input_len, args.random_range_ratio, args.num_prompts)
    outputs = _lengths(rng, args.random_output_len, args.random_range_ratio, args.num_prompts)
    items = []
    for input_len, output_len in zip(inputs, outputs, strict=True):
        ids = prefix + [rng.randrange(first, vocab_size) for _ in range(input_len)]
        if args.prompt_format == "text":
            text = tokenizer.decode(ids)
            items.append(Item(text, len(tokenizer.encode(text).ids), output_len))
        else:
            items.append(Item(ids, len(ids), output_len))
    return items


def arrival_gaps(rng: np.random.Generator, rate: float, burstiness: float, count: int) -> list[float]:
    """Gamma inter-arrival times with mean 1/rate; shape=burstiness (1 is a Poisson process)."""
    if rate == float("inf"):
        return [0.0] * count
    return list(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count))


async def send(http: httpx.AsyncClient, url: str, model: str, item: Item, extra: dict[str, Any]) -> Result:
    body = {"model": model, "prompt": item.prompt, "max_tokens": item.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    result = Result(prompt_len=item.prompt_len)
    start = time.perf_counter()
    last = start
    num_chunks = 0
    try:
        async with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = str(chunk["error"])
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    num_chunks += 1
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.e2el = time.perf_counter() - start
        result.output_tokens = result.output_tokens or num_chunks
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = repr(err)
    return result


async def run(args: argparse.Namespace, items: list[Item]) -> tuple[list[Result], float]:
    url = args.base_url.rstrip("/") + args.endpoint
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as http:
        model = args.model or (await http.get(args.base_url.rstrip("/") + "/v1/models")).json()["data"][0]["id"]
        extra = {"ignore_eos": True} if args.ignore_eos else {}
        for item in items[: args.num_warmups]:
            await send(http, url, model, item, extra)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(items))
        gaps = arrival_gaps(np.random.default_rng(args.seed), args.request_rate, args.burstiness, len(items))

        async def limited(item: Item) -> Result:
            async with semaphore:
                return await send(http, url, model, item, extra)

        start = time.perf_counter()
        tasks = []
        for item, gap in zip(items, gaps, strict=True):
            tasks.append(asyncio.create_task(limited(item)))
            if gap > 0:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    ms = np.asarray(values) * 1000
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            **{f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles}}  # fmt: skip


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    slos = {k: float(v) for k, v in (part.split(":") for part in args.goodput)} if args.goodput else {}
    good = [
        r for r in ok
        if all((r.tpot or 0.0) * 1000 <= float(v) if k == "tpot" else getattr(r, k) * 1000 <= float(v)
               for k, v in slos.items())
    ]  # fmt: skip
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    pct = [float(p) for p in args.percentiles.split(",")]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "goodput": len(good) / duration if slos else None,
        "slos_ms": slos or None,
        "ttft_ms": _stats([r.ttft for r in ok], pct),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None], pct),
        "itl_ms": _stats([gap for r in ok for gap in r.itl], pct),
        "e2el_ms": _stats([r.e2el for r in ok], pct),
    }


def print_table(summary: dict[str, Any]) -> None:
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Benchmark duration (s)", summary["duration_s"]), ("Total input tokens", summary["total_input_tokens"]),
            ("Total generated tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", summary["request_throughput"]),
            ("Output token throughput (tok/s)", summary["output_throughput"]),
            ("Total token throughput (tok/s)", summary["total_token_throughput"])]  # fmt: skip
    if summary["goodput"] is not None:
        rows.append((f"Request goodput (req/s) {summary['slos_ms']}", summary["goodput"]))
    for name, value in rows:
        print(f"{name:<40} {value:>12.2f}" if isinstance(value, float) else f"{name:<40} {value:>12}")
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat, value in summary[f"{metric}_ms"].items():
            print(f"{stat.capitalize() + ' ' + metric.upper() + ' (ms)':<40} {value:>12.2f}")
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ")


def plot_cdfs(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [g for r in ok for g in r.itl], "E2EL": [r.e2el for r in ok]}  # fmt: skip
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            ms = np.sort(np.asarray(values) * 1000)
            ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms))
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model id; default: the first of /v1/models")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (vocab size, text prompts)")
    p.add_argument("--vocab-size", type=int, default=None, help="without --tokenizer: draw ids below this")
    p.add_argument("--first-token-id", type=int, default=3, help="skip the lowest ids (special tokens)")
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens shared by every prompt, at the front")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs in ms, e.g. ttft:500 tpot:100 e2el:5000")
    p.add_argument("--percentiles", default="99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--label", default="serve", help="names the result files")
    p.add_argument("--result-dir", type=Path, default=RESULTS)
    args = p.parse_args()

    tokenizer = None
    if args.tokenizer:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    vocab_size = args.vocab_size or (tokenizer.get_vocab_size() if tokenizer else None)
    if vocab_size is None:
        p.error("give --tokenizer or --vocab-size")
    items = make_dataset(args, vocab_size, tokenizer)
    results, duration = asyncio.run(run(args, items))
    summary = summarize(results, duration, args)
    print_table(summary)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record = {"config": config, "summary": summary, "requests": [asdict(r) for r in results]}
    json_path = args.result_dir / f"{args.label}.json"
    json_path.write_text(json.dumps(record, indent=1))
    png_path = args.result_dir / f"{args.label}.png"
    plot_cdfs(results, png_path, f"{args.label}: {summary['completed']} requests, {duration:.0f} s")
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
