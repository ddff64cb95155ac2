"""Prebuilt CPU ops (issue #43): `tidepool build-ops` ahead of time, the lookup the engine does first, and the
run-time build as the fallback.

- build-ops writes one library per op and ISA and a manifest; a second run keeps what still matches, and a
  change of what the libraries are built from (a TIDEPOOL_CPU_* -D flag) rebuilds.
- With TIDEPOOL_CPU_OPS_DIR set, the engine's op loads from it with no compiler at all (CXX names a missing
  one, the cache stays empty) and computes what torch computes; it logs LOADED_LINE once, with the variant.
- Selection: the best ISA this CPU runs that the directory has; a directory with none for this CPU, an entry
  built from other inputs, a missing manifest or library: the run-time build, said in ONE WARNING line
  (COMPILE_LINE) with the reason however many ops fall back; no directory named: the same line at INFO.
- The ISA table: /proc/cpuinfo flags -> the levels a CPU runs; `--isa` parsing and its errors.

The "CPU" of the selection tests is given (prebuilt.runnable patched), so they mean the same on every machine;
the libraries are built for the ISAs this machine runs, so they load here.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tidepool.cli import main as cli_main
from tidepool.contract.cpu_ops import COMPILE_LINE, LOADED_LINE, MANIFEST_NAME, PREBUILT_DIR_ENV
from tidepool.engine import cpu_ops
from tidepool.engine.cpu_ops import build, isa, prebuilt
from tidepool.engine.cpu_ops.build_ops import build_ops, op_names

LOGGER = "tidepool.engine.cpu_ops"
HERE = isa.runnable()
OPS = ["fused", "gemv"]  # two small ones: enough for "every op" and "once however many ops"
AVX2_FLAGS = "fpu sse2 pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt avx f16c lahf_lm abm bmi1 avx2 bmi2"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ops in OPS built for every ISA this machine runs (at most two: the best and the one below)."""
    if not HERE:
        pytest.fail(f"this machine runs none of {list(isa.ISA_TABLE)}: add its ISA to engine/cpu_ops/isa.py")
    out = tmp_path_factory.mktemp("prebuilt")
    with pytest.MonkeyPatch.context() as patch:
        for env in (build.VECTOR_WIDTH_ENV, build.PREFETCH_ENV, build.PREFETCH_CACHE_ENV):
            patch.delenv(env, raising=False)
        report = build_ops(HERE[-2:], out, jobs=2, ops=OPS)
    assert report == {i.name: dict.fromkeys(OPS, "built") for i in HERE[-2:]}
    return out


@pytest.fixture
def prebuilt_dir(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A copy of `built` named by TIDEPOOL_CPU_OPS_DIR (tests edit its manifest), an empty cache, no compiler."""
    root = tmp_path / "ops"
    shutil.copytree(built, root)
    monkeypatch.setenv(PREBUILT_DIR_ENV, str(root))
    monkeypatch.setenv("TIDEPOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    for env in (build.VECTOR_WIDTH_ENV, build.PREFETCH_ENV, build.PREFETCH_CACHE_ENV, cpu_ops.FUSED_MODE_ENV):
        monkeypatch.delenv(env, raising=False)
    cpu_ops.reset()
    yield root
    cpu_ops.reset()


def _lines(caplog: pytest.LogCaptureFixture, needle: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and needle in r.getMessage()]


def _edit_manifest(root: Path, edit) -> None:
    path = root / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data["ops"])
    path.write_text(json.dumps(data))


def test_the_engine_loads_the_prebuilt_op_without_a_compiler(
    prebuilt_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    fused = cpu_ops.fused_op()
    assert fused is not None
    gate_up = torch.randn(3, 64)
    expected = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    torch.testing.assert_close(fused.silu_mul(gate_up), expected)
    library, _ = prebuilt.find_prebuilt("gemv")
    assert library is not None and library.prebuilt == HERE[-1].name  # the best this CPU runs
    assert library.vector_width == (16 if HERE[-1].name == "avx512" else 8)
    assert cpu_ops.gemv_op() is not None
    (loaded,) = _lines(caplog, LOADED_LINE)  # once for both ops
    assert f"{HERE[-1].name} variant" in loaded.getMessage() and str(prebuilt_dir) in loaded.getMessage()
    assert not _lines(caplog, COMPILE_LINE)
    assert "prebuilt " + HERE[-1].name in _lines(caplog, "CPU fused ops")[0].getMessage()
    assert not (tmp_path / "cache").exists()  # nothing built, nothing cached


def test_the_best_variant_this_cpu_runs_is_chosen(prebuilt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if len(HERE) < 2:
        pytest.skip("this machine runs a single known ISA: no choice to make")
    low, high = HERE[-2], HERE[-1]
    monkeypatch.setattr(prebuilt, "runnable", lambda: [low])  # a CPU one level down
    assert prebuilt.find_prebuilt("fused")[0].prebuilt == low.name
    monkeypatch.setattr(prebuilt, "runnable", lambda: [low, high])
    assert prebuilt.find_prebuilt("fused")[0].prebuilt == high.name
    _edit_manifest(prebuilt_dir, lambda ops: ops.pop(high.name))  # an image without the best level
    assert prebuilt.find_prebuilt("fused")[0].prebuilt == low.name


@pytest.mark.parametrize(
    ("breakage", "reason"),
    [
        ("cpu", "no prebuilt variant for this CPU"),
        ("sources", "built for other inputs (sources"),
        ("torch", "built for other inputs (torch"),
        ("library", "is missing"),
        ("manifest", f"{MANIFEST_NAME} does not exist"),
        ("defines", "built for other inputs (defines"),
    ],
)
def test_no_usable_prebuilt_op_builds_at_run_time_with_one_warning(
    prebuilt_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, breakage: str, reason: str
) -> None:
    best = HERE[-1].name
    if breakage == "cpu":
        monkeypatch.setattr(prebuilt, "runnable", lambda: [isa.ISA_TABLE["armv8" if best != "armv8" else "sse4"]])
    elif breakage in ("sources", "torch"):
        _edit_manifest(prebuilt_dir, lambda ops: [e.update({breakage: "other"}) for e in ops[best].values()])
    elif breakage == "library":
        for entry in json.loads((prebuilt_dir / MANIFEST_NAME).read_text())["ops"][best].values():
            (prebuilt_dir / entry["file"]).unlink()
    elif breakage == "manifest":
        (prebuilt_dir / MANIFEST_NAME).unlink()
    else:
        monkeypatch.setenv(build.VECTOR_WIDTH_ENV, "8")
    built_here: list[str] = []

    def run_time_build(name: str, source: str) -> build.BuiltLibrary:
        built_here.append(name)
        raise build.BuildUnavailable("no compiler here (the test's CXX)")

    monkeypatch.setattr(prebuilt, "build_library", run_time_build)
    caplog.set_level(logging.INFO, LOGGER)
    for name in OPS:
        with pytest.raises(build.BuildUnavailable):
            prebuilt.obtain_library(name)
    assert built_here == OPS
    (line,) = _lines(caplog, COMPILE_LINE)
    assert line.levelno == logging.WARNING and reason in line.getMessage(), line.getMessage()
    assert not _lines(caplog, LOADED_LINE)


def test_no_directory_named_builds_at_run_time_said_at_info(
    prebuilt_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(PREBUILT_DIR_ENV)
    monkeypatch.setattr(prebuilt, "build_library", lambda name, source: build.BuiltLibrary(Path(name), True, False, ()))
    caplog.set_level(logging.INFO, LOGGER)
    assert [prebuilt.obtain_library(name).path for name in OPS] == [Path(name) for name in OPS]
    (line,) = _lines(caplog, COMPILE_LINE)
    assert line.levelno == logging.INFO and f"{PREBUILT_DIR_ENV} is unset" in line.getMessage()


def test_build_ops_keeps_what_matches_and_rebuilds_what_changed(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ops"
    shutil.copytree(built, root)
    before = (root / MANIFEST_NAME).read_text()
    assert build_ops(HERE[-1:], root, ops=OPS) == {HERE[-1].name: dict.fromkeys(OPS, "kept")}
    assert (root / MANIFEST_NAME).read_text() == before
    monkeypatch.setenv(build.PREFETCH_ENV, "off")  # another -D flag: other libraries
    assert build_ops(HERE[-1:], root, ops=["fused"]) == {HERE[-1].name: {"fused": "built"}}
    entry = json.loads((root / MANIFEST_NAME).read_text())["ops"][HERE[-1].name]["fused"]
    assert entry["defines"] == ["-DTIDEPOOL_PREFETCH_BYTES=-1"]
    assert (root / entry["file"]).stat().st_mode & 0o755 == 0o755  # a pod's non-root user reads it
    with pytest.raises(ValueError, match="unknown CPU ops"):
        build_ops(HERE[-1:], root, ops=["nope"])
    foreign = isa.ISA_TABLE["armv8" if HERE[-1].machine != "aarch64" else "avx2"]
    with pytest.raises(ValueError, match=f"--isa {foreign.name}: not for this machine"):
        build_ops([foreign], root, ops=["fused"])


def test_op_names_are_the_sources() -> None:
    assert set(OPS) <= set(op_names())
    assert {"paged_attention", "decoder", "int4_gemv"} <= set(op_names())


def test_cpu_flags_give_the_levels_a_cpu_runs() -> None:
    features = isa.cpu_features(f"processor\t: 0\nflags\t\t: {AVX2_FLAGS}\n")
    assert [i.name for i in isa.runnable(features, "x86_64")] == ["sse4", "avx2"]
    assert [i.name for i in isa.runnable(features | isa.ISA_TABLE["avx512"].requires, "x86_64")] == [
        "sse4", "avx2", "avx512",
    ]  # fmt: skip
    assert [i.name for i in isa.runnable(features - {"fma"}, "x86_64")] == ["sse4"]
    assert [i.name for i in isa.runnable(isa.cpu_features("Features\t: fp asimd evtstrm\n"), "aarch64")] == ["armv8"]


def test_isa_parsing() -> None:
    assert [i.name for i in isa.parse_isas("avx512, AVX2,avx2")] == ["avx512", "avx2"]
    assert isa.parse_isas("auto") == HERE[-1:]
    with pytest.raises(ValueError, match=r"--isa: unknown ISA 'avx3'"):
        isa.parse_isas("avx2,avx3")
    with pytest.raises(ValueError, match="--isa: give one or more"):
        isa.parse_isas(" , ")


def test_cli_needs_a_directory(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(PREBUILT_DIR_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["build-ops", "--isa", "avx2"])
    assert exit_.value.code == 2 and f"--out: give the directory or set {PREBUILT_DIR_ENV}" in capsys.readouterr().err
    assert cli_main(["build-ops", "--isa", "avx3", "--out", "/nonexistent"]) == 1
    assert "tidepool build-ops: error: --isa: unknown ISA 'avx3'" in capsys.readouterr().err
