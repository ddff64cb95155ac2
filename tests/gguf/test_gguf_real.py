"""The real model (SmolLM2-135M-Instruct, Q4_1 GGUF, pulled through `tidepool pull`) against transformers.

- Dequantized to float32, Tidepool's greedy tokens on chat prompts equal transformers' own
  (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, which dequantizes the same file);
  transformers is used here only, never at run time.
- Kept 4-bit (quantization="gguf": Q4_1 -> Tidepool int4 with mins, exactly the file's values), the
  greedy text equals the dequantized path's on the same prompts, and held-out perplexity is within 1%.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.loading.loader import load_model
from tidepool.engine.quant.perplexity import perplexity
from tidepool.engine.quant.runtime import weight_bytes

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning' into Spanish and German.",
]
MAX_TOKENS = 32
ENGINE = dict(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=256, show_progress=False)


def _chat(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def dense_tokens(real_gguf: Path) -> list[list[int]]:
    return _chat(LLM(str(real_gguf), **ENGINE))


def test_greedy_chat_equals_transformers(real_gguf: Path, dense_tokens: list[list[int]]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(real_gguf.parent), gguf_file=real_gguf.name, dtype=torch.float32
    ).eval()
    stops = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    for prompt, ours in zip(PROMPTS, dense_tokens, strict=True):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=sorted(stops))
        theirs = out[0, ids.shape[1] :].tolist()
        assert ours == theirs, (prompt, ours, theirs)
    assert sum(len(t) for t in dense_tokens) > 4 * 5  # real answers, not immediate stops


def _heldout_ids(tokenizer: object) -> torch.Tensor:
    """English prose the model never saw in this form: docstrings of standard-library modules."""
    import argparse
    import collections
    import functools
    import json as json_module
    import logging
    import pathlib
    import subprocess
    import threading

    modules = (argparse, collections, functools, json_module, logging, pathlib, subprocess, threading)
    text = "\n\n".join(re.sub(r"\s+", " ", inspect.getdoc(m) or "") for m in modules)
    return torch.tensor(tokenizer.encode(text))  # type: ignore[attr-defined]


def test_kept_int4_matches_the_dequantized_model(real_gguf: Path, dense_tokens: list[list[int]]) -> None:
    llm = LLM(str(real_gguf), quantization="gguf", **ENGINE)
    kept_tokens = _chat(llm)
    dense, _ = load_model(real_gguf, dtype=torch.float32, show_progress=False)
    kept = llm.engine.model
    assert weight_bytes(kept) < weight_bytes(dense) / 2.5  # 4-bit projections (+ the dense embedding)
    ids = _heldout_ids(llm.get_tokenizer())
    ppl_dense, ppl_kept = perplexity(dense, ids, seq_len=256, max_windows=4), perplexity(kept, ids, 256, 4)
    report = {"same_text": kept_tokens == dense_tokens, "ppl_dense": ppl_dense, "ppl_kept": ppl_kept}
    print(json.dumps(report))
    assert abs(ppl_kept / ppl_dense - 1) < 0.01, report
    assert kept_tokens == dense_tokens, report
