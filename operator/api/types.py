"""Reusable field types whose CRD schema pydantic cannot derive on its own.

Each type validates in Python with the same rule and message that its CEL carries, so a value
refused by the API server is refused by the model too. Kubernetes quantities and int-or-percent
values are `x-kubernetes-int-or-string` on the wire (users write `cpu: 4` as often as `cpu: "4"`)
and strings in Python, kept as written (builders emit them in canonical form, see quantity.py).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, Field, StringConstraints, WithJsonSchema

from tidepool.operator.api.quantity import (
    MAX_QUANTITY_LENGTH,
    POSITIVE_QUANTITY_MESSAGE,
    QUANTITY_MESSAGE,
    is_positive_quantity,
    is_quantity,
)

PERCENT_RE = re.compile(r"^[0-9]{1,3}%$")
INT_OR_PERCENT_MESSAGE = "must be a non-negative integer or a percentage such as 25%"
DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _quantity(value: object) -> str:
    if not is_quantity(value):
        raise ValueError(f"{value!r} {QUANTITY_MESSAGE}")
    return str(value)


def _positive_quantity(value: object) -> str:
    if not is_positive_quantity(value):
        raise ValueError(f"{value!r} {POSITIVE_QUANTITY_MESSAGE}")
    return str(value)


def _int_or_percent(value: object) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and PERCENT_RE.match(value):
        return value
    raise ValueError(f"{value!r} {INT_OR_PERCENT_MESSAGE}")


Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "maxLength": MAX_QUANTITY_LENGTH,
            "x-kubernetes-validations": [
                {
                    "rule": "type(self) == int ? self >= 0 : "
                    "isQuantity(self) && !quantity(self).isLessThan(quantity('0'))",
                    "message": QUANTITY_MESSAGE,
                }
            ],
        }
    ),
]
"""A Kubernetes resource quantity (`4`, `500m`, `16Gi`), not negative; always a string in Python."""

PositiveQuantity = Annotated[
    str,
    BeforeValidator(_positive_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "maxLength": MAX_QUANTITY_LENGTH,
            "x-kubernetes-validations": [
                {
                    "rule": "type(self) == int ? self > 0 : "
                    "isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
                    "message": POSITIVE_QUANTITY_MESSAGE,
                }
            ],
        }
    ),
]
"""A quantity greater than zero (a claim's size: Kubernetes refuses a zero storage request)."""

IntOrPercent = Annotated[
    int | str,
    BeforeValidator(_int_or_percent),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [
                {
                    "rule": "type(self) == int ? self >= 0 : self.matches('^[0-9]{1,3}%$')",
                    "message": INT_OR_PERCENT_MESSAGE,
                }
            ],
        }
    ),
]
"""A Deployment rollout bound: a replica count or a percentage string."""

DnsLabel = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=DNS_LABEL_RE)]
DnsSubdomain = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_RE)]
ShortString = Annotated[str, StringConstraints(max_length=256)]
ReplicaCount = Annotated[int, Field(ge=0, le=10_000)]  # replicas of a pool or the router
