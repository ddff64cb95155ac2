"""Helpers for the LoRA tests: PEFT adapters made in the test, and PEFT's own greedy tokens to compare with.

Every adapter is made with `peft` (LoraConfig + get_peft_model) on a transformers model loaded from
the base folder, with lora_A and lora_B drawn at random (PEFT initialises B to zero, which would make
every adapter a no-op), and saved with `save_pretrained` (safetensors), as users' adapters are.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class AdapterSpec:
    r: int
    targets: tuple[str, ...]
    alpha: float = 16.0
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    std: float = 0.15


def base_model(base: Path) -> torch.nn.Module:
    """transformers' float32 model of a Hugging Face folder, or of a GGUF file (dequantized, as Tidepool loads it)."""
    from transformers import AutoModelForCausalLM

    where = {"pretrained_model_name_or_path": base}
    if base.suffix == ".gguf":
        where = {"pretrained_model_name_or_path": base.parent, "gguf_file": base.name}
    return AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32, attn_implementation="eager").eval()


def peft_model(base: Path, spec: AdapterSpec, seed: int) -> torch.nn.Module:
    """A PEFT LoRA model on `base` with random non-zero A and B (seeded)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        rank_pattern=dict(spec.rank_pattern),
        alpha_pattern=dict(spec.alpha_pattern),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base_model(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * spec.std)
    return model.eval()


def make_adapter(base: Path, out: Path, spec: AdapterSpec, seed: int) -> torch.nn.Module:
    """Save a random adapter to `out` (adapter_config.json + adapter_model.safetensors); returns the PEFT model."""
    model = peft_model(base, spec, seed)
    model.save_pretrained(out, safe_serialization=True)
    return model


def greedy(model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    """Greedy tokens of `model` (transformers or PEFT), one prompt alone, with its KV cache."""
    ids = torch.tensor([prompt])
    generated: list[int] = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(num_new):
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def prompts(seed: int, lengths: list[int], vocab: int = 512, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy_params(num_new: int) -> Any:
    from tidepool.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)


def expected_tokens(
    base: torch.nn.Module | Path, adapters: dict[str, tuple[Path, torch.nn.Module]], batch: list, requests: list,
    num_new: int,
) -> list[list[int]]:  # fmt: skip
    """Each prompt's greedy tokens alone: PEFT's for a `LoRARequest`, the base model's (folder or model) for None."""
    hf = base_model(base) if isinstance(base, Path) else base
    return [
        greedy(hf if r is None else adapters[r.lora_name][1], p, num_new) for p, r in zip(batch, requests, strict=True)
    ]


def engine_tokens(llm: Any, batch: list, requests: list, num_new: int) -> list[list[int]]:
    """The engine's greedy tokens for the batch, generated together with `lora_request=requests`."""
    outs = llm.generate(batch, greedy_params(num_new), use_tqdm=False, lora_request=requests)
    return [out.outputs[0].token_ids for out in outs]


SHARED = list(range(40, 40 + 37))  # a shared prefix of two full blocks and a bit (block size 16)


def mixed_batch(adapters: dict[str, tuple[Path, torch.nn.Module]]) -> tuple[list[list[int]], list[Any]]:
    """Each adapter and the base model on the same shared-prefix prompts, plus a few prompts of their own:
    (prompts, `LoRARequest | None` per prompt)."""
    from tidepool.engine.lora.types import LoRARequest

    names: list[str | None] = [None, *adapters]
    batch, requests = [], []
    for index, prompt in enumerate(prompts(7, [3, 20], prefix=SHARED) + prompts(8, [1, 5, 33])):
        for name in names if index < 2 else [names[index % len(names)]]:
            batch.append(prompt)
            requests.append(None if name is None else LoRARequest(name, str(adapters[name][0])))
    return batch, requests
