"""Files of a download: which to fetch, resume, verify, the shared-cache lock and the completion marker.

Invariants: a file appears under its final name only after its size (and, for LFS files, its
sha256) matched, so any final file is whole; a partial one lives as `<name>.incomplete` and the next
attempt resumes it with an HTTP Range request; the completion marker is written last, atomically,
so a pod that sees it (for the same repo and revision) can skip the Hub altogether; the lock
(`flock` on a file in the destination) makes pods sharing one cache download one at a time, and
each re-checks the marker once it holds the lock. flock works across nodes on NFSv4, CephFS and the
common RWX CSI drivers; on a filesystem without it the marker and the atomic renames still keep
every file whole (two pods may then fetch the same file, each verifying its own copy).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import TypeVar

from .hub import DownloadError, Hub, RepoFile, RepoInfo, TransientError

T = TypeVar("T")

logger = logging.getLogger("tidepool.download")

MARKER = ".tidepool-complete.json"
LOCK = ".tidepool-download.lock"
PARTIAL = ".incomplete"
CHUNK = 1 << 20
LOG_EVERY_S = 10.0
# Weights in formats the engine does not load, skipped when the repository also has safetensors.
SKIPPED_WITH_SAFETENSORS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.tflite")


def select_files(files: Sequence[RepoFile], include: Sequence[str] = ()) -> list[RepoFile]:
    """Files to fetch: those matching `include` globs if given; else all but other formats' weights."""
    if include:
        return [f for f in files if any(fnmatch.fnmatch(f.name, g) for g in include)]
    if not any(f.name.endswith(".safetensors") for f in files):
        return list(files)
    skipped = SKIPPED_WITH_SAFETENSORS
    return [f for f in files if not any(fnmatch.fnmatch(PurePosixPath(f.name).name, g) for g in skipped)]


def is_complete(dest: Path, repo: str, revision: str) -> bool:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("repo") == repo and marker.get("revision") == revision


def write_marker(dest: Path, info: RepoInfo, files: Sequence[RepoFile]) -> None:
    body = {
        "repo": info.repo,
        "revision": info.revision,
        "sha": info.sha,
        "files": sorted(f.name for f in files),
        "bytes": sum(f.size or 0 for f in files),
    }
    tmp = dest / f"{MARKER}{PARTIAL}"
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
    os.replace(tmp, dest / MARKER)


@contextlib.contextmanager
def cache_lock(dest: Path) -> Iterator[None]:
    """Exclusive lock on the destination, shared by every pod that mounts the same cache."""
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / LOCK, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another pod is downloading into %s; waiting for it", dest)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _target(dest: Path, name: str) -> Path:
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts:
        raise DownloadError(f"the repository lists an unsafe file name {name!r}; refusing to write it")
    return dest.joinpath(*parts)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _hash_prefix(path: Path, hasher: hashlib._Hash) -> None:
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            hasher.update(block)


def fetch_file(hub: Hub, info: RepoInfo, f: RepoFile, dest: Path) -> int:
    """Fetch one file (resuming a partial one); returns the bytes transferred. Verifies before renaming."""
    target = _target(dest, f.name)
    if target.exists() and (f.size is None or target.stat().st_size == f.size):
        return 0  # renamed only after it was verified
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + PARTIAL)
    offset = part.stat().st_size if part.exists() else 0
    if f.size is not None and offset > f.size:
        part.unlink()
        offset = 0
    hasher = hashlib.sha256()
    if offset and f.sha256:
        _hash_prefix(part, hasher)
    transferred = 0
    if f.size is None or offset < f.size:
        if offset:
            logger.info("resuming %s at %s of %s", f.name, _human(offset), _human(f.size or 0))
        with hub.open_file(info, f.name, offset) as resp:
            if resp.status_code == 416:  # nothing left past offset: the partial file is whole (verified below)
                pass
            else:
                if resp.status_code != 206 and offset:  # the server ignored the Range: start over
                    offset, hasher = 0, hashlib.sha256()
                last_log = time.monotonic()
                with open(part, "ab" if offset else "wb") as out:
                    for block in resp.iter_bytes():  # as received: a broken transfer keeps what came
                        out.write(block)
                        hasher.update(block)
                        transferred += len(block)
                        if time.monotonic() - last_log >= LOG_EVERY_S:
                            last_log = time.monotonic()
                            done = offset + transferred
                            logger.info("%s: %s of %s", f.name, _human(done), _human(f.size or done))
    _verify(part, f, hasher)
    os.replace(part, target)
    return transferred


def _verify(part: Path, f: RepoFile, hasher: hashlib._Hash) -> None:
    size = part.stat().st_size if part.exists() else 0
    if f.size is not None and size != f.size:
        raise DownloadError(f"{f.name}: got {size} bytes, expected {f.size}; the next attempt resumes it")
    if f.sha256 and hasher.hexdigest() != f.sha256:
        part.unlink()
        raise DownloadError(
            f"{f.name}: sha256 mismatch (expected {f.sha256}, got {hasher.hexdigest()}); the partial file was "
            "removed and the next attempt downloads it again (a proxy or mirror serving other content?)"
        )


def download(hub: Hub, repo: str, revision: str, dest: Path, include: Sequence[str] = (), retries: int = 3) -> bool:
    """Fetch `repo@revision` into `dest` once per cache; False when the marker says it is already there."""
    if is_complete(dest, repo, revision):
        logger.info("%s@%s is already complete in %s", repo, revision, dest)
        return False
    with cache_lock(dest):
        if is_complete(dest, repo, revision):  # another pod finished it while we waited
            logger.info("%s@%s was completed by another pod in %s", repo, revision, dest)
            return False
        info = _retrying(lambda: hub.info(repo, revision), retries)
        files = select_files(info.files, include)
        total = sum(f.size or 0 for f in files)
        logger.info("%s@%s (commit %s): %d files, %s", repo, revision, info.sha[:12], len(files), _human(total))
        done = 0
        for i, f in enumerate(files, 1):
            try:
                _retrying(lambda f=f: fetch_file(hub, info, f, dest), retries)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DownloadError(
                        f"no space left in {dest} after {_human(done)} of {_human(total)}: raise "
                        "spec.modelCache.emptyDir.sizeLimit or the claim's size"
                    ) from None
                raise
            done += f.size or 0
            logger.info("[%d/%d] %s done (%s of %s)", i, len(files), f.name, _human(done), _human(total))
        write_marker(dest, info, files)
    logger.info("%s@%s complete in %s", repo, revision, dest)
    return True


def _retrying(fn: Callable[[], T], retries: int) -> T:
    for attempt in range(retries + 1):
        try:
            return fn()
        except TransientError as exc:
            if attempt == retries:
                raise
            delay = 2.0**attempt
            logger.warning("%s; retrying in %.0fs", exc, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
