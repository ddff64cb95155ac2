"""The architecture, computed from the source (standard library `ast` only, no product import but one subprocess).

- No import cycle within tidepool.engine, .operator, .router, .contract or .common. The module graph has an edge
  for every `import` / `from ... import` anywhere in a module (inside functions and under `if TYPE_CHECKING:` too);
  `from X import name` is an edge to X.name when that is a module, else to X. Folders map to packages by setup.py's
  ROOTS (read from setup.py, not copied).
- Dependencies point one way: contract imports only the standard library and itself; common nothing from tidepool
  but itself; router and operator nothing from the engine; the engine nothing from the operator; kernels nothing
  from the engine or the operator. Importing any contract module, in a fresh interpreter, loads no third-party
  package and changes no process state (environment, threads, working directory, signal handlers, sys.path).
- No product function over MAX_FUNCTION_LINES lines except the Triton kernels in LONG_TRITON_KERNELS, each with
  its reason; no fixture name defined in more than one file under tests/.

Every failure names what to fix (the cycle as a chain, the offending import with its line, the function with its
length, the fixture with its files).
"""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
MAX_FUNCTION_LINES = 80
ACYCLIC_PACKAGES = ("tidepool.engine", "tidepool.operator", "tidepool.router", "tidepool.contract", "tidepool.common")
# Triton kernels allowed over MAX_FUNCTION_LINES, by qualified name, with the reason. A kernel is one compiled
# program: its loads, tiles and stores read top to bottom, and splitting it into @triton.jit helpers only moves
# the tiling out of sight.
LONG_TRITON_KERNELS: dict[str, str] = {
    "tidepool.kernels._paged_tile.attend_keys": "the whole key loop both attention kernels inline (online softmax "
    "over the unmasked tiles, then the causal/window-masked ones); about half of its lines are parameters, one a line",
    "tidepool.kernels.flash_attention_varlen._flash_varlen_kernel": "one program per (query tile, head): find the "
    "sequence, loop over its key tiles, store; about a third of its lines are its parameters, one a line",
    "tidepool.kernels.paged_attention_decode._decode_kernel": "one program per (sequence, head, split): its key range, "
    "the tile loop, the partial results for the merge; about a third of its lines are its parameters, one a line",
}


@dataclass(frozen=True)
class Import:
    target: str  # the module imported (or the module a `from` import names)
    line: int


@cache
def roots() -> dict[str, str]:
    """setup.py's ROOTS (package -> folder), read from its AST."""
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no ROOTS")


@cache
def product_modules() -> dict[str, Path]:
    """Every product module by dotted name: the .py files of each ROOTS folder's packages (folders with __init__.py)."""
    modules: dict[str, Path] = {}
    for package, folder in roots().items():
        base = REPO / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if not all((base / Path(*rel.parts[:i]) / "__init__.py").exists() for i in range(1, len(rel.parts))):
                continue  # not inside a package: setup.py does not ship it
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_package(module: str) -> bool:
    return product_modules()[module].name == "__init__.py"


def _resolve_relative(module: str, level: int, name: str | None) -> str:
    package = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{name}" if name else package


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    """Every import in `module`, anywhere in it (functions, `if TYPE_CHECKING:`), as the modules it names."""
    tree = ast.parse(product_modules()[module].read_text())
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, node.level, node.module) if node.level else node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append(Import(candidate if candidate in product_modules() else base, node.lineno))
    return tuple(found)


def _product_target(name: str) -> str | None:
    """The product module `name` refers to (its longest known prefix), or None outside the product."""
    while name:
        if name in product_modules():
            return name
        name = name.rpartition(".")[0]
    return None


@cache
def graph() -> dict[str, set[str]]:
    """module -> the product modules it imports."""
    edges: dict[str, set[str]] = {}
    for module in product_modules():
        targets = (_product_target(imp.target) for imp in imports_of(module))
        edges[module] = {t for t in targets if t is not None and t != module}
    return edges


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _components(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(nodes):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root] & nodes)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child] & nodes))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _shortest_cycle(start: str, members: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest chain start -> ... -> start inside one component (breadth first)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(edges[node] & members):
            if child == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return [start, *reversed(chain[:-1]), start]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is in no cycle")


def import_cycles(package: str) -> list[str]:
    """Every cycle within `package`, as readable chains: for each module in a cycle, the shortest one through it."""
    edges = graph()
    nodes = {m for m in edges if _within(m, package)}
    chains: list[str] = []
    seen: set[frozenset[str]] = set()
    for component in _components(nodes, edges):
        for start in component:
            cycle = _shortest_cycle(start, set(component), edges)
            key = frozenset(itertools.pairwise(cycle))
            if key not in seen:
                seen.add(key)
                chains.append(" -> ".join(cycle))
    return chains


def test_the_cycle_finder_finds_every_cycle_of_a_known_graph() -> None:
    edges = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"b"}, "e": {"a"}, "f": set()}
    components = _components(set(edges), edges)
    assert components == [["a", "b", "c", "d"]]
    chains = {" -> ".join(_shortest_cycle(start, set(components[0]), edges)) for start in components[0]}
    assert chains == {"a -> b -> c -> a", "b -> d -> b", "c -> a -> b -> c", "d -> b -> d"}


@pytest.mark.parametrize("package", ACYCLIC_PACKAGES)
def test_no_import_cycles(package: str) -> None:
    assert product_modules(), "setup.py's ROOTS name no product module"
    cycles = import_cycles(package)
    assert not cycles, f"{len(cycles)} import cycle(s) within {package}:\n" + "\n".join(cycles)


def _is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names


# package -> (what it must not import, what it may import): a name is refused when it falls under a
# refused prefix and under no allowed one; "<third-party>" stands for any non-stdlib, non-tidepool module.
DIRECTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tidepool.contract": (("tidepool", "<third-party>"), ("tidepool.contract",)),
    "tidepool.common": (("tidepool",), ("tidepool.common",)),
    "tidepool.router": (("tidepool.engine",), ()),
    "tidepool.operator": (("tidepool.engine",), ()),
    "tidepool.engine": (("tidepool.operator",), ()),
    "tidepool.kernels": (("tidepool.engine", "tidepool.operator"), ()),
}


def _refused(target: str, refused: tuple[str, ...], allowed: tuple[str, ...]) -> bool:
    if any(_within(target, prefix) for prefix in allowed):
        return False
    third_party = not _is_stdlib(target) and not _within(target, "tidepool")
    return any(_within(target, p) for p in refused if p != "<third-party>") or (
        "<third-party>" in refused and third_party
    )


@pytest.mark.parametrize("package", sorted(DIRECTIONS))
def test_dependencies_point_one_way(package: str) -> None:
    refused, allowed = DIRECTIONS[package]
    wrong = [
        f"{product_modules()[module].relative_to(REPO)}:{imp.line} imports {imp.target}"
        for module in sorted(product_modules())
        if _within(module, package)
        for imp in imports_of(module)
        if _refused(imp.target, refused, allowed)
    ]
    assert not wrong, f"{package} must not import {' or '.join(refused)}:\n" + "\n".join(wrong)


# Run in a fresh interpreter (from /tmp: the repository's operator/ folder must not shadow the stdlib): import one
# module and report what changed.
_PROBE = """
import importlib, json, os, signal, sys, threading
def state():
    handlers = {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)}
    return {"env": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path), "signals": handlers,
            "threads": sorted(t.name for t in threading.enumerate())}
before, loaded = state(), set(sys.modules)
importlib.import_module(sys.argv[1])
after = state()
changed = {key: [before[key], after[key]] for key in before if before[key] != after[key]}
print(json.dumps({"changed": changed, "new_modules": sorted(set(sys.modules) - loaded)}))
"""


@pytest.mark.parametrize("module", sorted(m for m in product_modules() if _within(m, "tidepool.contract")))
def test_importing_a_contract_module_has_no_side_effects(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, module], cwd="/tmp", capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    foreign = [
        name
        for name in report["new_modules"]
        if not _is_stdlib(name) and name != "tidepool" and not _within(name, "tidepool.contract")
    ]
    assert not foreign, f"importing {module} loads modules outside the standard library and the contract: {foreign}"
    assert not report["changed"], f"importing {module} changes process state: {report['changed']}"


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.add(ast.unparse(target))
    return names


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return bool(_decorator_names(node) & {"triton.jit", "triton.autotune", "triton.heuristics"})


def _functions(tree: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method (nested ones too) with its qualified name."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}.{node.name}", node
            yield from _functions(node, f"{prefix}.{node.name}")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}.{node.name}")
        else:
            yield from _functions(node, prefix)


def long_functions() -> dict[str, tuple[int, bool, str]]:
    """Qualified name -> (lines, is a Triton kernel, file:line) for every product function over the limit."""
    found: dict[str, tuple[int, bool, str]] = {}
    for module, path in product_modules().items():
        for name, node in _functions(ast.parse(path.read_text()), module):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found[name] = (lines, _is_triton_kernel(node), f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_no_product_function_is_over_the_limit() -> None:
    found = long_functions()
    too_long = [
        f"{where} {name}: {lines} lines"
        for name, (lines, triton, where) in sorted(found.items())
        if not (triton and name in LONG_TRITON_KERNELS)
    ]
    stale = sorted(set(LONG_TRITON_KERNELS) - {name for name, (_, triton, _) in found.items() if triton})
    problems = [f"functions over {MAX_FUNCTION_LINES} lines (split them; a Triton kernel may be listed in "]
    problems[0] += "LONG_TRITON_KERNELS with its reason):"
    problems += too_long
    problems += [f"LONG_TRITON_KERNELS names {name}, no long Triton kernel (remove it)" for name in stale]
    assert not too_long and not stale, "\n".join(problems)


def _fixture_name(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The name a function defines as a fixture (its `name=` if given), or None if it is no fixture."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target).rpartition(".")[2] != "fixture":
            continue
        if isinstance(decorator, ast.Call):
            for keyword in decorator.keywords:
                if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                    return str(keyword.value.value)
        return node.name
    return None


def fixture_files() -> dict[str, set[str]]:
    """Fixture name -> the files under tests/ that define it."""
    files: dict[str, set[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (name := _fixture_name(node)):
                files.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return files


def test_no_fixture_is_defined_in_more_than_one_file() -> None:
    twice = {name: sorted(paths) for name, paths in sorted(fixture_files().items()) if len(paths) > 1}
    assert not twice, "fixtures defined in more than one file (one definition, in the conftest that covers all):\n" + (
        "\n".join(f"{name}: {', '.join(paths)}" for name, paths in twice.items())
    )
