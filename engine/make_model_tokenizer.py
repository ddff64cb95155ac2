"""The byte-level BPE tokenizers and tokenizer files of the generated test models (make_model.py).

Role: train (or read from the cache) a preset's tokenizer, and write the Hugging Face tokenizer files
that both Tidepool and `transformers` read. Two styles: Llama (`<s>`/`</s>` at ids 1/2, a BOS
post-processor) and Qwen2 (no BOS; transformers' own pre-tokenizer regex and NFC).

Invariants:
- The tokenizer has exactly the requested vocabulary size, special tokens included, and depends only
  on (vocabulary size, corpus size, style, seed): the cache key holds all of them and the corpus version.
- Cache entries are written then renamed, so a concurrent writer never leaves a half-written file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors

from .make_model_corpus import CORPUS_VERSION, train_bpe

# Llama-style vocabularies put <s>/</s> at ids 1/2, as Llama checkpoints (and config defaults) do.
LLAMA_SPECIAL_TOKENS = ("<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# transformers 5 rebuilds Qwen2 tokenizers with this regex and NFC (ignoring tokenizer.json's
# pre-tokenizer), so a qwen2 model must be trained and saved with exactly these to agree with it.
_QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_cache_dir() -> Path:
    return Path(os.environ.get("TIDEPOOL_CACHE", "~/.cache/tidepool")).expanduser() / "tokenizers"


def cached_tokenizer(
    name: str, vocab_size: int, num_words: int, num_sentences: int, qwen: bool, seed: int = 0
) -> Tokenizer:
    """The tokenizer trained for `name` with these sizes and style, from the cache when it is there."""
    style = "qwen" if qwen else "llama"
    special_tokens = QWEN_SPECIAL_TOKENS if qwen else LLAMA_SPECIAL_TOKENS
    cache_file = tokenizer_cache_dir() / f"{name}-{style}-v{vocab_size}-c{CORPUS_VERSION}-s{seed}.json"
    if cache_file.is_file():
        return Tokenizer.from_file(str(cache_file))
    pre_tokenizer, normalizer = None, None
    if qwen:
        split = pre_tokenizers.Split(Regex(_QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False)
        pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        normalizer = normalizers.NFC()
    tokenizer = train_bpe(
        vocab_size, special_tokens, seed, num_words, num_sentences, pre_tokenizer=pre_tokenizer, normalizer=normalizer
    )
    if qwen:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", bos_id)]
        )
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename, so a concurrent make_model never reads a half-written cache entry.
    with tempfile.NamedTemporaryFile(
        "w", dir=cache_file.parent, suffix=".tmp", delete=False, encoding="utf-8"
    ) as handle:
        handle.write(tokenizer.to_str(pretty=True))
    os.replace(handle.name, cache_file)
    return tokenizer


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(
    out: Path, tokenizer: Tokenizer, qwen: bool, model_max_length: int
) -> tuple[int | None, int, list[int]]:
    """Writes tokenizer files; returns (config bos id, config eos id, generation eos ids)."""
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    specials = QWEN_SPECIAL_TOKENS if qwen else LLAMA_SPECIAL_TOKENS
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    bos_token, eos_token = (None, "<|im_end|>") if qwen else ("<s>", "</s>")
    extra = ["<|im_start|>", "<|im_end|>"]
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in specials
    }
    tokenizer_config = {
        "add_bos_token": not qwen,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": extra,
        "bos_token": bos_token,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    write_json(out / "tokenizer_config.json", tokenizer_config)
    special_map = {"additional_special_tokens": extra, "eos_token": eos_token, "pad_token": "<|endoftext|>"}
    if bos_token is not None:
        special_map["bos_token"] = bos_token
    write_json(out / "special_tokens_map.json", dict(sorted(special_map.items())))
    if qwen:
        return ids["<|endoftext|>"], ids["<|im_end|>"], [ids["<|im_end|>"], ids["<|endoftext|>"]]
    return ids["<s>"], ids["</s>"], [ids["</s>"], ids["<|im_end|>"]]
