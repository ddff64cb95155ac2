"""Sleep mode against a cold start: how long a sleeping engine takes to serve again, at both levels (issue #43).

Cold start is bench/startup.py's measurement, reused here (a fresh process per start, warm page cache, one
untimed start first): process start -> `LLM(...)` ready -> first token. The wake side runs in one more
fresh process per configuration: `LLM(...)`, a greedy generate (the reference tokens), then per round and
level: `sleep(level)`, `wake_up()` (timed), a one-token generate (timed from the wake's start: wake -> first
token), and the greedy tokens again, which must equal the reference (the bench stops if not). It also
reports the resident memory the sleep gave back (VmRSS before and after `sleep`). Issue target: wake <= 1/5
of the cold start to ready. Medians over rounds; writes ``sleep_wake.json`` under ``--out``.

    python bench/sleep_wake.py [--rounds 3] [--configs gguf,f32-folder]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import CONFIGS, model_paths, run_one  # bench/ is not a package

RESULTS = Path(__file__).resolve().parent / "results" / "sleep_wake"
SLEEP_CONFIGS = ("gguf", "f32-folder")
LEVELS = (1, 2)
PROMPT = "The capital of France is"


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(spec: dict[str, Any]) -> None:
    """One engine, `rounds` sleep/wake round trips per level; prints one JSON line."""
    from tidepool.engine import LLM, SamplingParams

    rounds = spec.pop("rounds")
    llm = LLM(spec.pop("path"), show_progress=False, **spec)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1)

    def tokens() -> list[int]:
        return list(llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids)

    reference = tokens()
    results: dict[str, list[dict[str, float]]] = {str(level): [] for level in LEVELS}
    for _ in range(rounds):
        for level in LEVELS:
            rss = _rss_bytes()
            started = time.perf_counter()
            llm.sleep(level)
            slept = time.perf_counter()
            released = rss - _rss_bytes()
            llm.wake_up()
            woke = time.perf_counter()
            llm.generate([PROMPT], one, use_tqdm=False)
            first = time.perf_counter()
            if tokens() != reference:
                raise SystemExit(f"level {level}: greedy tokens changed across the round trip")
            results[str(level)].append({"sleep_s": slept - started, "wake_s": woke - slept,
                                        "wake_to_first_token_s": first - slept,
                                        "released_mib": released / 2**20})  # fmt: skip
    print(json.dumps({"levels": results, "token_ids": reference}), flush=True)


def run_child(python: str, spec: dict[str, Any], log: Path) -> dict[str, Any]:
    import os
    import subprocess

    cmd = [python, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          cwd="/tmp", timeout=1200)  # fmt: skip
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n{proc.stderr}\n{proc.stdout}\n")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the child failed (exit {proc.returncode}); see {log}")
    return json.loads(lines[-1])


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--configs", default=",".join(SLEEP_CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    paths = model_paths()
    for path in paths.values():  # warm cache, as bench/startup.py
        for file in [Path(path)] if Path(path).is_file() else Path(path).iterdir():
            file.read_bytes()
    log = Path(tempfile.gettempdir()) / "tidepool-bench-sleep-wake.log"
    log.write_text("")
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, dict[str, Any]] = {}
    for name in args.configs.split(","):
        spec = {k: v for k, v in CONFIGS[name].items() if k != "model"}
        spec["path"] = paths[CONFIGS[name]["model"]]
        run_one(sys.executable, dict(spec), log)  # untimed: caches warm
        cold = [run_one(sys.executable, dict(spec), log) for _ in range(args.rounds)]
        wake = run_child(sys.executable, {**spec, "rounds": args.rounds}, log)
        row: dict[str, Any] = {"cold_ready_s": statistics.median(r["ready_s"] for r in cold),
                               "cold_first_token_s": statistics.median(r["first_token_s"] for r in cold)}  # fmt: skip
        for level in LEVELS:
            rows = wake["levels"][str(level)]
            for key in ("sleep_s", "wake_s", "wake_to_first_token_s", "released_mib"):
                row[f"l{level}_{key}"] = _median(rows, key)
            row[f"l{level}_wake_vs_cold"] = row[f"l{level}_wake_s"] / row["cold_ready_s"]
        summary[name] = row
        print(f"{name}: cold start to ready {row['cold_ready_s']:.2f} s; "
              + "; ".join(f"level {lv}: sleep {row[f'l{lv}_sleep_s']:.3f} s (gave back {row[f'l{lv}_released_mib']:.0f}"
                          f" MiB), wake {row[f'l{lv}_wake_s']:.3f} s = {row[f'l{lv}_wake_vs_cold']:.3f}x cold, "
                          f"wake->1st token {row[f'l{lv}_wake_to_first_token_s']:.3f} s" for lv in LEVELS),
              flush=True)  # fmt: skip
    (args.out / "sleep_wake.json").write_text(json.dumps({"rounds": args.rounds, "summary": summary}, indent=1))
    print(f"wrote {args.out / 'sleep_wake.json'}")


if __name__ == "__main__":
    main()
