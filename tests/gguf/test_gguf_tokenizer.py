"""The tokenizer rebuilt from GGUF metadata encodes, decodes and renders chats exactly as transformers does.

transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) is the reference,
on >= 1,000 varied strings (`tokenizer_strings.py`): the real SmolLM2 file (byte-level BPE, ``smollm``
pre-tokenizer, ChatML template), synthetic byte-level files with other pre-tokenizers, and a synthetic
SentencePiece (``llama``) vocabulary whose merges must be derived from the scores. The synthetic
byte-level file made from a `tokenizer.json` must also encode exactly like that `tokenizer.json`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_files import hf_to_gguf, sentencepiece_metadata
from tokenizer_strings import varied_strings

from tidepool.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
STRINGS = varied_strings(1200)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2? 😀"}],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Waves fold into foam\nsalt wind writes on wet sand"},
        {"role": "user", "content": "Now in 中文, with code: `x = 1`\n\n  indented"},
    ],
]


def _reference(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _mismatches(ours: Tokenizer, reference, strings: list[str]) -> list[tuple[str, list[int], list[int]]]:
    bad = []
    for text in strings:
        got, want = ours.encode(text), reference(text)["input_ids"]
        if got != want:
            bad.append((text, got, want))
    return bad


def _check_round_trip(ours: Tokenizer, reference, strings: list[str]) -> None:
    for text in strings:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True), text


@pytest.mark.slow
def test_real_model_tokenizer_matches_transformers(real_gguf: Path) -> None:
    """SmolLM2's file says tokenizer.ggml.pre = "smollm": llama.cpp splits off every digit (\\p{N}) before
    GPT-2's split, as SmolLM2's own tokenizer.json does (Digits(individual_digits) + ByteLevel).
    transformers 5.23's GGUF loader has no entry for "smollm" and falls back to GPT-2's split alone, so the
    reference is transformers' GGUF tokenizer (vocabulary, merges, special tokens, template) with the
    model's own pre-tokenizer; without that fix every difference must involve a digit."""
    from tokenizers import pre_tokenizers

    ours, reference = Tokenizer.from_pretrained(real_gguf), _reference(real_gguf)
    assert len(STRINGS) >= 1000
    unfixed = _mismatches(ours, reference, STRINGS)
    assert all(any(ch.isnumeric() for ch in text) for text, _, _ in unfixed)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bad = _mismatches(ours, reference, STRINGS)
    assert not bad, f"{len(bad)} of {len(STRINGS)} strings differ, e.g. {bad[:3]}"
    _check_round_trip(ours, reference, STRINGS)
    for text in STRINGS:  # byte-level BPE without a normalizer is lossless
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
    assert ours.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(reference)


@pytest.mark.parametrize("pre", ["default", "qwen2", "gpt-4o", "llama-bpe"])
def test_byte_level_pre_tokenizers_match_transformers(pre: str, hf_model_dir, tmp_path: Path) -> None:
    folder = hf_model_dir("llama-gqa")
    file = hf_to_gguf(folder, tmp_path / f"{pre}.gguf", pre=pre)
    ours, reference = Tokenizer.from_pretrained(file), _reference(file)
    bad = _mismatches(ours, reference, STRINGS)
    assert not bad, f"{len(bad)} of {len(STRINGS)} strings differ, e.g. {bad[:3]}"
    _check_round_trip(ours, reference, STRINGS[:200])
    if pre == "default":  # GPT-2's split is what the folder's tokenizer.json uses: the file must encode alike
        from_folder = Tokenizer.from_pretrained(folder)
        assert all(ours.encode(t) == from_folder.encode(t) for t in STRINGS)
        for messages in CONVERSATIONS:
            assert ours.apply_chat_template(messages) == from_folder.apply_chat_template(messages)


def test_sentencepiece_vocabulary_matches_transformers(hf_model_dir, tmp_path: Path) -> None:
    corpus = [*STRINGS, *(s.lower() for s in STRINGS)]
    file = hf_to_gguf(
        hf_model_dir("llama-gqa"), tmp_path / "spm.gguf", tokenizer=False, extra=sentencepiece_metadata(corpus)
    )
    ours, reference = Tokenizer.from_pretrained(file), _reference(file)
    assert ours.encode("hi")[0] == 1  # llama vocabularies add BOS by default
    bad = _mismatches(ours, reference, STRINGS)
    assert not bad, f"{len(bad)} of {len(STRINGS)} strings differ, e.g. {bad[:3]}"
    _check_round_trip(ours, reference, STRINGS[:300])


def test_missing_pre_tokenizer_means_gpt2(hf_model_dir, tmp_path: Path) -> None:
    """llama.cpp's default for a gpt2 vocabulary without tokenizer.ggml.pre is GPT-2's split."""
    folder = hf_model_dir("llama-gqa")
    ours = Tokenizer.from_pretrained(hf_to_gguf(folder, tmp_path / "nopre.gguf", pre=None))
    from_folder = Tokenizer.from_pretrained(folder)
    assert all(ours.encode(t) == from_folder.encode(t) for t in STRINGS[:300])
