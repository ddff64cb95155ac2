"""The tidepool-2:4 layout (engine/sparsity/format.py): pack/unpack round trips and errors that name the tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tidepool.engine.sparsity.format import (
    CONFIG_KEY,
    densify_tensors,
    meta_indices,
    pack_2to4,
    read_sparsity_config,
    sparsity_config,
    unpack_2to4,
    validate,
)


def random_2to4(out: int, in_features: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dense ``[out, in]`` weight with exactly 2 nonzeros in each group of 4, at random positions."""
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // 4
    keep = torch.rand(out, groups, 4, generator=gen).topk(2, dim=-1).indices
    mask = torch.zeros(out, groups, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(out, in_features)
    return (
        (torch.randn(out, in_features, generator=gen) + 0.01)
        .sign()
        .mul(torch.rand(out, in_features) + 0.1)
        .mul(mask)
        .to(dtype)
    )


shapes = st.tuples(st.integers(1, 9), st.integers(1, 24).map(lambda g: 4 * g))  # odd outs, in % 8 == 4 included


@given(shape=shapes, seed=st.integers(0, 2**16))
def test_round_trip_over_shapes(shape: tuple[int, int], seed: int) -> None:
    out, in_features = shape
    dense = random_2to4(out, in_features, seed)
    values, meta = pack_2to4(dense, name="p")
    assert values.shape == (out, in_features // 2)
    assert meta.shape == (out, -(-in_features // 8)) and meta.dtype == torch.uint8
    validate("p", values, meta, in_features)
    assert torch.equal(unpack_2to4(values, meta, in_features, name="p"), dense)
    idx = meta_indices(meta, in_features // 4)
    assert bool((idx[..., 0] < idx[..., 1]).all())
    if (in_features // 4) % 2:  # the unused high nibble of the last byte is zero
        assert not bool((meta[:, -1] >> 4).any())


@given(shape=shapes, seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_round_trip_half_dtypes(shape: tuple[int, int], seed: int, dtype: torch.dtype) -> None:
    dense = random_2to4(*shape, seed, dtype)
    values, meta = pack_2to4(dense)
    assert values.dtype == dtype
    assert torch.equal(unpack_2to4(values, meta, shape[1]), dense)


def test_layout_matches_the_contract_by_hand() -> None:
    # group 0 keeps columns 1, 3 -> nibble 1 | 3 << 2 = 13; group 1 keeps 0, 2 -> 8; group 2 keeps 2, 3 -> 14
    dense = torch.tensor([[0.0, 1.0, 0.0, 2.0, 3.0, 0.0, 4.0, 0.0, 0.0, 0.0, 5.0, 6.0]])
    values, meta = pack_2to4(dense)
    assert values.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]
    assert meta.tolist() == [[13 | 8 << 4, 14]]


def test_groups_with_zero_kept_values_still_name_two_indices() -> None:
    dense = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 7.0, 0.0]])
    values, meta = pack_2to4(dense)
    validate("p", values, meta)
    assert torch.equal(unpack_2to4(values, meta, 8), dense)
    mask = torch.tensor([[False, False, True, True, False, True, True, False]])
    values, meta = pack_2to4(dense, mask)  # an explicit mask keeps its (zero) positions
    assert meta_indices(meta, 2).tolist() == [[[2, 3], [1, 2]]]


def test_int8_values_need_scales_and_dequantize() -> None:
    dense = random_2to4(3, 8, seed=1)
    values, meta = pack_2to4(dense)
    scales = values.abs().amax(1) / 127
    q = torch.round(values / scales[:, None]).to(torch.int8)
    assert torch.allclose(unpack_2to4(q, meta, 8, scales), dense, atol=float(scales.max()))
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj\.scales is missing"):
        validate("layers.0.q_proj", q, meta)
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj\.scales is torch.float16"):
        validate("layers.0.q_proj", q, meta, scales=scales.half())
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj\.scales is present"):
        validate("layers.0.q_proj", values, meta, scales=scales)


@given(shape=shapes, seed=st.integers(0, 2**16), data=st.data())
def test_validate_catches_bad_indices(shape: tuple[int, int], seed: int, data: st.DataObject) -> None:
    out, in_features = shape
    values, meta = pack_2to4(random_2to4(out, in_features, seed))
    row = data.draw(st.integers(0, out - 1))
    group = data.draw(st.integers(0, in_features // 4 - 1))
    i0, i1 = data.draw(st.tuples(st.integers(0, 3), st.integers(0, 3)).filter(lambda p: p[0] >= p[1]))
    shift = 4 * (group % 2)
    byte = int(meta[row, group // 2]) & ~(0xF << shift) | ((i0 | i1 << 2) << shift)
    meta[row, group // 2] = byte
    with pytest.raises(ValueError, match=rf"model\.layers\.3\.mlp\.up_proj\.meta: row {row}, group {group}"):
        validate("model.layers.3.mlp.up_proj", values, meta)
    with pytest.raises(ValueError, match=r"up_proj\.meta"):
        unpack_2to4(values, meta, in_features, name="model.layers.3.mlp.up_proj")


def test_validate_catches_a_set_unused_nibble() -> None:
    values, meta = pack_2to4(random_2to4(2, 12, seed=3))
    meta[1, -1] |= 0x40
    with pytest.raises(ValueError, match=r"q\.meta: row 1 has a nonzero unused high nibble"):
        validate("q", values, meta)


@pytest.mark.parametrize(
    ("values_shape", "meta_shape", "in_features", "match"),
    [
        ((4, 6), (4, 1), 12, r"down_proj\.meta is torch\.uint8 \(4, 1\), expected uint8 \(4, 2\)"),
        ((4, 6), (3, 2), 12, r"down_proj\.meta is torch\.uint8 \(3, 2\)"),
        ((4, 6), (4, 2), 16, r"down_proj\.values has shape \(4, 6\), expected \(4, 8\)"),
        ((4, 5), (4, 2), 10, r"down_proj\.values has 10 input features, not a multiple of 4"),
        ((4, 6, 1), (4, 2), 12, r"down_proj\.values must be 2-D"),
    ],
)
def test_validate_catches_mismatched_shapes(
    values_shape: tuple[int, ...], meta_shape: tuple[int, int], in_features: int, match: str
) -> None:
    values = torch.ones(values_shape)
    meta = torch.full(meta_shape, 4 | 4 << 4, dtype=torch.uint8)  # (0, 1) in both nibbles
    with pytest.raises(ValueError, match=match):
        validate("mlp.down_proj", values, meta, in_features)


def test_meta_of_the_wrong_dtype_is_named() -> None:
    values, meta = pack_2to4(random_2to4(2, 8, seed=0))
    with pytest.raises(ValueError, match=r"o_proj\.meta is torch\.int32"):
        validate("o_proj", values, meta.to(torch.int32))


def test_pack_rejects_dense_weights_and_bad_widths() -> None:
    with pytest.raises(ValueError, match=r"gate_proj\.weight is not 2:4 sparse: row 0, columns 0\.\.3 keep 3"):
        pack_2to4(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), name="gate_proj.weight")
    with pytest.raises(ValueError, match=r"k_proj\.weight has 6 input features, not a multiple of 4"):
        pack_2to4(torch.zeros(2, 6), name="k_proj.weight")
    with pytest.raises(ValueError, match=r"v\.weight: mask shape"):
        pack_2to4(torch.zeros(2, 8), torch.ones(2, 4, dtype=torch.bool), name="v.weight")


def test_densify_tensors_restores_weights_and_names_a_missing_meta() -> None:
    dense = random_2to4(4, 16, seed=2)
    values, meta = pack_2to4(dense)
    tensors = {"m.layers.0.mlp.up_proj.values": values, "m.layers.0.mlp.up_proj.meta": meta, "m.norm.weight": meta}
    out = densify_tensors(tensors)
    assert set(out) == {"m.layers.0.mlp.up_proj.weight", "m.norm.weight"}
    assert torch.equal(out["m.layers.0.mlp.up_proj.weight"], dense)
    del tensors["m.layers.0.mlp.up_proj.meta"]
    with pytest.raises(ValueError, match=r"m\.layers\.0\.mlp\.up_proj\.meta is missing"):
        densify_tensors(tensors)


def test_config_round_trip_and_errors() -> None:
    raw = sparsity_config("wanda", "int8", {"source": "test"})
    parsed = read_sparsity_config({CONFIG_KEY: raw})
    assert parsed is not None and parsed.method == "wanda" and parsed.torch_values_dtype == torch.int8
    assert read_sparsity_config({}) is None
    with pytest.raises(ValueError, match=r"sparsity_config\.method is 'random'"):
        read_sparsity_config({CONFIG_KEY: {**raw, "method": "random"}})
    with pytest.raises(ValueError, match=r"format 'nm' version 1"):
        read_sparsity_config({CONFIG_KEY: {**raw, "format": "nm"}})
    with pytest.raises(ValueError, match=r"sparsity_config\.values_dtype is 'int4'"):
        sparsity_config("magnitude", "int4")
