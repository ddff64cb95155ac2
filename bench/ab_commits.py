"""Two commits, one benchmark, one run: is the working tree as fast as a base commit?

Runs a bench script (default `offline_throughput.py --workloads bs1,uniform`) on the base commit and on
this working tree, alternating in ABBA order (base, new, new, base, ...), each in a fresh process, and prints the
new/base ratio of chosen metrics per round and their median. Alternating in one run is what makes the
ratio mean something on a shared, noisy machine: drift hits both sides alike, and whatever running
first or second in a round does (warm page cache, memory another process just freed) cancels over an
even number of rounds.

How the base commit runs without its own install: `git worktree add` checks it out under a temporary
folder, and a package folder is assembled from symlinks following that commit's own `ROOTS` mapping in
setup.py (`cli/` is the `tidepool` package, `engine/` becomes `tidepool/engine`, ...), put first on
PYTHONPATH, so its `tidepool` wins over the editable install. The new side runs the same way from the
tree this script sits in (a clone elsewhere measures that clone, whatever the editable install points
at). Each side runs its own copy of the bench script, so an API that moved between the commits is called
the way each commit spells it.

    python bench/ab_commits.py --base 68e36f3 -- --model ~/.cache/tidepool/models/SmolLM2-135M-Instruct.Q4_1-f32
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_METRICS = (
    "workloads.uniform.tidepool.tokens_per_s",
    "workloads.uniform.tidepool_b64_step_s",
    "workloads.bs1.tidepool.step_s",
    "workloads.bs1.tidepool_layer_by_layer.step_s",
)


def package_roots(tree: Path) -> dict[str, str]:
    """The `ROOTS` dict of a tree's setup.py (package name -> folder), read without running setup.py."""
    for node in ast.walk(ast.parse((tree / "setup.py").read_text())):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{tree}/setup.py has no ROOTS mapping")


def assemble_packages(tree: Path, into: Path) -> Path:
    """A folder whose `tidepool` package is `tree`'s, by symlinks, per its ROOTS; returns the folder."""
    roots = package_roots(tree)
    top = into / "tidepool"
    top.mkdir(parents=True)
    for entry in (tree / roots["tidepool"]).iterdir():
        (top / entry.name).symlink_to(entry)
    for package, folder in roots.items():
        if package != "tidepool":
            (top / package.removeprefix("tidepool.")).symlink_to(tree / folder)
    return into


def run_side(tree: Path, pythonpath: Path, script: str, args: list[str], out: Path) -> dict[str, Any]:
    """One bench run in a fresh process, `tidepool` imported from `pythonpath`; returns the JSON it wrote."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH", "")]))
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(tree / "bench" / script), *args, "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=tempfile.gettempdir())
    written = sorted(out.glob("*.json"))
    if len(written) != 1:
        raise SystemExit(f"expected one JSON file in {out}, found {[p.name for p in written]}")
    return json.loads(written[0].read_text())


def metric(result: dict[str, Any], dotted: str) -> float:
    value: Any = result
    for key in dotted.split("."):
        value = value[key]
    return float(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base commit (any git revision)")
    parser.add_argument("--script", default="offline_throughput.py", help="bench script, in bench/ of each tree")
    parser.add_argument("--rounds", type=int, default=2, help="base/new pairs to run")
    parser.add_argument("--metric", action="append", help=f"dotted JSON path (default: {DEFAULT_METRICS})")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ab_commits.json")
    parser.add_argument("bench_args", nargs="*", help="after --: the bench script's arguments")
    args = parser.parse_args()
    bench_args = args.bench_args or ["--workloads", "bs1,uniform"]
    metrics = args.metric or list(DEFAULT_METRICS)
    base_sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", args.base], check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ab-commits-") as tmp:
        work = Path(tmp)
        base_tree = work / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree), base_sha], check=True)
        try:
            base_packages = assemble_packages(base_tree, work / "base-packages")
            new_packages = assemble_packages(REPO, work / "new-packages")
            rounds: list[dict[str, dict[str, float]]] = []
            for i in range(args.rounds):
                results: dict[str, dict[str, Any]] = {}
                sides = (("base", base_tree, base_packages), ("new", REPO, new_packages))
                for side, tree, packages in sides if i % 2 == 0 else sides[::-1]:  # ABBA: order effects cancel
                    print(f"== round {i + 1}/{args.rounds}: {side}", flush=True)
                    results[side] = run_side(tree, packages, args.script, bench_args, work / f"{side}-{i}")
                base, new = results["base"], results["new"]
                rounds.append({m: {"base": metric(base, m), "new": metric(new, m)} for m in metrics})
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=False)
    summary = {m: statistics.median(r[m]["new"] / r[m]["base"] for r in rounds) for m in metrics}
    print(f"\nnew / base (base {base_sha[:8]}; step_s: lower is faster, tokens_per_s: higher is faster)")
    for m in metrics:
        per_round = "  ".join(f"{r[m]['new'] / r[m]['base']:.3f}" for r in rounds)
        print(f"  {m:48s} median {summary[m]:.3f}   rounds: {per_round}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"base": base_sha, "script": args.script, "args": bench_args, "rounds": rounds, "median_ratio": summary}
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
