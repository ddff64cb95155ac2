"""Images for the dev cluster's real node, built offline and cached (DEV ONLY: production images are
docker/Dockerfile's).

- `pause`: the sandbox image, one static binary (e2e/images/pause, built by e2e/controlplane/build.sh).
- `dev`: a Debian root filesystem (`debootstrap --variant=minbase` + the shared libraries a CPython
  build and torch need, g++ for kernels compiled at first use) WITHOUT Tidepool in it. The project's
  own environment (its Python installation, the virtual environment and the clone, at their host
  paths) is mounted read-only into the pods by the dev cluster (devcluster_addons.py), so a code
  change needs no image rebuild. The image's PATH starts with the venv's bin/, so the operator's
  `command: [tidepool, ...]` runs the mounted venv's `tidepool`.

Cache (`$TIDEPOOL_CACHE/images/`): the root filesystem layer is keyed on the suite, the package list
and this file's recipe version, the pause archive on its binary; the dev archive (the cached layer
plus a config naming the venv) is written where the caller imports it from. A lock serializes
concurrent builders. Archives are OCI image layouts for `ctr -n k8s.io images import` (oci.py).

CLI: python e2e/images/build.py pause --bin-dir DIR | dev [--venv DIR] [--out DIR] | base
     (prints the archive path, then the image ref; `base` builds the cached root filesystem only)
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oci import Layer, image_config, write_archive, write_layer

SUITE = "bookworm"
MIRROR = os.environ.get("TIDEPOOL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# Shared libraries of a CPython build (ssl, ffi, sqlite3, curses, readline, uuid, gdbm, expat, lzma,
# bz2, zlib, nsl, gssapi), torch/numpy (libstdc++, libquadmath), g++ (kernels compiled at first use),
# python3.11 (for a venv made from Debian's own python, whose prefix is /usr and so is not mounted).
PACKAGES = [
    "libbz2-1.0",
    "libexpat1",
    "libffi8",
    "libgdbm6",
    "libgssapi-krb5-2",
    "liblzma5",
    "libncursesw6",
    "libnsl2",
    "libquadmath0",
    "libreadline8",
    "libsqlite3-0",
    "libssl3",
    "libstdc++6",
    "libuuid1",
    "zlib1g",
    "g++",
    "python3.11",
]
RECIPE = "3"  # bump when the root filesystem recipe below changes
RUN_AS_IDS = (1000, 65532)  # the operator's pods (builders/common.py) and docker/Dockerfile's user
REGISTRY = "tidepool.local"


@dataclass(frozen=True, slots=True)
class Image:
    archive: Path
    ref: str


def cache_dir() -> Path:
    root = Path(os.environ.get("TIDEPOOL_CACHE", Path.home() / ".cache" / "tidepool")) / "images"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class _Lock:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *_exc: object) -> None:
        os.close(self.fd)


def pause_image(bin_dir: Path) -> Image:
    binary = bin_dir / "pause"
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} missing: build it with bash e2e/controlplane/build.sh")
    key = hashlib.sha256(binary.read_bytes()).hexdigest()[:16]
    ref = f"{REGISTRY}/pause:{key}"
    out = cache_dir() / f"pause-{key}.tar"
    with _Lock(cache_dir() / ".lock"):
        if not out.exists():
            layer = write_layer(out.with_suffix(".layer"), files={"/pause": (binary, 0o755)})
            config = image_config([layer], ["/pause"], {}, user="65535:65535")
            write_archive(out, ref, [layer], config)
            layer.path.unlink()
    return Image(out, ref)


def _base_layer() -> Layer:
    """The dev engine's Debian root filesystem (debootstrap: ~2.5 min cold, network), cached."""
    return _debootstrap_layer("devbase", PACKAGES, RECIPE, _dev_tweaks)


def _debootstrap_layer(name: str, packages: list[str], recipe: str, finish) -> Layer:
    """A `debootstrap --variant=minbase` root filesystem with `packages`, trimmed and finished by
    `finish(rootfs)`, as one layer; cached on (suite, recipe, packages)."""
    key = _key(SUITE, recipe, *packages)
    layer_path = cache_dir() / f"{name}-{key}.layer"
    meta = layer_path.with_suffix(".json")
    if meta.exists() and layer_path.exists():
        info = json.loads(meta.read_text())
        return Layer(layer_path, info["digest"], info["size"])
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=cache_dir()))
    try:
        rootfs = work / "rootfs"
        print(f"debootstrap {SUITE} ({MIRROR}) into {rootfs}: a few minutes, once per machine", file=sys.stderr)
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE, str(rootfs), MIRROR]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        _trim(rootfs)
        finish(rootfs)
        layer = write_layer(layer_path, root=rootfs)
        meta.write_text(json.dumps({"digest": layer.digest, "size": layer.size, "packages": packages}))
        return layer
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _trim(rootfs: Path) -> None:
    """Drop what a container never uses (apt caches, docs, device nodes: the runtime mounts /dev)."""
    for sub in ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale"):
        shutil.rmtree(rootfs / sub, ignore_errors=True)
    for dev in (rootfs / "dev").iterdir():
        if dev.is_dir() and not dev.is_symlink():
            shutil.rmtree(dev)
        else:
            dev.unlink()


def _dev_tweaks(rootfs: Path) -> None:
    """Let non-root pods traverse to mounts under /root and give their uids a passwd entry."""
    # the host's Python often lives under /root (pyenv): its mount point must be reachable by the pod's uid
    (rootfs / "root").chmod(0o755)
    with open(rootfs / "etc" / "passwd", "a") as fh:  # torch asks getpass.getuser(), which needs an entry
        fh.writelines(f"tidepool{uid}:x:{uid}:{uid}::/tmp:/usr/sbin/nologin\n" for uid in RUN_AS_IDS)
    with open(rootfs / "etc" / "group", "a") as fh:
        fh.writelines(f"tidepool{uid}:x:{uid}:\n" for uid in RUN_AS_IDS)


def python_standin() -> Image:
    """A local stand-in for `python:3.11-slim` (no registry here): Debian's python3.11 + pip, no compiler,
    `python`/`pip` on PATH as in the official image. For e2e/images/check-dockerfile.sh only."""
    packages = ["python3.11", "python3-pip", "ca-certificates"]

    def finish(rootfs: Path) -> None:
        for name, target in (
            ("python", "/usr/bin/python3.11"),
            ("python3", "/usr/bin/python3.11"),
            ("pip", "/usr/bin/pip3"),
        ):
            link = rootfs / "usr" / "local" / "bin" / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)

    with _Lock(cache_dir() / ".lock"):
        layer = _debootstrap_layer("pystandin", packages, "1", finish)
        env = {
            "PATH": "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            # Debian marks its python "externally managed"; the official image's is not
            "PIP_BREAK_SYSTEM_PACKAGES": "1",
        }
        config = image_config([layer], [], env)
        config["config"]["Cmd"] = ["python3"]
        ref = f"{REGISTRY}/python-standin:{_key(layer.digest, json.dumps(config, sort_keys=True))}"
        out = cache_dir() / f"python-standin-{ref.rsplit(':', 1)[1]}.tar"
        if not out.exists():
            write_archive(out, ref, [layer], config)
    return Image(out, ref)


def dev_image(venv: Path, out_dir: Path) -> Image:
    """The dev engine image for this venv (its bin/ first on PATH), written to `out_dir` for one import:
    only the root filesystem layer is cached; the venv itself is mounted at run time."""
    venv = venv.resolve()
    with _Lock(cache_dir() / ".lock"):
        base = _base_layer()
    path = f"{venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env = {"PATH": path, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    config = image_config([base], ["tidepool"], env, user="65532:65532")
    ref = f"{REGISTRY}/dev-engine:{_key(base.digest, json.dumps(config, sort_keys=True))}"
    out = out_dir / "dev-engine.tar"
    write_archive(out, ref, [base], config)
    return Image(out, ref)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "image", choices=("pause", "dev", "base", "python-standin"), help="base: only the dev root filesystem"
    )
    parser.add_argument("--bin-dir", type=Path, help="where build.sh put `pause` (pause image)")
    parser.add_argument("--venv", type=Path, default=Path(sys.prefix), help="venv on the image's PATH (dev image)")
    parser.add_argument("--out", type=Path, default=Path.cwd(), help="folder for the dev archive (default: cwd)")
    args = parser.parse_args(argv)
    if args.image == "base":
        with _Lock(cache_dir() / ".lock"):
            layer = _base_layer()
        print(layer.path)
        return 0
    if args.image == "python-standin":
        image = python_standin()
    elif args.image == "pause":
        if args.bin_dir is None:
            parser.error("pause needs --bin-dir")
        image = pause_image(args.bin_dir)
    else:
        image = dev_image(args.venv, args.out)
    print(image.archive)
    print(image.ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
