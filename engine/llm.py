"""The offline API users know from vLLM: `LLM(model=...)`, `generate`, `chat`, `get_tokenizer`.

`generate` validates every prompt before queueing any (one bad prompt raises `ValueError` and
nothing runs), fans `n > 1` out into n sequences (seeded ones get seeds seed, seed+1, …, so
the n completions differ but stay reproducible), steps the engine until all are done and
returns results in input order. `lora_request` (vLLM's): one `LoRARequest` for every prompt or one per
prompt (None: the base model); an adapter not yet registered is read from its path and registered first.
`sleep(level)` / `wake_up()` / `is_sleeping()` are vLLM's sleep mode (engine/sleep.py); `generate` refuses while asleep.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .engine_config import EngineConfig
from .llm_engine import LLMEngine
from .lora.types import LoRAError, LoRARequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .sleep import EngineSleeper
from .tokenizer import Tokenizer

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """`LLM(model, **kwargs)`: the keywords are `EngineConfig`'s fields, the values `tidepool serve` and
    `tidepool generate` flags set (the flag `--max-num-seqs` is `max_num_seqs`; the table in
    contract/serve_flags.py maps each flag to its field and holds its default, bounds and help)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        self._counter = itertools.count()
        self._sleeper: EngineSleeper | None = None

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1; the weights stay in host memory) and at level 2 the weights, until
        `wake_up()`; the prefix cache is emptied."""
        if self._sleeper is None:
            self._sleeper = EngineSleeper(self.engine)
        self._sleeper.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Back to serving (vLLM's `tags`, "weights" or "kv_cache", are accepted; the engine wakes whole)."""
        if self._sleeper is not None:
            self._sleeper.wake()

    def is_sleeping(self) -> bool:
        return self._sleeper is not None and self._sleeper.is_sleeping

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if self.is_sleeping():
            raise RuntimeError("the engine is asleep (LLM.sleep): call wake_up() first")
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        lora_names = self._lora_names(lora_request, len(prompt_list))
        for prompt in prompt_list:
            self.engine.validate_prompt(prompt)
        groups: list[tuple[str, list[str]]] = []
        for prompt, params, lora_name in zip(prompt_list, params_list, lora_names, strict=True):
            parent = str(next(self._counter))
            children = []
            for i in range(params.n):
                child_id = parent if params.n == 1 else f"{parent}-{i}"
                self.engine.add_request(child_id, prompt, params.for_completion(i), lora_name=lora_name)
                children.append(child_id)
            groups.append((parent, children))

        done: dict[str, RequestOutput] = {}
        total = sum(len(children) for _, children in groups)
        with tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        results = []
        for parent, children in groups:
            first = done[children[0]]
            outputs = []
            for index, child in enumerate(children):
                completion = done[child].outputs[0]
                completion.index = index
                outputs.append(completion)
            results.append(dataclasses.replace(first, request_id=parent, outputs=outputs))
        return results

    def _lora_names(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[str | None]:
        """Each prompt's adapter name, registering adapters met for the first time (or under a new path)."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            requests: list[LoRARequest | None] = [lora_request] * count
        else:
            requests = list(lora_request)
            if len(requests) != count:
                raise ValueError(f"got {len(requests)} lora requests for {count} prompts; give one or one per prompt")
        registry = self.engine.lora
        for request in {r.lora_name: r for r in requests if r is not None}.values():
            if registry is None:
                raise LoRAError(f"adapter {request.lora_name!r} asked for, but LoRA is off: pass enable_lora=True")
            if registry.has(request.lora_name) and registry.info(request.lora_name).path == request.lora_path:
                continue
            if registry.has(request.lora_name):
                registry.unregister(request.lora_name)
            registry.register(registry.read(request.lora_name, request.lora_path))
        return [None if r is None else r.lora_name for r in requests]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            # The template already carries any BOS token, so encode without adding special tokens again.
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompt_list = list(prompts)
    if prompt_list and all(isinstance(t, int) for t in prompt_list):
        return [prompt_list]  # a single prompt given as token ids
    return prompt_list


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params_list = list(params)
    if len(params_list) != count:
        raise ValueError(f"got {len(params_list)} sampling params for {count} prompts; give one or one per prompt")
    return params_list
