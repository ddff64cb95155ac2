"""The compiled fused elementwise ops against the torch code they replace, and the layers' choice.

Random shapes (widths that are and are not multiples of the vector width, one row and many rows, row
strides wider than the row, many rows so the op splits them across threads); values must agree with
torch to float32 rounding (rotary: bit for bit). Calls the op does not take return None and write
nothing, and the layers then give torch's result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidepool.engine import cpu_ops
from tidepool.engine.layers import activation, attention_backend, rotary
from tidepool.engine.layers.norm import RMSNorm

pytestmark = pytest.mark.usefixtures("vector_width")

TOL = {"rtol": 2e-6, "atol": 2e-6}


@pytest.fixture(scope="module")
def fused(vector_width: int) -> cpu_ops.CpuFused:
    found = cpu_ops.fused_op()
    if found is None:
        pytest.skip("no C++ compiler here: the compiled fused ops are unavailable (the torch path is tested elsewhere)")
    return found


def _wide(gen: torch.Generator, rows: int, cols: int, pad: int) -> torch.Tensor:
    """[rows, cols] whose rows are `pad` floats further apart than their length."""
    return torch.randn(rows, cols + pad, generator=gen)[:, :cols]


@pytest.mark.parametrize(("rows", "n"), [(1, 1), (1, 576), (3, 13), (7, 64), (64, 576), (300, 1000)])
@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(fused: cpu_ops.CpuFused, rows: int, n: int, pad: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 31 + n + pad)
    x, residual = _wide(gen, rows, n, pad), _wide(gen, rows, n, 2 * pad) if with_residual else None
    weight, eps = torch.randn(n, generator=gen), 1e-5
    before = (x.clone(), None if residual is None else residual.clone())
    got = fused.add_rms_norm(x, residual, weight, eps)
    assert got is not None
    normed, new_residual = got
    h = x if residual is None else x + residual
    torch.testing.assert_close(new_residual, h, rtol=0, atol=0)
    torch.testing.assert_close(normed, F.rms_norm(h, (n,), weight, eps), **TOL)
    assert torch.equal(x, before[0]) and (residual is None or torch.equal(residual, before[1]))  # out of place


@pytest.mark.parametrize(("rows", "inter"), [(1, 1), (1, 1536), (5, 7), (64, 1536), (200, 333)])
def test_silu_mul(fused: cpu_ops.CpuFused, rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = _wide(gen, rows, 2 * inter, 3) * 8  # saturating and tiny sigmoids alike
    gate, up = gate_up.chunk(2, dim=-1)
    got = fused.silu_mul(gate_up)
    assert got is not None
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize(("tokens", "heads", "dim"), [(1, 12, 64), (7, 5, 18), (3, 1, 2), (64, 12, 128), (200, 9, 80)])
def test_rotary_in_place(fused: cpu_ops.CpuFused, tokens: int, heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    qkv = torch.randn(tokens, heads * dim + 40, generator=gen)  # a fused projection: q/k heads, then more
    x = qkv[:, : heads * dim].view(tokens, heads, dim)
    cos, sin_signed = torch.randn(tokens, dim, generator=gen), torch.randn(tokens, dim, generator=gen)
    want = x.clone()
    swapped = want.roll(dim // 2, dims=-1).mul_(sin_signed.unsqueeze(1))
    want.mul_(cos.unsqueeze(1)).add_(swapped)
    tail = qkv[:, heads * dim :].clone()
    assert fused.rotary_(x, cos, sin_signed) is x
    assert torch.equal(x, want)  # bit-identical: each product rounded, then the sum (no FMA)
    assert torch.equal(qkv[:, heads * dim :], tail)  # nothing outside the heads is touched


def test_store_kv_and_out_of_range_slots(fused: cpu_ops.CpuFused) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.zeros(10, 16, 3, 64), torch.zeros(10, 16, 3, 64)
    qkv = torch.randn(5, 9 * 64 + 2 * 192, generator=gen)
    k, v = qkv[:, 576:768].view(5, 3, 64), qkv[:, 768:].view(5, 3, 64)
    slots = torch.tensor([0, 17, 159, 33, 2])
    assert fused.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 3, 64)[slots], k) and torch.equal(v_cache.view(-1, 3, 64)[slots], v)
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 5  # those slots only
    with pytest.raises(ValueError, match="outside the cache"):
        fused.store_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 160]))


def test_calls_it_does_not_take_do_nothing(fused: cpu_ops.CpuFused) -> None:
    x = torch.randn(4, 8)
    assert fused.add_rms_norm(x.double(), None, torch.ones(8, dtype=torch.float64), 1e-6) is None
    assert fused.add_rms_norm(x, torch.randn(4, 9), torch.ones(8), 1e-6) is None
    assert fused.add_rms_norm(x.t(), None, torch.ones(4), 1e-6) is None  # columns not contiguous
    assert fused.silu_mul(torch.randn(4, 7)) is None  # odd width: no gate/up halves
    assert fused.silu_mul(torch.randn(4, 8, dtype=torch.bfloat16)) is None
    heads = torch.randn(2, 8, 3).transpose(1, 2)  # [2, 3, 8] with heads not contiguous
    assert fused.rotary_(heads, torch.ones(2, 8), torch.ones(2, 8)) is None
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, 8)
    assert not fused.store_kv(kv, kv, cache, cache, torch.tensor([0]))
    assert not (cache != 0).any()


def test_layers_fall_back_to_torch_for_other_dtypes(fused: cpu_ops.CpuFused) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    norm = RMSNorm(16, 1e-6, torch.float64)
    normed, residual = norm(x, x)
    torch.testing.assert_close(normed, F.rms_norm(2 * x, (16,), norm.weight, 1e-6))
    torch.testing.assert_close(residual, 2 * x)
    gate_up = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(activation.silu_mul(gate_up), F.silu(gate_up[:, :8]) * gate_up[:, 8:])


def test_layers_use_the_op_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = cpu_ops.fused_op()
    if compiled is None:
        pytest.skip("no C++ compiler here: the compiled fused ops are unavailable")
    calls: list[str] = []
    for name in ("add_rms_norm", "silu_mul", "rotary_", "store_kv"):
        original = getattr(compiled, name)

        def spy(*args: object, _name: str = name, _original: object = original) -> object:
            calls.append(_name)
            return _original(*args)  # type: ignore[operator]

        monkeypatch.setattr(compiled, name, spy)
    x = torch.randn(2, 16)
    RMSNorm(16, 1e-6, torch.float32)(x, x)
    activation.silu_mul(torch.randn(2, 32))
    rotary.apply_rotary_(torch.randn(2, 3, 8), torch.ones(2, 8), torch.zeros(2, 8))
    cache = torch.zeros(2, 4, 3, 8)
    attention_backend.store_kv(torch.randn(2, 3, 8), torch.randn(2, 3, 8), cache, cache.clone(), torch.tensor([1, 6]))
    assert calls == ["add_rms_norm", "silu_mul", "rotary_", "store_kv"]


def test_torch_mode_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.FUSED_MODE_ENV, "torch")
    cpu_ops.reset()
    try:
        assert cpu_ops.fused_op() is None
        x = torch.randn(2, 16)
        normed, _ = RMSNorm(16, 1e-6, torch.float32)(x)
        torch.testing.assert_close(normed, F.rms_norm(x, (16,), torch.ones(16), 1e-6))
    finally:
        cpu_ops.reset()
