"""Kubernetes resource quantities as the API server stores them in a resource list: exact value and canonical form.

Builders put quantities only into core resource lists (container requests/limits, PVC storage
requests). The API server rounds those up to milli precision (core/v1 `SetDefaults_ResourceList`:
"0.0001" and "1n" become "1m") and re-serialises them in canonical form: "0.5" -> "500m",
"1000m" -> "1", "1024Mi" -> "1Gi", "1.5Gi" -> "1536Mi". A builder that emits
`canonical_quantity(x)` therefore reads back exactly the string it wrote (a fixed point, checked
against a real API server in tests/controlplane/test_cp_quantity.py), and a drift check may
compare strings, or `quantity_value`s when one side was written by hand.

Canonical form (apimachinery's `resource.Quantity`): the suffix family of the input is kept
(decimal SI `m k M G …`, binary SI `Ki Mi Gi …`, or a decimal exponent `e3`); the number is
written without fractional digits, sign or leading zeros, and with the largest suffix that keeps
it exact; a binary-SI value below 1024 or not a whole number is written in decimal SI. Values are
exact rationals here, never floats. (Above 999E there is no SI suffix: older API servers then
drop the exponent, newer ones write `e21`; this module writes the latter. No resource is that big.)

Invariant: `QUANTITY_RE` is the one grammar; the API's `Quantity` type validates with it.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_SUFFIX = r"(?P<suffix>n|u|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+)?$"
QUANTITY_RE = re.compile(r"^(?P<number>[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+))" + _SUFFIX)
# The same with a non-zero digit in the number: a quantity greater than zero (claims' storage requests).
POSITIVE_QUANTITY_RE = re.compile(
    r"^(?P<number>[+]?([0-9]*[1-9][0-9]*(\.[0-9]*)?|[0-9]*\.[0-9]*[1-9][0-9]*))" + _SUFFIX
)
QUANTITY_MESSAGE = "must be a non-negative Kubernetes quantity such as 500m, 4, 16Gi or 100G"
POSITIVE_QUANTITY_MESSAGE = "must be a Kubernetes quantity greater than zero, such as 500m, 4, 16Gi or 100G"
DECIMAL_EXPONENTS = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BINARY_EXPONENTS = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL_SUFFIX = {exp: suffix for suffix, exp in DECIMAL_EXPONENTS.items()}
_BINARY_SUFFIX = {exp // 10: suffix for suffix, exp in BINARY_EXPONENTS.items()} | {0: ""}
_MILLI = 10**3  # resource lists are rounded up to this precision
# Longest quantity string accepted (a schema maxLength: it bounds the API server's estimated CEL cost of every
# rule that parses quantities; Kubernetes' own are far shorter).
MAX_QUANTITY_LENGTH = 64


def _parse(value: str | int) -> tuple[Fraction, str]:
    """(exact value, suffix family: "decimal" | "binary" | "exponent"); ValueError when not a quantity."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{value!r} {QUANTITY_MESSAGE}")
        return Fraction(value), "decimal"
    match = QUANTITY_RE.match(value) if isinstance(value, str) and len(value) <= MAX_QUANTITY_LENGTH else None
    if match is None:
        raise ValueError(f"{value!r} {QUANTITY_MESSAGE}")
    number = Fraction(match["number"].lstrip("+"))
    suffix = match["suffix"] or ""
    if suffix in BINARY_EXPONENTS:
        return number * 2 ** BINARY_EXPONENTS[suffix], "binary"
    if suffix in DECIMAL_EXPONENTS:
        return number * Fraction(10) ** DECIMAL_EXPONENTS[suffix], "decimal"
    return number * Fraction(10) ** int(suffix[1:]), "exponent"


def is_quantity(value: object) -> bool:
    try:
        _parse(value)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


def is_positive_quantity(value: object) -> bool:
    try:
        return _parse(value)[0] > 0  # type: ignore[arg-type]
    except ValueError:
        return False


def quantity_value(value: str | int) -> Fraction:
    """The amount a resource list holds for this quantity: exact, rounded up to 1m as the API server does."""
    exact, _ = _parse(value)
    return Fraction(math.ceil(exact * _MILLI), _MILLI)


def canonical_quantity(value: str | int) -> str:
    """The string the API server stores for this quantity in a resource list (see the module docstring)."""
    exact, family = _parse(value)
    millis = math.ceil(exact * _MILLI)
    if millis == 0:
        return "0"
    if family == "binary" and millis % _MILLI == 0 and millis >= 1024 * _MILLI:
        whole, power = millis // _MILLI, 0
        while whole % 1024 == 0 and power < max(_BINARY_SUFFIX):
            whole, power = whole // 1024, power + 1
        return f"{whole}{_BINARY_SUFFIX[power]}"
    mantissa, exponent = millis, -3
    while mantissa % 10 == 0:
        mantissa, exponent = mantissa // 10, exponent + 1
    shift = exponent % 3  # lower the exponent to a multiple of 3, keeping the mantissa whole
    mantissa, exponent = mantissa * 10**shift, exponent - shift
    if family == "exponent" or exponent not in _DECIMAL_SUFFIX:  # no SI suffix above E: exponent notation
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"


def same_quantity(a: object, b: object) -> bool:
    """True when both are quantities a resource list holds as the same amount (`"0.5"` and `"500m"`,
    `"1Gi"` and `"1024Mi"`): drift checks compare a hand-written value with the builders' by amount."""
    try:
        return quantity_value(a) == quantity_value(b)  # type: ignore[arg-type]
    except ValueError:
        return False
