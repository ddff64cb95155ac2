"""The pieces of tensor/pipeline parallelism without starting processes.

Sharding math: each TP rank's shard of a layer is run in this process inside a one-rank gloo
group (its all-reduce is then the identity), and the shards' outputs summed must equal the
unsharded layer: that is exactly what the all-reduce computes across real ranks. Covered: GQA
kv heads split, MQA / fewer kv heads than ranks replicated, qkv and o_proj biases (Qwen2),
vocabulary shards with a padded last shard. Plus the micro-batch split, the layer partition,
rank layout, and the errors for layouts that cannot work.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tidepool.engine.config import ModelConfig
from tidepool.engine.distributed.parallel_state import ParallelConfig, RankInfo, partition_layers
from tidepool.engine.distributed.pp import split_micro_batches
from tidepool.engine.distributed.tp import VocabShard, check_tp, shard_layer, vocab_parallel_embedding
from tidepool.engine.layers.attention_backend import build_decode_mask, build_prefill_mask
from tidepool.engine.layers.attention_metadata import AttentionMetadata, PrefillChunk
from tidepool.engine.loading.loader import load_model

BLOCK = 16


@pytest.fixture()
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _prefill_meta(num_tokens: int) -> AttentionMetadata:
    num_blocks = -(-num_tokens // BLOCK)
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        num_decode_seqs=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
        decode_mask=None,
        prefills=[PrefillChunk(0, num_tokens, num_tokens, torch.arange(num_blocks), None)],
    )


@pytest.mark.parametrize(
    ("variant", "tp"),
    [("tiny", 2), ("llama-mqa-tied-llama3rope", 2), ("llama-mqa-tied-llama3rope", 4), ("qwen2-tied", 2),
     ("qwen2-tied", 4)],
)  # fmt: skip
def test_layer_shards_sum_to_the_full_layer(
    one_rank_group: None,
    variant: str,
    tp: int,
    tiny_model_dir: Path,
    hf_model_dir: Callable[[str], Path],
) -> None:
    folder = tiny_model_dir if variant == "tiny" else hf_model_dir(variant)
    model, config = load_model(folder, dtype=torch.float32, show_progress=False)
    check_tp(config, tp)
    layer = model.layers[0]
    num_tokens = 21
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, config.hidden_size, generator=generator)
    cos_sin = model.rotary.cos_sin(torch.arange(num_tokens), x.dtype)
    meta = _prefill_meta(num_tokens)

    def run(attn: torch.nn.Module, num_kv_heads: int) -> torch.Tensor:
        shape = (-(-num_tokens // BLOCK), BLOCK, num_kv_heads, config.head_dim)
        return attn(x, cos_sin, (torch.zeros(shape), torch.zeros(shape)), meta)

    with torch.inference_mode():
        full_attn, full_mlp = run(layer.self_attn, config.num_key_value_heads), layer.mlp(x)
        attn_sum, mlp_sum = torch.zeros_like(full_attn), torch.zeros_like(full_mlp)
        for rank in range(tp):
            shard = copy.deepcopy(layer)
            shard_layer(shard, tp, rank, None)
            assert shard.self_attn.num_heads == config.num_attention_heads // tp
            assert shard.self_attn.num_kv_heads == max(config.num_key_value_heads // tp, 1)
            attn_sum += run(shard.self_attn, shard.self_attn.num_kv_heads)
            mlp_sum += shard.mlp(x)
    torch.testing.assert_close(attn_sum, full_attn, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp_sum, full_mlp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_shards_rebuild_embedding_and_logits(one_rank_group: None, tp: int) -> None:
    vocab, hidden = 10, 4
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([0, 3, 9, 4, 9, 7])
    rows = torch.randn(3, hidden)
    shards = [VocabShard.of(vocab, tp, rank) for rank in range(tp)]
    assert len({s.width for s in shards}) == 1  # every rank's logits shard has the same width
    embedded = sum(vocab_parallel_embedding(ids, s.slice_weight(weight), s, None) for s in shards)
    torch.testing.assert_close(embedded, F.embedding(ids, weight))
    logits = torch.cat([F.linear(rows, s.slice_weight(weight)) for s in shards], dim=1)[:, :vocab]
    torch.testing.assert_close(logits, F.linear(rows, weight))


def _config(**overrides: object) -> ModelConfig:
    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    }  # fmt: skip
    return ModelConfig.from_dict({**raw, **overrides})


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        ({}, 3, "must divide num_attention_heads=4"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}, 2, "one must divide the other"),
        ({"intermediate_size": 50}, 4, "must divide intermediate_size=50"),
    ],
)
def test_impossible_tensor_parallel_layouts_are_clear_errors(overrides: dict, tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tp(_config(**overrides), tp)


def test_layer_partition_and_rank_layout() -> None:
    assert partition_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert partition_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        partition_layers(2, 3)
    info = RankInfo(rank=3, tp_size=2, pp_size=2)
    assert (info.tp_rank, info.pp_rank, info.prev_rank, info.is_last_stage) == (1, 1, 1, True)
    assert RankInfo(0, 2, 2).last_stage_ranks == [2, 3]
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, master_port=29500)
    assert [list(parallel.node_ranks(n)) for n in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="cannot be split evenly over nnodes=3"):
        ParallelConfig(2, 2, nnodes=3, master_port=1).validate()


def _mixed_meta() -> tuple[AttentionMetadata, int]:
    """3 decodes (context 5, 20, 9) then prefill chunks of 10 (fresh) and 6 (after 16 cached) tokens."""
    lens = [5, 20, 9]
    tables = torch.tensor([[0, 0], [1, 2], [3, 0]])
    chunks = [
        PrefillChunk(3, 10, 10, torch.tensor([4]), None),
        PrefillChunk(13, 6, 22, torch.tensor([5, 6]), build_prefill_mask(16, 6, 22, None, torch.device("cpu"))),
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(19) + 100,
        num_decode_seqs=3,
        decode_block_tables=tables,
        decode_mask=build_decode_mask(lens, 2 * BLOCK, None, torch.device("cpu")),
        decode_kv_scratch=(torch.empty(6, BLOCK, 2, 8), torch.empty(6, BLOCK, 2, 8)),
        prefills=chunks,
        seq_lens=torch.tensor([5, 20, 9, 10, 22], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 2, 3, 13, 19], dtype=torch.int32),
    )
    return meta, 19


def test_micro_batches_are_whole_sequences_rebased() -> None:
    meta, num_tokens = _mixed_meta()
    batches = split_micro_batches(meta, num_tokens, 2)
    assert [(b.token_start, b.token_stop) for b in batches] == [(0, 13), (13, 19)]
    first, second = batches[0].meta, batches[1].meta
    assert first.num_decode_seqs == 3 and [c.query_start for c in first.prefills] == [3]
    assert first.decode_kv_scratch[0].shape[0] == 6
    assert second.num_decode_seqs == 0 and second.decode_mask is None and second.decode_kv_scratch is None
    assert [(c.query_start, c.num_query_tokens, c.context_len) for c in second.prefills] == [(0, 6, 22)]
    assert torch.equal(second.slot_mapping, torch.arange(13, 19) + 100)
    assert second.seq_lens.tolist() == [22] and second.cu_seqlens_q.tolist() == [0, 6]
    assert first.cu_seqlens_q.tolist() == [0, 1, 2, 3, 13]
    # Tokens are conserved, in order, across any number of micro-batches.
    for count in (1, 3, 4, 8):
        parts = split_micro_batches(meta, num_tokens, count)
        assert len(parts) <= count
        assert [p.token_start for p in parts[1:]] == [p.token_stop for p in parts[:-1]]
        assert parts[0].token_start == 0 and parts[-1].token_stop == num_tokens


def test_micro_batches_fall_back_to_one_for_a_single_sequence() -> None:
    meta = _prefill_meta(40)
    assert len(split_micro_batches(meta, 40, 4)) == 1
