"""Benchmark tools that live in their own virtual environment (guidellm, lm-eval), installed once.

Role: a tool with dependencies of its own goes into `$TIDEPOOL_CACHE/bench-env/<name>-<version>`, a
venv that also sees the parent environment's packages (torch, transformers, httpx, ...) through a
`.pth` file, so pip counts them as installed and only adds what the tool itself needs.

Invariant: a venv counts as ready only once its install finished (`.complete`); an interrupted
install is redone from scratch.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path


def tool_env(name: str, version: str, requirement: str) -> Path:
    """The venv folder of `name`==`version`, installing `requirement` into it first if it is not there yet."""
    cache = Path(os.environ.get("TIDEPOOL_CACHE", Path.home() / ".cache" / "tidepool"))
    venv = cache / "bench-env" / f"{name}-{version}"
    if (venv / ".complete").is_file() and (venv / "bin" / "python").is_file():
        return venv
    print(f"installing {requirement} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    child_site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(child_site, "zz_tidepool_parent.pth").write_text(site.getsitepackages()[0] + "\n")
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", requirement], check=True, cwd="/tmp")
    (venv / ".complete").touch()
    return venv
