"""CUDA-graph bookkeeping on the CPU: buckets, padding, static buffers, lazy capture and replay (fake capture).

`EagerReplayBackend` "captures" by running the function and "replays" by running it again from the
static buffers into the captured output tensor, so a runner that forgot to refresh a static input
would replay stale values and these tests would see it. The end-to-end tests swap a graph runner
into a real engine on the tiny models and compare greedy tokens with the eager runner.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.cuda_graphs import (
    DecodeBatch,
    DecodeGraphs,
    EagerReplayBackend,
    GraphInputs,
    StaticInputs,
    capture_sizes,
    choose_bucket,
)
from tidepool.engine.model_runner import ModelRunner

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [(1, [1]), (3, [1, 2, 3]), (6, [1, 2, 4, 6]), (20, [1, 2, 4, 8, 16, 20]), (24, [1, 2, 4, 8, 16, 24])],
)
def test_capture_sizes(max_num_seqs: int, expected: list[int]) -> None:
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_are_capped() -> None:
    sizes = capture_sizes(1000)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and all(s % 8 == 0 for s in sizes[3:])


@pytest.mark.parametrize(
    ("num_seqs", "bucket"), [(0, None), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (16, 16), (17, None)]
)
def test_choose_bucket(num_seqs: int, bucket: int | None) -> None:
    assert choose_bucket(num_seqs, [1, 2, 4, 8, 16]) == bucket


def _batch(n: int, max_blocks: int = 4) -> DecodeBatch:
    return DecodeBatch(
        input_ids=[10 + i for i in range(n)],
        positions=[20 + i for i in range(n)],
        slots=[100 + i for i in range(n)],
        seq_lens=[21 + i for i in range(n)],
        block_tables=[[i, i + 1][: 1 + i % 2] for i in range(n)],
    )


def test_static_inputs_pad_to_the_bucket_with_the_sink() -> None:
    static = StaticInputs(max_bucket=8, max_blocks=4, pad_slot=99 * 16, pad_block=99, device=CPU)
    static.fill(_batch(3), bucket=4)
    view = static.views(4)
    assert view.input_ids.tolist() == [10, 11, 12, 0]
    assert view.positions.tolist() == [20, 21, 22, 0]
    assert view.slot_mapping.tolist() == [100, 101, 102, 99 * 16]
    assert view.seq_lens.tolist() == [21, 22, 23, 1]
    assert view.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert view.block_tables.tolist() == [[0, 99, 99, 99], [1, 2, 99, 99], [2, 99, 99, 99], [99, 99, 99, 99]]
    # Every view is a fixed slice of the one arena (what a captured graph keeps reading).
    base, end = static.device_arena.data_ptr(), static.device_arena.data_ptr() + static.device_arena.nbytes
    for t in (view.input_ids, view.positions, view.slot_mapping, view.seq_lens, view.block_tables):
        assert base <= t.data_ptr() < end
    assert static.views(4).input_ids.data_ptr() == view.input_ids.data_ptr()
    with pytest.raises(ValueError, match="does not fit bucket 2"):
        static.fill(_batch(3), bucket=2)


def _toy_forward(calls: list[int]) -> Callable[[GraphInputs], torch.Tensor]:
    def forward(inputs: GraphInputs) -> torch.Tensor:
        calls.append(inputs.num_seqs)
        table_sum = inputs.block_tables.long().sum(dim=1)
        return torch.stack(
            [inputs.input_ids.long(), inputs.positions.long(), inputs.slot_mapping.long(), inputs.seq_lens.long(),
             table_sum], dim=1)  # fmt: skip

    return forward


def test_graphs_capture_each_bucket_once_and_replay_fresh_inputs() -> None:
    backend = EagerReplayBackend()
    calls: list[int] = []
    graphs = DecodeGraphs(_toy_forward(calls), [1, 2, 4, 8], max_blocks=4, pad_block=50, block_size=16,
                          device=CPU, backend=backend)  # fmt: skip
    for n in (3, 4, 1, 3, 7, 2, 3):
        batch = _batch(n)
        out = graphs.run(batch)
        assert out.shape[0] == n
        padded_tables = [t + [50] * (4 - len(t)) for t in batch.block_tables]
        assert out[:, 0].tolist() == batch.input_ids and out[:, 1].tolist() == batch.positions
        assert out[:, 2].tolist() == batch.slots and out[:, 3].tolist() == batch.seq_lens
        assert out[:, 4].tolist() == [sum(t) for t in padded_tables]
    assert backend.num_captures == 4  # buckets 4, 1, 8, 2: each captured the first time it was needed
    assert graphs.stats.num_replays == {4: 4, 1: 1, 8: 1, 2: 1}
    assert graphs.stats.num_padding_rows == 1 + 0 + 0 + 1 + 1 + 0 + 1
    with pytest.raises(ValueError, match="no captured size holds 9"):
        graphs.run(_batch(9))


def _generate(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("variant", ["tiny", "mistral-window"])
def test_graph_runner_gives_the_eager_tokens(
    variant: str, tiny_model_dir: Path, hf_model_dir: Callable[[str], Path]
) -> None:
    folder = tiny_model_dir if variant == "tiny" else hf_model_dir(variant)
    kwargs = dict(show_progress=False, num_kv_blocks=64, max_model_len=128, block_size=8)
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 40, 9, 60)]
    lengths = [30, 12, 6, 25, 3]  # sequences finish at different steps: batches of 5, 4, 3, 2, 1
    eager = _generate(LLM(str(folder), **kwargs), prompts, lengths)

    llm = LLM(str(folder), **kwargs)
    engine = llm.engine
    backend = EagerReplayBackend()
    engine.runner = ModelRunner(engine.model, engine.model_config, 8, engine.num_kv_blocks, engine.sampler, CPU,
                                graph_backend=backend, max_model_len=128)  # fmt: skip
    assert len(engine.runner.kv_caches[0][0]) == engine.num_kv_blocks + 1  # the padding sink
    assert _generate(llm, prompts, lengths) == eager
    stats = engine.runner.graphs.stats
    assert sum(stats.num_replays.values()) > 20 and stats.num_padding_rows > 0
    assert set(stats.num_replays) <= {1, 2, 4, 8} and backend.num_captures == len(stats.num_replays)
    sink = engine.runner.kv_caches[0][0][engine.num_kv_blocks]
    assert sink.abs().sum() > 0  # padding rows wrote there, and only there (tokens above are unchanged)
