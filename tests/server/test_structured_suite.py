"""Structured outputs end to end: the JSON-schema suite against the real SmolLM2 through `tidepool serve`.

What is checked, with the official `openai` client (AsyncOpenAI, ~16 requests in flight):
- every schema of `structured_schemas.SCHEMAS` as `response_format` json_schema (strict), greedy and
  sampled (seeded, temperature 0.7), in batches mixed with unconstrained requests: every constrained
  output finishes with "stop", parses with `json.loads` and validates with `jsonschema` (Draft
  2020-12, formats asserted); only for a schema that admits outputs of any length (`bounded=False`)
  may the model run into max_tokens instead;
- a subset again on a server with n-gram speculation on, and on one whose tiny KV cache forces
  preemption (checked through `vllm:num_preemptions_total`);
- the SDK's `chat.completions.parse` / `.stream` with pydantic models; vLLM's `structured_outputs`
  extension (json, regex, choice, grammar) on completions and chat; `n=3` with a schema.
A failure names the schema and shows the model's output; all failures of a batch are listed at once.
The suite's own invariants (valid schemas, satisfiable examples, llguidance compiles them) are
checked first, without a model, in the one test here that is not `slow`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serve_proc import MODEL_NAME, Server, start_server
from structured_schemas import PARSE_MODELS, SCHEMAS, SUBSET, SchemaCase

from tidepool.contract import metrics_names

MAX_TOKENS = 300
# Sampling as chat front-ends do; at 1.0 the 135M model writes numbers with digits without end (a bounded
# number's grammar allows any number of fraction digits), which says nothing about the engine.
SAMPLED_TEMPERATURE = 0.7
CONCURRENCY = 16
SEED = 1234
UNCONSTRAINED_EVERY = 3  # one unconstrained request after every third constrained one
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
PREEMPT_FLAGS = ("--max-model-len", "512", "--num-kv-blocks", "40")  # 640 token slots for 16 requests

_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_TIME_RE = re.compile(f"^{_TIME}$")
_DATE_TIME_RE = re.compile(f"^([0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}})[Tt]{_TIME}$")

# jsonschema asserts "time" and "date-time" only with optional packages; RFC 3339 checks of our own instead.
FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("time")
def _is_time(value: object) -> bool:
    return not isinstance(value, str) or _TIME_RE.match(value) is not None


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    match = _DATE_TIME_RE.match(value)
    return match is not None and dt.date.fromisoformat(match.group(1)) is not None


def validation_errors(schema: dict[str, Any], instance: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(instance)]


def test_suite_cases_are_valid_and_satisfiable(tiny_model_dir: Path) -> None:
    import llguidance

    tokenizer = llguidance.LLTokenizer(str(tiny_model_dir / "tokenizer.json"))
    assert len(SCHEMAS) >= 60 and len({case.name for case in SCHEMAS}) == len(SCHEMAS)
    problems = []
    for case in SCHEMAS:
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", case.name), case.name
        jsonschema.Draft202012Validator.check_schema(case.schema)
        problems += [f"{case.name}: example invalid: {e}" for e in validation_errors(case.schema, case.example)]
        grammar = llguidance.LLMatcher.grammar_from_json_schema(case.schema)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error or messages:
            problems.append(f"{case.name}: llguidance: {messages}")
            continue
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        tokens = tokenizer.tokenize_str(json.dumps(case.example))
        if matcher.try_consume_tokens(tokens) != len(tokens) or not matcher.is_accepting():
            problems.append(f"{case.name}: llguidance refuses the example {json.dumps(case.example)}")
    assert not problems, "\n".join(problems)


# --- servers ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_server(smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = start_server(smollm_gguf, tmp_path_factory.mktemp("structured-serve"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def smollm_client(smollm_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm_server.api, api_key="unused", max_retries=0, timeout=300)


def metric_total(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"{name}_total{{") or line.startswith(f"{name}_total "))  # fmt: skip


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def json_schema_format(case: SchemaCase) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema, "strict": True}}


def check_output(case: SchemaCase, label: str, finish_reason: str | None, text: str | None) -> str | None:
    """None if `text` is a finished, valid instance of the case's schema; else what is wrong, with the output."""
    problem = None
    if finish_reason == "length" and not case.bounded:
        # The schema admits outputs of any length (an unbounded array, string or nesting) and the 135M model
        # repeated itself until max_tokens: the constraint held every token, the model did not finish.
        return None
    if finish_reason != "stop":
        problem = f"finish_reason {finish_reason!r}"
    else:
        try:
            errors = validation_errors(case.schema, json.loads(text or ""))
            problem = "; ".join(errors) or None
        except json.JSONDecodeError as err:
            problem = f"not JSON ({err})"
    return None if problem is None else f"{case.name} [{label}]: {problem}; output: {(text or '')[:400]!r}"


# --- the mixed batch ------------------------------------------------------------------------------------


async def _constrained(client: openai.AsyncOpenAI, gate: asyncio.Semaphore, case: SchemaCase,
                       temperature: float, seed: int) -> str | None:  # fmt: skip
    label = f"temperature {temperature}, seed {seed}"
    async with gate:
        try:
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=messages(case.prompt), response_format=json_schema_format(case),
                temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
            )  # fmt: skip
        except openai.APIError as err:
            return f"{case.name} [{label}]: request failed: {err}"
    choice = resp.choices[0]
    if choice.finish_reason == "length":
        print(f"  {case.name} [{label}] ran into max_tokens (bounded={case.bounded})")
    return check_output(case, label, choice.finish_reason, choice.message.content)


async def _unconstrained(client: openai.AsyncOpenAI, gate: asyncio.Semaphore, index: int) -> str | None:
    topics = ("a lighthouse", "a lost key", "the first snow", "a robot chef", "a quiet library")
    async with gate:
        try:
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=messages(f"Tell me a short story about {topics[index % len(topics)]}."),
                temperature=0.8 if index % 2 else 0.0, seed=SEED + index, max_tokens=48,
            )  # fmt: skip
        except openai.APIError as err:
            return f"unconstrained #{index}: request failed: {err}"
    choice = resp.choices[0]
    if choice.finish_reason not in ("stop", "length") or resp.usage is None or resp.usage.completion_tokens < 1:
        return f"unconstrained #{index}: finish_reason {choice.finish_reason!r}, usage {resp.usage}"
    return None


async def _mixed_batch(server: Server, cases: tuple[SchemaCase, ...]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=900)
    gate = asyncio.Semaphore(CONCURRENCY)
    jobs = []
    for i, case in enumerate(cases):
        for temperature in (0.0, SAMPLED_TEMPERATURE):
            jobs.append(_constrained(client, gate, case, temperature, SEED + i))
        if i % UNCONSTRAINED_EVERY == 0:
            jobs.append(_unconstrained(client, gate, i))
    try:
        return [failure for failure in await asyncio.gather(*jobs) if failure]
    finally:
        await client.close()


def run_suite(server: Server, cases: tuple[SchemaCase, ...]) -> None:
    failures = asyncio.run(_mixed_batch(server, cases))
    assert not failures, f"{len(failures)} of {2 * len(cases)} constrained requests failed:\n" + "\n".join(failures)


@pytest.mark.slow
def test_every_schema_greedy_and_sampled_in_mixed_batches(smollm_server: Server) -> None:
    run_suite(smollm_server, SCHEMAS)
    smollm_server.wait_pool_free(timeout=60)


def run_subset_on_own_server(smollm: Path, log_dir: Path, flags: tuple[str, ...], metric: str, what: str) -> None:
    """The subset on a server started with `flags`; `metric` (a counter) shows the flags took effect."""
    server = start_server(smollm, log_dir, *flags)
    try:
        run_suite(server, SUBSET)
        assert metric_total(server, metric) > 0, what
        server.wait_pool_free(timeout=60)
    finally:
        server.stop()


@pytest.mark.slow
def test_subset_with_ngram_speculation(smollm_gguf: Path, tmp_path: Path) -> None:
    flags = ("--speculative-config", NGRAM)
    run_subset_on_own_server(smollm_gguf, tmp_path, flags, metrics_names.SPEC_DECODE_NUM_DRAFT_TOKENS,
                             "no token was ever proposed")  # fmt: skip


@pytest.mark.slow
def test_subset_after_forced_preemption(smollm_gguf: Path, tmp_path: Path) -> None:
    run_subset_on_own_server(smollm_gguf, tmp_path, PREEMPT_FLAGS, metrics_names.NUM_PREEMPTIONS,
                             "the small KV cache preempted nothing")  # fmt: skip


# --- the SDK's helpers, the vLLM extension, n > 1 ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", PARSE_MODELS, ids=lambda m: m.__name__)
def test_sdk_parse_and_stream_with_a_pydantic_model(smollm_client: openai.OpenAI, model: type) -> None:
    prompt = f"Give an example {model.__name__} as JSON."
    parsed = smollm_client.chat.completions.parse(model=MODEL_NAME, messages=messages(prompt), response_format=model,
                                                  temperature=0, max_tokens=MAX_TOKENS)  # fmt: skip
    message = parsed.choices[0].message
    assert parsed.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, model), message.content
    with smollm_client.chat.completions.stream(
        model=MODEL_NAME,
        messages=messages(prompt),
        response_format=model,
        temperature=1.0,
        seed=SEED,
        max_tokens=MAX_TOKENS,
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop", final.choices[0].message.content
    assert isinstance(final.choices[0].message.parsed, model)
    assert "".join(deltas) == final.choices[0].message.content


@pytest.mark.slow
def test_json_object(smollm_client: openai.OpenAI) -> None:
    resp = smollm_client.chat.completions.create(
        model=MODEL_NAME, messages=messages("Describe a cat with its name and age as a small JSON object."),
        response_format={"type": "json_object"}, temperature=0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text or ""), dict), text


REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
LARK = 'start: GREETING " " NAME "!"\nGREETING: "hello" | "hi"\nNAME: /[A-Z][a-z]{1,8}/'
LARK_RE = r"(hello|hi) [A-Z][a-z]{1,8}!"
GBNF = 'root ::= answer "."\nanswer ::= "yes" | "no"'
EXTENSION_CASES = {
    "regex": ({"regex": REGEX}, "Give a fictional local phone number.", REGEX),
    "choice": ({"choice": CHOICES}, "Is 'I love it' positive, negative or neutral?", "|".join(CHOICES)),
    "lark": ({"grammar": LARK}, "Greet someone by their first name.", LARK_RE),
    "gbnf": ({"grammar": GBNF}, "Is water wet? Answer yes or no.", r"(yes|no)\."),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", EXTENSION_CASES)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_structured_outputs_extension(smollm_client: openai.OpenAI, endpoint: str, kind: str) -> None:
    constraint, prompt, pattern = EXTENSION_CASES[kind]
    extra = {"structured_outputs": constraint}
    for temperature in (0.0, 1.0):
        if endpoint == "chat":
            chat = smollm_client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages(prompt),
                max_tokens=64,
                temperature=temperature,
                seed=SEED,
                extra_body=extra,
            )
            finish, text = chat.choices[0].finish_reason, chat.choices[0].message.content or ""
        else:
            completion = smollm_client.completions.create(
                model=MODEL_NAME,
                prompt=f"{prompt}\nAnswer: ",
                max_tokens=64,
                temperature=temperature,
                seed=SEED,
                extra_body=extra,
            )
            finish, text = completion.choices[0].finish_reason, completion.choices[0].text
        assert finish == "stop" and re.fullmatch(pattern, text), (temperature, finish, text)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_json_extension(smollm_client: openai.OpenAI, endpoint: str) -> None:
    case = SUBSET[0]
    extra = {"structured_outputs": {"json": case.schema}}
    if endpoint == "chat":
        chat = smollm_client.chat.completions.create(
            model=MODEL_NAME, messages=messages(case.prompt), max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        finish, text = chat.choices[0].finish_reason, chat.choices[0].message.content
    else:
        completion = smollm_client.completions.create(
            model=MODEL_NAME, prompt=f"{case.prompt}\n", max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        finish, text = completion.choices[0].finish_reason, completion.choices[0].text
    failure = check_output(case, endpoint, finish, text)
    assert failure is None, failure


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n3_with_a_schema_gives_three_valid_outputs(smollm_client: openai.OpenAI, stream: bool) -> None:
    case = SUBSET[1]
    args: dict[str, Any] = dict(model=MODEL_NAME, messages=messages(case.prompt), n=3, temperature=1.0, seed=SEED,
                                response_format=json_schema_format(case), max_tokens=MAX_TOKENS)  # fmt: skip
    if stream:
        texts, finishes = ["", "", ""], [None, None, None]
        for chunk in smollm_client.chat.completions.create(**args, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        outputs = list(zip(finishes, texts, strict=True))
    else:
        resp = smollm_client.chat.completions.create(**args)
        outputs = [(c.finish_reason, c.message.content) for c in sorted(resp.choices, key=lambda c: c.index)]
    assert len(outputs) == 3
    failures = [check_output(case, f"choice {i}", f, t) for i, (f, t) in enumerate(outputs)]
    assert not any(failures), "\n".join(filter(None, failures))
