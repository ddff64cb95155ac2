"""`ServiceState.view_of`: a key's spec is validated once per spec, not once per sync.

Most syncs are pod and workload events; re-validating an unchanged spec (pydantic plus the CEL twins) was
37% of a sync's CPU at fleet scale (bench/README.md "Operator at scale"). The view is reused only for an
equal spec: any change, including an in-place edit of the body it was parsed from, parses again.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fake_api import NAME, NS, SPEC
from pydantic import ValidationError

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.state import ServiceState


def body(spec: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": NAME, "namespace": NS, "uid": "u1", "generation": 1}, "spec": spec}


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    original = InferenceServiceSpec.model_validate

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(InferenceServiceSpec, "model_validate", counting)
    return calls


def test_an_unchanged_spec_reuses_its_view(parses: list[Any]) -> None:
    state = ServiceState()
    first = state.view_of(body(copy.deepcopy(SPEC)))
    again = state.view_of(body(copy.deepcopy(SPEC)))  # a fresh body, as each sync decodes one from the cache
    assert again is first and len(parses) == 1


def test_a_changed_spec_is_parsed_again_even_when_edited_in_place(parses: list[Any]) -> None:
    state = ServiceState()
    obj = body(copy.deepcopy(SPEC))
    first = state.view_of(obj)
    obj["spec"]["engine"] = {"maxNumSeqs": 64}  # the very dict it was parsed from
    second = state.view_of(obj)
    assert second is not first and len(parses) == 2
    assert second.spec.engine.max_num_seqs == 64 and first.spec.engine.max_num_seqs != 64


def test_an_invalid_spec_is_refused_every_time_and_never_kept(parses: list[Any]) -> None:
    state = ServiceState()
    valid = state.view_of(body(copy.deepcopy(SPEC)))
    bad = copy.deepcopy(SPEC)
    bad["mode"] = "sideways"
    for _ in range(2):
        with pytest.raises(ValidationError):
            state.view_of(body(bad))
    assert state.view_of(body(copy.deepcopy(SPEC))) is valid  # back to the valid spec: its view again
    assert len(parses) == 3
