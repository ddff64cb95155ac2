"""Fused rotary embedding: kernel vs reference, reference vs Hugging Face's formula, the engine's CPU path."""

from __future__ import annotations

import pytest
import torch
from paged_cases import DTYPES, KERNEL_TOL, REF_TOL, close

from tidepool.engine.layers.rotary import RotaryEmbedding, apply_rotary_


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inputs(num_q: int, num_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """q and k heads as one token-strided view of a fused qkv row, as the engine passes them."""
    gen = torch.Generator().manual_seed(head_dim + num_q)
    num_tokens = 7
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None)
    positions = torch.tensor([0, 3, 5, 9, 17, 33, 63])
    cos, sin_signed = rotary.cos_sin(positions, dtype)
    half = head_dim // 2
    sin = torch.cat((sin_signed[:, half:], sin_signed[:, half:]), dim=-1)  # the unsigned table
    qkv = torch.randn(num_tokens, (num_q + 2 * num_kv) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (num_q + num_kv) * head_dim].view(num_tokens, num_q + num_kv, head_dim)
    return qkv.to(device), qk, cos, sin_signed, sin


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_q", "num_kv", "head_dim"), [(9, 3, 64), (4, 4, 80), (8, 1, 96), (2, 2, 128)])
def test_rotary_kernel_matches_reference(num_q: int, num_kv: int, head_dim: int, dtype: torch.dtype, device) -> None:
    from tidepool.kernels.rotary import rotary_, rotary_ref

    qkv, _, cos, sin_signed, _ = _inputs(num_q, num_kv, head_dim, dtype, device)
    width = (num_q + num_kv) * head_dim
    got_qkv, want_qkv = qkv.clone(), qkv.clone()
    view = got_qkv[:, :width].view(-1, num_q + num_kv, head_dim)
    out = rotary_(view, cos.to(device), sin_signed.to(device))
    assert out.data_ptr() == view.data_ptr()  # in place
    rotary_ref(want_qkv[:, :width].view(-1, num_q + num_kv, head_dim), cos.to(device), sin_signed.to(device))
    close(got_qkv, want_qkv, KERNEL_TOL[dtype])
    assert torch.equal(got_qkv[:, width:], qkv[:, width:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_reference_matches_hugging_face_formula(dtype: torch.dtype) -> None:
    from tidepool.kernels.rotary import rotary_ref

    _, qk, cos, sin_signed, sin = _inputs(9, 3, 64, dtype, torch.device("cpu"))
    want = qk.double() * cos.double().unsqueeze(1) + _rotate_half(qk.double()) * sin.double().unsqueeze(1)
    close(rotary_ref(qk.clone(), cos, sin_signed), want, REF_TOL[dtype])


@pytest.mark.parametrize("head_dim", [64, 80])
def test_engine_cpu_path_is_bit_exact_with_hugging_face_in_float32(head_dim: int) -> None:
    _, qk, cos, sin_signed, sin = _inputs(4, 2, head_dim, torch.float32, torch.device("cpu"))
    want = qk * cos.unsqueeze(1) + _rotate_half(qk) * sin.unsqueeze(1)
    got = qk.clone()
    apply_rotary_(got, cos, sin_signed)
    assert torch.equal(got, want)


def test_rotary_checks_name_the_problem(device) -> None:
    from tidepool.kernels.rotary import rotary_

    x = torch.zeros(3, 2, 6, device=device)
    cos = torch.zeros(3, 6, device=device)
    with pytest.raises(ValueError, match="even"):
        rotary_(torch.zeros(3, 2, 5, device=device), cos[:, :5], cos[:, :5])
    with pytest.raises(ValueError, match=r"cos must be \[num_tokens, head_dim\]"):
        rotary_(x, torch.zeros(2, 6, device=device), cos)
    with pytest.raises(ValueError, match="float"):
        rotary_(x.long(), cos, cos)
