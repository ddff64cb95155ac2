"""Online vs offline in one run: what does the HTTP path cost the engine?

Measures, in one invocation, for one model and one engine configuration, in ONE server process
(bench/serve_inprocess.py: this VM's memory bandwidth differs by 10-25% between processes, so an
offline step timed in another process would compare placements, not the serving path):
1. offline: the engine `tidepool serve` builds, stepped directly (`LLMEngine.step()`): the prefill
   of a lone `--input-len` prompt (add to first token), the decode step of a lone sequence
   (median gap between its tokens), and for every concurrency level B > 1 the output throughput
   of B requests given at once (B x (`--input-len` + `--output-len`));
2. online: the same engine served over HTTP, driven by guidellm (vLLM's benchmark client,
   bench/guidellm_client.py) at each concurrency level in turn, streaming `/v1/completions`
   (`--endpoint /v1/chat/completions` for chat), prompts of `--input-len` tokens of English text
   from a file made beforehand and exactly `--output-len` output tokens. Beside guidellm's
   figures: the server's own mean TTFT/ITL (its vLLM histograms), and CPU time per output token of
   the server's event-loop thread (HTTP, SSE), of its other threads (engine, OpenMP workers), and
   of the client (including guidellm's start-up, shown on its own too), from /proc and getrusage.

Reported against the serving-path targets: at concurrency 1, ITL p50 / offline decode step
(<= 1.1) and TTFT p50 - offline prefill (<= 20 ms); at 16, online output tok/s / offline tok/s at
batch 16 (>= 0.9). The client runs on the same cores as the server, so its CPU is part of what the
online figures pay (see the client column). Prints a table, writes JSON and a PNG under
bench/results/serve_latency/ (`--out`).

    python bench/serve_latency.py --model ~/.cache/tidepool/models/SmolLM2-135M-Instruct.Q4_1-f32
    python bench/serve_latency.py --model smollm2-135m-instruct --tokenizer <a folder with its tokenizer.json>
    python bench/serve_latency.py --quick      # a smoke run on the tiny random preset
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import procs
import serve as minimal
from guidellm_client import ClientResult, make_dataset, run_level

CLIENTS = ("guidellm", "minimal")

RESULTS = Path(__file__).resolve().parent / "results" / "serve_latency"


# ---- online ---------------------------------------------------------------------------------------
def thread_cpu_s(pid: int) -> dict[int, float]:
    """User + system CPU seconds of every thread of `pid` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    result = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        result[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return result


SERVER_HISTOGRAMS = {  # the server's own view, from its vLLM-named histograms (sum/count deltas)
    "ttft_ms": "vllm:time_to_first_token_seconds",
    "itl_ms": "vllm:inter_token_latency_seconds",
    "queue_ms": "vllm:request_queue_time_seconds",
    "prefill_ms": "vllm:request_prefill_time_seconds",
}


def histogram_totals(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in SERVER_HISTOGRAMS, read from the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals = {}
    for key, name in SERVER_HISTOGRAMS.items():
        found = [re.search(rf"^{re.escape(name)}_{part}{{[^}}]*}} (\S+)$", text, re.M) for part in ("sum", "count")]
        totals[key] = (float(found[0].group(1)), float(found[1].group(1))) if all(found) else (0.0, 0.0)
    return totals


def cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def minimal_level(url: str, dataset: Path, concurrency: int, num_requests: int, endpoint: str) -> ClientResult:
    """The same level driven by bench/serve.py's client (httpx, vLLM's definitions), in this process."""
    rows = [json.loads(line) for line in dataset.read_text().splitlines()][:num_requests]
    items = [minimal.Item(r["prompt"], r["prompt_tokens_count"], r["output_tokens_count"]) for r in rows]
    args = argparse.Namespace(base_url=url, endpoint=endpoint, timeout=600.0, model="bench", ignore_eos=True,
                              num_warmups=0, max_concurrency=concurrency, seed=0, request_rate=float("inf"),
                              burstiness=1.0, goodput=None, percentiles="90")  # fmt: skip
    results, duration = asyncio.run(minimal.run(args, items))
    summary = minimal.summarize(results, duration, args)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed at concurrency {concurrency}: {summary['errors']}")
    itl, ttft, tpot = summary["itl_ms"], summary["ttft_ms"], summary["tpot_ms"]
    return ClientResult(concurrency, summary["completed"], summary["total_output_tokens"], duration,
                        summary["output_throughput"], itl["median"], itl["p90"], ttft["median"], ttft["p90"],
                        tpot["median"])  # fmt: skip


def start_server(
    args: argparse.Namespace, levels: list[int], out: Path, cycles: int = 1
) -> tuple[subprocess.Popen[bytes], str, dict]:
    """bench/serve_inprocess.py: the offline figures of the engine it then serves, and its URL once ready."""
    port = procs.free_port()
    log, offline_json = out / "server.log", out / "offline.json"
    offline_json.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).with_name("serve_inprocess.py")), "--offline-json", str(offline_json),
           "--levels", ",".join(map(str, levels)), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--repeats", str(args.repeats), "--cycles", str(cycles),
           "--", "--model", args.model, "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
           *args.serve_flags]  # fmt: skip
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd="/tmp",
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    procs.wait_ready(url, proc, log, timeout=1800)  # the offline measurements come first
    return proc, url, json.loads(offline_json.read_text())


def online(args: argparse.Namespace, levels: list[int], out: Path) -> tuple[dict, list[dict]]:
    proc, url, off = start_server(args, levels, out)
    print(f"  offline: prefill {off['prefill_ms']:.1f} ms, decode step {off['decode_step_ms']:.2f} ms; "
          + ", ".join(f"batch {b}: {v['output_tok_s']:.1f} tok/s" for b, v in off["batches"].items()),
          flush=True)  # fmt: skip
    rows = []
    tokenizer = Path(args.tokenizer or args.model)
    counts = [max(args.min_requests, args.requests_per_stream * level) for level in levels]
    log = out / "guidellm.log"
    log.unlink(missing_ok=True)

    # Every run gets prompts of its own (distinct places in the text), so none hits the prefix cache of an earlier one.
    pool = make_dataset(tokenizer, args.input_len, args.output_len, 2 + len(args.clients.split(",")) * sum(counts),
                        out / "prompts.jsonl").read_text().splitlines(keepends=True)  # fmt: skip

    def prompts(name: str, count: int) -> Path:
        path = out / f"prompts-{name}.jsonl"
        path.write_text("".join(pool[:count]))
        del pool[:count]
        return path

    try:
        # Two requests first: warm the server's HTTP path, and show guidellm's own start-up CPU, which every
        # guidellm level's client CPU below includes once.
        client_before = cpu_s(resource.RUSAGE_CHILDREN)
        run_level(url, "bench", tokenizer, 1, 2, prompts("warm-up", 2), args.endpoint, out, log)  # guidellm: 2+
        off["client_startup_cpu_s"] = cpu_s(resource.RUSAGE_CHILDREN) - client_before
        for level, num_requests in zip(levels, counts, strict=True):
            for client in args.clients.split(","):
                dataset = prompts(f"{client}-c{level}", num_requests)
                rows.append(measure_level(proc.pid, url, client, level, num_requests, dataset, tokenizer, args, log))
    except BaseException:
        print(f"server log: {out / 'server.log'}", file=sys.stderr)
        raise
    finally:
        procs.stop(proc, timeout=300)  # it drains, stops, then times the lone sequence again: give it minutes
    after = json.loads((out / "offline.json").read_text()).get("after")
    if after is not None:  # the lone sequence timed again once the server stopped (see serve_inprocess.py)
        off["after"] = after
        print(f"  offline after: prefill {after['prefill_ms']:.1f} ms, decode step {after['decode_step_ms']:.2f} ms")
    return off, rows


def measure_level(
    pid: int, url: str, client: str, level: int, num_requests: int, dataset: Path, tokenizer: Path,
    args: argparse.Namespace, log: Path,
) -> dict:  # fmt: skip
    """One concurrency level with one client: the client's figures, the server's own, and CPU per output token."""
    who = resource.RUSAGE_CHILDREN if client == "guidellm" else resource.RUSAGE_SELF
    before, hist_before, client_before = thread_cpu_s(pid), histogram_totals(url), cpu_s(who)
    if client == "guidellm":
        res = run_level(url, "bench", tokenizer, level, num_requests, dataset, args.endpoint, args.out, log,
                        args.client_nice)  # fmt: skip
    else:
        res = minimal_level(url, dataset, level, num_requests, args.endpoint)
    after, hist_after, client_after = thread_cpu_s(pid), histogram_totals(url), cpu_s(who)
    loop_s = after.get(pid, 0.0) - before.get(pid, 0.0)
    other_s = sum(v - before.get(t, 0.0) for t, v in after.items() if t != pid)
    row = {"client": client, **asdict(res)}
    per_token = 1000 / res.output_tokens
    row["cpu_ms_per_token"] = {"server_event_loop": loop_s * per_token, "server_other": other_s * per_token,
                               "client": (client_after - client_before) * per_token}  # fmt: skip
    row["server_mean_ms"] = {}
    for key in SERVER_HISTOGRAMS:
        (sum_0, count_0), (sum_1, count_1) = hist_before[key], hist_after[key]
        row["server_mean_ms"][key] = 1000 * (sum_1 - sum_0) / max(1.0, count_1 - count_0)
    print(f"  online c={level} ({client}): {res.output_tok_s:.1f} tok/s, ITL p50 {res.itl_p50_ms:.1f} ms, "
          f"TTFT p50 {res.ttft_p50_ms:.0f} ms", flush=True)  # fmt: skip
    return row


def alternate(args: argparse.Namespace, out: Path) -> dict:
    """Concurrency 1 only, in `--alternate` serving periods of one process, each between two offline timings of a
    lone sequence: each period's ITL and TTFT against the mean of the two timings around it, so the VM's
    bandwidth drift (which moves the offline step by 10% within minutes) cancels instead of deciding the ratio."""
    proc, url, off = start_server(args, [1], out, cycles=args.alternate)
    clients = args.clients.split(",")
    count = max(args.min_requests, args.requests_per_stream)
    tokenizer = Path(args.tokenizer or args.model)
    total = args.alternate * len(clients) * count
    pool = make_dataset(tokenizer, args.input_len, args.output_len, total, out / "prompts.jsonl").read_text()
    pool = pool.splitlines(keepends=True)
    rows = []
    try:
        for cycle in range(args.alternate):
            if cycle:
                procs.wait_ready(url, proc, out / "server.log", timeout=600)
            for client in clients:
                dataset = out / f"prompts-{client}-cycle{cycle}.jsonl"
                dataset.write_text("".join(pool[:count]))
                del pool[:count]
                row = measure_level(proc.pid, url, client, 1, count, dataset, tokenizer, args, out / "guidellm.log")
                rows.append({**row, "cycle": cycle})
            proc.send_signal(signal.SIGTERM)  # drains and stops; the process times a lone sequence, then serves again
            while True:
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code != 200:
                        break
                except httpx.HTTPError:
                    break
                time.sleep(0.2)
        proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
    off = json.loads((out / "offline.json").read_text())
    lone = [off["decode_step_ms"], *(r["decode_step_ms"] for r in off["rounds"])]
    prefill = [off["prefill_ms"], *(r["prefill_ms"] for r in off["rounds"])]
    for row in rows:
        i = row["cycle"]
        row["offline_step_ms"] = (lone[i] + lone[i + 1]) / 2
        row["offline_prefill_ms"] = (prefill[i] + prefill[i + 1]) / 2
        row["itl_over_step"] = row["itl_p50_ms"] / row["offline_step_ms"]
        row["ttft_minus_prefill_ms"] = row["ttft_p50_ms"] - row["offline_prefill_ms"]
    summary = {}
    for client in clients:
        mine = [r for r in rows if r["client"] == client]
        summary[client] = {
            "itl_over_step_median": statistics.median(r["itl_over_step"] for r in mine),
            "ttft_minus_prefill_median_ms": statistics.median(r["ttft_minus_prefill_ms"] for r in mine),
        }
    print(f"{'cycle':>5} {'client':>8} {'ITL p50':>8} {'offline step':>13} {'ratio':>6} {'TTFT p50':>9} {'prefill':>8}")
    for r in rows:
        print(f"{r['cycle']:>5} {r['client']:>8} {r['itl_p50_ms']:>8.2f} {r['offline_step_ms']:>13.2f} "
              f"{r['itl_over_step']:>6.3f} {r['ttft_p50_ms']:>9.1f} {r['offline_prefill_ms']:>8.1f}")  # fmt: skip
    print("lone-sequence steps (ms), in order:", ", ".join(f"{v:.2f}" for v in lone))
    print("medians:", json.dumps({c: {k: round(v, 3) for k, v in m.items()} for c, m in summary.items()}))
    return {"model": args.model, "mode": "alternate", "cycles": args.alternate, "offline": off, "online": rows,
            "summary": summary, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip


# ---- report ---------------------------------------------------------------------------------------
def verdicts(off: dict, rows: list[dict]) -> dict:
    """Per client: c=1 ITL p50 / offline decode step, c=1 TTFT p50 - offline prefill, and online / offline tok/s."""
    result: dict = {}
    for row in rows:
        mine = result.setdefault(row["client"], {})
        level = row["concurrency"]
        if level == 1:
            mine["c1_itl_over_step"] = row["itl_p50_ms"] / off["decode_step_ms"]
            mine["c1_ttft_minus_prefill_ms"] = row["ttft_p50_ms"] - off["prefill_ms"]
            if "after" in off:  # the same against the step timed after the online runs
                mine["c1_itl_over_step_after"] = row["itl_p50_ms"] / off["after"]["decode_step_ms"]
                mine["c1_ttft_minus_prefill_after_ms"] = row["ttft_p50_ms"] - off["after"]["prefill_ms"]
        batch = off["batches"].get(str(level))
        if batch:
            mine[f"c{level}_tok_s_over_offline"] = row["output_tok_s"] / batch["output_tok_s"]
    return result


def plot(off: dict, rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["concurrency"] for r in rows})
    clients = list(dict.fromkeys(r["client"] for r in rows))
    width = 0.8 / (len(clients) + 1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.bar([i for i in range(len(levels))], [off["batches"][str(c)]["output_tok_s"] for c in levels], width,
            label="offline (same process)")  # fmt: skip
    ax2.plot(levels, [off["batches"][str(c)]["decode_step_ms"] for c in levels], "s--", label="offline decode step")
    for k, client in enumerate(clients, start=1):
        mine = {r["concurrency"]: r for r in rows if r["client"] == client}
        ax1.bar([i + k * width for i in range(len(levels))], [mine[c]["output_tok_s"] for c in levels], width,
                label=f"online, {client} client")  # fmt: skip
        ax2.plot(levels, [mine[c]["itl_p50_ms"] for c in levels], "o-", label=f"online ITL p50, {client}")
    ax1.set_xticks([i + width * len(clients) / 2 for i in range(len(levels))], [str(c) for c in levels])
    ax1.set_xlabel("concurrency (offline: batch)")
    ax1.set_ylabel("output tokens / s")
    ax1.legend(fontsize=8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("ms")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(off: dict, rows: list[dict]) -> None:
    print(f"{'client':>8} {'conc':>4} {'online tok/s':>12} {'offline':>8} {'ratio':>6} {'ITL p50':>8} {'step':>7} "
          f"{'TTFT p50':>9} {'srv TTFT':>9} {'srv ITL':>8} {'CPU ms/token: loop':>19} {'engine':>7} "
          f"{'client*':>7}")  # fmt: skip
    for r in rows:
        b = off["batches"][str(r["concurrency"])]
        cpu, srv = r["cpu_ms_per_token"], r["server_mean_ms"]
        print(f"{r['client']:>8} {r['concurrency']:>4} {r['output_tok_s']:>12.1f} {b['output_tok_s']:>8.1f} "
              f"{r['output_tok_s'] / b['output_tok_s']:>6.2f} {r['itl_p50_ms']:>8.2f} {b['decode_step_ms']:>7.2f} "
              f"{r['ttft_p50_ms']:>9.1f} {srv['ttft_ms']:>9.1f} {srv['itl_ms']:>8.2f} "
              f"{cpu['server_event_loop']:>19.3f} {cpu['server_other']:>7.2f} {cpu['client']:>7.2f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model `tidepool serve` and `LLM(...)` take (folder, .gguf, catalogue name)")
    p.add_argument("--tokenizer", help="folder with the Hugging Face tokenizer guidellm uses (default: --model)")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = this x concurrency")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="lone sequences timed offline")
    p.add_argument("--clients", default=",".join(CLIENTS), help="guidellm, minimal (bench/serve.py's), or both")
    p.add_argument("--client-nice", type=int, default=0, help="run guidellm at this nice level (0: as the server)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument(
        "--alternate",
        type=int,
        default=0,
        metavar="N",
        help="concurrency 1 only: N serving periods, each between two offline timings (cancels drift)",
    )
    p.add_argument("--quick", action="store_true", help="tiny random model, short requests, levels 1 and 4")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("serve_flags", nargs="*", help="more `tidepool serve` flags, after --")
    args = p.parse_args()
    if args.quick:
        from common import bench_model

        args.model = args.model or str(bench_model("llama", "tiny"))
        args.concurrency, args.input_len, args.output_len, args.min_requests = "1,4", 32, 16, 4
    if not args.model:
        p.error("give --model (or --quick)")
    args.out = args.out.resolve()  # the server process runs from /tmp
    if args.alternate:
        args.out.mkdir(parents=True, exist_ok=True)
        record = alternate(args, args.out)
        (args.out / "serve_latency_alternate.json").write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out / 'serve_latency_alternate.json'}")
        return
    levels = [int(v) for v in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{args.model}: prompts of {args.input_len} tokens, {args.output_len} out; offline then online (guidellm, "
          f"{args.endpoint}) in one server process", flush=True)  # fmt: skip
    off, rows = online(args, levels, args.out)
    verdict = verdicts(off, rows)
    print_table(off, rows)
    rounded = {client: {k: round(v, 3) for k, v in mine.items()} for client, mine in verdict.items()}
    print(f"* client CPU includes guidellm's start-up, {off['client_startup_cpu_s']:.1f} s for a 2-request run")
    print(f"offline prefill {off['prefill_ms']:.1f} ms; verdicts: {json.dumps(rounded)}")
    record = {"model": args.model, "endpoint": args.endpoint, "input_len": args.input_len,
              "output_len": args.output_len, "client_nice": args.client_nice,
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
              "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "offline": off, "online": rows,
              "verdicts": verdict}  # fmt: skip
    (args.out / "serve_latency.json").write_text(json.dumps(record, indent=1))
    nice = f", guidellm at nice {args.client_nice}" if args.client_nice else ""
    plot(off, rows, args.out / "serve_latency.png", f"{Path(args.model).name}: online vs offline, one process{nice}")
    print(f"wrote {args.out / 'serve_latency.json'} and {args.out / 'serve_latency.png'}")


if __name__ == "__main__":
    main()
