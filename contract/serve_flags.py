"""The `tidepool serve` flags as one table, from which every part that must agree on them is generated.

- `add_to_parser(parser, flags)`: argparse flags (`tidepool serve --help` shows the whole table;
  `tidepool generate` takes `GENERATE_FLAGS`); `resolve_positionals(parser, args)` after
  parsing (a `positional` flag may be given bare, as vLLM's `vllm serve MODEL` takes the model).
- `engine_kwargs(args, flags)`: the `EngineConfig` / `LLM(...)` keywords the parsed flags feed
  (JSON flags decoded here, once, for every command line).
- `EngineConfig`'s fields (engine/engine_config.py) take their default, bounds, choices and
  description from the flag whose `engine_field` they are: the table is the one source.
- `render_args(values)`: argv for a `{flag name: value}` mapping (the operator's builders use it).
- `managed_flags()` / `managed_spellings()`: the flags the operator sets on every engine pod, which
  `engine.extraArgs` may not override (the CRD's CEL rule is generated from them).

Adding a flag is one `ServeFlag(...)` line in `SERVE_FLAGS`. Mark it `managed=True` only if the
operator's builder sets it (a test proves the builder emits exactly the managed flags); give it
an `engine_field` when it maps onto an `EngineConfig` keyword (and add that field, built by
`flag_field`; a test proves the two name each other).

Invariants: stdlib only, no import side effects (the operator image has no torch, and imports this
module); names are unique, spelled without the leading `--`; `default` is the value the server uses
when the flag is absent; numeric bounds (`ge`/`gt`/`le`) are enforced by argparse here and by
pydantic in `EngineConfig`; a `bool` flag is negatable (`--x` / `--no-x`), a `switch` is a bare
`--x`, a `json` flag carries a JSON object as a string, and a `list` flag takes one or more values
(repeating it adds to them).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .quantization import QUANTIZATION_METHODS

Kind = Literal["int", "float", "str", "bool", "switch", "json", "list"]

# Help-section titles, in the order `tidepool serve --help` shows them ("" = the parser's own section).
GROUPS: dict[str, str] = {
    "": "",
    "engine": "engine (as LLM(...))",
    "lora": "LoRA adapters (many adapters on one base model, mixed in one batch)",
    "disagg": "prefill/decode disaggregation",
    "parallel": "parallelism (one replica over several ranks, optionally several nodes)",
    "server": "server",
    "auth": "API keys (`tidepool serve` and `tidepool router`)",
    "limits": "request limits",
}
_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "json": str}
_OPERATORS = {"ge": ">=", "gt": ">", "le": "<="}


@dataclass(frozen=True, slots=True)
class ServeFlag:
    """One `tidepool serve` flag."""

    name: str  # spelled without "--", e.g. "max-num-seqs"
    kind: Kind
    default: Any
    help: str
    group: str = "engine"  # a key of GROUPS
    choices: tuple[str, ...] | None = None
    managed: bool = False  # the operator sets it on every engine pod; engine.extraArgs may not
    engine_field: str | None = None  # the EngineConfig / LLM(...) keyword it feeds
    aliases: tuple[str, ...] = ()  # short spellings, e.g. "-tp"
    required: bool = False  # the server refuses to start without it (argparse checks it, resolve_positionals if bare)
    positional: bool = False  # may also be the first bare argument (`tidepool serve MODEL`)
    ge: float | None = None  # numeric bounds of an int/float flag (argparse and EngineConfig enforce them)
    gt: float | None = None
    le: float | None = None

    @property
    def option(self) -> str:
        return f"--{self.name}"

    @property
    def bounds(self) -> dict[str, float]:
        """The numeric bounds that are set, as pydantic `Field` keywords (`ge`, `gt`, `le`)."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None}

    def bound_violation(self, value: float) -> str | None:
        """Why `value` is out of bounds ("must be >= 1"), or None; NaN is out of any bound."""
        for op, bound in self.bounds.items():
            inside = value >= bound if op == "ge" else value > bound if op == "gt" else value <= bound
            if not inside:
                return f"must be {_OPERATORS[op]} {bound:g}"
        return None

    @property
    def dest(self) -> str:
        """The attribute name on the parsed argparse namespace."""
        return self.name.replace("-", "_")

    def spellings(self) -> tuple[str, ...]:
        """Every long option that sets this flag (`--x`, and `--no-x` for a negatable bool)."""
        return (self.option, f"--no-{self.name}") if self.kind == "bool" else (self.option,)

    def render(self, value: Any) -> list[str]:
        """argv for one value; [] when the value means "leave the flag out" (None, or False for a switch)."""
        if value is None or (self.kind == "switch" and value is False):
            return []
        if self.kind in ("bool", "switch"):
            if not isinstance(value, bool):
                raise TypeError(f"{self.option} takes a bool, got {value!r}")
            return [self.option if value else f"--no-{self.name}"]
        if self.kind == "json":
            return [self.option, value if isinstance(value, str) else json.dumps(value, sort_keys=True)]
        if self.kind == "list":
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"{self.option} takes a list of strings, got {value!r}")
            return [self.option, *value] if value else []
        if isinstance(value, bool):
            raise TypeError(f"{self.option} takes a {self.kind}, got {value!r}")
        return [self.option, str(value)]


SERVE_FLAGS: tuple[ServeFlag, ...] = (
    # name, kind, default, help; then its help section, choices, whether the operator sets it, its EngineConfig field.
    ServeFlag("model", "str", None, "Hugging Face model folder, .gguf file (or a folder holding one) or catalogue "
              "name (`tidepool pull --list`); may also be given bare (`tidepool serve MODEL`)", group="",
              required=True, positional=True, managed=True, engine_field="model"),
    ServeFlag("tokenizer", "str", None, "tokenizer folder or .gguf file; default: the model", engine_field="tokenizer"),
    ServeFlag("dtype", "str", "auto", "activation/weight dtype; auto uses the checkpoint's",
              choices=("auto", "float32", "bfloat16", "float16"), managed=True, engine_field="dtype"),
    ServeFlag("device", "str", "auto", "'auto', 'cpu', 'cuda' or 'cuda:N'", engine_field="device"),
    ServeFlag("block-size", "int", 16, "tokens per KV-cache block", managed=True, engine_field="block_size",
              ge=1, le=1024),
    ServeFlag("max-model-len", "int", None, "longest prompt + output in tokens; default: the model's",
              managed=True, engine_field="max_model_len", ge=2),
    ServeFlag("max-num-seqs", "int", 256, "most sequences scheduled in one step",
              managed=True, engine_field="max_num_seqs", ge=1),
    ServeFlag("max-num-batched-tokens", "int", None, "token budget of one engine step; default: 2048",
              managed=True, engine_field="max_num_batched_tokens", ge=1),
    ServeFlag("num-kv-blocks", "int", None, "fix the KV cache size in blocks; default: from a memory budget",
              engine_field="num_kv_blocks", ge=1),
    ServeFlag("kv-cache-memory-bytes", "int", None, "KV budget on CPU; default: 2 GiB",
              engine_field="kv_cache_memory_bytes", ge=1),
    ServeFlag("gpu-memory-utilization", "float", 0.9, "fraction of GPU memory for weights + KV cache",
              managed=True, engine_field="gpu_memory_utilization", gt=0, le=1),
    ServeFlag("enable-prefix-caching", "bool", True, "reuse KV blocks of shared prompt prefixes",
              managed=True, engine_field="enable_prefix_caching"),
    ServeFlag("enable-chunked-prefill", "bool", True, "split long prompts across steps",
              managed=True, engine_field="enable_chunked_prefill"),
    ServeFlag("num-threads", "int", None, "CPU threads for torch ops; default: $TIDEPOOL_NUM_THREADS, else the "
              "cgroup's CPU quota", engine_field="num_threads", ge=1),
    ServeFlag("seed", "int", 0, "sampling seed of requests that set none", engine_field="seed"),
    ServeFlag("quantization", "str", None,
              "check a quantized checkpoint's method, quantize a dense model to int8/int4 at load, or gguf: "
              "keep a GGUF file's Q8_0/Q4_0/Q4_1 weights quantized", choices=QUANTIZATION_METHODS,
              managed=True, engine_field="quantization"),
    ServeFlag("sparsity", "str", None, "serve a 2:4-sparse checkpoint (`tidepool sparsify`); default: detected from "
              "the checkpoint; 2:4 asked of a dense checkpoint is an error", choices=("2:4",), managed=True,
              engine_field="sparsity"),
    ServeFlag("speculative-config", "json", None,
              'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
              '\'{"method": "draft", "draft_model": PATH, "num_speculative_tokens": 4}\'',
              managed=True, engine_field="speculative_config"),
    ServeFlag("enable-lora", "switch", False, "serve LoRA adapters on the base model (the request's `model` picks "
              "one)", group="lora", managed=True, engine_field="enable_lora"),
    ServeFlag("max-loras", "int", 1, "adapters resident at once (device slots); a request whose adapter is not "
              "resident waits", group="lora", managed=True, engine_field="max_loras", ge=1),
    ServeFlag("max-lora-rank", "int", 16, "largest adapter rank accepted", group="lora", managed=True,
              engine_field="max_lora_rank", ge=1, le=1024),
    ServeFlag("max-cpu-loras", "int", None, "adapters kept loaded in host memory (LRU); default: --max-loras",
              group="lora", managed=True, engine_field="max_cpu_loras", ge=1),
    ServeFlag("lora-modules", "list", None, "adapters to load at start, as name=path (or vLLM's JSON "
              '\'{"name": ..., "path": ...}\')', group="lora"),
    ServeFlag("allow-runtime-lora-updating", "switch", False, "enable POST /v1/load_lora_adapter and "
              "/v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)", group="lora", managed=True),
    ServeFlag("role", "str", "unified",
              "'prefill' sends prompt KV to decode engines; 'decode' receives it on --kv-port", group="disagg",
              choices=("unified", "prefill", "decode"), managed=True, engine_field="role"),
    ServeFlag("kv-port", "int", 14579,
              "TCP port of the KV receiver (decode role; parallel rank r listens on this + r; 0: any free port)",
              group="disagg", managed=True, engine_field="kv_port", ge=0, le=65535),
    ServeFlag("kv-transfer-timeout", "float", 30.0, "seconds a KV transfer may take end to end", group="disagg",
              engine_field="kv_transfer_timeout", gt=0),
    ServeFlag("tensor-parallel-size", "int", 1, "ranks each layer is split over (heads, MLP, vocab)",
              group="parallel", aliases=("-tp",), managed=True, engine_field="tensor_parallel_size", ge=1),
    ServeFlag("pipeline-parallel-size", "int", 1, "pipeline stages the decoder layers are split into",
              group="parallel", aliases=("-pp",), managed=True, engine_field="pipeline_parallel_size", ge=1),
    ServeFlag("nnodes", "int", 1, "nodes the tp x pp ranks span (tp*pp/nnodes each)", group="parallel",
              managed=True, engine_field="nnodes", ge=1),
    ServeFlag("node-rank", "int", 0, "this node's index: 0 serves the API, others run worker ranks only "
              "(and a health endpoint on --port)", group="parallel", managed=True),
    ServeFlag("master-addr", "str", None, "node 0's address; default $MASTER_ADDR or 127.0.0.1", group="parallel",
              managed=True, engine_field="master_addr"),
    ServeFlag("master-port", "int", None, "rendezvous port on node 0; default $MASTER_PORT or 29500 "
              "(LLM(...): a free port)", group="parallel", managed=True, engine_field="master_port", ge=1, le=65535),
    ServeFlag("host", "str", "0.0.0.0", "address the HTTP server binds", group="server", managed=True),
    ServeFlag("port", "int", 8000, "HTTP port (node 0: the API; other nodes: the health endpoint)", group="server",
              managed=True),
    ServeFlag("served-model-name", "str", None, "the model id clients use; default: --model", group="server",
              managed=True),
    ServeFlag("max-queue-len", "int", 1024, "engine requests allowed to wait before new requests get 429",
              group="server", ge=0),
    ServeFlag("retry-after", "int", 1, "seconds sent in Retry-After with a 429", group="server", ge=0),
    ServeFlag("drain-timeout", "float", 30.0, "seconds in-flight requests get to finish after SIGTERM",
              group="server", managed=True),
    ServeFlag("access-log", "switch", False, "log every HTTP request", group="server"),
    ServeFlag("enable-sleep-mode", "switch", False, "serve vLLM's POST /sleep?level=1|2, POST /wake_up and GET "
              "/is_sleeping (an idle engine releases its KV cache, and at level 2 its weights; contract/sleep.py)",
              group="server", managed=True),
    ServeFlag("enable-auto-tool-choice", "switch", False, 'allow tool_choice "auto" (the default with tools): '
              "the output is parsed for calls by --tool-call-parser", group="server"),
    ServeFlag("tool-call-parser", "str", None, "the format the model writes tool calls in (vLLM's names): hermes "
              "(<tool_call> JSON blocks: Qwen2.5, Hermes; SmolLM2's JSON lists in them too)", group="server"),
    # `tidepool router` takes the same (AUTH_FLAGS); the environment's key only when neither flag is given.
    ServeFlag("api-key", "list", None, "require an API key (`Authorization: Bearer KEY` or `x-api-key: KEY`) "
              "on all but the probes and /metrics; repeatable, any one of the keys is accepted. Shows in the "
              "process list: prefer --api-key-file or $TIDEPOOL_API_KEY", group="auth"),
    ServeFlag("api-key-file", "str", None, "a file of accepted keys, one a line (blank and # lines ignored), "
              "re-read when it changes (a mounted Secret rotates in place)", group="auth"),
    # Also caps the event loop's JSON parsing of one body (worst case ~0.1 s per MB on a slow core).
    ServeFlag("max-body-bytes", "int", 16 << 20, "largest request body accepted; larger ones get 413 "
              "(default: 16 MiB)", group="limits", gt=0),
    ServeFlag("body-read-timeout", "float", 30.0, "seconds a client may pause while sending a request body "
              "before it gets 408", group="limits", gt=0),
)  # fmt: skip

FLAGS: dict[str, ServeFlag] = {f.name: f for f in SERVE_FLAGS}
# `tidepool generate`'s engine flags (beside its own prompt and sampling ones): the model and the
# "engine (as LLM(...))" section, spelled as `tidepool serve` spells them.
GENERATE_FLAGS: tuple[ServeFlag, ...] = tuple(f for f in SERVE_FLAGS if f.group in ("", "engine"))
# The API-key flags, which `tidepool router` takes as `tidepool serve` does (tidepool.common.api_key reads them).
AUTH_FLAGS: tuple[ServeFlag, ...] = tuple(f for f in SERVE_FLAGS if f.group == "auth")


def flag_default(name: str) -> Any:
    """The default of one flag (what the server uses when it is absent)."""
    return FLAGS[name].default


def managed_flags() -> tuple[ServeFlag, ...]:
    return tuple(f for f in SERVE_FLAGS if f.managed)


def managed_spellings() -> tuple[str, ...]:
    """Every long option of a managed flag, sorted (`--no-x` included for negatable ones)."""
    return tuple(sorted(s for f in managed_flags() for s in f.spellings()))


def add_to_parser(parser: argparse.ArgumentParser, flags: Iterable[ServeFlag] = SERVE_FLAGS) -> None:
    """Add `flags` to `parser`, grouped under GROUPS' titles."""
    sections: dict[str, Any] = {"": parser}
    for flag in flags:
        section = sections.get(flag.group)
        if section is None:
            section = sections[flag.group] = parser.add_argument_group(GROUPS[flag.group])
        spellings = (flag.option, *flag.aliases)
        if flag.kind == "bool":
            action = argparse.BooleanOptionalAction
            section.add_argument(*spellings, action=action, default=flag.default, help=flag.help)
        elif flag.kind == "switch":
            section.add_argument(*spellings, action="store_true", help=flag.help)
        elif flag.kind == "list":
            # "extend": `--x a b` and `--x a --x b` both give [a, b]
            section.add_argument(*spellings, nargs="+", action="extend", type=str, default=flag.default, help=flag.help)
        else:
            section.add_argument(
                *spellings,
                type=_converter(flag),
                default=flag.default,
                choices=flag.choices,
                required=flag.required and not flag.positional,  # a bare value may stand in for it
                help=flag.help,
            )
        if flag.positional:
            section.add_argument(
                _positional_dest(flag), nargs="?", metavar=flag.name.upper(), help=f"the same as {flag.option}"
            )


def _converter(flag: ServeFlag) -> Callable[[str], Any]:
    """argparse's `type` for a valued flag: the kind's type, checked against the flag's bounds."""
    kind_type = _TYPES[flag.kind]
    if not flag.bounds:
        return kind_type

    def convert(raw: str) -> Any:
        value = kind_type(raw)  # a ValueError here reads "invalid int value: 'x'"
        problem = flag.bound_violation(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{problem}, got {raw}")
        return value

    convert.__name__ = kind_type.__name__  # what argparse names in "invalid int value"
    return convert


def _positional_dest(flag: ServeFlag) -> str:
    return f"{flag.dest}_positional"


def resolve_positionals(
    parser: argparse.ArgumentParser, args: argparse.Namespace, flags: Iterable[ServeFlag] = SERVE_FLAGS
) -> argparse.Namespace:
    """Fold each positional flag's bare value into its option; exits via `parser.error` (status 2) when
    both are given and differ, or when a required one is given neither way."""
    for flag in flags:
        if not flag.positional:
            continue  # argparse itself enforces `required` for the others
        bare = vars(args).pop(_positional_dest(flag), None)
        given = getattr(args, flag.dest)
        if bare is not None and given is not None and bare != given:
            parser.error(f"the {flag.name} is given twice ({bare!r} and {flag.option} {given!r}); give it once")
        if given is None:
            setattr(args, flag.dest, bare)
        if flag.required and getattr(args, flag.dest) is None:
            parser.error(f"{flag.option} (or bare: {flag.name.upper()}) is required")
    return args


def parse_json_object(flag: ServeFlag, raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag.option} is not valid JSON ({err}); pass a JSON object") from err
    if not isinstance(value, dict):
        raise ValueError(f'{flag.option} must be a JSON object, e.g. {{"method": "ngram", ...}}')
    return value


def engine_kwargs(args: argparse.Namespace, flags: Iterable[ServeFlag] = SERVE_FLAGS) -> dict[str, Any]:
    """`EngineConfig` keywords of the parsed `flags` (JSON flags decoded); raises ValueError naming a bad flag."""
    out: dict[str, Any] = {}
    for flag in flags:
        if flag.engine_field is None:
            continue
        value = getattr(args, flag.dest)
        if flag.kind == "json" and value is not None:
            value = parse_json_object(flag, value)
        out[flag.engine_field] = value
    return out


def render_args(values: Mapping[str, Any], *, managed_only: bool = False) -> list[str]:
    """argv for `{flag name: value}`, sorted by option; None leaves a flag out.

    Raises KeyError for a name that is not a serve flag, and (with `managed_only`) ValueError for a
    flag the operator does not manage: users may override those through extraArgs, so the operator
    setting one would be a silent conflict.
    """
    rendered: list[list[str]] = []
    for name, value in values.items():
        flag = FLAGS.get(name)
        if flag is None:
            raise KeyError(f"--{name} is not a `tidepool serve` flag (see tidepool.contract.serve_flags)")
        if managed_only and not flag.managed:
            raise ValueError(f"{flag.option} is not marked managed in tidepool.contract.serve_flags")
        tokens = flag.render(value)
        if tokens:
            rendered.append(tokens)
    return [token for tokens in sorted(rendered) for token in tokens]
