"""The HTTP side reaches the engine only through `AsyncEngine`'s queue and the read-only `EngineInfo` (issue #15).

Checked on the source: no server module but the engine thread's owner touches the `LLMEngine`
object, and only the module that builds it (off the event loop) or snapshots it imports it (plus two type-only
imports for functions the owner runs on the engine thread: `CallEngine`, sleep mode).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import tidepool.engine.server as server_pkg
from tidepool.engine.server.engine_info import EngineInfo

SERVER = Path(server_pkg.__file__).parent
OWNER = "async_engine.py"  # the engine thread's owner: the only holder of the LLMEngine
# The owner, the snapshot, the loader thread; and, for types only, the `CallEngine` command (a function the owner
# runs on the engine thread, between steps) and sleep.py, whose only such functions are the engine-side sleeper's.
MAY_IMPORT_ENGINE = {OWNER, "engine_info.py", "app.py", "commands.py", "sleep.py"}


def _modules() -> list[Path]:
    return sorted(SERVER.glob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_no_server_module_reaches_into_the_engine(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            assert not (node.attr == "_engine" and path.name != OWNER), f"{path.name}:{node.lineno} uses ._engine"
            is_chain = node.attr == "engine" and isinstance(node.value, ast.Attribute) and node.value.attr == "engine"
            assert not is_chain, f"{path.name}:{node.lineno} reaches through .engine.engine"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("llm_engine"):
            assert path.name in MAY_IMPORT_ENGINE, f"{path.name}:{node.lineno} imports the engine"


def test_engine_info_is_read_only() -> None:
    assert dataclasses.fields(EngineInfo)
    params = EngineInfo.__dataclass_params__  # type: ignore[attr-defined]
    assert params.frozen
