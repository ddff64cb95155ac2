"""API keys for `tidepool serve` and `tidepool router`: the valid keys, the check in front of the app.

The client side (`ApiKeyAuth`, an httpx auth) lives in api_key_auth.py, imported on first use of the
name here, so a server that only checks keys never imports httpx.

Keys come from `--api-key KEY` (repeatable), `--api-key-file PATH` (one key a line; blank lines and
lines starting with `#` are ignored) and, only when neither flag is given, `$TIDEPOOL_API_KEY` (as vLLM
reads VLLM_API_KEY). `--api-key` shows the key in the process list; the file (a mounted Secret) or the
variable do not. No key from any source means no authentication, as in vLLM without `--api-key`.

A client presents a key as `Authorization: Bearer <key>` (what OpenAI's SDKs send) or as
`x-api-key: <key>`. `ApiKeyMiddleware` asks for one on every path except `OPEN_PATHS`: the probes and
the scrapers (`/health`, `/ready`, `/live`, `/metrics`, `/version`), because the kubelet and Prometheus
send no credentials, a pod that fails its probes is restarted, and an engine whose metrics cannot be
scraped is never scaled; those paths reveal load and liveness, never a prompt or an output. Everything
else (the OpenAI API under /v1, vLLM's /tokenize and /detokenize, the LoRA admin endpoints, /debug/*,
the OpenAPI docs) answers 401 without a valid key, with OpenAI's body
(`{"error": {"message", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}`,
as api.openai.com answers a wrong key; vLLM answers `{"error": "Unauthorized"}`) and
`WWW-Authenticate: Bearer` (RFC 6750).

Invariants:
- The check takes the same time whichever key matches and however much of one does: the presented
  key is hashed (SHA-256) and its digest compared with `hmac.compare_digest` to every valid key's
  digest, all of them, with no early exit (equal lengths: nothing leaks through the key's length).
- A key file is re-read when its (mtime, size, inode) changes, looked at no more than once per
  `reload_interval_s` (the kubelet rotates a mounted Secret in place by swapping a symlink). A re-read
  that fails or finds no key keeps the keys held before (closed, never open, while a file is briefly
  missing or empty) and logs a warning; a file that is missing or holds no key at start is an error.
- A key is printable ASCII without spaces (what an HTTP header carries unchanged); keys are never
  logged and never echoed in an error.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .asgi_reply import Receive, Send, error_body, refuse

if TYPE_CHECKING:
    from .api_key_auth import ApiKeyAuth as ApiKeyAuth  # resolved lazily by __getattr__ at run time

logger = logging.getLogger(__name__)

ENV_VAR = "TIDEPOOL_API_KEY"
OPEN_PATHS = frozenset({"/health", "/ready", "/live", "/metrics", "/version"})
RELOAD_INTERVAL_S = 1.0
_UNAUTHORIZED_HEADERS = {"www-authenticate": "Bearer"}


class ApiKeyError(ValueError):
    """A key source that cannot be used (a missing or empty file, a malformed key); the message names the flag."""


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _check_key(key: str, where: str) -> str:
    if not key or not all("!" <= ch <= "~" for ch in key):
        raise ApiKeyError(f"{where}: an API key must be printable ASCII without spaces")
    return key


def read_key_file(path: Path) -> list[str]:
    """The keys of a key file, in order; ApiKeyError naming `--api-key-file` if it cannot be read or holds none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ApiKeyError(f"--api-key-file {path}: cannot read it ({type(err).__name__}: {err})") from None
    return parse_keys(text, f"--api-key-file {path}")


def parse_keys(text: str, where: str) -> list[str]:
    """The keys of a key file's text, in order (the operator reads a Secret's value with it too);
    ApiKeyError starting with `where` if a line is malformed or there is no key."""
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(_check_key(line, f"{where} line {number}"))
    if not keys:
        raise ApiKeyError(f"{where}: holds no key (one key a line; blank and # lines are ignored)")
    return keys


@dataclass(frozen=True, slots=True)
class _KeySet:
    keys: tuple[str, ...]  # in order: the first is the one a client of ours sends
    digests: tuple[bytes, ...]  # SHA-256 of each key


def _key_set(keys: Iterable[str]) -> _KeySet:
    ordered = tuple(dict.fromkeys(keys))
    return _KeySet(ordered, tuple(_digest(k.encode("ascii")) for k in ordered))


def _file_signature(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()  # follows the Secret volume's ..data symlink: a rotation is a new inode
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


class ApiKeys:
    """The valid keys: fixed ones plus, optionally, a key file watched for changes."""

    def __init__(
        self,
        keys: Sequence[str] = (),
        key_file: Path | None = None,
        reload_interval_s: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fixed = [_check_key(k, "--api-key") for k in keys]
        self._file = key_file
        self._reload_interval_s = reload_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # the router's and the server's checks run on one loop; clients may not
        self._signature = _file_signature(key_file) if key_file is not None else None
        file_keys = read_key_file(key_file) if key_file is not None else []
        self._set = _key_set([*self._fixed, *file_keys])
        self._checked_at = clock()

    @classmethod
    def from_flags(
        cls, api_key: Sequence[str] | None, api_key_file: str | None, environ: dict[str, str] | None = None
    ) -> ApiKeys | None:
        """The keys `--api-key`, `--api-key-file` and (when neither is given) $TIDEPOOL_API_KEY name; None if none.

        Raises ApiKeyError naming the flag for a file that cannot be read or holds no key, or a malformed key.
        """
        keys = list(api_key or [])
        if not keys and not api_key_file:
            env_key = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
            if not env_key:
                return None
            return cls([_check_key(env_key, f"${ENV_VAR}")])
        return cls(keys, Path(api_key_file) if api_key_file else None)

    def _current(self) -> _KeySet:
        if self._file is None:
            return self._set
        now = self._clock()
        if now - self._checked_at < self._reload_interval_s:
            return self._set
        with self._lock:
            if now - self._checked_at >= self._reload_interval_s:
                self._checked_at = now
                self._reload()
        return self._set

    def _reload(self) -> None:
        assert self._file is not None  # only called with a file
        signature = _file_signature(self._file)
        if signature == self._signature:
            return
        try:
            file_keys = read_key_file(self._file)
        except ApiKeyError as err:
            logger.warning("keeping the API keys held before: %s", err)
            return  # the signature stays old: the next look re-reads it
        self._signature = signature
        self._set = _key_set([*self._fixed, *file_keys])
        logger.info("API keys re-read from %s: %d key(s)", self._file, len(self._set.keys))

    @property
    def num_keys(self) -> int:
        return len(self._current().keys)

    def first(self) -> str:
        """The key a client of ours sends (the first one given)."""
        return self._current().keys[0]

    def is_valid(self, presented: bytes) -> bool:
        """Whether `presented` is one of the keys, in the same time whichever matches (see the module's invariants)."""
        digest = _digest(presented)
        is_match = False
        for valid in self._current().digests:
            is_match |= hmac.compare_digest(valid, digest)
        return is_match


def presented_keys(headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys a request presents: `Authorization: Bearer <key>` and `x-api-key: <key>` (raw ASGI headers)."""
    found = []
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                found.append(token.strip())
        elif name == b"x-api-key" and value.strip():
            found.append(value.strip())
    return found


class ApiKeyMiddleware:
    """ASGI middleware: requests outside `open_paths` need a valid key, else 401 (see the module docstring)."""

    def __init__(self, app: Any, keys: ApiKeys, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        presented = presented_keys(scope["headers"])
        if any([self.keys.is_valid(key) for key in presented]):  # a list: every presented key is checked
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: the client sees 403
            return
        await refuse(receive, send, 401, unauthorized_body(bool(presented)), _UNAUTHORIZED_HEADERS)


def unauthorized_body(was_presented: bool) -> bytes:
    """The 401 body: OpenAI's shape, never echoing what the client sent."""
    if was_presented:
        message = "Incorrect API key provided."
    else:
        message = ("You didn't provide an API key. Send it as an `Authorization: Bearer <key>` header "
                   "(or `x-api-key: <key>`).")  # fmt: skip
    return error_body(message, "invalid_request_error", "invalid_api_key")


def __getattr__(name: str) -> Any:
    """`ApiKeyAuth` (common/api_key_auth.py), imported on first use: it needs httpx, which the server never does."""
    if name == "ApiKeyAuth":
        from .api_key_auth import ApiKeyAuth

        return ApiKeyAuth
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
