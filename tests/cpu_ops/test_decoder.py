"""The one-call float32 decode step (`cpu_ops.decoder_op()`) against the layer-by-layer path.

Engine level, on every model variant of the model-vs-transformers tests plus one with biases on every
projection: greedy tokens AND their logprobs are identical, bit for bit, with the step on and off
(the layers then run with the same compiled ops one call at a time), through continuous batching
with chunked prefill, sliding windows, batches wider than the row kernel's group of 8 (9-11), batches
on the packed-panel kernel (24-26), and batches above the op's limit (those steps take the layers).
Model level: the op refuses what it does not take (a step with a prefill, a hooked layer, weights it
cannot read) and then the layers run; a bad slot is an error that writes nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from decoder_steps import count_decoder_steps
from model_variants import HF_VARIANTS
from tidepool.engine import LLM, SamplingParams, cpu_ops
from tidepool.engine.cpu_ops.decoder import DecoderShape

pytestmark = pytest.mark.usefixtures("vector_width")

BIAS_VARIANT = "llama-all-biases"


@pytest.fixture
def decoder(monkeypatch: pytest.MonkeyPatch) -> Iterator[cpu_ops.CpuDecoder]:
    """The op, required (CI has a compiler), with every step it runs counted in `.ran`."""
    for env in (cpu_ops.MODE_ENV, cpu_ops.GEMV_MODE_ENV, cpu_ops.FUSED_MODE_ENV, cpu_ops.DECODER_MODE_ENV):
        monkeypatch.setenv(env, "compiled")
    cpu_ops.reset()
    compiled = cpu_ops.decoder_op()
    assert compiled is not None
    compiled.counts = count_decoder_steps(monkeypatch)  # type: ignore[attr-defined]
    yield compiled
    cpu_ops.reset()


@pytest.fixture(scope="module")
def bias_model_dir(tmp_path_factory: pytest.TempPathFactory, hf_model_dir: Callable[[str], Path]) -> Path:
    """A Llama with biases on q/k/v/o and on the MLP (none of the shared variants has o or MLP biases)."""
    import transformers

    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, attention_bias=True, mlp_bias=True,
        initializer_range=0.08, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    path = tmp_path_factory.mktemp("models") / BIAS_VARIANT
    model.save_pretrained(path)
    tokenizer_from = hf_model_dir("llama-gqa")
    for file in tokenizer_from.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            (path / file.name).write_bytes(file.read_bytes())
    return path


def _generate(path: Path, max_num_seqs: int, max_tokens: int = 16) -> list[tuple[list[int], object]]:
    rng = random.Random(3)
    lengths = (1, 2, 9, 17, 40, 63, 130, 5, 3, 70, 11, 4, 25, 8, 33, 2, 6, 90, 7, 12, 3, 44, 19, 1, 28, 6)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    llm = LLM(str(path), show_progress=False, max_num_seqs=max_num_seqs, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("variant", [*sorted(HF_VARIANTS), BIAS_VARIANT])
def test_tokens_and_logprobs_identical_with_the_step_on_and_off(
    variant: str,
    decoder: cpu_ops.CpuDecoder,
    hf_model_dir: Callable[[str], Path],
    bias_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = bias_model_dir if variant == BIAS_VARIANT else hf_model_dir(variant)
    # Steps of up to 11 sequences: the row kernel's inputs in a group of 8 and a remainder; of 24-26, the
    # packed-panel kernel (32 new tokens each, so that the first are still decoding when the last prompt is
    # in). With the op's limit lowered to 4, the wider steps take the layers and the narrower ones the op.
    configs = ((6, decoder.max_batch, 16), (11, decoder.max_batch, 16), (26, decoder.max_batch, 32), (11, 4, 16))
    for max_num_seqs, limit, max_tokens in configs:
        compiled = cpu_ops.decoder_op()
        assert compiled is not None
        compiled.max_batch = limit
        ran = decoder.counts["ran"]  # type: ignore[attr-defined]
        decoder.counts["widest"] = 0  # type: ignore[attr-defined]
        got = _generate(path, max_num_seqs, max_tokens)
        assert decoder.counts["ran"] > ran  # type: ignore[attr-defined]
        if max_num_seqs == 26:  # steps the packed-panel kernel takes really ran in the op
            assert decoder.counts["widest"] >= 24, decoder.counts  # type: ignore[attr-defined]
        monkeypatch.setenv(cpu_ops.DECODER_MODE_ENV, "torch")
        cpu_ops.reset()
        assert cpu_ops.decoder_op() is None and cpu_ops.fused_op() is not None
        ran = decoder.counts["ran"]  # type: ignore[attr-defined]
        reference = _generate(path, max_num_seqs, max_tokens)
        assert decoder.counts["ran"] == ran  # type: ignore[attr-defined]
        assert got == reference
        monkeypatch.setenv(cpu_ops.DECODER_MODE_ENV, "compiled")
        cpu_ops.reset()


def test_step_is_off_when_a_part_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.DECODER_MODE_ENV, "compiled")
    for part in (cpu_ops.MODE_ENV, cpu_ops.GEMV_MODE_ENV, cpu_ops.FUSED_MODE_ENV):
        monkeypatch.setenv(part, "torch")
        cpu_ops.reset()
        assert cpu_ops.decoder_op() is None  # the reference paths stay reachable one switch at a time
        monkeypatch.delenv(part)
    cpu_ops.reset()


# ---- model level ------------------------------------------------------------------------------------


def _engine(path: Path) -> LLM:
    return LLM(str(path), show_progress=False, max_num_seqs=4, num_kv_blocks=32)


def _decode_inputs(llm: LLM, seed: int) -> tuple:
    """The engine's model and its KV caches, filled with random numbers so attention reads real values."""
    runner = llm.engine.runner
    model = runner.model
    gen = torch.Generator().manual_seed(seed)
    caches = runner.kv_caches
    for k, v in caches:  # nonzero caches, so attention reads real numbers
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return model, caches


def _meta_for(llm: LLM, lens: list[int], blocks_per_seq: int, prefill: bool = False):
    from tidepool.engine.layers.attention_backend import attach_kernel_views
    from tidepool.engine.layers.attention_metadata import AttentionMetadata, PrefillChunk

    block_size = llm.engine.runner.kv_caches[0][0].shape[1]
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(lens))]
    last = [n - 1 for n in lens]
    slots = torch.tensor([t[p // block_size] * block_size + p % block_size for t, p in zip(tables, last, strict=True)])
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_seqs=len(lens), decode_block_tables=torch.tensor(tables), decode_mask=None
    )
    if prefill:  # the last sequence as a 1-token prefill chunk instead: the step is not all decodes
        meta.num_decode_seqs -= 1
        meta.prefills = [PrefillChunk(len(lens) - 1, 1, lens[-1], torch.tensor(tables[-1]), None)]
    attach_kernel_views(meta, tables, lens, [1] * len(lens), None)
    return meta


def test_refusals_run_the_layers_and_bad_slots_write_nothing(
    decoder: cpu_ops.CpuDecoder, hf_model_dir: Callable[[str], Path]
) -> None:
    llm = _engine(hf_model_dir("llama-gqa"))
    model, caches = _decode_inputs(llm, 3)
    lens = [20, 33, 7]
    ids = torch.tensor([11, 12, 13])
    positions = torch.tensor([n - 1 for n in lens])

    def forward(meta: object) -> torch.Tensor:
        with torch.no_grad():
            return model(ids, positions, caches, meta)

    before = decoder.counts["ran"]  # type: ignore[attr-defined]
    fast = forward(_meta_for(llm, lens, 4))
    assert decoder.counts["ran"] == before + 1  # type: ignore[attr-defined]

    handle = model.layers[1].mlp.register_forward_hook(lambda *_: None)  # e.g. tensor parallelism's all-reduce
    try:
        hooked = forward(_meta_for(llm, lens, 4))
    finally:
        handle.remove()
    mixed = forward(_meta_for(llm, lens, 4, prefill=True))  # a 1-token "prefill": same math, not all decodes
    assert decoder.counts["ran"] == before + 1  # type: ignore[attr-defined]
    assert torch.equal(hooked, fast) and torch.equal(mixed, fast)

    # A weight swapped for a new tensor after the step was prepared: the step sees the new one.
    mlp = model.layers[0].mlp
    mlp.down_weight = torch.nn.Parameter(mlp.down_weight.detach() * 1.5, requires_grad=False)
    swapped = forward(_meta_for(llm, lens, 4))
    assert decoder.counts["ran"] == before + 2  # type: ignore[attr-defined]
    handle = model.layers[0].register_forward_pre_hook(lambda *_: None)
    try:
        assert torch.equal(forward(_meta_for(llm, lens, 4)), swapped) and not torch.equal(swapped, fast)
    finally:
        handle.remove()

    meta = _meta_for(llm, lens, 4)
    meta.slot_mapping[1] = caches[0][0].shape[0] * caches[0][0].shape[1]  # one past the cache
    snapshot = [t.clone() for pair in caches for t in pair]
    with pytest.raises(ValueError, match="slot outside the cache"):
        forward(meta)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (t for pair in caches for t in pair), strict=True))


def test_prepare_refuses_weights_it_cannot_read(decoder: cpu_ops.CpuDecoder) -> None:
    shape = DecoderShape(hidden=16, num_q_heads=4, num_kv_heads=2, head_dim=4, intermediate=24, eps=1e-6, scale=0.5)
    gen = torch.Generator().manual_seed(0)

    def layer(**changes: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
        tensors: dict[str, torch.Tensor | None] = {
            "input_norm": torch.randn(16, generator=gen), "post_norm": torch.randn(16, generator=gen),
            "qkv_weight": torch.randn(32, 16, generator=gen), "qkv_bias": None,
            "o_weight": torch.randn(16, 16, generator=gen), "o_bias": None,
            "gate_up_weight": torch.randn(48, 16, generator=gen), "gate_up_bias": torch.randn(48, generator=gen),
            "down_weight": torch.randn(16, 24, generator=gen), "down_bias": None,
        }  # fmt: skip
        tensors.update(changes)
        return tensors

    norm = torch.ones(16)
    assert decoder.prepare(shape, [layer(), layer()], norm) is not None
    refused = {
        "transposed (weight_layout's [in, out])": layer(o_weight=torch.randn(16, 16).t()),
        "bfloat16": layer(down_weight=torch.randn(16, 24, dtype=torch.bfloat16)),
        "wrong shape": layer(gate_up_weight=torch.randn(24, 16)),
        "wrong bias length": layer(qkv_bias=torch.randn(31)),
    }
    for why, bad in refused.items():
        assert decoder.prepare(shape, [layer(), bad], norm) is None, why
