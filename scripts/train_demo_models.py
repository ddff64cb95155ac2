"""Trains Tidepool's demo model pair: a small target Llama and a draft that shares its tokenizer.

Role: gives the README demo, the speculative-decoding benchmark and the quantization benchmark
models with real structure (text-like output, meaningful acceptance rates and perplexities),
built from text every machine has without downloads: the Python standard library's sources and
the documentation installed with it (`pydoc_data/topics.py`).

Invariants:
- Deterministic: the file list is sorted, split into train/held-out by position, the corpus is
  hashed (sha256, printed and stored in each config.json under `tidepool_demo`), all randomness
  comes from fixed seeds, `torch.use_deterministic_algorithms(True)` is on and the number of CPU
  threads is fixed (`--threads`; float reductions depend on it). Same script + corpus + arguments
  ⇒ same weights.
- Training length is a fixed number of steps, never a time budget (a time budget is not
  reproducible); `--max-steps` shortens it for tuning.
- Output is cached outside the clone, in `$TIDEPOOL_CACHE/models/demo-target` and `demo-draft`
  (default ~/.cache/tidepool); a build key (sha256 of this script, the corpus and the arguments)
  is stored with them, and a folder whose key matches is reused without training.
- Both folders are plain Hugging Face Llama folders (written with `make_model`'s config and
  tokenizer-file helpers), loadable by Tidepool and `transformers`.

Run from /tmp (or via scripts/demo_models.sh) with the dev venv's python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from tidepool.engine.make_model import Preset, _config
from tidepool.engine.make_model_tokenizer import write_tokenizer_files

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
HELDOUT_EVERY = 20  # every 20th file of the sorted list is held out for perplexity
MAX_TRAIN_BYTES = 4_000_000  # more than the steps below ever read; bounds tokenizer time
MAX_HELDOUT_BYTES = 400_000
MAX_FILE_BYTES = 300_000  # generated tables (unicode data, encodings) would dominate otherwise
_EXCLUDED_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """One model's shape and schedule."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    steps: int
    lr: float
    batch_size: int
    seq_len: int
    seed: int
    warmup_steps: int = 40


# Sized for about 30 minutes on 2 idle CPU cores (fp32, AVX2, 2 threads), extrapolated from runs on a
# loaded machine: the 28M-parameter variant of the target took 14 s/step and the draft 1.7 s/step at
# load ~3 (about 1.3 cores to spare), so ~8 s and ~1.2 s idle at 4096 tokens/step: 160 steps (~21 min)
# + 320 steps (~6.5 min) + ~1 min for the corpus and tokenizer.
TARGET = TrainSpec("demo-target", 512, 6, 8, 4, 1408, False, 160, 2e-3, 16, 256, 1, warmup_steps=20)
DRAFT = TrainSpec("demo-draft", 256, 4, 4, 2, 768, True, 320, 3e-3, 16, 256, 2, warmup_steps=30)


def corpus_files(stdlib: Path) -> list[Path]:
    """The standard library's .py sources (no tests, no site-packages), sorted by relative path."""
    files = [
        p
        for p in stdlib.rglob("*.py")
        if not (_EXCLUDED_PARTS & set(p.relative_to(stdlib).parts)) and p.stat().st_size <= MAX_FILE_BYTES
    ]
    files.append(stdlib / "pydoc_data" / "topics.py")  # the language reference and docs topics
    return sorted(set(files), key=lambda p: p.relative_to(stdlib).as_posix())


def build_corpus(stdlib: Path) -> tuple[list[str], list[str], str, int]:
    """(train documents, held-out documents, corpus sha256, number of files)."""
    files = corpus_files(stdlib)
    digest = hashlib.sha256()
    train: list[str] = []
    heldout: list[str] = []
    train_bytes = heldout_bytes = 0
    for index, path in enumerate(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        size = len(text.encode("utf-8"))
        if index % HELDOUT_EVERY == HELDOUT_EVERY - 1:
            if heldout_bytes + size > MAX_HELDOUT_BYTES:
                continue
            heldout.append(text)
            heldout_bytes += size
        else:
            if train_bytes + size > MAX_TRAIN_BYTES:
                continue
            train.append(text)
            train_bytes += size
        digest.update(path.relative_to(stdlib).as_posix().encode() + b"\0" + text.encode("utf-8") + b"\0")
    return train, heldout, digest.hexdigest(), len(files)


def train_tokenizer(documents: list[str]) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenizer, all 256 bytes), Llama-style <s> post-processor."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"BPE reached {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", bos_id)]
    )
    return tokenizer


def encode_stream(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """All documents as one token stream, each preceded by <s> and followed by </s>."""
    eos_id = tokenizer.token_to_id("</s>")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def preset_for(spec: TrainSpec) -> Preset:
    head_dim = spec.hidden_size // spec.num_attention_heads
    return Preset(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=spec.intermediate_size,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=1024,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=0.02,
    )


def lr_at(step: int, spec: TrainSpec, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, total_steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def heldout_perplexity(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, max_windows: int = 48) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of the held-out stream."""
    model.eval()
    num_windows = min(max_windows, (stream.numel() - 1) // seq_len)
    total_nll, total_tokens = 0.0, 0
    for w in range(num_windows):
        chunk = stream[w * seq_len : (w + 1) * seq_len + 1]
        logits = model(input_ids=chunk[:-1].unsqueeze(0)).logits[0]
        total_nll += float(torch.nn.functional.cross_entropy(logits.float(), chunk[1:], reduction="sum"))
        total_tokens += seq_len
    model.train()
    return math.exp(total_nll / total_tokens)


def train_one(
    spec: TrainSpec, config: dict[str, Any], train_ids: torch.Tensor, heldout_ids: torch.Tensor, max_steps: int | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Trains one model; returns (HF-named float32 state dict, stats)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # training-only dependency

    torch.manual_seed(spec.seed)
    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hf_config)
    num_params = sum(p.numel() for p in model.parameters())
    steps = spec.steps if max_steps is None else min(spec.steps, max_steps)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(spec.seed)
    num_starts = train_ids.numel() - spec.seq_len - 1
    start = time.perf_counter()
    ema_loss: float | None = None
    model.train()
    with tqdm(total=steps, desc=f"training {spec.name} ({num_params / 1e6:.1f}M)", unit="step") as bar:
        for step in range(steps):
            starts = torch.randint(0, num_starts, (spec.batch_size,), generator=generator)
            batch = torch.stack([train_ids[s : s + spec.seq_len + 1] for s in starts.tolist()])
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, spec, steps)
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            ema_loss = float(loss) if ema_loss is None else 0.95 * ema_loss + 0.05 * float(loss)
            bar.set_postfix(loss=f"{ema_loss:.3f}", lr=f"{lr_at(step, spec, steps):.2e}")
            bar.update(1)
            if step % 100 == 0 or step == steps - 1:
                tqdm.write(f"{spec.name} step {step}/{steps} loss {float(loss):.4f} (ema {ema_loss:.4f})")
    wall_s = time.perf_counter() - start
    ppl = heldout_perplexity(model, heldout_ids, spec.seq_len)
    stats = {
        "num_params": num_params,
        "steps": steps,
        "tokens_seen": steps * spec.batch_size * spec.seq_len,
        "train_wall_s": round(wall_s, 1),
        "final_loss_ema": round(ema_loss or float("nan"), 4),
        "heldout_perplexity": round(ppl, 3),
    }
    tqdm.write(f"{spec.name}: {json.dumps(stats)}")
    state = {name: t.detach().to(torch.float32).contiguous() for name, t in model.state_dict().items()}
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state, stats


def write_model(
    out: Path, spec: TrainSpec, tokenizer: Tokenizer, state: dict[str, torch.Tensor], demo_info: dict[str, Any]
) -> None:
    """Writes the folder next to `out`, then renames it into place (no half-written cache entry)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    preset = preset_for(spec)
    bos_id, eos_id, generation_eos_ids = write_tokenizer_files(tmp, tokenizer, False, preset.max_position_embeddings)
    config = _config("llama", preset, spec.tie_word_embeddings, "float32", bos_id, eos_id)
    config["tidepool_demo"] = demo_info
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": generation_eos_ids,
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
    }
    (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n", encoding="utf-8")
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for path in tmp.iterdir():
        path.chmod(0o644)
    tmp.chmod(0o755)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def build_key(corpus_sha: str, args: argparse.Namespace) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(corpus_sha.encode())
    digest.update(json.dumps({"max_steps": args.max_steps, "threads": args.threads}).encode())
    return digest.hexdigest()[:16]


def cached_key(folder: Path) -> str | None:
    config = folder / "config.json"
    if not (config.is_file() and (folder / "model.safetensors").is_file()):
        return None
    return json.loads(config.read_text()).get("tidepool_demo", {}).get("build_key")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cache = Path(os.environ.get("TIDEPOOL_CACHE", "~/.cache/tidepool")).expanduser() / "models"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=cache, help="where demo-target/ and demo-draft/ go")
    parser.add_argument("--max-steps", type=int, default=None, help="cap each model's steps (tuning runs)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (fixed: results depend on it)")
    parser.add_argument("--only", choices=("target", "draft"), default=None, help="train one model only")
    parser.add_argument("--force", action="store_true", help="retrain even if the cached build key matches")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    begin = time.perf_counter()
    train_docs, heldout_docs, corpus_sha, num_files = build_corpus(stdlib)
    key = build_key(corpus_sha, args)
    print(f"corpus: {num_files} files under {stdlib}, sha256 {corpus_sha}; build key {key}", flush=True)
    specs = [s for s in (TARGET, DRAFT) if args.only is None or s.name == f"demo-{args.only}"]
    todo = [s for s in specs if args.force or cached_key(args.out_dir / s.name) != key]
    for spec in specs:
        if spec not in todo:
            print(f"{args.out_dir / spec.name}: up to date (build key {key}), skipped", flush=True)
    if not todo:
        return 0
    tokenizer = train_tokenizer(train_docs)
    train_ids = encode_stream(tokenizer, train_docs)
    heldout_ids = encode_stream(tokenizer, heldout_docs)
    print(
        f"tokenizer: {VOCAB_SIZE} tokens; train {train_ids.numel()} tokens, held-out {heldout_ids.numel()} tokens "
        f"({time.perf_counter() - begin:.1f}s)",
        flush=True,
    )
    for spec in todo:
        config = _config(
            "llama", preset_for(spec), spec.tie_word_embeddings, "float32", tokenizer.token_to_id("<s>"), 2
        )
        state, stats = train_one(spec, config, train_ids, heldout_ids, args.max_steps)
        info = {
            "build_key": key,
            "corpus_sha256": corpus_sha,
            "corpus_files": num_files,
            "python": sys.version.split()[0],
            "threads": args.threads,
            "spec": asdict(spec),
            **stats,
        }
        write_model(args.out_dir / spec.name, spec, tokenizer, state, info)
        print(f"wrote {args.out_dir / spec.name}", flush=True)
    print(f"total wall time {time.perf_counter() - begin:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
