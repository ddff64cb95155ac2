"""`tidepool download hf://org/name --dest DIR`: the engine pods' download step (see the package docstring).

Credentials come from the environment only (HF_TOKEN, HF_ENDPOINT; a flag would show in the pod spec
and in `ps`). On failure the one-line reason goes to stderr and to the termination message file
(`--termination-log`, default $TIDEPOOL_TERMINATION_LOG or /dev/termination-log, which the kubelet
turns into the container's `state.terminated.message`), and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tidepool.contract.download import HF_DEFAULT_REVISION, SECRET_NAME_ENV, TERMINATION_LOG, TERMINATION_LOG_ENV

from .files import download
from .hub import DEFAULT_ENDPOINT, DownloadError, Hub

MAX_MESSAGE = 4096  # the kubelet keeps at most this many bytes of a termination message


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool download", description=__doc__.split("\n", 1)[0])
    parser.add_argument("uri", help="hf://org/name")
    parser.add_argument("--dest", required=True, help="folder to fill (a completion marker makes reruns skip)")
    parser.add_argument(
        "--revision", default=HF_DEFAULT_REVISION, help=f"branch, tag or commit (default: {HF_DEFAULT_REVISION})"
    )
    parser.add_argument("--include", action="append", default=[], help="only files matching this glob (repeatable)")
    parser.add_argument("--endpoint", default=None, help=f"Hub endpoint (default: $HF_ENDPOINT or {DEFAULT_ENDPOINT})")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per connect/read (default 30)")
    parser.add_argument("--retries", type=int, default=3, help="in-process retries of transient failures")
    parser.add_argument(
        "--termination-log",
        default=os.environ.get(TERMINATION_LOG_ENV, TERMINATION_LOG),
        help="file that receives the one-line failure reason (the container's termination message path)",
    )
    return parser


def _repo(uri: str) -> str:
    scheme, sep, rest = uri.partition("://")
    repo = rest.strip("/")
    if scheme != "hf" or not sep or repo.count("/") != 1:
        raise DownloadError(f"{uri!r} is not an hf://org/name URI; check spec.model.uri")
    return repo


def write_reason(path: str, message: str) -> None:
    """The termination message: one line, within the kubelet's limit; a path we cannot write is skipped."""
    line = " ".join(message.split()).encode()[:MAX_MESSAGE].decode(errors="ignore")
    with contextlib.suppress(OSError):
        Path(path).write_text(line)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    endpoint = args.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    try:
        repo = _repo(args.uri)
        hub = Hub(
            endpoint,
            os.environ.get("HF_TOKEN") or None,
            secret_name=os.environ.get(SECRET_NAME_ENV) or None,
            timeout_s=args.timeout,
        )
        try:
            download(hub, repo, args.revision, Path(args.dest), args.include, retries=args.retries)
        finally:
            hub.close()
    except DownloadError as err:
        message = f"{err}"
    except OSError as err:  # the cache volume itself: permissions, a read-only mount
        message = f"cannot write the model cache {args.dest}: {err.strerror or err}"
    else:
        return 0
    print(f"tidepool download: error: {message}", file=sys.stderr)
    write_reason(args.termination_log, message)
    return 1


if __name__ == "__main__":
    sys.exit(main())
