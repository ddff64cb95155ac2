"""Calibration for one-shot pruning: the text, its token windows, and the per-projection input statistics.

Role: `calibration_windows` turns a text source into ``[num_samples, seq_len]`` token ids;
`InputStats` accumulates what a pruning method needs from a projection's inputs (Wanda: the squared
norm of every input channel; SparseGPT: the Hessian ``XᵀX``), both over all calibration tokens.

Sources (`SOURCES`; a path to a UTF-8 text file is accepted too):
- ``pydoc``: the Python language reference and library topics that ship inside every CPython
  (``pydoc_data.topics``: ~80 documents of English prose with code snippets). Sorted by topic name,
  the even-indexed topics are calibration text and the odd-indexed ones are held out (`heldout_topics`)
  for evaluation, so a perplexity measured on the held-out half never sees calibration text.

Invariants: windows are deterministic (evenly spaced over the token stream, no randomness), so the
same source, tokenizer and sizes always give the same calibration set; statistics are float32 sums
divided by the token count (the mean), so they do not depend on how the windows were batched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = ("pydoc",)
DEFAULT_SOURCE = "pydoc"


def _pydoc_topics() -> list[str]:
    """The distinct topic texts of ``pydoc_data.topics`` (ships with CPython), in topic-name order."""
    from pydoc_data.topics import topics

    return list(dict.fromkeys(text for _, text in sorted(topics.items())))


def calibration_topics() -> list[str]:
    """The calibration half of ``pydoc_data.topics``: the distinct topics at even positions in name order."""
    return _pydoc_topics()[0::2]


def heldout_topics() -> list[str]:
    """The held-out half (odd positions), less every paragraph that also occurs in a calibration topic.

    Topics quote each other (operator tables, shared notes); dropping the shared paragraphs keeps the
    held-out text disjoint from the calibration text paragraph by paragraph.
    """
    seen = {p.strip() for text in calibration_topics() for p in text.split("\n\n")}
    return ["\n\n".join(p for p in text.split("\n\n") if p.strip() not in seen) for text in _pydoc_topics()[1::2]]


def source_documents(source: str) -> list[str]:
    """The documents of a calibration `source`: a name from `SOURCES` or a path to a text file."""
    if source == "pydoc":
        return calibration_topics()
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"calibration source {source!r} is neither one of {', '.join(SOURCES)} nor a text file")
    return [path.read_text(encoding="utf-8", errors="replace")]


def token_stream(model_dir: Path, documents: list[str]) -> torch.Tensor:
    """The documents encoded with the model's tokenizer.json, joined by its EOS token, as one 1-D stream."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    separator = _eos_id(model_dir)
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.extend(separator)
    return torch.tensor(ids, dtype=torch.long)


def _eos_id(model_dir: Path) -> list[int]:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    return [] if eos is None else [int(eos)]


def windows(stream: torch.Tensor, num_samples: int, seq_len: int) -> torch.Tensor:
    """``[num_samples, seq_len]`` windows evenly spaced over `stream` (overlapping only where it is short)."""
    if num_samples < 1 or seq_len < 1:
        raise ValueError(f"need positive --num-samples and --seq-len, got {num_samples} and {seq_len}")
    if stream.numel() < seq_len:
        raise ValueError(f"calibration text has {stream.numel()} tokens, fewer than one window of {seq_len}")
    last = stream.numel() - seq_len
    if num_samples * seq_len > stream.numel():
        logger.warning("calibration text has %d tokens; %d windows of %d overlap", stream.numel(), num_samples, seq_len)
    starts = torch.linspace(0, last, num_samples).round().long()
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def calibration_windows(model_dir: Path, source: str, num_samples: int, seq_len: int) -> torch.Tensor:
    """``[num_samples, seq_len]`` calibration token ids for the model in `model_dir`."""
    return windows(token_stream(model_dir, source_documents(source)), num_samples, seq_len)


class InputStats:
    """Running statistics of one projection's inputs ``x [tokens, in]``.

    ``sq_norms`` ``[in]``: the mean of ``x_j²`` (Wanda's ‖X_j‖₂², up to the token count);
    ``hessian`` ``[in, in]``: the mean of ``xᵀx`` (SparseGPT's H, without damping), only if asked.
    """

    def __init__(self, in_features: int, with_hessian: bool) -> None:
        self.num_tokens = 0
        self._sq = torch.zeros(in_features, dtype=torch.float32)
        self._h = torch.zeros(in_features, in_features, dtype=torch.float32) if with_hessian else None

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        self.num_tokens += x.shape[0]
        self._sq += x.square().sum(0)
        if self._h is not None:
            self._h.addmm_(x.T, x)

    @property
    def sq_norms(self) -> torch.Tensor:
        return self._sq / max(self.num_tokens, 1)

    @property
    def hessian(self) -> torch.Tensor:
        if self._h is None:
            raise RuntimeError("these statistics were collected without the Hessian")
        return self._h / max(self.num_tokens, 1)
