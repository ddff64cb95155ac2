"""`tidepool serve` under controlled_serve.py whose LoRA adapter reads wait on a file: a load held mid-read.

Usage: `python lora_gated_serve.py CONTROL_DIR serve --model ...`. Everything controlled_serve.py
does (pause, hold, crash, poison files in CONTROL_DIR) applies; in addition, while
`CONTROL_DIR/hold_lora_read` exists, `LoRARegistry.read` (the server's worker-thread read of an
adapter's files) writes the adapter's name to `CONTROL_DIR/reading_lora` and waits, then reads.
So a test can keep one adapter load in progress for exactly as long as it wants, and check what
the server does meanwhile, on a fast or a slow machine.
"""

from __future__ import annotations

import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tidepool.engine.lora.peft import LoadedAdapter
from tidepool.engine.lora.registry import LoRARegistry

CONTROLLED = Path(__file__).with_name("controlled_serve.py")
_POLL_S = 0.01


def gated(control: Path) -> Callable[[LoRARegistry, str, str], LoadedAdapter]:
    real_read = LoRARegistry.read

    def read(self: LoRARegistry, name: str, path: str) -> LoadedAdapter:
        gate = control / "hold_lora_read"
        if gate.exists():
            (control / "reading_lora").write_text(name)
            while gate.exists():
                time.sleep(_POLL_S)
        return real_read(self, name, path)

    return read


def launcher(control_dir: Path) -> list[str]:
    """The command prefix that runs `tidepool <args>` under this script (args follow it)."""
    return [sys.executable, str(Path(__file__)), str(control_dir)]


if __name__ == "__main__":
    LoRARegistry.read = gated(Path(sys.argv[1]))  # type: ignore[method-assign]
    sys.argv = [str(CONTROLLED), *sys.argv[1:]]
    runpy.run_path(str(CONTROLLED), run_name="__main__")
