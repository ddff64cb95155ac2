"""Tokenizer and IncrementalDetokenizer against transformers 5.x on made (random) model folders.

The folders come from `make_model`, whose tokenizer is a real byte-level BPE, so these tests
exercise multi-byte characters split over tokens, special tokens and ChatML templates.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidepool.engine.detokenizer import IncrementalDetokenizer
from tidepool.engine.make_model import make_model
from tidepool.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "",
    " leading space and trailing   ",
    "multiple    spaces\n\n\n\ttabs\r\nand CRLF",
    "héllo wörld — naïve café, 中文字符, 日本語, 한국어",
    "emoji 😀🚀✨ and flags 🇫🇷 and a ZWJ family 👨‍👩‍👧",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    '{"key": [1, 2.5, null], "other": "va\\"lue"}',
    "numbers 1234567890 3.14159 -42 1e10",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text with <s> and </s> markers and <|endoftext|> inside",
    "\u00a0non-breaking\u2003em space\u200bzero width",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2? 😀"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and\n  in code?"},
    ],
]

# A template that uses the transformers extras: raise_exception, tojson, namespace, loop controls,
# bos_token/eos_token variables, trim_blocks/lstrip_blocks whitespace handling.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
[{{ ns.count }}] {{ message['role'] | upper }}: {{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if tools %}TOOLS {{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}[{{ ns.count + 1 }}] ASSISTANT:{% endif %}"""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("tok-models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIDEPOOL_CACHE", str(root / "cache"))
        yield {arch: make_model(arch, "tiny", root / arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> tuple[Tokenizer, object]:
    folder = model_dirs[request.param]
    return Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


def _variant(base: Path, dest: Path, config_edit: dict[str, object], files: dict[str, str]) -> Path:
    shutil.copytree(base, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key, value in config_edit.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config))
    for name, text in files.items():
        (dest / name).write_text(text)
    return dest


# -- encoding and decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(pair: tuple[Tokenizer, object], text: str) -> None:
    ours, hf = pair
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(pair: tuple[Tokenizer, object], skip: bool) -> None:
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80))
def test_encode_random_text_matches_and_round_trips(model_dirs: dict[str, Path], text: str) -> None:
    ours = Tokenizer.from_pretrained(model_dirs["llama"])
    hf = _hf_tokenizer(model_dirs["llama"])
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80))
def test_qwen_encode_random_text_matches(model_dirs: dict[str, Path], text: str) -> None:
    # Qwen-style folders normalise to NFC, so only encoding (not the round trip) must agree.
    ours = Tokenizer.from_pretrained(model_dirs["qwen2"])
    assert ours.encode(text) == _hf_tokenizer(model_dirs["qwen2"])(text)["input_ids"]


_HF_CACHE: dict[Path, object] = {}


def _hf_tokenizer(folder: Path) -> object:
    if folder not in _HF_CACHE:
        _HF_CACHE[folder] = transformers.AutoTokenizer.from_pretrained(folder)
    return _HF_CACHE[folder]


def test_special_ids_and_vocab(model_dirs: dict[str, Path]) -> None:
    llama = Tokenizer.from_pretrained(model_dirs["llama"])
    hf = _hf_tokenizer(model_dirs["llama"])
    assert llama.vocab_size == 512 == len(hf)
    assert llama.bos_token_id == 1 == hf.bos_token_id
    assert llama.encode("x")[0] == 1
    # </s> from config/tokenizer plus <|im_end|> from generation_config.json
    assert llama.eos_token_ids == frozenset({2, llama.token_to_id("<|im_end|>")})
    assert set(llama.all_special_ids) == set(hf.all_special_ids)
    qwen = Tokenizer.from_pretrained(model_dirs["qwen2"])
    assert qwen.bos_token_id is None
    assert qwen.encode("x") == qwen.encode("x", add_special_tokens=False)
    assert qwen.eos_token_ids == frozenset({qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")})
    assert set(qwen.all_special_ids) == set(_hf_tokenizer(model_dirs["qwen2"]).all_special_ids)


def test_eos_from_every_source(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = _variant(model_dirs["llama"], tmp_path / "m", {"eos_token": {"content": "<|endoftext|>"}}, {})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [4, 2]}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({0, 2, 3, 4})


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*" + tmp_path.name):
        Tokenizer.from_pretrained(tmp_path)


# -- chat templates ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair: tuple[Tokenizer, object], add_generation_prompt: bool) -> None:
    ours, hf = pair
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert ours.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_rich_template_from_jinja_file(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    # A chat_template.jinja file wins over the config's template; bos/eos given as AddedToken dicts.
    edit = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": {"__type": "AddedToken", "content": "</s>"},
    }
    folder = _variant(model_dirs["llama"], tmp_path / "m", edit, {"chat_template.jinja": RICH_TEMPLATE})
    ours, hf = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "ü <b>"}}}]
    for messages in CONVERSATIONS:
        for tool_list in (None, tools):
            expected = hf.apply_chat_template(messages, tools=tool_list, tokenize=False, add_generation_prompt=True)
            assert ours.apply_chat_template(messages, tools=tool_list) == expected
    bad = [{"role": "robot", "content": "x"}]
    with pytest.raises(Exception, match="bad role robot"):
        ours.apply_chat_template(bad)


def test_named_templates(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D{{ messages[0]['content'] }}"},
             {"name": "tool_use", "template": "T{{ tools | length }}"}]  # fmt: skip
    folder = _variant(model_dirs["llama"], tmp_path / "m", {"chat_template": named}, {})
    ours, hf = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATIONS[0]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False) == "DHi there!"
    tools = [{"name": "a"}, {"name": "b"}]
    assert ours.apply_chat_template(messages, tools=tools) == "T2"
    assert ours.apply_chat_template(messages, chat_template="tool_use", tools=[]) == "T0"


def test_no_chat_template(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = _variant(model_dirs["qwen2"], tmp_path / "m", {"chat_template": None}, {})
    tokenizer = Tokenizer.from_pretrained(folder)
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])


# -- incremental detokenizer -------------------------------------------------------------------------------


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], object]:
    """Feeds ids one at a time; returns every delta (finish() included) and the stop match."""
    deltas, match = [], None
    for token_id in ids:
        match = detok.update([token_id])
        deltas.append(detok.get_delta_text())
        # What has been streamed must stay a prefix of the text, whatever comes later.
        assert detok.output_text.startswith("".join(deltas))
        if match is not None:
            break
    deltas.append(detok.finish())
    return deltas, match


@pytest.fixture(scope="module")
def llama_tok(model_dirs: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dirs["llama"])


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_stream_equals_full_decode(llama_tok: Tokenizer, text: str) -> None:
    prompt = llama_tok.encode("Prompt: ")
    ids = llama_tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(llama_tok, prompt, [], skip, False)
        deltas, match = _stream(detok, ids)
        assert match is None
        assert "".join(deltas) == detok.output_text == llama_tok.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in delta for delta in deltas)


def test_multibyte_character_split_over_tokens(llama_tok: Tokenizer) -> None:
    ids = llama_tok.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # a 512-token vocabulary spells the emoji's 4 bytes in several tokens
    detok = IncrementalDetokenizer(llama_tok, [], [], True, False)
    detok.update(ids[:1])
    assert detok.output_text == "a"
    for token_id in ids[1:-1]:
        detok.update([token_id])
        assert detok.output_text == "a"  # no U+FFFD while the character is incomplete
    detok.update(ids[-1:])
    assert detok.output_text == "a😀"


def test_unfinished_character_flushed_on_finish(llama_tok: Tokenizer) -> None:
    ids = llama_tok.encode("x😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(llama_tok, [], [], True, False)
    detok.update(ids)
    assert detok.output_text == "x"
    assert detok.get_delta_text() == "x"
    assert detok.finish().startswith("\ufffd")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(llama_tok: Tokenizer, include: bool) -> None:
    ids = llama_tok.encode("say QXZSTOP now please", add_special_tokens=False)
    stop_ids = llama_tok.encode("QXZSTOP", add_special_tokens=False)
    assert len(stop_ids) > 1
    detok = IncrementalDetokenizer(llama_tok, [], ["never", "QXZSTOP"], True, include)
    deltas, match = _stream(detok, ids)
    assert match is not None and match.stop_str == "QXZSTOP"
    expected = "say QXZSTOP" if include else "say "
    assert detok.output_text == expected == "".join(deltas)
    assert "Q" not in "".join(deltas[:-1]) or include  # held back until the stop was decided


def test_held_back_text_released_when_stop_cannot_match(llama_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(llama_tok, [], ["<END>"], True, False)
    detok.update(llama_tok.encode("abc <EN", add_special_tokens=False))
    assert detok.get_delta_text() == "abc "  # "<EN" could start "<END>"
    detok.update(llama_tok.encode("x", add_special_tokens=False))
    assert detok.get_delta_text() == "<ENx"
    assert detok.finish() == ""


def test_batched_update_reports_tokens_used(llama_tok: Tokenizer) -> None:
    ids = llama_tok.encode("one two three four", add_special_tokens=False)
    prefix_ids = llama_tok.encode("one two", add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tok, [], [" two"], True, False)
    match = detok.update(ids)
    assert match is not None and match.num_tokens_used == len(prefix_ids)
    assert detok.output_text == "one"
    assert detok.update(ids) is match  # later tokens are ignored once stopped


def test_special_tokens_skipped_or_kept(llama_tok: Tokenizer) -> None:
    ids = llama_tok.encode("hi<|im_end|>", add_special_tokens=False)
    kept = IncrementalDetokenizer(llama_tok, [1], [], False, False)
    kept.update(ids)
    kept.finish()
    assert kept.output_text == "hi<|im_end|>"
    skipped = IncrementalDetokenizer(llama_tok, [1], [], True, False)
    skipped.update(ids)
    skipped.finish()
    assert skipped.output_text == "hi"
    stopped = IncrementalDetokenizer(llama_tok, [], ["<|im_end|>"], False, False)
    assert stopped.update(ids) is not None and stopped.output_text == "hi"


def test_work_per_token_is_bounded(llama_tok: Tokenizer) -> None:
    ids = llama_tok.encode("lorem ipsum 😀 dolor " * 300, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tok, llama_tok.encode("p" * 50), ["zzz"], True, False)
    largest_window = 0
    for token_id in ids:
        detok.update([token_id])
        largest_window = max(largest_window, len(detok._window_ids))
    assert largest_window <= 8  # decode work per token does not grow with the sequence


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.sampled_from(list("ab cé😀\n")), max_size=40),
    stop=st.text(alphabet=st.sampled_from(list("ab cé😀\n")), min_size=1, max_size=4),
    include=st.booleans(),
)
def test_stop_property(llama_tok: Tokenizer, text: str, stop: str, include: bool) -> None:
    ids = llama_tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tok, [], [stop], True, include)
    deltas, match = _stream(detok, ids)
    index = text.find(stop)
    if index == -1:
        assert match is None and detok.output_text == text
    else:
        assert match is not None
        assert detok.output_text == text[: index + (len(stop) if include else 0)]
    assert "".join(deltas) == detok.output_text
