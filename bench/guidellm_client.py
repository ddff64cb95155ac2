"""guidellm (vLLM's benchmark client) as the load generator of the serving benchmarks.

Role: make (once per machine) a virtual environment holding guidellm beside Tidepool's own, run
one guidellm benchmark at a fixed concurrency against an OpenAI-compatible endpoint, and read
back the numbers its JSON report gives (guidellm's own definitions: TTFT from the request's send
to the first streamed token, ITL between streamed tokens, output tokens per second over the
benchmark's duration).

Invariants: guidellm is pinned (`GUIDELLM_VERSION`) and lives in its own environment under
$TIDEPOOL_CACHE/bench-env/, which sees Tidepool's environment through a `.pth` file, so the
multi-GB torch/transformers install is shared while guidellm's other dependencies stay out of
Tidepool's. Every run goes from /tmp (the repository root on sys.path would let `operator/`
shadow the standard library). Nothing here imports torch or Tidepool.
"""

from __future__ import annotations

import importlib
import json
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tool_env import tool_env

GUIDELLM_VERSION = "0.8.1"


def guidellm_bin() -> Path:
    """The guidellm executable, installing it first if this machine has none of this version."""
    return tool_env("guidellm", GUIDELLM_VERSION, f"guidellm=={GUIDELLM_VERSION}") / "bin" / "guidellm"


# Prompt text that ships with Python: the docstrings of these standard-library modules and their members.
_TEXT_MODULES = ("json", "argparse", "asyncio", "collections", "functools", "itertools", "logging", "pathlib",
                 "random", "re", "socket", "string", "subprocess", "textwrap", "threading", "unittest", "zipfile",
                 "decimal")  # fmt: skip


def make_dataset(tokenizer_dir: Path, input_len: int, output_len: int, count: int, path: Path, seed: int = 0) -> Path:
    """A JSONL file of `count` prompts of `input_len` tokens (English text cut by the model's tokenizer) for guidellm.

    guidellm's own synthetic prompts are generated while it runs, in the processes that also time
    the responses, on the same cores as the server; a file made beforehand keeps that work out of
    the measurement.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    docs = []
    for name in _TEXT_MODULES:
        module = importlib.import_module(name)
        for obj in (module, *(getattr(module, attr) for attr in sorted(dir(module)) if not attr.startswith("_"))):
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200:
                docs.append(doc)
    text = "\n\n".join(dict.fromkeys(docs))
    encoding = tokenizer.encode(text)
    if len(encoding.ids) < 2 * input_len + 2:
        raise RuntimeError("not enough text for the requested prompt length")
    rng = random.Random(seed)
    starts = rng.sample(range(len(encoding.ids) - input_len - 1), count)  # distinct: no two prompts share a prefix
    with path.open("w") as out:
        for start in starts:
            prompt = text[encoding.offsets[start][0] : encoding.offsets[start + input_len][0]]
            row = {"prompt": prompt, "prompt_tokens_count": len(tokenizer.encode(prompt).ids),
                   "output_tokens_count": output_len}  # fmt: skip
            out.write(json.dumps(row) + "\n")
    return path


@dataclass(slots=True)
class ClientResult:
    """One concurrency level as guidellm measured it (milliseconds, tokens per second)."""

    concurrency: int
    requests: int
    output_tokens: int
    duration_s: float
    output_tok_s: float  # output tokens / benchmark duration
    itl_p50_ms: float
    itl_p90_ms: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float


def run_level(
    target: str,
    model: str,
    tokenizer_dir: Path,
    concurrency: int,
    num_requests: int,
    dataset: Path,
    endpoint: str,
    out_dir: Path,
    log: Path,
    nice: int = 0,
) -> ClientResult:
    """One guidellm benchmark: `num_requests` requests from `dataset` (make_dataset), `concurrency` streams.

    `nice` > 0 runs guidellm at that lower CPU priority: on a machine whose cores the server also uses, its
    processes then take mostly CPU time the engine leaves idle (bench/README.md has both ways measured).
    """
    scenario = {
        "metadata": {"name": f"tidepool-c{concurrency}"},
        "spec": {
            # Greedy, as the offline reference steps (guidellm sends no temperature: the API default, 1.0, samples).
            "backend": {
                "kind": "openai_http",
                "target": target,
                "model": model,
                "request_format": endpoint,
                "extras": {"body": {"temperature": 0.0}},
            },
            "profile": {"kind": "concurrent", "streams": [concurrency]},
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "data": [{"kind": "json_file", "path": str(dataset)}],
            "constraints": [{"kind": "max_requests", "count": num_requests}],
        },
        "benchmarks": [{"profile.streams": concurrency}],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    scenario_path = out_dir / f"guidellm-c{concurrency}.scenario.json"
    report = out_dir / f"guidellm-c{concurrency}.json"
    scenario_path.write_text(json.dumps(scenario, indent=1))
    report.unlink(missing_ok=True)
    cmd = ["nice", "-n", str(nice)] if nice else []
    cmd += [str(guidellm_bin()), "run", "-c", str(scenario_path), "--disable-progress",
           "--output", f"kind=json,path={report}"]  # fmt: skip
    with log.open("ab") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd="/tmp", check=False)
    if done.returncode != 0 or not report.is_file():
        raise RuntimeError(f"guidellm failed at concurrency {concurrency} (exit {done.returncode}); see {log}")
    return parse_report(json.loads(report.read_text()), concurrency)


def parse_report(report: dict, concurrency: int) -> ClientResult:
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]

    def ok(name: str) -> dict:
        return metrics[name]["successful"]

    errored = metrics["request_totals"].get("errored", 0) if isinstance(metrics["request_totals"], dict) else 0
    if errored:
        raise RuntimeError(f"guidellm saw {errored} failed requests at concurrency {concurrency}")
    output_tokens = int(ok("output_token_count")["total_sum"])
    duration = float(bench["duration"])
    return ClientResult(
        concurrency=concurrency,
        requests=int(ok("output_token_count")["count"]),
        output_tokens=output_tokens,
        duration_s=duration,
        output_tok_s=output_tokens / duration,
        itl_p50_ms=float(ok("inter_token_latency_ms")["median"]),
        itl_p90_ms=float(ok("inter_token_latency_ms")["percentiles"]["p90"]),
        ttft_p50_ms=float(ok("time_to_first_token_ms")["median"]),
        ttft_p90_ms=float(ok("time_to_first_token_ms")["percentiles"]["p90"]),
        tpot_p50_ms=float(ok("time_per_output_token_ms")["median"]),
    )
