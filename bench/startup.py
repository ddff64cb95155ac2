"""Cold start, phase by phase: process start -> engine imported -> `LLM` ready -> first token.

Each configuration runs in a fresh Python process (warm page cache: the files were read before, and
one untimed start ran first), rounds alternate the order so the shared machine's drift hits every
configuration alike, and the median over rounds is reported. Configurations, on the real SmolLM2-135M-Instruct:

- ``gguf``: the Q4_1 GGUF file, dequantized to float32 (what ``LLM("smollm2-135m-instruct")`` does);
- ``gguf-int4``: the same file kept 4-bit (``quantization="gguf"``): fewer weight bytes to lay out;
- ``f32-folder``: the float32 Hugging Face folder made from that file (safetensors, tokenizer.json);
- ``gguf-4x-kv``: ``gguf`` with a 4x KV budget (``kv_cache_memory_bytes``): start-up must not grow
  with it (the CPU KV cache is reserved, not touched; `engine/hugepages.py`).

Per configuration: process start -> imported, -> ready (``LLM(...)`` returned), -> first token (a
one-token greedy generate), the engine's own start phases (`engine/startup_phases.py`, from its
INFO log record), and peak RSS. It prints a table and the ratios to ``gguf``, and writes
``startup.json`` and ``startup.png`` (stacked phases) under ``--out``. ``--python`` runs the
children with another interpreter (e.g. one whose ``tidepool`` is an older checkout: a before/after
in one run; phases an older engine does not record are left out).

    python bench/startup.py [--rounds 3] [--configs gguf,gguf-int4,f32-folder,gguf-4x-kv]
    python bench/startup.py --python /path/to/other/venv/bin/python --out bench/results/startup/before
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "startup"
CATALOGUE_NAME = "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
KV_DEFAULT = 2 << 30  # engine_config.CPU_KV_CACHE_BYTES (not imported here: the parent stays torch-free)
CONFIGS: dict[str, dict[str, Any]] = {
    "gguf": {"model": "gguf"},
    "gguf-int4": {"model": "gguf", "quantization": "gguf"},
    "f32-folder": {"model": "folder"},
    "gguf-4x-kv": {"model": "gguf", "kv_cache_memory_bytes": 4 * KV_DEFAULT},
}
COLUMNS = ("import_s", "ready_s", "first_token_s")


def child(spec: dict[str, Any]) -> None:
    """One cold start; prints one JSON line. Timestamps are seconds since this process started."""
    started = _process_start_epoch()
    import logging

    phases: dict[str, float] = {}

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            phases.update(getattr(record, "startup_phases", {}))

    logging.getLogger("tidepool").addHandler(Capture(logging.INFO))
    logging.getLogger("tidepool").setLevel(logging.INFO)
    from tidepool.engine import LLM, SamplingParams

    imported = time.time()
    kwargs = {k: v for k, v in spec.items() if k not in ("path",)}
    llm = LLM(spec["path"], show_progress=False, **kwargs)
    ready = time.time()
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first = time.time()
    print(
        json.dumps(
            {
                "import_s": imported - started,
                "ready_s": ready - started,
                "first_token_s": first - started,
                "phases": phases,
                "token_ids": list(out[0].outputs[0].token_ids),
                "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        ),
        flush=True,
    )


def _process_start_epoch() -> float:
    """This process's start as a Unix time (Linux /proc; elsewhere: now, which undercounts the interpreter)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot_s = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (boot_s - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def cache_dir() -> Path:
    """`common.cache_dir` without importing `common` (which imports torch: the children must import only the engine)."""
    return Path(os.environ.get("TIDEPOOL_CACHE", Path.home() / ".cache" / "tidepool"))


def model_paths() -> dict[str, str]:
    gguf = cache_dir() / "models" / CATALOGUE_NAME / GGUF_NAME
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is missing: run `tidepool pull {CATALOGUE_NAME}` first")
    folder = cache_dir() / "models" / f"{gguf.stem}-f32"
    if not (folder / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from offline_throughput import resolve_model  # converts once with transformers (imports torch)

        folder, _ = resolve_model(argparse.Namespace(model=str(gguf)))
    return {"gguf": str(gguf), "folder": str(folder)}


def run_one(python: str, spec: dict[str, Any], log: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [python, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp", timeout=600)
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n{proc.stderr}\n{proc.stdout}\n")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the child failed (exit {proc.returncode}); see {log}")
    return json.loads(lines[-1])


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        row: dict[str, Any] = {col: statistics.median(r[col] for r in results) for col in COLUMNS}
        phase_names = [p for p in results[0]["phases"] if all(p in r["phases"] for r in results)]
        row["phases"] = {p: statistics.median(r["phases"][p] for r in results) for p in phase_names}
        row["max_rss_mib"] = statistics.median(r["max_rss_mib"] for r in results)
        row["same_first_token"] = len({tuple(r["token_ids"]) for r in results}) == 1
        row["token_ids"] = results[0]["token_ids"]
        summary[name] = row
    return summary


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    phase_names = list(dict.fromkeys(p for row in summary.values() for p in row["phases"]))
    head = ["config", "imported", "ready", "1st token", "vs gguf", *phase_names, "RSS MiB"]
    print(" | ".join(head))
    base = summary.get("gguf", next(iter(summary.values())))["ready_s"]
    for name, row in summary.items():
        cells = [name, *(f"{row[c]:.2f}" for c in COLUMNS), f"{row['ready_s'] / base:.2f}x"]
        cells += [f"{row['phases'][p]:.2f}" if p in row["phases"] else "-" for p in phase_names]
        print(" | ".join([*cells, f"{row['max_rss_mib']:.0f}"]))


def plot(summary: dict[str, dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    names = list(summary)
    phase_names = list(dict.fromkeys(p for row in summary.values() for p in row["phases"]))
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(names) + 1.6))
    bottoms = [0.0] * len(names)
    for phase in phase_names:
        values = [summary[n]["phases"].get(phase, 0.0) for n in names]
        ax.barh(names, values, left=bottoms, label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    rest = [max(0.0, summary[n]["ready_s"] - b) for n, b in zip(names, bottoms, strict=True)]
    ax.barh(names, rest, left=bottoms, label="not in a phase\n(all of it for an engine\nwithout phases)", color="0.7")
    ax.scatter([summary[n]["first_token_s"] for n in names], names, color="black", marker="|", s=300,
               label="first token (process start)", zorder=3)  # fmt: skip
    ax.set_xlabel("seconds from process start")
    ax.set_title("Tidepool cold start, SmolLM2-135M-Instruct (median of rounds)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="interpreter for the children (default: this one)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    paths = model_paths()
    for path in paths.values():  # warm cache: every file read once before the first timed start
        for file in [Path(path)] if Path(path).is_file() else Path(path).iterdir():
            file.read_bytes()
    args.out.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.gettempdir()) / "tidepool-bench-startup.log"  # the children's output, for failures
    log.write_text("")
    first = {**CONFIGS[names[0]], "path": paths[CONFIGS[names[0]]["model"]]}
    first.pop("model")
    run_one(args.python, first, log)  # untimed: compiled-op caches, .pyc files and shared libraries warm
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            spec = {**CONFIGS[name], "path": paths[CONFIGS[name]["model"]]}
            spec.pop("model")
            result = run_one(args.python, spec, log)
            runs[name].append(result)
            print(f"round {round_index + 1} {name}: ready {result['ready_s']:.2f} s, "
                  f"first token {result['first_token_s']:.2f} s", flush=True)  # fmt: skip
    summary = summarise(runs)
    print_table(summary)
    record = {"python": args.python, "rounds": args.rounds, "configs": {n: CONFIGS[n] for n in names},
              "summary": summary, "runs": runs}  # fmt: skip
    (args.out / "startup.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out / 'startup.json'}")
    plot(summary, args.out / "startup.png")


if __name__ == "__main__":
    main()
