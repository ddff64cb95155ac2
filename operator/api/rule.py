"""`Rule`: one validation rule of InferenceService, a CEL expression for the API server and the same check in Python.

Invariants: the message is written once and says what to fix; `check` mirrors `cel` exactly (see rules.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True, slots=True)
class Rule:
    """One validation rule. `where` is the model class whose schema carries the CEL (`self` = that object)."""

    where: type[BaseModel]
    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None

    def to_cel(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out
