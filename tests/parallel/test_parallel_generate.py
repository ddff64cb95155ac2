"""Tensor/pipeline parallel engines on CPU (gloo) give the single process's greedy tokens.

One engine per layout (2-way TP, 2-stage PP over two nodes, TP x PP = 2 x 2), each reused for several checks
because starting ranks (a torch import per process) dominates the run time on a small machine:
identical greedy tokens over a continuous batch of mixed lengths (a small token budget, so
chunked prefills and decodes share steps), logits and prompt logprobs close to the single process's, each rank's
KV cache holding only its heads / layers. The 2-way TP engine then loses a worker to SIGKILL
and must raise `WorkerFailedError` (not hang) and leave no process behind. A multi-node group
runs as two "nodes" on this machine (the test process is node 0, `tidepool serve --node-rank 1`
is node 1); it is also the 2-stage PP check, one process start cheaper than a separate one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tidepool.contract.wire import CONTROL_KEY_FILE_ENV
from tidepool.engine import LLM, SamplingParams
from tidepool.engine.distributed.executor import WorkerFailedError
from tidepool.engine.distributed.launch import free_port
from tidepool.engine.step_hooks import BeforeSchedule, StepHook, StepView
from tidepool.engine.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.slow

# Small budget: prompts longer than 24 tokens are prefilled in chunks while others decode.
ENGINE: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_num_batched_tokens=24, num_kv_blocks=96, max_model_len=256, show_progress=False
)
PROMPT_LENGTHS = (3, 61, 17, 40, 9, 26)
NUM_TOKENS = 10


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _params() -> list[SamplingParams]:
    # Different output lengths, so requests finish at different steps and the batch keeps changing.
    return [SamplingParams(max_tokens=NUM_TOKENS + i % 3, temperature=0.0, ignore_eos=True) for i in range(6)]


def _generate(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), _params(), use_tqdm=False)]


# Structured outputs: the grammar masks the logits rank 0 gathers, where the sampler lives.
CONSTRAINED = SamplingParams(
    max_tokens=80,
    temperature=1.0,
    seed=9,
    structured_outputs=StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["n"],
            "additionalProperties": False,
        }
    ),
)


def _constrained(llm: LLM) -> list[str]:
    outputs = llm.generate(_prompts()[:3], CONSTRAINED, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, Any]:
    llm = LLM(str(tiny_model_dir), **ENGINE)
    tokens = _generate(llm)
    logits = llm.engine.runner.prompt_logits(_prompts()[1])
    return {"tokens": tokens, "logits": logits, "constrained": _constrained(llm)}


@pytest.fixture()
def parallel_llm(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[LLM]:
    tp, pp = request.param
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        yield llm
    finally:
        llm.engine.close()
    for proc in llm.engine.executor._workers.procs.values():
        assert not proc.is_alive(), f"worker {proc.name} outlived close()"


class _KillAtStep(StepHook):
    """SIGKILLs a process before the engine's `step`-th schedule (counted from when it is added)."""

    def __init__(self, step: int, pid: int) -> None:
        self.step, self.pid, self.num_steps, self.killed = step, pid, 0, False

    def before_schedule(self, view: StepView) -> BeforeSchedule | None:
        self.num_steps += 1
        if self.num_steps == self.step:
            os.kill(self.pid, signal.SIGKILL)
            self.killed = True
        return None


def _check_same_as_single(llm: LLM, reference: dict[str, Any]) -> None:
    assert _generate(llm) == reference["tokens"]
    assert _constrained(llm) == reference["constrained"]
    logits = llm.engine.runner.prompt_logits(_prompts()[1])  # a scratch-KV pass through every rank
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-4, atol=1e-4)
    # Prompt logprobs (chunked: 61 tokens over a 24-token budget) from the rows every rank computed.
    prompt = _prompts()[1]
    [scored] = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    got = torch.tensor([scored.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    expected = torch.log_softmax(reference["logits"], dim=-1)[torch.arange(len(prompt) - 1), prompt[1:]]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # Prefix caching: the same prompts again hit the cache on every rank's (sharded) KV.
    assert _generate(llm) == reference["tokens"]


@pytest.mark.parametrize("parallel_llm", [(2, 1)], indirect=True, ids=["tp2"])
def test_tp2_matches_single_process_and_a_killed_worker_raises(parallel_llm: LLM, reference: dict[str, Any]) -> None:
    _check_same_as_single(parallel_llm, reference)
    k_cache = parallel_llm.engine.runner.kv_caches[0][0]
    assert k_cache.shape[2] == 1  # 2 kv heads over 2 ranks: one each
    assert len(parallel_llm.engine.runner.kv_caches) == 2

    # Killed in the middle of a long generation, at a step the engine reaches whatever the machine's speed
    # (a timer raced the generation: a fast machine finished first); the next step's collectives meet it.
    worker = parallel_llm.engine.executor._workers.procs[1]
    killer = _KillAtStep(20, worker.pid)
    parallel_llm.engine.hooks.append(killer)
    long = [SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)] * len(PROMPT_LENGTHS)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerFailedError, match="rank 1"):
            parallel_llm.generate(_prompts(), long, use_tqdm=False)
    finally:
        parallel_llm.engine.hooks.remove(killer)
    assert killer.killed and time.monotonic() - start < 60
    worker.join(5)
    assert not worker.is_alive()
    with pytest.raises(WorkerFailedError):  # stays failed: no half-working engine
        _generate(parallel_llm)


@pytest.mark.parametrize("parallel_llm", [(2, 2)], indirect=True, ids=["tp2xpp2"])
def test_tp2_pp2_matches_single_process(parallel_llm: LLM, reference: dict[str, Any]) -> None:
    _check_same_as_single(parallel_llm, reference)
    assert parallel_llm.engine.model.stage.num_split_steps > 0  # micro-batches really went through the pipeline
    assert len(parallel_llm.engine.runner.kv_caches) == 1
    assert parallel_llm.engine.runner.kv_caches[0][0].shape[2] == 1


def test_pp2_over_two_nodes_matches_single_process(
    tiny_model_dir: Path, reference: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2-stage PP as two "nodes": this process (driver, stage 0) and `tidepool serve --node-rank 1` (stage 1)."""
    (tmp_path / "control-key").write_bytes(os.urandom(32))  # both nodes read it, as from a mounted Secret
    monkeypatch.setenv(CONTROL_KEY_FILE_ENV, str(tmp_path / "control-key"))
    port = free_port()
    tidepool = Path(sys.executable).with_name("tidepool")
    node1 = subprocess.Popen(
        [str(tidepool), "serve", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
         "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--port", str(free_port())],  # the worker node's health endpoint: not 8000, which may be taken here
        env={**os.environ, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        llm = LLM(
            str(tiny_model_dir), pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port, **ENGINE
        )
        assert not llm.engine.executor._workers.procs  # every worker rank lives on node 1
        _check_same_as_single(llm, reference)
        assert len(llm.engine.runner.kv_caches) == 1  # rank 0 caches its own stage's layer only
        assert llm.engine.runner.kv_caches[0][0].shape[2] == 2
        llm.engine.close()
        output, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, output
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


DRIVER_SCRIPT = """
import os, signal, sys
from tidepool.engine import LLM

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", num_kv_blocks=16, max_model_len=128,
              show_progress=False)
    print(llm.engine.executor._workers.procs[1].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie has exited; only its parent's reaping is left


def test_killed_driver_leaves_no_orphan_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    driver = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert driver.returncode == -signal.SIGKILL, driver.stderr
    worker_pid = int(driver.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while not _is_gone(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _is_gone(worker_pid), f"worker {worker_pid} outlived its SIGKILLed driver"
