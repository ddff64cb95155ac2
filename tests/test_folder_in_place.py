"""A dense Hugging Face folder loads straight into the huge-page arena, as a dense GGUF file does (issue #43):
the engine's single-process CPU path writes each weight once, into its final place, instead of loading it and then
copying it into the arena (tests/gguf/test_gguf_in_place.py is the GGUF twin).

Checked: an in-place load equals a plain load value for value (tied weights stay one tensor); the engine takes
the in-place path for a folder (its load log says so, and the runner's own packing finds nothing left to move);
and its greedy tokens match the plain path's (huge pages off).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from in_place_kit import packed_equals_plain

from tidepool.engine import LLM, SamplingParams, hugepages


def test_in_place_folder_load_equals_a_plain_load(hf_model_dir) -> None:
    path = hf_model_dir("qwen2-tied")
    packed_equals_plain(path)


def test_the_engine_loads_a_dense_folder_in_place(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if hugepages.unavailable_reason() is not None:
        pytest.skip(f"huge pages off here: {hugepages.unavailable_reason()}")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 17, 3, 44], list(range(3, 40))]
    caplog.set_level(logging.INFO, "tidepool.engine.loading.loader")
    llm = LLM(str(tiny_model_dir), dtype="float32", show_progress=False)
    assert [r for r in caplog.records if "(loaded in place)" in r.getMessage()], "the folder was not loaded in place"
    tensors = [*llm.engine.model.parameters(), *llm.engine.model.buffers()]
    assert len({t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu"}) == 1  # one arena
    in_place = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    monkeypatch.setenv(hugepages.MODE_ENV, "off")
    plain = LLM(str(tiny_model_dir), dtype="float32", show_progress=False)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == in_place
