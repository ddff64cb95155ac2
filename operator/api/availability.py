"""`pools.<name>.disruptionBudget`: the PodDisruptionBudget of one engine pool, and its one rule.

Shapes plus the rule that belongs to them (a CEL expression for the API server and the same check in Python,
rules.py's way): exactly one of `maxUnavailable` and `minAvailable`, as a PodDisruptionBudget takes. Unset, a
pool that can run more than one replica (`InferenceServiceSpec.can_exceed_one_replica`) gets the operator's
default budget, `maxUnavailable: 1` (`DEFAULT_POOL_BUDGET`: a drain evicts one replica at a time), and a
single-replica pool gets no PDB at all: `maxUnavailable: 1` would protect nothing there and `minAvailable: 1`
would block every drain of its node, so the object would be pure cost (set a budget to have one anyway).

Invariants: the builder (builders/network.py) copies the one field set verbatim into the PDB's spec, so
what the API server accepts here is what a PDB accepts (a count or a percentage).
"""

from __future__ import annotations

from pydantic import Field

from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.rule import Rule
from tidepool.operator.api.types import IntOrPercent

DEFAULT_POOL_BUDGET: dict[str, int | str] = {"maxUnavailable": 1}
ONE_OF_MESSAGE = (
    "disruptionBudget must set exactly one of maxUnavailable or minAvailable (a PodDisruptionBudget takes one); "
    "remove disruptionBudget for the default (maxUnavailable: 1, none for a single-replica pool)"
)


class DisruptionBudget(ApiModel):
    """How many replicas of a pool voluntary disruptions (node drains, evictions) may take down at once."""

    max_unavailable: IntOrPercent | None = Field(
        default=None,
        description=(
            "Replicas (count or % of the pool) a voluntary disruption may take down at once. 0 blocks every eviction "
            "(node drains wait until the budget is changed)."
        ),
    )
    min_available: IntOrPercent | None = Field(
        default=None,
        description=(
            "Replicas (count or %) that must stay up through voluntary disruptions. On a single-replica pool "
            "minAvailable: 1 (or 100%) blocks every drain of its node until the pool grows or the budget changes: "
            "use it only where a drain should wait for an operator's hand."
        ),
    )

    def to_pdb_spec(self) -> dict[str, int | str]:
        """The PodDisruptionBudget spec field this budget sets."""
        if self.min_available is not None:
            return {"minAvailable": self.min_available}
        return {"maxUnavailable": self.max_unavailable if self.max_unavailable is not None else 1}


AVAILABILITY_RULES: tuple[Rule, ...] = (
    Rule(
        DisruptionBudget,
        "has(self.maxUnavailable) != has(self.minAvailable)",
        ONE_OF_MESSAGE,
        lambda b: (b.max_unavailable is None) != (b.min_available is None),
    ),
)
