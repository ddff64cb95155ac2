"""Int4/int8 packing and round-to-nearest quantization against plain references."""

from __future__ import annotations

import pytest
import torch
from quant_reference import pack_along_rows, unpack_along_rows

from tidepool.engine.quant.formats import unpack_along_first, unpack_along_last
from tidepool.engine.quant.quantize import int4_group_size, quantize_int4, quantize_int8, quantize_tensors
from tidepool.kernels.int4_packing import dequantize_int4, pack_int4, unpack_int4


@pytest.mark.parametrize(("k", "n"), [(8, 1), (16, 8), (64, 24)])
def test_runtime_packing_matches_loop_reference(k: int, n: int) -> None:
    q = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(k + n))
    packed = pack_int4(q)
    assert torch.equal(packed, pack_along_rows(q))
    assert torch.equal(unpack_int4(packed).to(torch.int64), q)
    assert torch.equal(unpack_along_rows(packed), q)
    assert torch.equal(unpack_along_first(packed).to(torch.int64), q)


def test_unpack_along_last_matches_loop_reference() -> None:
    from quant_reference import pack_along_cols, unpack_along_cols

    q = torch.randint(0, 16, (5, 32), generator=torch.Generator().manual_seed(3))
    words = pack_along_cols(q)
    assert torch.equal(unpack_along_last(words).to(torch.int64), unpack_along_cols(words))
    assert torch.equal(unpack_along_cols(words), q)


def test_all_nibbles_fifteen_sets_the_sign_bit() -> None:
    q = torch.full((8, 2), 15)
    packed = pack_int4(q)
    assert int(packed[0, 0]) == -1  # 0xFFFFFFFF as int32
    assert torch.equal(unpack_int4(packed).to(torch.int64), q)


def test_int8_error_is_at_most_half_a_step() -> None:
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(0))
    w_int8, scales = quantize_int8(w)
    assert w_int8.dtype == torch.int8 and scales.shape == (16,)
    err = (w_int8.float() * scales[:, None] - w).abs()
    assert bool((err <= scales[:, None] / 2 + 1e-6).all())
    assert int(w_int8.abs().max()) == 127  # the largest weight of each row uses the full range


@pytest.mark.parametrize("group_size", [8, 32])
def test_int4_error_is_bounded_by_the_group_step(group_size: int) -> None:
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))
    qweight, scales, zeros = quantize_int4(w, group_size)
    assert qweight.shape == (64 // 8, 12) and scales.shape == zeros.shape == (64 // group_size, 12)
    deq = dequantize_int4(qweight, scales, zeros, group_size).t()
    step = scales.repeat_interleave(group_size, dim=0).t()
    # Clipped weights may lie beyond half a step; the clip search only shrinks ranges by <= 30%.
    err = (deq - w).abs()
    assert float(err.max()) < float(w.abs().max()) * 0.35
    assert float((err <= step / 2 + 1e-5).float().mean()) > 0.9


def test_clip_search_never_worse_than_min_max() -> None:
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(2)) ** 3  # heavy tails: clipping pays
    errs = {}
    for clip in (False, True):
        qweight, scales, zeros = quantize_int4(w, 64, clip_search=clip)
        errs[clip] = float((dequantize_int4(qweight, scales, zeros, 64).t() - w).square().sum())
    assert errs[True] < errs[False]


def test_quantize_tensors_only_touches_projections() -> None:
    tensors = {
        "model.embed_tokens.weight": torch.randn(10, 16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 32),
        "lm_head.weight": torch.randn(10, 16),
    }
    out, group_sizes = quantize_tensors(tensors, "int4", group_size=16)
    assert group_sizes == {16: 16, 32: 16}
    assert set(out) == {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.qweight",
        "model.layers.0.self_attn.q_proj.scales",
        "model.layers.0.self_attn.q_proj.zeros",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.mlp.down_proj.qweight",
        "model.layers.0.mlp.down_proj.scales",
        "model.layers.0.mlp.down_proj.zeros",
        "lm_head.weight",
    }
    assert out["lm_head.weight"] is tensors["lm_head.weight"]


@pytest.mark.parametrize(
    ("method", "group_size", "message"),
    [
        ("int3", 128, "unknown quantization method 'int3'"),
        ("int4", 12, "multiple of 8"),
        ("int4", 24, "does not divide model.layers.0.mlp.down_proj.weight's 32 input features"),
        ("int4", 0, "positive multiple"),
    ],
)
def test_bad_quantization_arguments(method: str, group_size: int, message: str) -> None:
    tensors = {"model.layers.0.mlp.down_proj.weight": torch.randn(16, 32)}
    with pytest.raises(ValueError, match=message):
        quantize_tensors(tensors, method, group_size)


def test_nothing_to_quantize_is_an_error() -> None:
    with pytest.raises(ValueError, match="no decoder projection"):
        quantize_tensors({"model.embed_tokens.weight": torch.randn(4, 8)}, "int8")


def test_mins_form_and_fusing_parts_of_both_forms() -> None:
    """W = q * s + m dequantizes exactly; a zeros part and a mins part fuse side by side (ConcatWeight)."""
    from tidepool.engine.quant.formats import Int4Parts
    from tidepool.engine.quant.runtime import ConcatWeight, Int4Weight, fuse_int4

    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (64, 12), generator=gen)
    scales, mins = torch.rand(2, 12, generator=gen), torch.randn(2, 12, generator=gen)
    w = dequantize_int4(pack_int4(q), scales, None, 32, mins=mins)
    assert torch.equal(w, q.float() * scales.repeat_interleave(32, 0) + mins.repeat_interleave(32, 0))
    zeros = torch.rand(2, 12, generator=gen) * 15
    with_zeros = Int4Parts(pack_int4(q), scales, zeros, 32)
    with_mins = Int4Parts(pack_int4(q), scales, None, 32, mins=mins)
    fused = fuse_int4([with_zeros, with_mins])
    assert isinstance(fused, ConcatWeight)
    assert isinstance(fuse_int4([with_mins, with_mins]), Int4Weight)
    x = torch.randn(3, 64, generator=gen)
    want = torch.cat([x @ dequantize_int4(pack_int4(q), scales, zeros, 32), x @ w], dim=1)
    torch.testing.assert_close(torch.nn.functional.linear(x, fused), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("k", "at_most", "size"),
    [(1536, 128, 128), (576, 128, 96), (576, 64, 64), (64, 128, 64), (160, 128, 80), (1000, 128, 40), (776, 128, 8)],
)
def test_int4_group_size_is_the_largest_multiple_of_8_that_divides(k: int, at_most: int, size: int) -> None:
    assert int4_group_size(k, at_most) == size
    assert k % size == 0 and size % 8 == 0 and size <= at_most
    assert not any(k % g == 0 for g in range(size + 8, at_most + 1, 8))


@pytest.mark.parametrize(
    ("k", "at_most", "message"),
    [
        (78, 128, "78 input features, not a multiple of 8.*use int8"),
        (64, 12, "positive multiple of 8"),
        (64, 0, "positive"),
    ],
)
def test_int4_group_size_refuses_what_cannot_pack(k: int, at_most: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        int4_group_size(k, at_most, "w")


def test_default_group_size_narrows_per_projection_only_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(5)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 576, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 1536, generator=g),
    }
    with pytest.raises(ValueError, match=r"group size 128 does not divide .*q_proj.weight's 576 .*e\.g\. 96"):
        quantize_tensors(tensors, "int4", 128)  # a size the user chose is kept or refused, never changed
    with caplog.at_level("INFO", logger="tidepool.engine.quant.quantize"):
        out, group_sizes = quantize_tensors(tensors, "int4", 128, adapt_group_size=True)
    assert group_sizes == {576: 96, 1536: 128}  # what the checkpoint's config records
    assert "narrower where 128 does not divide a projection's inputs (576 inputs: 96)" in caplog.text
    assert out["model.layers.0.self_attn.q_proj.scales"].shape == (576 // 96, 16)
    assert out["model.layers.0.mlp.down_proj.scales"].shape == (1536 // 128, 8)
    for prefix, size in (("model.layers.0.self_attn.q_proj", 96), ("model.layers.0.mlp.down_proj", 128)):
        weight = tensors[f"{prefix}.weight"]
        same, *_ = quantize_int4(weight, size)
        assert torch.equal(out[f"{prefix}.qweight"], same)
