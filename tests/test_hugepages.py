"""Weights and KV cache in huge-page-advised memory: values, strides, ties and outputs kept; refusals explained."""

from __future__ import annotations

import copy
import ctypes
import mmap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_weight_layout import _logits
from torch import nn

from tidepool.engine import LLM, SamplingParams, hugepages
from tidepool.engine.layers.weight_layout import apply_weight_layout, is_input_major
from tidepool.engine.loading.loader import load_model

needs_thp = pytest.mark.skipif(
    hugepages.unavailable_reason() is not None, reason=f"huge pages off here: {hugepages.unavailable_reason()}"
)


def _storages(model: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


@needs_thp
@pytest.mark.parametrize("variant", ["tiny", "llama-mqa-tied-llama3rope", "qwen2-tied", "mistral-window"])
def test_pack_keeps_values_strides_ties_and_outputs(
    variant: str, tiny_model_dir: Path, hf_model_dir: Callable[[str], Path]
) -> None:
    folder = tiny_model_dir if variant == "tiny" else hf_model_dir(variant)
    model, config = load_model(folder, dtype=torch.float32, show_progress=False)
    apply_weight_layout(model)  # the runner packs after this: [in, out] views must keep their strides
    before = copy.deepcopy(model)
    ids = list(range(3, 40))
    expected = _logits(model, ids)
    objects = {name: p for name, p in model.named_parameters()}

    report = hugepages.pack_weights(model)

    tensors = [*model.parameters(), *model.buffers()]
    assert report.reason is None and report.moved == len(tensors) and report.skipped == 0
    assert report.num_bytes == sum(t.numel() * t.element_size() for t in tensors)
    assert len(_storages(model)) == 1  # one arena
    arena = model.embed_tokens.untyped_storage()
    assert all(t.data_ptr() % hugepages.ALIGN == 0 for t in tensors)
    assert min(t.data_ptr() for t in tensors) % hugepages.HUGE_PAGE == 0 < arena.nbytes()
    for name, param in model.named_parameters():
        old = dict(before.named_parameters())[name]
        assert param is objects[name], name  # same Parameter objects: modules and optimisers see no swap
        assert param.stride() == old.stride() and param.dtype == old.dtype and torch.equal(param, old), name
    assert any(is_input_major(p) for p in model.parameters())
    if config.tie_word_embeddings:
        assert model.lm_head_weight is model.embed_tokens
    for (name, buf), (_, old) in zip(model.named_buffers(), before.named_buffers(), strict=True):
        assert torch.equal(buf, old), name
    assert torch.equal(_logits(model, ids), expected)


def test_views_of_shared_storage_stay_in_place() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            whole = torch.randn(8, 4)
            self.a = nn.Parameter(whole[:4], requires_grad=False)
            self.b = nn.Parameter(whole[4:], requires_grad=False)  # shares `a`'s storage
            self.c = nn.Parameter(torch.randn(4, 6)[:, ::2], requires_grad=False)  # not dense
            self.d = nn.Parameter(torch.randn(5, 3), requires_grad=False)

    module = Shared()
    pointers = (module.a.data_ptr(), module.b.data_ptr(), module.c.data_ptr())
    d = module.d.detach().clone()
    report = hugepages.pack_weights(module)
    if report.reason is not None:
        assert report.moved == 0 and module.d.data_ptr() != 0
        pytest.skip(f"huge pages off here: {report.reason}")
    assert (module.a.data_ptr(), module.b.data_ptr(), module.c.data_ptr()) == pointers
    assert report.moved == 1 and report.skipped == 3 and torch.equal(module.d, d)
    assert module.d.data_ptr() % hugepages.HUGE_PAGE == 0


def test_off_by_environment_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hugepages.MODE_ENV, "off")
    layer = nn.Linear(16, 16)
    pointer = layer.weight.data_ptr()
    report = hugepages.pack_weights(layer)
    assert report.moved == 0 and report.reason == f"{hugepages.MODE_ENV}=off" and layer.weight.data_ptr() == pointer
    assert "ordinary pages" in report.summary()
    cache = hugepages.zeros((3, 16, 2, 8), torch.float32)
    assert cache.shape == (3, 16, 2, 8) and not cache.any()


@pytest.mark.parametrize(
    ("text", "mode"),
    [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
     ("always madvise [never]\n", "never"), ("garbled\n", "unavailable")],
)  # fmt: skip
def test_thp_mode_reads_the_bracketed_word(tmp_path: Path, text: str, mode: str) -> None:
    path = tmp_path / "enabled"
    path.write_text(text)
    assert hugepages.thp_mode(path) == mode
    assert hugepages.thp_mode(tmp_path / "missing") == "unavailable"
    reason = hugepages.unavailable_reason({}, mode)
    assert (reason is None) == (mode in ("always", "madvise")) or not hugepages.sys.platform.startswith("linux")
    if mode == "never":
        assert reason is not None and "never" in reason


def test_huge_page_bytes_counts_only_the_tensors_mappings(tmp_path: Path) -> None:
    tensor = torch.empty(1 << 20, dtype=torch.uint8)
    lo = tensor.untyped_storage().data_ptr()
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{lo - 0x10000:x}-{lo - 0x1000:x} rw-p 00000000 00:00 0\nAnonHugePages:      4096 kB\n"
        f"{lo - 0x1000:x}-{lo + (2 << 20):x} rw-p 00000000 00:00 0\nRss: 1 kB\nAnonHugePages:      2048 kB\n"
        f"{lo + (2 << 20):x}-{lo + (8 << 20):x} rw-p 00000000 00:00 0 [heap]\nAnonHugePages:      6144 kB\n"
    )
    assert hugepages.huge_page_bytes(tensor, smaps) == 2048 * 1024
    assert hugepages.huge_page_bytes(tensor, tmp_path / "missing") == 0


@needs_thp
def test_zeros_are_aligned_zero_and_writable() -> None:
    cache = hugepages.zeros((4, 16, 2, 64), torch.float32)
    assert cache.shape == (4, 16, 2, 64) and cache.is_contiguous() and not cache.any()
    assert cache.data_ptr() % hugepages.HUGE_PAGE == 0
    cache[1, 2] = 1.5
    assert cache.sum().item() == 1.5 * 2 * 64


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s own pages resident in memory, from mincore(2) over exactly its range.

    (smaps' Rss is per mapping, and the kernel merges a new anonymous mapping with a neighbour of the
    same flags, e.g. an earlier test's advised buffer whose pages are resident.)
    """
    page = mmap.PAGESIZE
    start = tensor.data_ptr() - tensor.data_ptr() % page
    length = tensor.data_ptr() + tensor.untyped_storage().nbytes() - start
    num_pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * num_pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return sum(b & 1 for b in vec) * page


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_zeros_are_reserved_not_touched(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A KV cache costs no resident memory until it is used: a fresh mapping, no page written at start."""
    monkeypatch.setenv(hugepages.MODE_ENV, mode)
    num_bytes = 64 << 20
    cache = hugepages.zeros((num_bytes // (16 * 2 * 64 * 4), 16, 2, 64), torch.float32)
    assert cache.untyped_storage().nbytes() >= num_bytes and cache.data_ptr() % hugepages.HUGE_PAGE == 0
    assert _resident_bytes(cache) == 0  # reserved: nothing faulted in yet
    cache[3, 5] = 2.0  # one slot's keys: faults in one page (at most one 2 MiB huge page)
    assert 0 < _resident_bytes(cache) <= hugepages.HUGE_PAGE
    assert cache.sum().item() == 2.0 * 2 * 64  # every other byte reads as the kernel's zeros


def test_engine_output_is_the_same_with_huge_pages_on_and_off(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [[5, 9, 17, 3, 44], list(range(3, 60))]
    results = {}
    for mode in ("off", "auto"):
        monkeypatch.setenv(hugepages.MODE_ENV, mode)
        llm = LLM(str(tiny_model_dir), dtype="float32", show_progress=False)
        runner = llm.engine.runner
        if mode == "auto" and hugepages.unavailable_reason() is None:
            assert len(_storages(llm.engine.model)) == 1
            assert all(k.data_ptr() % hugepages.HUGE_PAGE == 0 for k, _ in runner.kv_caches)
        outs = llm.generate(prompts, params)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results["off"] == results["auto"]
