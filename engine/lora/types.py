"""Public LoRA types shared by the engine, the server and the tests (issue #37 contract).

Invariants: every type here is immutable and free of torch, so the server can import it
without touching the engine's data path. `LoRAError` carries the HTTP status (400 or 404)
and the OpenAI-style error code the server returns verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The seven projections an adapter may target, in the engine's site order."""


class LoRAError(ValueError):
    """A refused adapter operation: bad files/config (400) or an unknown adapter name (404)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_lora", param: str | None = None) -> None:
        super().__init__(message)
        self.status: int = status
        self.code: str = code
        self.param: str | None = param

    @classmethod
    def not_found(cls, name: str, param: str | None = "model") -> LoRAError:
        """The OpenAI-shaped 404 for an adapter name that is not loaded."""
        return cls(f"The model `{name}` does not exist.", status=404, code="model_not_found", param=param)


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's name and fields; `lora_int_id` is accepted and ignored)."""

    lora_name: str
    lora_path: str
    lora_int_id: int | None = None


@dataclass(frozen=True)
class AdapterInfo:
    """What the registry reports about one loaded adapter."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    scaling: float
    num_bytes: int
    load_seconds: float


@dataclass(frozen=True)
class LoRASnapshot:
    """A consistent, thread-safe view of the registry for the metrics and /v1/models endpoints."""

    adapters: tuple[AdapterInfo, ...] = ()
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    max_loras: int = 0
    changed_at: float = field(default=0.0)

    def names(self) -> list[str]:
        """Names of the loaded adapters, in load order."""
        return [a.name for a in self.adapters]
