"""`--lora-modules` and adapter names: what the command line and the load endpoint accept as an adapter.

Role: parse vLLM's two spellings of a start-up adapter (`name=path`, or the JSON object
`{"name": ..., "path": ..., "base_model_name": ...}`) into `LoRAModule`s, and check an adapter
name wherever one enters the server (the flag, `POST /v1/load_lora_adapter`).

Invariants:
- An adapter name is what a request's `model` selects and what the gateway metric lists
  (`vllm:lora_requests_info`, names joined by ","): it is non-empty, at most `MAX_NAME_CHARS`
  long, free of "," and of whitespace and control characters, and never the served model's own
  name (that selects the base model). Every refusal is a message that says what to fix.
- Torch-free and engine-free: the command line checks the flag before anything loads (exit 2).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

MAX_NAME_CHARS = 256
_JSON_KEYS = frozenset({"name", "path", "base_model_name"})


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapter to load at start: the name requests select it by, and its PEFT folder."""

    name: str
    path: str


def adapter_name_error(name: str, served_names: Sequence[str]) -> str | None:
    """Why `name` cannot name an adapter on a server serving `served_names`; None when it can."""
    if not name:
        return "an adapter name must not be empty"
    if len(name) > MAX_NAME_CHARS:
        return f"an adapter name is at most {MAX_NAME_CHARS} characters; got {len(name)}"
    if "," in name or any(ch.isspace() or not ch.isprintable() for ch in name):
        return (f"the adapter name {name[:40]!r} holds a comma, whitespace or a control character; metrics list "
                "adapter names joined by commas, so use letters, digits and -_./:")  # fmt: skip
    if name in served_names:
        return f"the adapter name {name!r} is the served model's own name (it selects the base model); pick another"
    return None


def parse_lora_modules(values: Sequence[str] | None, served_names: Sequence[str]) -> list[LoRAModule]:
    """`--lora-modules` values (name=path or vLLM's JSON form) as modules; ValueError naming the bad one."""
    modules: list[LoRAModule] = []
    for value in values or ():
        module = _parse_one(value.strip(), served_names)
        if any(m.name == module.name for m in modules):
            raise ValueError(f"--lora-modules names the adapter {module.name!r} twice; give each adapter once")
        modules.append(module)
    return modules


def _parse_one(value: str, served_names: Sequence[str]) -> LoRAModule:
    if value.startswith("{"):
        module = _parse_json(value, served_names)
    else:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object "
                             '\'{"name": ..., "path": ...}\'')  # fmt: skip
        module = LoRAModule(name, path)
    error = adapter_name_error(module.name, served_names)
    if error is not None:
        raise ValueError(f"--lora-modules {value!r}: {error}")
    return module


def _parse_json(value: str, served_names: Sequence[str]) -> LoRAModule:
    try:
        raw = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"--lora-modules {value!r} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--lora-modules {value!r}: expected a JSON object")
    unknown = sorted(set(raw) - _JSON_KEYS)
    if unknown:
        raise ValueError(f"--lora-modules {value!r}: unknown key(s) {', '.join(unknown)}; the keys are name, path "
                         "and base_model_name")  # fmt: skip
    name, path, base = raw.get("name"), raw.get("path"), raw.get("base_model_name")
    if not isinstance(name, str) or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {value!r}: name and path must be strings (path not empty)")
    if base is not None and base not in served_names:
        raise ValueError(f"--lora-modules {value!r}: base_model_name {base!r} is not the model this server serves "
                         f"({' or '.join(map(repr, served_names))})")  # fmt: skip
    return LoRAModule(name, path)
