"""GPTQ and AWQ layer conversion against dense weights built directly from (q, zeros, scales, g_idx)."""

from __future__ import annotations

import pytest
import torch
from quant_reference import AWQ_PACK_ORDER, dense_from_groups, pack_along_cols, pack_along_rows, unpack_along_cols

from tidepool.engine.quant.formats import AWQ_ORDER, awq_to_int4, gptq_to_int4, unpack_along_last
from tidepool.engine.quant.runtime import Int4Weight
from tidepool.kernels.int4_packing import dequantize_int4

K, N, GROUP = 64, 24, 16


def _random_layer(seed: int, symmetric: bool, act_order: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=gen)
    # 1..15 for asymmetric zeros: GPTQ v1 stores zero - 1 in a nibble, so a zero of 0 is not representable.
    zeros = torch.full((K // GROUP, N), 8) if symmetric else torch.randint(1, 16, (K // GROUP, N), generator=gen)
    scales = torch.rand((K // GROUP, N), generator=gen) * 0.1 + 0.01
    if act_order:
        order = torch.randperm(K, generator=gen)  # quantization order: position i -> row order[i]
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[order] = (torch.arange(K) // GROUP).to(torch.int32)
    else:
        g_idx = (torch.arange(K) // GROUP).to(torch.int32)
    return q, zeros, scales, g_idx


def _check_against_dense(parts: object, dense: torch.Tensor) -> None:
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(9))
    layer = Int4Weight(parts)  # type: ignore[arg-type]
    torch.testing.assert_close(torch.nn.functional.linear(x, layer), x @ dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_gptq_conversion(symmetric: bool, act_order: bool, version: str) -> None:
    seed = 100 * symmetric + 10 * act_order + (version == "v1")
    q, zeros, scales, g_idx = _random_layer(seed, symmetric, act_order)
    dense = dense_from_groups(q, zeros, scales, g_idx.long())
    stored_zeros = zeros - 1 if version == "v1" else zeros
    parts = gptq_to_int4(
        "layer", pack_along_rows(q), pack_along_cols(stored_zeros), scales, g_idx, GROUP, is_v1=version == "v1"
    )
    assert (parts.perm is not None) == act_order
    if act_order:
        # Rows sorted into group order: every group of GROUP consecutive permuted rows shares its g_idx.
        assert torch.equal(g_idx.long()[parts.perm], torch.arange(K) // GROUP)
        torch.testing.assert_close(dequantize_int4(parts.qweight, parts.scales, parts.zeros, GROUP), dense[parts.perm])
    else:
        torch.testing.assert_close(dequantize_int4(parts.qweight, parts.scales, parts.zeros, GROUP), dense)
    _check_against_dense(parts, dense)


def test_gptq_group_size_minus_one_is_one_group() -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(1, 16, (1, N), generator=gen)
    scales = torch.rand((1, N), generator=gen)
    parts = gptq_to_int4("layer", pack_along_rows(q), pack_along_cols(zeros - 1), scales, None, -1)
    assert parts.group_size == K
    _check_against_dense(parts, dense_from_groups(q, zeros, scales, torch.zeros(K, dtype=torch.long)))


def test_awq_order_matches_autoawq_pack_order() -> None:
    assert list(AWQ_ORDER) == AWQ_PACK_ORDER
    words = pack_along_cols(torch.arange(8).view(1, 8), AWQ_PACK_ORDER)
    # Column c sits in nibble AWQ_PACK_ORDER.index(c): reading nibbles in order gives 0, 2, 4, 6, 1, 3, 5, 7.
    assert unpack_along_last(words).tolist() == [AWQ_PACK_ORDER]
    assert unpack_along_cols(words, AWQ_PACK_ORDER).tolist() == [list(range(8))]


def test_awq_conversion() -> None:
    q, zeros, scales, g_idx = _random_layer(7, symmetric=False, act_order=False)
    zeros[0, 0] = 0  # AWQ stores zeros as is, so 0 is fine
    dense = dense_from_groups(q, zeros, scales, g_idx.long())
    parts = awq_to_int4(
        "layer", pack_along_cols(q, AWQ_PACK_ORDER), pack_along_cols(zeros, AWQ_PACK_ORDER), scales, GROUP
    )
    assert parts.perm is None
    torch.testing.assert_close(dequantize_int4(parts.qweight, parts.scales, parts.zeros, GROUP), dense)
    _check_against_dense(parts, dense)


def test_gptq_bad_g_idx_is_rejected() -> None:
    q, zeros, scales, _ = _random_layer(1, symmetric=True, act_order=False)
    g_idx = torch.zeros(K, dtype=torch.int32)  # every row in group 0
    with pytest.raises(ValueError, match="g_idx must assign exactly 16 rows"):
        gptq_to_int4("model.x", pack_along_rows(q), pack_along_cols(zeros - 1), scales, g_idx, GROUP)


def test_gptq_shape_mismatch_names_the_tensor() -> None:
    q, zeros, scales, g_idx = _random_layer(2, symmetric=True, act_order=False)
    with pytest.raises(ValueError, match=r"model.x.scales has shape \(2, 24\)"):
        gptq_to_int4("model.x", pack_along_rows(q), pack_along_cols(zeros - 1), scales[:2], g_idx, GROUP)
    with pytest.raises(ValueError, match=r"model\.x\.qweight must be a 2-D int32"):
        gptq_to_int4("model.x", pack_along_rows(q).float(), pack_along_cols(zeros - 1), scales, g_idx, GROUP)
