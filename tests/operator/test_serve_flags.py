"""The serve-flag table, `tidepool serve`'s parser, `EngineConfig`, the builder's engine args and MANAGED_FLAGS
agree, flag by flag.

Every check is driven by `SERVE_FLAGS` (one parametrized case per flag or spelling), so a flag added to
the table is checked without touching this file; a flag added anywhere else fails here. Where values must
agree, real argv goes through the real parsers and is compared with hand-written `LLM(...)` keywords.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import types
from typing import Any

import pytest

from tidepool.contract import serve_flags
from tidepool.contract.serve_flags import FLAGS, SERVE_FLAGS, ServeFlag, managed_spellings, render_args
from tidepool.engine.engine_config import SERVE_FLAG_KEY, EngineConfig
from tidepool.engine.server.cli import build_parser, engine_config, parse_args
from tidepool.operator.api import InferenceServiceSpec, rules, serve_flag_fields, validate_spec
from tidepool.operator.builders import ClusterFeatures, ServiceView, desired_state

BASE: dict[str, Any] = {
    "model": {"uri": "hf://org/model"},
    "resources": {"gpusPerReplica": 1},
    "pools": {"unified": {"replicas": 1}},
}
DISAGG = {**BASE, "mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}}
MULTI_NODE = {**BASE, "parallelism": {"tensor": 2, "pipeline": 2}, "resources": {"gpusPerReplica": 4}}
# Specs that together exercise every branch of the builder's flag rendering.
SPEC_MATRIX: list[tuple[dict[str, Any], ClusterFeatures]] = [
    (BASE, ClusterFeatures()),
    ({**BASE, "engine": {"prefixCaching": False, "chunkedPrefill": False}}, ClusterFeatures()),
    ({**BASE, "engine": {"maxModelLen": 2048, "maxNumBatchedTokens": 4096}}, ClusterFeatures()),
    ({**BASE, "model": {"uri": "hf://org/model", "quantization": "int4"}}, ClusterFeatures()),
    ({**BASE, "model": {"uri": "hf://org/model", "sparsity": "2:4"}}, ClusterFeatures()),
    ({**BASE, "engine": {"speculative": {"method": "draft", "draftModel": "hf://org/draft"}}}, ClusterFeatures()),
    (DISAGG, ClusterFeatures()),
    (MULTI_NODE, ClusterFeatures()),
    (MULTI_NODE, ClusterFeatures(has_lws=True)),
    ({**BASE, "lora": {"maxAdapters": 2, "maxRank": 32, "maxCpuAdapters": 4}}, ClusterFeatures()),
    ({**BASE, "autoscaling": {"enabled": True, "idle": "sleep"}}, ClusterFeatures()),
]
RANK_ENV = {
    "TIDEPOOL_NODE_RANK": "1",
    "TIDEPOOL_MASTER_ADDR": "svc-unified-g0-0.svc-unified-hl.ns.svc",
    "LWS_WORKER_INDEX": "1",
    "LWS_LEADER_ADDRESS": "svc-unified-0.svc-unified",
}


def engine_arg_lists(spec: dict[str, Any], features: ClusterFeatures) -> list[list[str]]:
    """The engine containers' args of every pool, $(VAR)s expanded as the kubelet would."""
    out = []
    for child in desired_state("svc", "ns", ServiceView.from_spec(spec), features).children:
        if child["kind"] not in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
            continue
        pod = child["spec"].get("template") or child["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        if pod["spec"]["containers"][0]["name"] != "engine":  # the router
            continue
        args = pod["spec"]["containers"][0]["args"]
        out.append([re.sub(r"\$\((\w+)\)", lambda m: RANK_ENV[m.group(1)], a) for a in args])
    return out


def option_of(spelling: str) -> ServeFlag:
    name = spelling.removeprefix("--")
    flag = FLAGS.get(name) or FLAGS[name.removeprefix("no-")]
    assert spelling in flag.spellings()
    return flag


def test_table_module_imports_nothing_heavy() -> None:
    """The operator image has no torch and imports the table: it must stay stdlib-only."""
    code = (
        "import sys; import tidepool.contract.serve_flags; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'pydantic', 'fastapi') "
        "or (m.startswith('tidepool.') and m.split('.')[1] != 'contract')]; "
        "sys.exit(f'imported {heavy}' if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr + result.stdout


def test_table_is_well_formed() -> None:
    assert len(FLAGS) == len(SERVE_FLAGS), "duplicate flag names"
    for flag in SERVE_FLAGS:
        assert not flag.name.startswith("-") and flag.name == flag.name.lower(), flag.name
        assert flag.group in serve_flags.GROUPS and flag.help, flag.name
        assert flag.choices is None or flag.default is None or flag.default in flag.choices, flag.name
        assert not flag.bounds or flag.kind in ("int", "float"), flag.name
        assert flag.default is None or flag.bound_violation(flag.default) is None, flag.name


def _actions() -> dict[str, argparse.Action]:
    return {option: action for action in build_parser()._actions for option in action.option_strings}


@pytest.mark.parametrize("flag", SERVE_FLAGS, ids=lambda f: f.name)
def test_parser_has_exactly_the_tables_flag(flag: ServeFlag) -> None:
    action = _actions()[flag.option]
    assert action.dest == flag.dest and action.default == flag.default
    assert action.required == (flag.required and not flag.positional)  # a bare value may stand in
    assert tuple(action.choices) == flag.choices if flag.choices else action.choices is None
    assert all(alias in action.option_strings for alias in flag.aliases)
    if flag.kind == "bool":
        assert f"--no-{flag.name}" in action.option_strings
    elif flag.kind == "switch":
        assert action.nargs == 0 and action.default is False
    elif flag.kind == "list":
        assert action.nargs == "+" and action.type is str
    else:
        assert action.type.__name__ == {"int": "int", "float": "float"}.get(flag.kind, "str")  # bounds: below


BOUND_CASES = [(flag, op, bound) for flag in SERVE_FLAGS for op, bound in flag.bounds.items()]


@pytest.mark.parametrize(("flag", "op", "bound"), BOUND_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_parser_enforces_the_tables_bounds(
    flag: ServeFlag, op: str, bound: float, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value just past a bound exits 2 naming it, and EngineConfig (LLM(...)) refuses it too; the bound itself
    passes where it is inclusive."""
    step = 1 if flag.kind == "int" else 0.5
    outside = bound - step if op in ("ge", "gt") else bound + step
    raw = str(int(outside) if flag.kind == "int" else outside)
    with pytest.raises(SystemExit) as exc:
        parse_args(["m", flag.option, raw])
    symbol = {"ge": ">=", "gt": ">", "le": "<="}[op]
    err = capsys.readouterr().err
    assert (
        exc.value.code == 2 and f"argument {flag.option}" in err and f": must be {symbol} {bound:g}, got {raw}" in err
    )
    if flag.engine_field:
        with pytest.raises(ValueError, match=flag.engine_field):
            EngineConfig(model="m", **{flag.engine_field: outside})
    if op != "gt":
        value = int(bound) if flag.kind == "int" else float(bound)
        assert getattr(parse_args(["m", flag.option, str(value)]), flag.dest) == value


def test_parser_has_no_flag_outside_the_table() -> None:
    known = {s for f in SERVE_FLAGS for s in (*f.spellings(), *f.aliases)} | {"-h", "--help"}
    assert set(_actions()) - known == set()


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        (["m"], "m"),
        (["--model", "m"], "m"),
        (["m", "--port", "9"], "m"),
        (["--port", "9", "m"], "m"),
        (["m", "--model", "m"], "m"),
    ],
)
def test_model_may_be_given_bare_as_vllm_serve_takes_it(argv: list[str], model: str) -> None:
    args = parse_args(argv)
    assert args.model == model and not hasattr(args, "model_positional")
    assert serve_flags.engine_kwargs(args)["model"] == model


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--model (or bare: MODEL) is required"),
        (["a", "--model", "b"], "the model is given twice ('a' and --model 'b')"),
        (["a", "b"], "unrecognized arguments: b"),
    ],
)
def test_model_missing_or_given_twice_is_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_parser_refuses_abbreviations() -> None:
    """--max-num=8 must not reach --max-num-seqs past the CRD's exact-name rule."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--max-num=8"])


def test_builder_emits_exactly_the_managed_flags() -> None:
    emitted = {a for spec, features in SPEC_MATRIX for args in engine_arg_lists(spec, features) for a in args}
    spellings = {a for a in emitted if a.startswith("--")}
    managed = {f.option for f in serve_flags.managed_flags()}
    assert {option_of(s).option for s in spellings} == managed
    assert spellings <= set(managed_spellings())


@pytest.mark.parametrize(("spec", "features"), SPEC_MATRIX)
def test_builder_args_parse_back_to_the_spec(spec: dict[str, Any], features: ClusterFeatures) -> None:
    """What the pod runs is what the spec says, read back through the real parser and the table's EngineConfig map."""
    model = InferenceServiceSpec.model_validate(spec)
    for args in engine_arg_lists(spec, features):
        parsed = build_parser().parse_args(args)
        for field, flag in serve_flag_fields().items():
            assert getattr(parsed, FLAGS[flag].dest) == getattr(model.engine, field), flag
        kwargs = serve_flags.engine_kwargs(parsed)
        assert kwargs["tensor_parallel_size"] == model.parallelism.tensor
        assert kwargs["pipeline_parallel_size"] == model.parallelism.pipeline
        assert kwargs["quantization"] == (None if model.model.quantization == "none" else model.model.quantization)
        if model.engine.speculative is not None:
            assert (
                kwargs["speculative_config"]["num_speculative_tokens"]
                == model.engine.speculative.num_speculative_tokens
            )


@pytest.mark.parametrize("spelling", managed_spellings())
def test_every_managed_spelling_is_refused_in_extra_args(spelling: str) -> None:
    assert tuple(s.removeprefix("--") for s in managed_spellings()) == rules.MANAGED_FLAGS
    message = next(r.message for r in rules.SPEC_RULES if r.message.startswith("engine.extraArgs must not"))
    for arg in (spelling, f"{spelling}=1"):
        spec = InferenceServiceSpec.model_validate({**BASE, "engine": {"extraArgs": [arg]}})
        assert message in validate_spec(spec), arg


@pytest.mark.parametrize("flag", [f for f in SERVE_FLAGS if not f.managed], ids=lambda f: f.name)
def test_unmanaged_flags_are_allowed_in_extra_args(flag: ServeFlag) -> None:
    args = [f"{s}=1" if flag.kind not in ("bool", "switch") else s for s in flag.spellings()]
    spec = InferenceServiceSpec.model_validate({**BASE, "engine": {"extraArgs": args}})
    assert validate_spec(spec) == []
    (engine_args,) = engine_arg_lists(spec.to_wire(), ClusterFeatures())
    assert engine_args[-len(args) :] == args  # last, in their order


def test_engine_config_fields_are_built_from_the_flags_that_name_them() -> None:
    """Each flag's `engine_field` is an EngineConfig field built by `flag_field` from that very flag, and every
    field built from a flag is that flag's `engine_field` (a field built from the wrong flag fails here)."""
    built_from = {
        name: (info.json_schema_extra or {}).get(SERVE_FLAG_KEY) for name, info in EngineConfig.model_fields.items()
    }
    expected = {f.engine_field: f.name for f in SERVE_FLAGS if f.engine_field}
    assert {field: flag for field, flag in built_from.items() if flag is not None} == expected
    assert [field for field, flag in built_from.items() if flag is None] == ["show_progress"]  # no flag sets it
    # LLM(...) takes the flags' own names: `--speculative-config X` is `LLM(speculative_config=X)`, as in vLLM.
    assert [(f, n) for f, n in expected.items() if f != n.replace("-", "_")] == []


def test_help_names_the_defaults_the_engine_picks() -> None:
    from tidepool.engine.engine_config import CPU_KV_CACHE_BYTES, MAX_NUM_BATCHED_TOKENS

    assert f"default: {CPU_KV_CACHE_BYTES >> 30} GiB" in FLAGS["kv-cache-memory-bytes"].help
    assert f"default: {MAX_NUM_BATCHED_TOKENS}" in FLAGS["max-num-batched-tokens"].help


# (argv of `tidepool serve m`, the `LLM("m", ...)` keywords it must equal), written out by hand.
ENGINE_ARGV_CASES: list[tuple[list[str], dict[str, Any]]] = [
    ([], {}),
    (
        ["--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--max-num-seqs", "8", "--block-size", "32",
         "--max-num-batched-tokens", "4096", "--dtype", "float32", "--seed", "7", "--device", "cpu"],
        {"enable_prefix_caching": False, "enable_chunked_prefill": False, "max_num_seqs": 8, "block_size": 32,
         "max_num_batched_tokens": 4096, "dtype": "float32", "seed": 7, "device": "cpu"},
    ),
    (
        ["--quantization", "int8", "--num-threads", "2", "--gpu-memory-utilization", "0.5", "--max-model-len", "128",
         "--kv-cache-memory-bytes", "1000", "--num-kv-blocks", "9", "--tokenizer", "t",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        {"quantization": "int8", "num_threads": 2, "gpu_memory_utilization": 0.5, "max_model_len": 128,
         "kv_cache_memory_bytes": 1000, "num_kv_blocks": 9, "tokenizer": "t",
         "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ),
]  # fmt: skip
SERVE_ONLY_ARGV_CASE = (
    ["--role", "decode", "--kv-port", "0", "--kv-transfer-timeout", "2.5", "-tp", "2", "-pp", "2", "--nnodes", "2",
     "--master-addr", "h", "--master-port", "1234"],
    {"role": "decode", "kv_port": 0, "kv_transfer_timeout": 2.5, "tensor_parallel_size": 2,
     "pipeline_parallel_size": 2, "nnodes": 2, "master_addr": "h", "master_port": 1234},
)  # fmt: skip


class GenerateStopped(Exception):
    """Raised by the fake LLM: `tidepool generate` got as far as building the engine."""


@pytest.mark.parametrize(("argv", "kwargs"), [*ENGINE_ARGV_CASES, SERVE_ONLY_ARGV_CASE])
def test_serve_argv_builds_the_config_llm_takes(
    argv: list[str], kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tidepool serve` and `LLM(...)` agree value by value, defaults included ([] = no flags)."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert engine_config(parse_args(["m", *argv])) == EngineConfig(model="m", show_progress=False, **kwargs)


@pytest.mark.parametrize(("argv", "kwargs"), ENGINE_ARGV_CASES)
def test_generate_argv_builds_the_config_llm_takes(
    argv: list[str], kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tidepool generate` spells its engine flags as `tidepool serve` does and hands LLM(...) the same keywords."""
    from tidepool.cli import main

    def fake_llm(**given: Any) -> None:
        raise GenerateStopped(EngineConfig(**given))

    monkeypatch.setitem(sys.modules, "tidepool.engine.llm", types.SimpleNamespace(LLM=fake_llm))  # no model loads
    with pytest.raises(GenerateStopped) as stopped:
        main(["generate", "m", *argv])
    assert stopped.value.args[0] == EngineConfig(model="m", **kwargs)


@pytest.mark.parametrize(("field", "flag"), sorted(serve_flag_fields().items()))
def test_a_default_inference_service_runs_the_engine_as_a_bare_serve_does(field: str, flag: str) -> None:
    """A field left unset in the CRD reaches the pod as the value `tidepool serve MODEL` takes with no flag: the
    builder's rendering of EngineSpec's default, parsed back by the real parser, equals the parser's own default."""
    assert FLAGS[flag].managed
    (pod_args,) = engine_arg_lists(BASE, ClusterFeatures())
    dest = FLAGS[flag].dest
    assert getattr(parse_args(pod_args), dest) == getattr(parse_args(["m"]), dest), field


def test_api_enumerations_come_from_the_table() -> None:
    schema = InferenceServiceSpec.model_json_schema(by_alias=True)["$defs"]
    assert tuple(schema["EngineSpec"]["properties"]["dtype"]["enum"]) == FLAGS["dtype"].choices
    quantization = schema["ModelSource"]["properties"]["quantization"]["enum"]
    assert tuple(quantization) == ("none", *FLAGS["quantization"].choices)


def test_render_args() -> None:
    values = {"port": 8000, "enable-prefix-caching": False, "max-model-len": None, "speculative-config": {"b": 1}}
    assert render_args(values) == ["--no-enable-prefix-caching", "--port", "8000", "--speculative-config", '{"b": 1}']
    assert render_args({"access-log": True}) == ["--access-log"] and render_args({"access-log": False}) == []
    with pytest.raises(KeyError, match="--bogus is not a `tidepool serve` flag"):
        render_args({"bogus": 1})
    with pytest.raises(ValueError, match="--seed is not marked managed"):
        render_args({"seed": 1}, managed_only=True)
    with pytest.raises(TypeError):
        render_args({"enable-prefix-caching": "yes"})


def test_help_lists_every_flag() -> None:
    text = build_parser().format_help()
    assert [f.option for f in SERVE_FLAGS if f.option not in text] == []
