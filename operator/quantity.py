"""Kubernetes resource quantities as exact numbers, so drift detection compares values, not spellings.

The API server canonicalises quantities it stores (`0.5` -> `500m`, `1024Mi` -> `1Gi`, `1e3` -> `1k`),
so a desired `cpu: 0.5` never equals the observed string `500m`; comparing the strings would re-apply
(and report drift) on every reconcile. `parse_quantity` returns an exact `Fraction`; `same_quantity`
says whether two spellings mean the same amount. Pure, no I/O.
"""

from __future__ import annotations

import re
from fractions import Fraction

_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(value: object) -> Fraction | None:
    """The exact amount of a quantity (`"500m"` -> 1/2, `"1Gi"` -> 2**30, `4` -> 4); None if not a quantity."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(str(value))
    if not isinstance(value, str):
        return None
    match = _QUANTITY.match(value.strip())
    if match is None:
        return None
    number, suffix = Fraction(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        return number * 1024 ** _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * Fraction(10) ** _DECIMAL[suffix]
    return number * Fraction(10) ** int(suffix[1:])  # an exponent: 1e3, 5E-1


def same_quantity(a: object, b: object) -> bool:
    """True when both are quantities of the same amount (`"0.5"` and `"500m"`, `"1Gi"` and `"1024Mi"`)."""
    left, right = parse_quantity(a), parse_quantity(b)
    return left is not None and left == right
