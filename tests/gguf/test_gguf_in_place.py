"""Loading a GGUF file straight into the huge-page arena gives the same model as loading, then packing.

`load_model(pack_weights=True)` moves the parameters into the arena before the load (their values
are not copied: every one is overwritten by the load) and copies the buffers (rotary tables). The
result must equal a plain load value for value, keep tied weights one object, and leave the model
runner's later `pack_weights` nothing to move.
"""

from __future__ import annotations

import pytest
from in_place_kit import packed_equals_plain

from tidepool.engine import LLM, SamplingParams, hugepages


@pytest.mark.parametrize(("variant", "type_name"), [("llama-mqa-tied-llama3rope", "Q8_0"), ("qwen2-tied", "Q4_1")])
def test_in_place_load_equals_a_plain_load(gguf_model, variant: str, type_name: str) -> None:
    path = gguf_model(variant, type_name)
    packed = packed_equals_plain(path)
    if hugepages.unavailable_reason() is not None:
        pytest.skip(f"huge pages off here: {hugepages.unavailable_reason()}")
    tensors = [*packed.parameters(), *packed.buffers()]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one arena, params and buffers
    assert min(t.data_ptr() for t in tensors) % hugepages.HUGE_PAGE == 0
    again = hugepages.pack_weights(packed)  # what the model runner does next: nothing left to move
    assert again.moved == 0 and again.reason == "no CPU weights to move"


def test_engine_greedy_tokens_are_the_same_with_huge_pages_on_and_off(gguf_model, monkeypatch) -> None:
    """The engine's GGUF path (in place when huge pages are on) against the plain path (huge pages off)."""
    path = gguf_model("llama-gqa", "Q8_0")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    results = {}
    for mode in ("off", "auto"):
        monkeypatch.setenv(hugepages.MODE_ENV, mode)
        llm = LLM(str(path), dtype="float32", show_progress=False)
        outs = llm.generate([[5, 9, 17, 3, 44], list(range(3, 60))], params, use_tqdm=False)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results["off"] == results["auto"] and all(len(ids) == 10 for ids, _ in results["auto"])
