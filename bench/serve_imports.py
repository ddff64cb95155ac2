"""`tidepool serve` start -> /ready measured in CPU seconds, modules imported and import time (issue #43).

Role: a before/after that stays meaningful on a loaded machine. Wall-clock start times swing with
the load; what a start *costs* does not: the child's CPU time (`time.process_time()`, every thread
of the process, read the moment /ready first answers 200), the number of modules in `sys.modules`
then, and `python -X importtime`'s total (the sum of every module's self time, from a separate run:
importtime slows the import it measures). Each round runs every (tree, model) pair once, in an order
that alternates between rounds; the medians over rounds are printed.

A "tree" is the current checkout (`after`) and, with `--before DIR`, a copy of the product packages laid
out as `DIR/tidepool/...` (e.g. the checkout with some files taken from `git show HEAD:<file>`), put first
on the children's PYTHONPATH so it wins over the editable install.

    python bench/serve_imports.py [--rounds 5] [--before /tmp/before] [--models gguf,folder]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

MODELS = {"gguf": "smollm2-135m-instruct", "folder": "SmolLM2-135M-Instruct.Q4_1-f32"}

# The child: `tidepool serve MODEL`, and a thread that waits for /ready, records what the start cost, and exits.
_CHILD = r"""
import json, os, sys, threading, time, urllib.request
port, model, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def watch():
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5).status == 200:
                break
        except Exception:
            threading.Event().wait(0.05)
    with open(out, "w") as f:
        json.dump({"cpu_s": time.process_time(), "modules": len(sys.modules)}, f)
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
from tidepool.cli import main
sys.exit(main(["serve", model, "--port", str(port)]))
"""
_IMPORTTIME = re.compile(r"import time:\s+(\d+) \|\s+\d+ \|( *)(\S+)")


def import_seconds(stderr: str) -> tuple[float, float]:
    """(every module's self time, the same without torch's subtree) in seconds, from `-X importtime`'s lines.

    importtime prints a module after what it imported, one indent deeper: torch's subtree is the run of
    deeper lines just before the line naming `torch`.
    """
    rows = [(int(m[1]), len(m[2]), m[3]) for m in _IMPORTTIME.finditer(stderr)]
    in_torch = [False] * len(rows)
    for i, (_, depth, name) in enumerate(rows):
        if name == "torch":
            in_torch[i] = True
            j = i - 1
            while j >= 0 and rows[j][1] > depth:
                in_torch[j] = True
                j -= 1
    total = sum(r[0] for r in rows)
    return total / 1e6, sum(r[0] for r, t in zip(rows, in_torch, strict=True) if not t) / 1e6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_arg(key: str) -> str:
    """The catalogue name for the GGUF file; the f32 folder beside it (made by bench/startup.py) by path."""
    if key == "gguf":
        return MODELS[key]
    root = Path(os.environ.get("TIDEPOOL_CACHE", Path.home() / ".cache" / "tidepool")) / "models"
    return str(root / MODELS[key])


def start(tree: str | None, model: str, importtime: bool, scratch: Path) -> dict[str, Any]:
    """One `tidepool serve` start to /ready in a fresh process; its CPU s and module count (or import time)."""
    env = {**os.environ, "PYTHONPATH": tree} if tree else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = scratch / "start.json"
    out.unlink(missing_ok=True)
    flags = ["-X", "importtime"] if importtime else []
    cmd = [sys.executable, *flags, "-c", _CHILD, str(_free_port()), model, str(out)]
    proc = subprocess.run(cmd, cwd="/tmp", env=env, capture_output=True, text=True, timeout=600, check=False)
    if not out.exists():
        raise SystemExit(f"the server never reached /ready (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    record = json.loads(out.read_text())
    if importtime:
        total, without_torch = import_seconds(proc.stderr)
        return {"import_total_s": total, "import_non_torch_s": without_torch}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", help="a tree laid out as DIR/tidepool/... to compare with the checkout")
    parser.add_argument("--models", default="gguf,folder", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    trees: dict[str, str | None] = {"after": None} | ({"before": args.before} if args.before else {})
    pairs = [(t, m) for m in args.models.split(",") for t in trees]
    for tree, model in pairs:  # untimed: byte-compile each tree and warm the page cache
        start(trees[tree], model_arg(model), False, args.scratch)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {pair: [] for pair in pairs}
    for round_ in range(args.rounds):
        for tree, model in pairs if round_ % 2 == 0 else pairs[::-1]:
            record = start(trees[tree], model_arg(model), False, args.scratch)
            record |= start(trees[tree], model_arg(model), True, args.scratch)
            runs[(tree, model)].append(record)
    print(f"{'model':8} {'tree':7} {'CPU s to /ready':>16} {'modules':>8} {'import s':>9} {'non-torch':>10}", end="")
    print(f"   (median of {args.rounds})")
    for (tree, model), records in runs.items():
        cpu = statistics.median(r["cpu_s"] for r in records)
        mods = statistics.median(r["modules"] for r in records)
        imp = statistics.median(r["import_total_s"] for r in records)
        own = statistics.median(r["import_non_torch_s"] for r in records)
        print(f"{model:8} {tree:7} {cpu:16.2f} {mods:8.0f} {imp:9.2f} {own:10.2f}")


if __name__ == "__main__":
    main()
