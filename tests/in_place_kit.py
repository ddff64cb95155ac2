"""One check shared by the in-place load tests of GGUF files (tests/gguf/test_gguf_in_place.py) and dense
Hugging Face folders (tests/test_folder_in_place.py): no tests here.

`packed_equals_plain(path)` loads `path` twice, plainly and straight into the huge-page arena
(`load_model(pack_weights=True)`), asserts the two models are equal value for value and dtype for dtype, under the
same names in the same order, with the tied lm_head still one tensor; it returns the packed model for further checks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tidepool.engine.loading.loader import load_model


def packed_equals_plain(path: str | Path) -> torch.nn.Module:
    plain, _ = load_model(path, torch.float32, show_progress=False)
    packed, _ = load_model(path, torch.float32, show_progress=False, pack_weights=True)
    expected = dict(plain.state_dict(keep_vars=True))
    got = dict(packed.state_dict(keep_vars=True))
    assert list(got) == list(expected)
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert packed.lm_head is None and packed.lm_head_weight is packed.embed_tokens  # tied: still one tensor
    return packed
