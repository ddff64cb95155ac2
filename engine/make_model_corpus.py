"""A deterministic, generated text corpus, and the byte-level BPE that random models train on it.

Role: gives `make_model` a corpus that looks enough like text and code (Zipf-distributed
pseudo-English words, capitalisation, punctuation, numbers, code lines, some non-ASCII) for a
byte-level BPE to learn realistic merges, without reading any file or network resource.

Invariants:
- The output depends only on (`seed`, `num_words`, `num_sentences`) and `CORPUS_VERSION`, through
  Python's `random.Random` (Mersenne Twister, stable across platforms and CPython versions).
  Bump `CORPUS_VERSION` whenever the corpus or the tokenizer recipe changes: cached tokenizers are
  keyed on it.
- Every lexicon word appears at least once (a glossary section), so the number of distinct
  pre-tokens, and hence the number of reachable merges, grows with `num_words`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import accumulate

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

CORPUS_VERSION = 2
_MAX_CORPUS_GROWTH_STEPS = 6

# fmt: off
# Compact tables: one element per line would make this file mostly vertical whitespace.
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
           "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "sc", "sh", "sk", "sl",
           "sm", "sn", "sp", "st", "str", "sw", "th", "tr", "wh")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ee", "ie", "oa", "oo", "ou", "y")
_CODAS = ("", "", "", "b", "ck", "d", "ft", "g", "l", "ld", "lt", "m", "mp", "n", "nd", "ng", "nk", "nt",
          "p", "r", "rd", "rk", "rn", "rt", "s", "sh", "sk", "ss", "st", "t", "th", "x")
_SUFFIXES = ("", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ness", "ment", "able", "ity", "ous",
             "est")
_NON_ASCII = ("é", "è", "ü", "ö", "ñ", "ç", "ß", "ø", "å", "α", "β", "λ", "π", "中", "文", "字", "日", "本",
              "한", "글", "😀", "🚀", "✨", "→", "€", "°")
_PUNCTUATION = (".", ".", ".", ".", ",", "!", "?", ";", ":", "...")
_KEYWORDS = ("def", "return", "if", "else", "for", "in", "while", "import", "from", "class", "self", "None",
             "True", "False", "let", "const", "fn", "int", "str", "void", "struct", "pub", "async", "await")
# fmt: on


def _make_word(rng: random.Random) -> str:
    syllables = [
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))
    ]
    word = "".join(syllables) + rng.choice(_SUFFIXES)
    if rng.random() < 0.03:
        # A few non-ASCII words so multi-byte characters get merges of their own.
        position = rng.randrange(len(word) + 1)
        word = word[:position] + rng.choice(_NON_ASCII) + word[position:]
    return word


def make_lexicon(rng: random.Random, num_words: int) -> list[str]:
    """Distinct pseudo-words; list order is frequency rank."""
    seen: set[str] = set()
    words: list[str] = []
    while len(words) < num_words:
        word = _make_word(rng)
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        return str(rng.randrange(100))
    if kind < 0.7:
        return str(rng.randrange(1900, 2100))
    if kind < 0.9:
        return f"{rng.randrange(1000)}.{rng.randrange(100):02d}"
    return str(rng.randrange(10**9))


def _sentence(rng: random.Random, sample: list[str]) -> str:
    parts: list[str] = []
    for index, word in enumerate(sample):
        if rng.random() < 0.05:
            word = _number(rng)
        elif index == 0 or rng.random() < 0.04:
            word = word.capitalize()
        elif rng.random() < 0.01:
            word = word.upper()
        if index > 0 and rng.random() < 0.08:
            word = word + ","
        parts.append(word)
    if rng.random() < 0.05:
        parts.insert(rng.randrange(len(parts)), f'"{rng.choice(sample)}"')
    return " ".join(parts) + rng.choice(_PUNCTUATION)


def _code_line(rng: random.Random, sample: list[str]) -> str:
    a, b, c = sample[0], sample[1], sample[2]
    indent = "    " * rng.randrange(3)
    templates = (
        f"def {a}_{b}({c}, n={rng.randrange(10)}):",
        f"{indent}return {a}.{b}({c}) + {rng.randrange(100)}",
        f"{indent}if {a} == {b}:",
        f"{indent}for {a} in range({rng.randrange(1, 64)}):",
        f'{indent}{a}_{b} = {{"{c}": {rng.randrange(1000)}, "{b}": [{rng.randrange(9)}, {rng.randrange(9)}]}}',
        f"{indent}{rng.choice(_KEYWORDS)} {a}({b}, {c});",
        f"import {a}.{b} as {c}",
        f"{indent}// {a} {b} {c}",
        f"{indent}# TODO({a}): {b} the {c}",
        f"{indent}let {a}: {rng.choice(('i32', 'u8', 'f64', 'String'))} = {b}::{c}()?;",
        f'<{a} class="{b}">{c}</{a}>',
    )
    return rng.choice(templates)


def generate_corpus(seed: int, num_words: int, num_sentences: int) -> Iterator[str]:
    """Yields corpus lines: prose and code sampled with Zipf frequencies, then a glossary."""
    rng = random.Random(seed)
    lexicon = make_lexicon(rng, num_words)
    # Zipf's law with exponent ~1, as in natural text; cumulative weights make sampling O(log n).
    cum_weights = list(accumulate(1.0 / (rank + 2.7) for rank in range(num_words)))
    paragraph: list[str] = []
    for _ in range(num_sentences):
        sample = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randrange(4, 18))
        if rng.random() < 0.15:
            yield _code_line(rng, sample)
            continue
        paragraph.append(_sentence(rng, sample))
        if len(paragraph) >= rng.randrange(2, 7):
            yield " ".join(paragraph)
            paragraph.clear()
    if paragraph:
        yield " ".join(paragraph)
    # Glossary: every word at least once, with and without a leading space (distinct BPE pre-tokens).
    for start in range(0, num_words, 16):
        yield " ".join(lexicon[start : start + 16])


def train_bpe(
    vocab_size: int,
    special_tokens: tuple[str, ...],
    seed: int,
    num_words: int,
    num_sentences: int,
    pre_tokenizer: pre_tokenizers.PreTokenizer | None = None,
    normalizer: normalizers.Normalizer | None = None,
) -> Tokenizer:
    """Byte-level BPE of exactly `vocab_size` tokens (special tokens first, at ids 0..k-1).

    The corpus doubles until training reaches the size: too few distinct words cap the merges.
    `pre_tokenizer` defaults to GPT-2's ByteLevel; merges are learned within its pieces, so the
    tokenizer must be used with the same pre-tokenizer (and `normalizer`) it was trained with.
    """
    for _ in range(_MAX_CORPUS_GROWTH_STEPS):
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
        if normalizer is not None:
            tokenizer.normalizer = normalizer
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(special_tokens),
            # All 256 bytes, so any text encodes without an unknown token.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(generate_corpus(seed, num_words, num_sentences), trainer)
        if tokenizer.get_vocab_size() == vocab_size:
            return tokenizer
        num_words, num_sentences = num_words * 2, num_sentences * 2
    raise RuntimeError(f"BPE training could not reach {vocab_size} tokens; the generated corpus is too small")
