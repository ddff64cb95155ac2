"""Unpaired UTF-16 surrogates in a request: found before anything encodes it.

Role: `refuse_unpaired_surrogates` is the request models' validator (protocol.py, tokenization.py);
`find_unpaired_surrogate` walks any parsed value. Invariant: linear in the input, and a request is
refused with the parameter that holds the bad string, never failed later by the tokenizer.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

_SCALARS = frozenset({int, float, bool, type(None)})
_WALKED = (str, list, tuple, dict, BaseModel)  # what can hold a string


def find_unpaired_surrogate(value: Any, path: str = "") -> tuple[str, int] | None:
    """(where, index) of the first string in `value` holding an unpaired UTF-16 surrogate, else None.

    Python's JSON parser turns a lone `\\ud800` escape into such a string; it cannot be encoded as
    UTF-8, so the tokenizer (and any response echoing it) would fail on it. Linear in the input,
    with the per-item work in C where it can be: a 5M-token-id prompt is scanned in a fraction of a second.
    """
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return path or "body", err.start
        return None
    if isinstance(value, BaseModel):
        items: Any = ((name, getattr(value, name)) for name in type(value).model_fields)
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        types = set(map(type, value))
        if types <= _SCALARS:  # numbers only (token ids): nothing to look at
            return None
        if types == {list} and set(map(type, chain.from_iterable(value))) <= _SCALARS:  # lists of token ids
            return None
        if types == {str} and find_unpaired_surrogate("".join(value)) is None:  # many strings checked at once
            return None
        items = ((i, item) for i, item in enumerate(value) if isinstance(item, _WALKED))
    else:
        return None
    for key, item in items:
        if isinstance(key, int):
            where = f"{path}[{key}]"
        else:
            found = find_unpaired_surrogate(key, path)  # a dict key names no parameter of its own
            if found is not None:
                return found
            shown = key if len(key) <= 40 else key[:40] + "..."  # a huge key must not make a huge message
            where = f"{path}.{shown}" if path else shown
        found = find_unpaired_surrogate(item, where)
        if found is not None:
            return found
    return None


def refuse_unpaired_surrogates(request: BaseModel) -> None:
    """A request model's validator: the error naming where `request` holds an unpaired surrogate, if it does."""
    found = find_unpaired_surrogate(request)
    if found is not None:
        message = "{param}: the string holds an unpaired UTF-16 surrogate at index {index}; send valid Unicode"
        raise PydanticCustomError("invalid_unicode", message, {"param": found[0], "index": found[1]})
