"""bs=1 decode quiet and beside a busy neighbour, each in a fresh process that sees a given CPU budget.

A Kubernetes pod with a CPU limit of N gets a CFS quota of N CPUs; here the budget is given by the
affinity mask instead (`os.sched_setaffinity` in the child before torch starts: creating cgroups
would need to reconfigure the host), which the engine's thread rule reads the same way
(`tidepool.engine.threads`). The neighbour is one process spinning in a Python loop, not pinned,
as another pod's busy container would be. Each measurement is the median decode step time of
`steps` steps at `context_len` tokens of context, greedy.

    python bench/neighbour.py --model DIR                 # standalone; offline_throughput.py calls `measure`
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class DecodeRun:
    label: str
    cpus: list[int]  # the affinity mask the engine process saw
    threads_requested: int | None  # None: the engine decided
    threads_used: int
    thread_reason: str
    with_burner: bool
    step_s: float
    read_bandwidth_GBps: float  # a 1 GiB streaming read with the engine's threads, after the steps


def _burn(stop: mp.Event) -> None:  # type: ignore[valid-type]
    x = 0
    while not stop.is_set():  # type: ignore[attr-defined]
        for _ in range(100_000):
            x += 1


def _child(
    model: str, cpus: list[int], threads: int | None, env: dict[str, str], context_len: int, steps: int, queue: mp.Queue
) -> None:
    os.sched_setaffinity(0, set(cpus))  # before torch starts its thread pool
    os.environ.update(env)  # e.g. OMP_WAIT_POLICY, read when OpenMP starts
    from tidepool.engine import LLM, SamplingParams

    llm = LLM(model, show_progress=False, max_model_len=context_len + steps + 8, num_threads=threads)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True)
    engine.add_request("bs1", list(range(3, 3 + context_len)), params)
    engine.step()  # prefill
    engine.step()
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import read_bandwidth

    bandwidth = read_bandwidth() / 1e9
    queue.put((times[len(times) // 2], engine.threads.num_threads, engine.threads.reason, bandwidth))


def run_decode(
    model: str,
    cpus: list[int],
    threads: int | None,
    with_burner: bool,
    context_len: int,
    steps: int,
    label: str,
    env: dict[str, str] | None = None,
) -> DecodeRun:
    ctx = mp.get_context("spawn")
    stop, burner = ctx.Event(), None
    if with_burner:
        burner = ctx.Process(target=_burn, args=(stop,), daemon=True)
        burner.start()
        time.sleep(0.5)  # let it reach full speed
    queue: mp.Queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(model, cpus, threads, env or {}, context_len, steps, queue))
    try:
        child.start()
        step_s, used, reason, bandwidth = queue.get(timeout=1800)
        child.join(60)
    finally:
        stop.set()
        if burner is not None:
            burner.join(10)
            if burner.is_alive():
                burner.terminate()
        if child.is_alive():
            child.terminate()
    return DecodeRun(label, cpus, threads, used, reason, with_burner, step_s, bandwidth)


def measure(model: str, context_len: int = 128, steps: int = 32, rounds: int = 2) -> dict:
    """Quiet (all CPUs, engine's choice) vs beside a burner with a budget of all CPUs but one (engine's choice).

    Also quiet with that same budget: `burner_vs_quiet_same_limit` is what the neighbour itself costs,
    apart from what having one CPU fewer costs (at bs=1 a step is bound by the read bandwidth the
    threads reach, and one thread reaches less than two). Also beside the burner with all CPUs' worth of
    threads, with the engine's sleeping OpenMP waits
    and with spinning ones (OMP_WAIT_POLICY=ACTIVE: what the engine did before). Rounds alternate
    the scenarios so slow drifts of a shared machine hit all alike.
    """
    cpus = sorted(os.sched_getaffinity(0))
    limited = cpus[: max(1, len(cpus) - 1)]
    all_threads, spin = len(cpus), {"OMP_WAIT_POLICY": "ACTIVE"}
    limit = f"CPU limit {len(limited)}"
    scenarios = [
        ("quiet", cpus, None, False, {}),
        (f"quiet, {limit}", limited, None, False, {}),
        (f"burner, {limit}", limited, None, True, {}),
        (f"burner, {all_threads} threads", cpus, all_threads, True, {}),
        (f"burner, {all_threads} threads spinning", cpus, all_threads, True, spin),
    ]
    runs: list[DecodeRun] = []
    for _ in range(rounds):
        for label, mask, threads, burn, env in scenarios:
            runs.append(run_decode(model, mask, threads, burn, context_len, steps, label, env))
    best = {label: min(r.step_s for r in runs if r.label == label) for label, *_ in scenarios}
    bandwidth = {label: max(r.read_bandwidth_GBps for r in runs if r.label == label) for label, *_ in scenarios}
    quiet = best["quiet"]
    return {
        "runs": [asdict(r) for r in runs],
        "best_step_s": best,
        "slowdown_vs_quiet": {label: s / quiet for label, s in best.items()},
        "burner_vs_quiet_same_limit": best[f"burner, {limit}"] / best[f"quiet, {limit}"],
        # A step bound by read bandwidth cannot be less slower at the limit than the bandwidth is lower there.
        "read_bandwidth_GBps": bandwidth,
        "read_bandwidth_quiet_vs_limit": bandwidth["quiet"] / bandwidth[f"quiet, {limit}"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    result = measure(args.model, args.context_len, args.steps, args.rounds)
    for label, ratio in result["slowdown_vs_quiet"].items():
        print(f"{label:32s} {1e3 * result['best_step_s'][label]:8.2f} ms/step  {ratio:5.2f}x quiet")
    print(f"burner vs quiet at the same CPU limit: {result['burner_vs_quiet_same_limit']:.2f}x")
    print(f"read bandwidth, quiet vs quiet at the limit: {result['read_bandwidth_quiet_vs_limit']:.2f}x")
    json.dump(result, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
