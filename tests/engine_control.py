"""A test's hand on a real `tidepool serve` engine: the control files that server/controlled_serve.py reads.

`Controllable` is mixed into the handles of served engines (serve_proc.Server, router_helpers.Proc):
with a `control_dir`, the process runs under controlled_serve.py and the test can pause the engine,
hold it mid-generation, poison one seed or crash it, so what a test sees "while requests run" never
depends on how fast the machine decodes. Without one, the process is plain `tidepool serve`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

CONTROLLED = Path(__file__).parent / "server" / "controlled_serve.py"


def launcher(control_dir: Path) -> list[str]:
    """The command prefix that runs `tidepool <args>` under controlled_serve.py (args follow it)."""
    return [sys.executable, str(CONTROLLED), str(control_dir)]


class Controllable:
    control_dir: Path | None

    def pause(self, paused: bool = True) -> None:
        """Stop (or resume) all engine progress; needs a server started with `control_dir`."""
        self._control("pause", paused)

    def hold(self, held: bool = True) -> None:
        """Let the engine run until every request has started generating, then hold it there (or release
        it); needs a server started with `control_dir`. A new hold first clears the last one's count, which
        the engine writes only while the `hold` file exists, so `num_held` never reads a previous hold."""
        if held:
            (self._dir("hold") / "holding").unlink(missing_ok=True)
        self._control("hold", held)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """`hold()` for the block, released however it ends (a failed assertion included)."""
        self.hold()
        try:
            yield
        finally:
            self.hold(False)

    def wait_held(self, num: int, timeout: float = 60.0) -> None:
        """Wait until the held engine holds exactly `num` requests mid-generation."""
        deadline = time.monotonic() + timeout
        while self.num_held() != num:
            assert time.monotonic() < deadline, f"the engine never held {num} running requests"
            time.sleep(0.05)

    def num_held(self) -> int:
        """Requests the held engine holds mid-generation (0 when not holding)."""
        path = self._dir("read the hold of") / "holding"
        text = path.read_text() if path.exists() else ""
        return int(text) if text.strip() else 0

    def poison_seed(self, seed: int) -> None:
        """Make the sampler fail every request with this seed (a per-request fault); needs `control_dir`."""
        (self._dir("poison requests of") / "poison").write_text(str(seed))

    def crash_engine(self) -> None:
        """Make the engine's next step raise (the engine thread dies); needs `control_dir`."""
        (self._dir("crash") / "crash").touch()

    def _control(self, name: str, on: bool) -> None:
        flag = self._dir(name) / name
        if on:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)

    def _dir(self, what: str) -> Path:
        assert self.control_dir is not None, f"start the server with control_dir to {what} it"
        return self.control_dir
