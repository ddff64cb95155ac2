"""A deterministic set of >= 1,000 varied strings for tokenizer equivalence tests.

Hand-picked cases (unicode scripts, emoji sequences, code, whitespace runs, special tokens and
near-misses, digit runs, contractions, punctuation) followed by seeded random mixtures of fragments
of every kind, so pieces meet at unusual boundaries (a digit run after CJK, a special token inside a
word, spaces before emoji).
"""

from __future__ import annotations

import random

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<repo_name>", "<file_sep>"]

FRAGMENTS = [
    # scripts and symbols
    "héllo wörld", "naïve café", "Ærøskøbing", "Ελληνικά γράμματα", "Привет, мир", "مرحبا بالعالم", "שלום עולם",
    "नमस्ते दुनिया", "สวัสดีชาวโลก", "你好，世界", "中文字符测试", "日本語のテキスト", "カタカナ", "한국어 문장", "∑ x² ≤ ∞",
    "e\u0301 combining", "ﬁ ligature", "Ｆｕｌｌｗｉｄｔｈ", "\u200bzero\u200dwidth\u200c", "\u202eRTL override", "ß ẞ",
    # emoji
    "😀", "🚀✨", "👨‍👩‍👧‍👦", "👍🏽", "🇫🇷🇯🇵", "🏳️‍🌈", "❤️", "🤖 robots", "emoji😀inside",
    # code
    "def f(x: int) -> int:\n    return x ** 2  # square\n", "for (let i = 0; i < n; i++) { sum += a[i]; }",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }", "fn main() -> Result<(), Box<dyn Error>> {}",
    '{"key": [1, 2.5, null], "nested": {"a": "b\\"c"}}', "SELECT id, name FROM users WHERE age >= 21;",
    "<div class=\"x\">&amp; &lt;tag&gt;</div>", "ls -la | grep '.py$' && echo $HOME", "x_1 = y__2 - __init__()",
    "    indented\n\tand tabbed\n", "camelCaseIdentifier snake_case_name SCREAMING_CASE",
    # whitespace
    " ", "  ", "    ", "\t", "\t\t", "\n", "\n\n\n", "\r\n", " \n ", "   leading", "trailing   ",
    "a\u00a0b", "x\u2003y",
    # digits
    "0", "7", "42", "123", "2024", "31415926535", "1234567890123456789", "3.14159", "-42", "1e10", "1,000,000",
    "+1 (555) 123-4567", "2024-12-01T06:21:00Z", "v1.2.3", "0xDEADBEEF", "½ ¾ ²",
    # contractions and case
    "I'll", "don't", "DON'T", "it's", "they're", "we've", "I'M", "y'all", "rock'n'roll",
    # punctuation
    "!!!", "???", "...", "…", "---", "***", "\"quoted\"", "'single'", "(parens)", "[brackets]", "{braces}",
    # words
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "supercalifragilisticexpialidocious",
    "tokenization", "Tidepool", "Kubernetes operator", "a", "I",
]  # fmt: skip

CASES = [
    "",
    "Hello, world!",
    " leading space and trailing   ",
    "multiple    spaces\n\n\n\ttabs\r\nand CRLF",
    "text with <s> and </s> markers and <|endoftext|> inside",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start|  near <|im_end miss |im_start|>",
    "word<|im_end|>word",
    "numbers 1234567890 3.14159 -42 1e10",
    "\u00a0non-breaking\u2003em space\u200bzero width",
    "emoji 😀🚀✨ and flags 🇫🇷 and a ZWJ family 👨‍👩‍👧",
    "    " * 20,
    "\n" * 30,
    "9" * 40,
    "a" * 100,
    "😀" * 12,
    "中" * 30,
]


def varied_strings(count: int = 1200, seed: int = 0) -> list[str]:
    """`count` strings: every case, fragment and special token alone, then seeded random mixtures."""
    rng = random.Random(seed)
    out = [*CASES, *FRAGMENTS, *SPECIALS]
    separators = ["", " ", "  ", "\n", "\t", " \n", "", "", " "]
    pool = FRAGMENTS + SPECIALS + [str(rng.randrange(10**12)) for _ in range(40)]
    while len(out) < count:
        pieces = rng.choices(pool, k=rng.randint(2, 7))
        text = "".join(piece + rng.choice(separators) for piece in pieces)
        if rng.random() < 0.2:
            text = " " * rng.randint(1, 6) + text
        if rng.random() < 0.2:
            text = text + "\n" * rng.randint(1, 4)
        out.append(text)
    return out[:count]
