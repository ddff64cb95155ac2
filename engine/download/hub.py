"""The two Hugging Face Hub HTTP calls `tidepool download` makes, and what each failure tells an admin.

Invariants: the token is sent only as an Authorization header to the endpoint (httpx drops it on a
redirect to another host, such as the Hub's CDN) and never appears in a message or log; every
failure is a `DownloadError` whose message is one line naming what to change (the Secret and key,
the spec field, the network); `TransientError` marks the ones worth retrying in-process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from tidepool.contract.download import HF_ENDPOINT as DEFAULT_ENDPOINT


class DownloadError(Exception):
    """A download that cannot succeed as configured; the message says what to change (one line)."""


class TransientError(DownloadError):
    """A failure that may pass on its own (server error, rate limit, broken connection): retried."""


@dataclass(frozen=True, slots=True)
class RepoFile:
    name: str  # path inside the repository
    size: int | None  # bytes, when the Hub reports it
    sha256: str | None  # LFS files only: the content's sha256


@dataclass(frozen=True, slots=True)
class RepoInfo:
    repo: str
    revision: str  # as asked (branch, tag or commit)
    sha: str  # the commit it resolved to
    files: tuple[RepoFile, ...]


class Hub:
    """A Hub endpoint (or mirror) with an optional token; `secret_name` only words the messages."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        token: str | None = None,
        *,
        secret_name: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.secret_name = secret_name
        self.has_token = bool(token)
        headers = {"User-Agent": "tidepool-download/1"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.client = httpx.Client(headers=headers, timeout=timeout_s, follow_redirects=True)

    def close(self) -> None:
        self.client.close()

    def info(self, repo: str, revision: str) -> RepoInfo:
        """The revision's commit and files (sizes; sha256 of LFS files)."""
        url = f"{self.endpoint}/api/models/{repo}/revision/{quote(revision, safe='')}"
        with self._request("GET", url, repo, revision, params={"blobs": "true"}) as resp:
            resp.read()
            body = resp.json()
        files = []
        for sib in body.get("siblings") or []:
            lfs = sib.get("lfs") or {}
            size = lfs.get("size", sib.get("size"))
            files.append(RepoFile(sib["rfilename"], int(size) if size is not None else None, lfs.get("sha256")))
        return RepoInfo(repo, revision, body.get("sha") or revision, tuple(files))

    @contextlib.contextmanager
    def open_file(self, info: RepoInfo, name: str, offset: int = 0) -> Iterator[httpx.Response]:
        """A streaming response for one file of the resolved commit, from `offset` (206) or whole (200)."""
        url = f"{self.endpoint}/{info.repo}/resolve/{info.sha}/{quote(name)}"
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        with self._request("GET", url, info.repo, info.revision, headers=headers, file=name) as resp:
            yield resp

    @contextlib.contextmanager
    def _request(
        self, method: str, url: str, repo: str, revision: str, file: str | None = None, **kwargs
    ) -> Iterator[httpx.Response]:
        try:
            with self.client.stream(method, url, **kwargs) as resp:
                if resp.status_code >= 400 and resp.status_code != 416:
                    raise self.http_error(resp.status_code, repo, revision, file)
                yield resp
        except httpx.TimeoutException as exc:
            raise TransientError(self.unreachable(f"timed out ({type(exc).__name__})")) from None
        except httpx.ConnectError as exc:
            raise TransientError(self.unreachable(f"ConnectError: {exc}")) from None
        except httpx.TransportError as exc:  # the connection broke mid-response
            where = f" during {file}" if file else ""
            raise TransientError(
                f"the connection to {self.endpoint} broke{where} ({type(exc).__name__}: {exc}); the next attempt "
                "resumes where it stopped"
            ) from None

    def unreachable(self, why: str) -> str:
        return (
            f"cannot reach {self.endpoint}: {why}; check the cluster's egress (network policy, proxy, DNS) "
            "or set HF_ENDPOINT in the credentials Secret to a reachable mirror"
        )

    def _token_source(self) -> str:
        if self.secret_name:
            return f"the token in Secret {self.secret_name} key HF_TOKEN"
        return "the token in HF_TOKEN" if self.has_token else "no token (HF_TOKEN unset)"

    def http_error(self, status: int, repo: str, revision: str, file: str | None = None) -> DownloadError:
        """The message an admin can act on, per status."""
        what = f"{repo}@{revision}" + (f" file {file}" if file else "")
        if status == 401:
            if self.secret_name:
                why = f"the token in Secret {self.secret_name} key HF_TOKEN is missing or invalid"
            elif self.has_token:
                why = "the token in HF_TOKEN is invalid"
            else:
                why = (
                    "no token was given and the repository is private, gated or does not exist; set "
                    "spec.model.credentials.secretName to a Secret with key HF_TOKEN, or check spec.model.uri"
                )
            return DownloadError(f"401 Unauthorized for {what} at {self.endpoint}: {why}")
        if status == 403:
            return DownloadError(
                f"403 Forbidden for {what}: the model is gated or the token may not read it; accept its licence "
                f"at {self.endpoint}/{repo} with the account of {self._token_source()} (a fine-grained token also "
                "needs read access to gated repositories)"
            )
        if status == 404:
            return DownloadError(
                f"404 Not Found for {what} at {self.endpoint}: the repository or revision does not exist; "
                "check spec.model.uri and spec.model.revision"
            )
        if status == 429:
            return TransientError(
                f"429 Too Many Requests from {self.endpoint}: rate-limited; give a token (spec.model.credentials) "
                "and share the download through a ReadWriteMany spec.modelCache.persistentVolumeClaim"
            )
        if status >= 500:
            return TransientError(f"{status} server error from {self.endpoint} for {what}; the pod retries")
        return DownloadError(f"HTTP {status} from {self.endpoint} for {what}")
