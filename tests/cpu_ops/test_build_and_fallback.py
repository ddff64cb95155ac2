"""Building, caching and falling back: the compiled op's life outside its arithmetic.

- TIDEPOOL_CPU_ATTENTION=torch builds nothing; a missing compiler or a failing build leaves the torch
  path in use, said in exactly one log line, and the engine still generates.
- Concurrent processes on a cold cache build the library exactly once and all load it.
- A failed build is recorded and not retried by every later process.
- The library shares torch's OpenMP runtime (no second thread pool in the process).
- TIDEPOOL_CPU_VECTOR_WIDTH forces the SIMD width (a separate cache entry); other values are an error.
- TIDEPOOL_CPU_PREFETCH_BYTES sets the weight streams' prefetch distance and TIDEPOOL_CPU_PREFETCH_CACHE
  the level prefetches fill (each reported by the library, other values an error); whatever they are, the
  GEMV (float32, int8), int4 and attention results are the same bits.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_op_steps import dense_reference, kernel_view_metadata, random_step

from tidepool.engine import cpu_ops
from tidepool.engine.cpu_ops import build
from tidepool.engine.cpu_ops.int4_gemv import tile_weight
from tidepool.engine.layers import attention_backend as backend
from tidepool.kernels.int4_packing import pack_int4

LOGGER = "tidepool.engine.cpu_ops"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache and a forgotten decision; restored afterwards."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TIDEPOOL_CACHE", str(cache))
    monkeypatch.delenv(cpu_ops.MODE_ENV, raising=False)
    cpu_ops.reset()
    yield cache
    cpu_ops.reset()


def _path_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "CPU attention" in r.getMessage()]


def test_torch_mode_builds_nothing(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(cpu_ops.MODE_ENV, "torch")
    caplog.set_level(logging.INFO, LOGGER)
    assert cpu_ops.paged_attention_op() is None
    assert not backend.cpu_kernel_available()
    assert _path_lines(caplog) == ["CPU attention: torch path (TIDEPOOL_CPU_ATTENTION=torch)"]
    assert not (fresh / "cpu_ops").exists()


def test_missing_compiler_falls_back_with_one_log_line(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    caplog.set_level(logging.INFO, LOGGER)
    assert not backend.cpu_kernel_available()
    # The engine may still hand over kernel views without a decode mask (a worker whose op failed while
    # rank 0's loaded): the torch path derives the mask from the views.
    step = random_step(5, num_kv_heads=2, group=3, head_dim=64, block_size=16, seqs=[(70, 1), (5, 1), (90, 20)])
    meta = kernel_view_metadata(step)
    got = backend.paged_attention(step.q, step.k, step.v, step.k_cache, step.v_cache, meta, step.scale)
    torch.testing.assert_close(got.double(), dense_reference(step), atol=3e-5, rtol=1e-4)
    lines = _path_lines(caplog)
    assert len(lines) == 1
    assert "torch path" in lines[0] and "CXX=/nonexistent/g++ not found" in lines[0]


def test_compiled_mode_refuses_to_fall_back(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv(cpu_ops.MODE_ENV, "compiled")
    with pytest.raises(RuntimeError, match=r"TIDEPOOL_CPU_ATTENTION=compiled but .* unavailable"):
        cpu_ops.paged_attention_op()


def test_unknown_mode_is_an_error(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="expected one of auto, torch, compiled"):
        cpu_ops.paged_attention_op()


def test_vector_width_is_forced_and_reported(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(build.VECTOR_WIDTH_ENV, raising=False)
    native = build.build_library("fused", "fused.cpp")
    assert native.vector_width in build.VECTOR_WIDTHS
    paths = {native.path}
    for width in build.VECTOR_WIDTHS:
        monkeypatch.setenv(build.VECTOR_WIDTH_ENV, str(width))
        built = build.build_library("fused", "fused.cpp")
        assert built.vector_width == width
        assert f"-DTIDEPOOL_VEC_WIDTH={width}" in built.flags
        paths.add(built.path)
    assert len(paths) == 3  # the default and each forced width are separate cache entries


@pytest.mark.parametrize("value", ["4", "32", "wide", "16.0"])
def test_unknown_vector_width_is_an_error(fresh: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(build.VECTOR_WIDTH_ENV, value)
    with pytest.raises(ValueError, match=rf"{build.VECTOR_WIDTH_ENV}=.*expected auto, 8 or 16"):
        cpu_ops.fused_op()


def _streamed_products() -> list[torch.Tensor]:
    """The GEMV (float32 and int8 rows) and the int4 op over shapes and batches that run every row kernel
    (1-8 inputs, groups of 8, the panel kernel from 24), and paged attention over decodes and prefills
    across many blocks (the prefetched KV rows), with the libraries the environment selects now."""
    gemv = cpu_ops.CpuGemv(build.build_library("gemv", "gemv.cpp").path)
    int4 = cpu_ops.CpuInt4Gemv(build.build_library("int4_gemv", "int4_gemv.cpp").path)
    cpu_ops.reset()
    assert cpu_ops.paged_attention_op() is not None
    seqs = [(700, 1), (33, 1), (1000, 1), (300, 40), (90, 90)]
    step = random_step(9, num_kv_heads=2, group=4, head_dim=64, block_size=16, seqs=seqs)
    meta = kernel_view_metadata(step)
    out = [backend.paged_attention(step.q, step.k, step.v, step.k_cache, step.v_cache, meta, step.scale)]
    gen = torch.Generator().manual_seed(5)
    for rows, inner in ((37, 100), (96, 576), (200, 1536)):
        w = torch.randn(rows, inner, generator=gen)
        w8 = torch.randint(-127, 128, (rows, inner), generator=gen, dtype=torch.int8)
        scales = torch.rand(rows, generator=gen) + 0.01
        k4 = inner - inner % 32  # int4 groups of 32 along the inputs
        qweight = pack_int4(torch.randint(0, 16, (k4, rows), generator=gen))
        group_scales, group_mins = torch.rand(k4 // 32, rows, generator=gen), torch.randn(k4 // 32, rows, generator=gen)
        tiles = tile_weight(qweight, group_scales, None, 32, group_mins)
        for batch in (1, 2, 3, 5, 8, 13, 30):
            x = torch.randn(batch, inner, generator=gen)
            out += [gemv(x, w), gemv.int8(x, w8, scales), int4(x[:, :k4], tiles)]
    return out


@pytest.mark.parametrize(
    ("env", "value", "reported"),
    [(build.PREFETCH_ENV, "off", ("prefetch_bytes", -1)), (build.PREFETCH_CACHE_ENV, "l1", ("prefetch_cache", "l1"))],
)
def test_prefetch_settings_change_no_bits(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, env: str, value: str, reported: tuple[str, object]
) -> None:
    monkeypatch.delenv(build.PREFETCH_ENV, raising=False)
    monkeypatch.delenv(build.PREFETCH_CACHE_ENV, raising=False)
    default = build.build_library("gemv", "gemv.cpp")
    assert default.prefetch_bytes > 0 and default.prefetch_cache == "l2"  # the defaults
    with_default = _streamed_products()
    monkeypatch.setenv(env, value)
    assert getattr(build.build_library("gemv", "gemv.cpp"), reported[0]) == reported[1]
    with_other = _streamed_products()
    assert len(with_default) == len(with_other) == 64
    for a, b in zip(with_default, with_other, strict=True):
        assert torch.equal(a, b)


def test_prefetch_distance_is_forced_and_reported(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.PREFETCH_ENV, "8192")
    built = build.build_library("fused", "fused.cpp")
    assert built.prefetch_bytes == 8192 and "-DTIDEPOOL_PREFETCH_BYTES=8192" in built.flags


def test_prefetch_cache_is_forced_and_reported(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = set()
    for value, locality in build.PREFETCH_LOCALITIES.items():
        monkeypatch.setenv(build.PREFETCH_CACHE_ENV, value)
        built = build.build_library("paged_attention", "paged_attention.cpp")
        assert built.prefetch_cache == value and f"-DTIDEPOOL_PREFETCH_LOCALITY={locality}" in built.flags
        paths.add(built.path)
    assert len(paths) == 2  # separate cache entries


@pytest.mark.parametrize("value", ["l3", "L2x", "2", "none"])
def test_unknown_prefetch_cache_is_an_error(fresh: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(build.PREFETCH_CACHE_ENV, value)
    with pytest.raises(ValueError, match=rf"{build.PREFETCH_CACHE_ENV}=.*expected auto, l2 or l1"):
        cpu_ops.paged_attention_op()


@pytest.mark.parametrize("value", ["32", "-64", "far", "1e3", "131072"])
def test_unknown_prefetch_distance_is_an_error(fresh: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(build.PREFETCH_ENV, value)
    with pytest.raises(ValueError, match=rf"{build.PREFETCH_ENV}=.*expected auto, off or a multiple of 64"):
        cpu_ops.gemv_op()


def test_failed_build_is_recorded_and_not_retried(
    fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = tmp_path / "calls"
    compiler = tmp_path / "broken-c++"
    compiler.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then echo "broken 1.0"; exit 0; fi\n'
        f'echo "$@" >> {calls}\necho "broken: cannot compile" >&2\nexit 1\n'
    )
    compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(compiler))
    caplog.set_level(logging.INFO, LOGGER)
    assert cpu_ops.paged_attention_op() is None
    attempts = calls.read_text().splitlines()
    assert attempts, "the compiler was never asked to build"
    logs = sorted((fresh / "cpu_ops").glob("*.log"))
    assert logs and all("broken: cannot compile" in log.read_text() for log in logs)
    [line] = _path_lines(caplog)
    assert "the C++ build failed" in line and str(logs[0]) in line
    cpu_ops.reset()
    assert cpu_ops.paged_attention_op() is None
    assert calls.read_text().splitlines() == attempts  # the recorded failure is not compiled again


def test_cache_key_covers_what_makes_a_library_valid(tmp_path: Path) -> None:
    source = tmp_path / "op.cpp"
    source.write_text("int f() { return 1; }\n")
    recipe = build._Recipe("/usr/bin/c++", (source,), ("-O3",), ())
    key = recipe.key("c++ 12", "cpu A")
    assert recipe.key("c++ 12", "cpu A") == key
    assert recipe.key("c++ 13", "cpu A") != key
    assert recipe.key("c++ 12", "cpu B") != key
    assert build._Recipe("/usr/bin/c++", (source,), ("-O2",), ()).key("c++ 12", "cpu A") != key
    source.write_text("int f() { return 2; }\n")
    assert recipe.key("c++ 12", "cpu A") != key


_BUILD_ONCE = """
import sys
from tidepool.engine.cpu_ops import build
from tidepool.engine.cpu_ops.paged_attention import CpuPagedAttention
built = build.build_library("paged_attention", "paged_attention.cpp")
CpuPagedAttention(built.path)  # loads: the file is complete
print(built.built_now, built.path)
"""


@pytest.mark.slow
def test_concurrent_processes_build_once(tmp_path: Path) -> None:
    env = {**os.environ, "TIDEPOOL_CACHE": str(tmp_path / "cache")}
    env.pop("CXX", None)
    procs = [
        # cwd outside the clone: the repository root on sys.path would shadow the stdlib `operator`
        subprocess.Popen([sys.executable, "-c", _BUILD_ONCE], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = [p.communicate(timeout=600)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(built for built, _ in results) == ["False", "False", "True"]
    assert len({path for _, path in results}) == 1
    libraries = list((tmp_path / "cache" / "cpu_ops").glob("*.so"))
    assert [str(p) for p in libraries] == [results[0][1]]
    assert not [p for p in (tmp_path / "cache" / "cpu_ops").iterdir() if p.name.startswith(".")]  # no leftovers


@pytest.mark.slow
def test_engine_without_a_compiler_generates_and_says_so_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from tidepool.engine import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir)!r}, show_progress=False)\n"
        "params = SamplingParams(temperature=0.0, max_tokens=5)\n"
        "out = llm.generate([[5, 6, 7] * 10, [9] * 40], params, use_tqdm=False)\n"
        "print([len(o.outputs[0].token_ids) for o in out])\n"
    )
    env = {**os.environ, "CXX": "/nonexistent/g++", "TIDEPOOL_CACHE": str(tmp_path / "cache")}
    env.pop(cpu_ops.MODE_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[5, 5]"
    for op_label in ("CPU attention", "CPU GEMV", "CPU fused ops"):  # each op: one line, saying why
        lines = [line for line in proc.stderr.splitlines() if op_label in line]
        assert len(lines) == 1 and "torch path" in lines[0] and "not found" in lines[0], proc.stderr


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's memory map (Linux)")
def test_op_shares_torchs_openmp_runtime(paged_attention: cpu_ops.CpuPagedAttention) -> None:
    runtime = build.torch_openmp_runtime()
    if runtime is None:
        assert not paged_attention.has_openmp  # torch without OpenMP: the op is built single-threaded
        return
    assert paged_attention.has_openmp
    mapped = {
        line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if build._OMP_LIB.search(line)
    }
    assert mapped == {str(runtime)}
