"""`tidepool serve` that first measures its own engine offline: both sides of bench/serve_latency.py in one process.

This VM's memory bandwidth differs by 10-25% between processes (bench/README.md), so an offline
step timed in one process and an online token timed in another compare placements, not the
serving path. Here the engine `tidepool serve` is about to serve is built exactly as the CLI builds
it (`cli.parse_args` + `cli._server_config`), stepped directly (`LLMEngine.step()` on this thread)
for the offline figures, written to `--offline-json`, and then served over HTTP by the unchanged
server code: the app's loader gets this engine instead of building a second one. After each SIGTERM
(the server drains and stops) the lone sequence is timed again (`rounds`; the last is `after`), and
with `--cycles N` the engine is served again, N periods in all, each between two offline timings.

    python bench/serve_inprocess.py --offline-json F --levels 1,4,16 --input-len 128 --output-len 128 \\
        -- --model MODEL --host 127.0.0.1 --port 8000 --served-model-name bench
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any


def measure(engine: Any, levels: list[int], input_len: int, output_len: int, repeats: int, seed: int = 0) -> dict:
    """Prefill and decode step of a lone sequence; output tok/s and decode step of each batch B > 1 given at once.

    Each call needs its own `seed`: the same prompts again would hit the prefix cache and time no prefill."""
    from tidepool.engine import SamplingParams

    vocab = engine.model_config.vocab_size
    rng = random.Random(1234 + seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    counter = iter(range(seed << 20, (seed + 1) << 20))  # request ids unique across calls

    def run_batch(batch: int) -> tuple[float, list[float], float]:
        """(seconds to the batch's first tokens, decode-step gaps, seconds to the end)."""
        for _ in range(batch):  # fresh random prompts: no prefix-cache hits between runs
            engine.add_request(f"offline-{next(counter)}", [rng.randrange(3, vocab) for _ in range(input_len)], params)
        start = time.perf_counter()
        stamps = []
        while engine.has_unfinished_requests():
            engine.step()
            stamps.append(time.perf_counter())
        decode = stamps[len(stamps) - output_len + 1 :]  # the steps that only decode
        return stamps[0] - start, [b - a for a, b in pairwise(decode)], stamps[-1] - start

    run_batch(1)  # first use of the allocator and caches
    prefills, steps = [], []
    for _ in range(repeats):
        first, gaps, _ = run_batch(1)
        prefills.append(first)
        steps.extend(gaps)
    prefill_s, step_s = statistics.median(prefills), statistics.median(steps)
    result: dict = {"prefill_ms": 1000 * prefill_s, "decode_step_ms": 1000 * step_s, "batches": {}}
    result["batches"]["1"] = {"output_tok_s": output_len / (prefill_s + (output_len - 1) * step_s),
                              "decode_step_ms": 1000 * step_s}  # fmt: skip
    for batch in levels:
        if batch > 1:
            _, gaps, total = run_batch(batch)
            result["batches"][str(batch)] = {"output_tok_s": batch * output_len / total,
                                             "decode_step_ms": 1000 * statistics.median(gaps)}  # fmt: skip
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--offline-json", type=Path, required=True)
    p.add_argument("--levels", default="1")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cycles", type=int, default=1, help="serving periods, each followed by a lone-sequence timing")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `tidepool serve` flags")
    args = p.parse_args()
    serve_argv = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args

    from tidepool.engine import llm_engine
    from tidepool.engine.server import cli

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve = cli.parse_args(serve_argv)
    config = cli._server_config(serve)
    engine = llm_engine.LLMEngine(config.engine)
    levels = [int(v) for v in args.levels.split(",")]
    offline = measure(engine, levels, args.input_len, args.output_len, args.repeats)
    args.offline_json.write_text(json.dumps(offline))
    # The app's loader builds `LLMEngine(config.engine)`; hand it this one, measured and warm, instead.
    llm_engine.LLMEngine = lambda _config: engine  # type: ignore[assignment,misc]
    code = cli.serve(config, serve.host, serve.port)
    # Each time the server has stopped (SIGTERM: it drains, its engine thread is gone), time a lone sequence
    # again, since this VM's bandwidth drifts within a process too; then serve again, `--cycles` times in all.
    # `rounds` holds those timings: every serving period lies between two offline ones.
    offline["rounds"] = []
    for cycle in range(args.cycles):
        lone = measure(engine, [1], args.input_len, args.output_len, args.repeats, seed=cycle + 1)
        offline["rounds"].append({"prefill_ms": lone["prefill_ms"], "decode_step_ms": lone["decode_step_ms"]})
        offline["after"] = offline["rounds"][-1]
        args.offline_json.write_text(json.dumps(offline))
        if cycle + 1 < args.cycles:
            code = cli.serve(config, serve.host, serve.port)
    return code


if __name__ == "__main__":
    sys.exit(main())
