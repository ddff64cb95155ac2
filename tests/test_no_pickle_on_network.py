"""Nothing that can execute code while deserializing is used by the processes that read bytes off a network.

An AST scan of the engine (control channel, KV transfer, server), the router, the shared helpers and the
contract, which fails on any of:
- importing `pickle` (or `_pickle`, `cPickle`, `cloudpickle`, `dill`, `marshal`, `shelve`, `joblib`);
- `torch.load` (or `torch.jit.load`) without `weights_only=True`; `numpy.load(..., allow_pickle=True)`;
- `yaml.load` without an explicit safe loader, `yaml.unsafe_load`, `pandas.read_pickle`;
- the builtins `eval`, `exec` and `__import__`;
- torch.distributed's object collectives (`broadcast_object_list`, `recv_object_list`, ...: they pickle);
- `multiprocessing.connection` `Client`/`Listener` and a bare `.recv()` call (a Connection's `recv`
  unpickles; sockets' `recv` takes a size, and the control channel uses `recv_bytes` + contract/wire.py).
The scanner itself is checked on a snippet of each forbidden form, so a clean result means something.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("engine", "router", "common", "contract")
FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
FORBIDDEN_BUILTINS = {"eval", "exec", "__import__"}
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "recv_object_list",
    "send_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
}
PICKLING_CONNECTIONS = {"Client", "Listener"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords)


def _call_problem(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    last = name.rsplit(".", 1)[-1]
    if isinstance(call.func, ast.Name) and name in FORBIDDEN_BUILTINS:
        return f"{name}()"
    if name in ("torch.load", "torch.jit.load") and not _keyword_is(call, "weights_only", True):
        return f"{name} without weights_only=True"
    if name in ("np.load", "numpy.load") and _keyword_is(call, "allow_pickle", True):
        return f"{name}(allow_pickle=True)"
    if name == "yaml.load" and not any(k.arg == "Loader" and "Safe" in _dotted(k.value) for k in call.keywords):
        return "yaml.load without a safe Loader"
    if name in ("yaml.unsafe_load", "pd.read_pickle", "pandas.read_pickle"):
        return name
    if last in OBJECT_COLLECTIVES:
        return f"{name} (pickles its objects)"
    if isinstance(call.func, ast.Attribute) and last == "recv" and not call.args and not call.keywords:
        return f"{name}() (a multiprocessing Connection's recv unpickles)"
    return None


def _node_problems(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module.split(".")[0] in FORBIDDEN_MODULES:
            return [f"from {node.module} import ..."]
        if node.module == "multiprocessing.connection":
            return [f"multiprocessing.connection.{a.name}" for a in node.names if a.name in PICKLING_CONNECTIONS]
    if isinstance(node, ast.Call) and (problem := _call_problem(node)):
        return [problem]
    return []


def problems(source: str) -> list[str]:
    return [f"line {node.lineno}: {p}" for node in ast.walk(ast.parse(source)) for p in _node_problems(node)]


def _sources() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def test_the_scan_covers_the_network_readers() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    for reader in ("engine/distributed/comm.py", "engine/kv_transfer/protocol.py", "router/proxy.py"):
        assert reader in names


def test_no_network_reader_deserializes_with_code_execution() -> None:
    found = {p.relative_to(ROOT).as_posix(): problems(p.read_text()) for p in _sources()}
    assert not {path: lines for path, lines in found.items() if lines}


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from marshal import loads",
        "from pickle import loads as l",
        "torch.load(path)",
        "torch.load(path, weights_only=False)",
        "torch.jit.load(f)",
        "np.load(f, allow_pickle=True)",
        "yaml.load(text)",
        "yaml.unsafe_load(text)",
        "pd.read_pickle(p)",
        "eval(text)",
        "exec(code)",
        "__import__(name)",
        "dist.broadcast_object_list(objs, src=0)",
        "torch.distributed.recv_object_list(objs)",
        "message = conn.recv()",
        "from multiprocessing.connection import Client",
    ],
)
def test_the_scanner_flags_each_forbidden_form(snippet: str) -> None:
    assert problems(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "torch.load(path, weights_only=True)",
        "model.eval()",
        "sock.recv(4096)",
        "conn.recv_bytes(1 << 20)",
        "yaml.load(text, Loader=yaml.SafeLoader)",
        "from multiprocessing.connection import Connection, wait",
        "json.loads(body)",
    ],
)
def test_the_scanner_passes_safe_forms(snippet: str) -> None:
    assert not problems(snippet)
