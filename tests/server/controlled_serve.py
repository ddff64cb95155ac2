"""`tidepool serve` with a test's hand on its engine, so shutdown tests never depend on machine speed.

Usage: `python controlled_serve.py CONTROL_DIR serve --model ...` (the rest is `tidepool`'s own
command line). Two files in CONTROL_DIR steer every engine step:
- `pause` exists: the step does nothing (and returns no output), while the engine thread keeps
  taking adds and aborts from its queue. Requests stay in flight, unfinished, for exactly as
  long as the test wants, on a fast or a slow machine.
- `hold` exists: the engine steps only while a request is waiting (or pending in a step hook, as a
  decode replica's KV hand-off) or has no output token yet; then
  it holds (steps do nothing) with every request running, its KV cache allocated, until the file
  goes; while holding it writes the number of running requests to `holding`. What a scrape sees
  "while loaded" is then certain, not a matter of sampling at the right millisecond.
- `crash` exists: the step raises outside the engine's per-request isolation, as a fault in the
  engine itself would; the engine thread dies.
- `poison` holds a seed: the sampler raises on every request with that seed, as a per-request
  fault would; the engine must fail those requests alone and carry on with the others.
Everything else (HTTP, signals, exit codes, the real engine when neither file exists) is the
production code, run in its own process like `serve_proc.start_server` runs it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from tidepool.cli import main
from tidepool.engine.llm_engine import LLMEngine
from tidepool.engine.outputs import RequestOutput
from tidepool.engine.request import Request
from tidepool.engine.sampler import Sampler

_PAUSE_POLL_S = 0.01


def _controlled(control: Path) -> Callable[[LLMEngine], list[RequestOutput]]:
    real_step = LLMEngine.step

    def step(self: LLMEngine) -> list[RequestOutput]:
        if (control / "crash").exists():
            raise RuntimeError("engine fault injected by the test (controlled_serve crash file)")
        if (control / "hold").exists() and _all_started(self):
            (control / "holding").write_text(str(len(self.scheduler.running)))
            time.sleep(_PAUSE_POLL_S)
            return []
        if (control / "pause").exists():
            time.sleep(_PAUSE_POLL_S)
            return []
        return real_step(self)

    return step


def _all_started(engine: LLMEngine) -> bool:
    """Nothing waiting (nor pending in a step hook: a decode replica's KV hand-offs), and every running
    request has produced at least one token."""
    scheduler = engine.scheduler
    if scheduler.waiting or any(hook.has_pending() for hook in engine.hooks):
        return False
    return all(r.num_output_tokens >= 1 for r in scheduler.running)


def _poisoned(control: Path) -> Callable[..., None]:
    real = Sampler._apply_penalties_and_masks

    def apply(self: Sampler, logits: object, row: int, request: Request) -> None:
        poison = control / "poison"
        if poison.exists() and request.sampling_params.seed == int(poison.read_text()):
            raise RuntimeError("per-request fault injected by the test (controlled_serve poison file)")
        real(self, logits, row, request)  # type: ignore[arg-type]

    return apply


if __name__ == "__main__":
    control_dir = Path(sys.argv[1])
    LLMEngine.step = _controlled(control_dir)  # type: ignore[method-assign]
    Sampler._apply_penalties_and_masks = _poisoned(control_dir)  # type: ignore[method-assign]
    sys.exit(main(sys.argv[2:]))
