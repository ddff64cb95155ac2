"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata (no transformers).

Two vocabularies, as llama.cpp defines them (`tokenizer.ggml.model`):
- ``gpt2``: byte-level BPE. Tokens are spelled in GPT-2's byte alphabet; ``tokenizer.ggml.merges``
  lists the merges. ``tokenizer.ggml.pre`` names the pre-tokenizer (how text is split before BPE):
  `PRE_TOKENIZERS` maps the names Tidepool knows to the split llama.cpp uses for them; a file
  without the key gets GPT-2's split (llama.cpp's default), an unknown name is an error rather than
  a silently different tokenization. The llama3 family also takes a whole word that is itself a
  token before applying merges (``ignore_merges``), as llama.cpp and the original tokenizer do.
- ``llama``: SentencePiece BPE with byte fallback (``<0xNN>`` tokens). Merges come from the file
  when present, else from the scores (a merge ranks by the score of the piece it makes; ties by
  the left then right piece's length, longer first, then by id), ``▁`` marks spaces, and a space is
  prepended to the text when ``tokenizer.ggml.add_space_prefix`` (default true).

Token types (``tokenizer.ggml.token_type``): CONTROL (3) tokens become special added tokens and
USER_DEFINED (4) plain added tokens, both matched whole in the text, as llama.cpp does. Their
vocabulary keys keep the file's spelling (so they keep their ids); a NORMAL byte-level token spelled
outside the byte alphabet is re-spelled so BPE can reach it.
BOS/EOS are added per ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` (default: BOS for
``llama`` vocabularies, nothing for ``gpt2``, as transformers' GGUF loader does). Stop ids: EOS, EOT
and EOM. Chat templates: ``tokenizer.chat_template`` plus named ``tokenizer.chat_template.<name>``.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from .errors import GGUFError
from .reader import GGUFFile

CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split: "gpt2" | "digits" (each digit alone, then GPT-2's) | a regex, ignore_merges)
PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "default": ("gpt2", False),
    "gpt-2": ("gpt2", False),
    "gpt2": ("gpt2", False),
    "smollm": ("digits", False),
    "starcoder": ("digits", False),
    "refact": ("digits", False),
    **{name: (_LLAMA3_SPLIT, True) for name in ("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe")},
    **{name: (_QWEN2_SPLIT, False) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
    **{name: (_GPT4O_SPLIT, False) for name in ("gpt-4o", "llama4")},
}
_SPECIALS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
_STOPS = ("eos", "eot", "eom")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (printable Latin-1 stays, the rest maps to U+0100...)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


class GGUFTokenizerSpec:
    """Everything `engine.tokenizer.Tokenizer` needs, read from one GGUF file."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        self.kind = gguf.get("tokenizer.ggml.model")
        if self.kind is None:
            raise GGUFError(
                f"{gguf.path}: no tokenizer metadata (tokenizer.ggml.model is missing), so the file cannot be used "
                "for text; convert it with llama.cpp's convert_hf_to_gguf.py, which stores the tokenizer"
            )
        if self.kind not in ("gpt2", "llama"):
            raise GGUFError(
                f"{gguf.path}: tokenizer.ggml.model {self.kind!r} is not supported; supported: gpt2 (byte-level BPE), "
                "llama (SentencePiece BPE)"
            )
        self.tokens: list[str] = list(gguf.require("tokenizer.ggml.tokens", "the tokenizer's vocabulary"))
        types = gguf.get("tokenizer.ggml.token_type")
        self.token_types: list[int] = [int(t) for t in types] if types is not None else [1] * len(self.tokens)
        if len(self.token_types) != len(self.tokens):
            raise GGUFError(f"{gguf.path}: {len(self.token_types)} token types for {len(self.tokens)} tokens")
        self.ids = {role: self._token_id(role) for role in ("bos", "eos", "unknown", "padding", "eot", "eom")}
        self.pre = str(gguf.get("tokenizer.ggml.pre", "default"))
        if self.kind == "gpt2" and self.pre not in PRE_TOKENIZERS:
            raise GGUFError(
                f"{gguf.path}: tokenizer.ggml.pre {self.pre!r} is not a pre-tokenizer Tidepool knows; "
                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        default_bos = self.kind == "llama"
        self.add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", default_bos)) and self.ids["bos"] is not None
        self.add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and self.ids["eos"] is not None

    def _token_id(self, role: str) -> int | None:
        value = self.gguf.get(f"tokenizer.ggml.{role}_token_id")
        if value is None:
            return None
        if not 0 <= int(value) < len(self.tokens):
            raise GGUFError(f"{self.gguf.path}: tokenizer.ggml.{role}_token_id={value} is outside the vocabulary")
        return int(value)

    # -- pieces of the Tokenizer wrapper --------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """tokenizer_config.json's equivalent: special token strings and add_bos_token."""
        config: dict[str, Any] = {"add_bos_token": self.add_bos}
        for attr, role in _SPECIALS.items():
            if (token_id := self.ids[role]) is not None:
                config[attr] = self.tokens[token_id]
        return config

    def chat_templates(self) -> dict[str, str]:
        templates: dict[str, str] = {}
        default = self.gguf.get("tokenizer.chat_template")
        if default is not None:
            templates["default"] = str(default)
        for name in self.gguf.get("tokenizer.chat_templates") or []:
            template = self.gguf.get(f"tokenizer.chat_template.{name}")
            if template is not None:
                templates[str(name)] = str(template)
        return templates

    def stop_ids(self) -> set[int]:
        return {token_id for role in _STOPS if (token_id := self.ids[role]) is not None}

    def backend(self) -> BackendTokenizer:
        tokenizer = self._byte_level() if self.kind == "gpt2" else self._sentencepiece()
        added = [
            AddedToken(token, normalized=False, special=kind == CONTROL)
            for token, kind in zip(self.tokens, self.token_types, strict=True)
            if kind in (CONTROL, USER_DEFINED)
        ]
        tokenizer.add_tokens(added)
        tokenizer.post_processor = self._post_processor()
        tokenizer.no_padding()
        tokenizer.no_truncation()
        return tokenizer

    def _byte_level(self) -> BackendTokenizer:
        spelling = _byte_alphabet()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for index, (token, kind) in enumerate(zip(self.tokens, self.token_types, strict=True)):
            if kind not in (CONTROL, USER_DEFINED) and not set(token) <= alphabet:
                token = "".join(spelling[b] for b in token.encode("utf-8"))
            vocab[token] = index
        merges = [self._merge(m) for m in self.gguf.require("tokenizer.ggml.merges", "the BPE merges of a gpt2 vocab")]
        split, ignore_merges = PRE_TOKENIZERS[self.pre]
        tokenizer = BackendTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in ("gpt2", "digits"))
        if split == "gpt2":
            tokenizer.pre_tokenizer = byte_level
        elif split == "digits":
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
            )
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer

    def _merge(self, merge: str) -> tuple[str, str]:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise GGUFError(f"{self.gguf.path}: tokenizer.ggml.merges entry {merge!r} is not 'left right'")
        return left, right

    def _sentencepiece(self) -> BackendTokenizer:
        vocab = {token: index for index, token in enumerate(self.tokens)}
        raw_merges = self.gguf.get("tokenizer.ggml.merges")
        if raw_merges is not None:
            merges = [self._merge(m) for m in raw_merges]
        else:
            scores = self.gguf.require("tokenizer.ggml.scores", "a SentencePiece vocabulary without merges")
            merges = merges_from_scores(self.tokens, [float(s) for s in scores], vocab)
        unk = self.ids["unknown"]
        bpe = models.BPE(
            vocab,
            merges,
            unk_token=None if unk is None else self.tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
        tokenizer = BackendTokenizer(bpe)
        add_prefix = bool(self.gguf.get("tokenizer.ggml.add_space_prefix", True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tokenizer.decoder = decoders.Sequence(steps)
        return tokenizer

    def _post_processor(self) -> processors.TemplateProcessing:
        bos_id = self.ids["bos"] if self.add_bos else None
        eos_id = self.ids["eos"] if self.add_eos else None
        first, second = ["$A:0"], ["$B:1"]
        specials: dict[str, int] = {}
        if bos_id is not None:
            bos = self.tokens[bos_id]
            first.insert(0, f"{bos}:0")
            second.insert(0, f"{bos}:1")
            specials[bos] = bos_id
        if eos_id is not None:
            eos = self.tokens[eos_id]
            first.append(f"{eos}:0")
            second.append(f"{eos}:1")
            specials[eos] = eos_id
        return processors.TemplateProcessing(
            single=" ".join(first), pair=" ".join(first + second), special_tokens=list(specials.items())
        )


def merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by piece scores (see the module docstring for the order)."""
    by_token = dict(zip(tokens, scores, strict=True))
    candidates: list[tuple[float, str, str]] = []
    for token, score in by_token.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        candidates.extend((score, left, right) for left, right in splits)
    candidates.sort(key=lambda c: (-c[0], -len(c[1]), -len(c[2])))
    return [(left, right) for _, left, right in candidates]
