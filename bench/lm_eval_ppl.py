"""Word perplexity of a text file through Tidepool's HTTP server vs transformers, both scored by EleutherAI lm-eval.

What it checks (issue #36): lm-eval's `local-completions` backend scores `loglikelihood_rolling`
requests with `/v1/completions` `echo: true`, `logprobs: 1`, `max_tokens: 0` over token-id
prompts, i.e. Tidepool's prompt logprobs. The same task on lm-eval's `hf` backend (transformers,
the same weights, float32) gives the reference; the two word perplexities must agree to float
rounding (printed with their relative difference).

How: a one-task lm-eval config is written next to the text (`dataset_path: text`, the whole file
one document, `loglikelihood_rolling`, word/byte perplexity and bits per byte), `tidepool serve`
is started on a free port, and lm-eval runs twice in its own environment. lm-eval is pinned
(`LM_EVAL_VERSION`) and installed once under $TIDEPOOL_CACHE/bench-env/, which sees Tidepool's
environment through a `.pth` file (torch and transformers are shared), like guidellm_client.py.
Every child runs from /tmp (the repository root on sys.path would let `operator/` shadow the
standard library). Nothing here imports torch.

    python bench/lm_eval_ppl.py                       # the tiny random preset, a stdlib docstring text
    python bench/lm_eval_ppl.py --model smollm2-135m-instruct      # the real model (GGUF -> float32 folder, once)
    python bench/lm_eval_ppl.py --model <hf folder> --text book.txt --max-length 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import free_port, spawn, stop, wait_ready
from tool_env import tool_env

from common import cache_dir

LM_EVAL_VERSION = "0.4.13"
TASK = "tidepool_text_ppl"

_DRIVER = f"""
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
backend, model_args, task_dir, out = sys.argv[1:5]
result = lm_eval.simple_evaluate(model=backend, model_args=model_args, tasks=[{TASK!r}],
                                 task_manager=TaskManager(include_path=task_dir), batch_size=1)
json.dump(result["results"][{TASK!r}], open(out, "w"), default=str)
"""


def lm_eval_python() -> Path:
    """The Python of the lm-eval environment, installing lm-eval first if this machine has none of this version."""
    return tool_env("lm-eval", LM_EVAL_VERSION, f"lm-eval[api]=={LM_EVAL_VERSION}") / "bin" / "python"


def default_text(path: Path) -> Path:
    """English prose that ships with Python: the module docstrings of a few standard-library modules."""
    import argparse as a
    import asyncio as b
    import json as c
    import logging as d
    import subprocess as e

    path.write_text("\n\n".join(textwrap.dedent(m.__doc__ or "").strip() for m in (a, b, c, d, e)) + "\n")
    return path


def write_task(task_dir: Path, text: Path) -> None:
    task_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "task": TASK,
        "dataset_path": "text",
        "dataset_kwargs": {"data_files": {"test": str(text.resolve())}, "sample_by": "document"},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
    }
    (task_dir / f"{TASK}.yaml").write_text(json.dumps(config, indent=2))  # JSON is YAML


def run(python: Path, backend: str, model_args: str, task_dir: Path, out: Path) -> dict[str, float]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(python), "-c", _DRIVER, backend, model_args, str(task_dir), str(out)], check=True, cwd="/tmp",
                   env=env)  # fmt: skip
    raw = json.loads(out.read_text())
    return {k.split(",")[0]: float(v) for k, v in raw.items() if k.split(",")[0] in ("word_perplexity",
            "byte_perplexity", "bits_per_byte")}  # fmt: skip


def _model_folder(name: str | None) -> Path:
    if name is None:
        from tidepool.engine.make_model import make_model

        folder = cache_dir() / "models" / "llama-tiny-seed0"
        if not (folder / "config.json").is_file():
            make_model("llama", "tiny", folder, seed=0)
        return folder.resolve()
    if Path(name).is_dir():
        return Path(name).resolve()
    from offline_throughput import resolve_model  # GGUF -> float32 folder, once (imports torch, transformers)

    from tidepool.engine.engine_config import resolve_model_path

    gguf = Path(resolve_model_path(name))  # catalogue names are pulled on first use
    folder, _ = resolve_model(argparse.Namespace(model=str(gguf)))
    return folder.resolve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a Hugging Face folder, a .gguf file or a catalogue name, e.g. "
                        "smollm2-135m-instruct (a GGUF is dequantized to a float32 folder once, so that both backends "
                        "read the same weights; default: the tiny random preset)")  # fmt: skip
    parser.add_argument("--text", type=Path, help="a UTF-8 text file (default: stdlib module docstrings)")
    parser.add_argument("--max-length", type=int, default=512, help="lm-eval's rolling window, in tokens")
    parser.add_argument("--hf-device", default="cpu", help="where lm-eval's hf backend runs (cpu, cuda)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/lm_eval_ppl"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = _model_folder(args.model)
    text = args.text.resolve() if args.text else default_text(out / "text.txt")
    write_task(out / "task", text)
    python = lm_eval_python()

    port, log = free_port(), out / "serve.log"
    proc = spawn(["serve", "--model", str(model), "--served-model-name", "m", "--dtype", "float32"], port, log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log)
        # The same requests as the hf backend's: lm-eval's API backends keep one token of max_length for generation
        # and cut rolling windows one shorter again (hence + 2), and encode without the tokenizer's special tokens
        # unless add_bos_token (the hf backend encodes with them). Same windows, same contexts, same logprobs.
        api_args = (f"model=m,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={model},tokenized_requests=True,"
                    f"max_length={args.max_length + 2},add_bos_token=True,num_concurrent=1")  # fmt: skip
        served = run(python, "local-completions", api_args, out / "task", out / "served.json")
    finally:
        stop(proc)
    hf_args = f"pretrained={model},dtype=float32,max_length={args.max_length},device={args.hf_device}"
    reference = run(python, "hf", hf_args, out / "task", out / "hf.json")
    print(f"{'metric':<18}{'tidepool (HTTP)':>18}{'transformers':>18}{'rel. diff':>12}")
    for name in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        a, b = served[name], reference[name]
        print(f"{name:<18}{a:>18.6f}{b:>18.6f}{abs(a - b) / abs(b):>12.2e}")
    (out / "summary.json").write_text(json.dumps({"tidepool": served, "hf": reference}, indent=2))


if __name__ == "__main__":
    main()
