"""S3 objects for `files.download`: AWS Signature Version 4 (stdlib hmac/hashlib) and a store shaped like `Hub`.

Role: s3:// LoRA adapters are fetched by the engine itself (engine/server/lora_fetch.py), through the same
resume/verify/lock/completion-marker path as hf:// ones (`files.download`): `S3Store` answers `info` (a HEAD
per named object: its size and ETag) and `open_file` (a GET, ranged when resuming) like `Hub` does, and words
each failure for S3.

Invariants: credentials come from the environment the operator gives the pod (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION/AWS_DEFAULT_REGION, AWS_ENDPOINT_URL) and never appear in
a message or log; with no keys requests go unsigned (public buckets); with AWS_ENDPOINT_URL (MinIO and other
S3-compatible stores) URLs are path-style `<endpoint>/<bucket>/<key>`, otherwise virtual-hosted
`https://<bucket>.s3.<region>.amazonaws.com/<key>`; every request (each retry too) is signed afresh at send
time, with the host and every x-amz-* header signed and the payload hash of its (empty) body. A 3xx S3 answers
without a Location (a bucket in another region) is an error that names AWS_REGION, never a body written to disk.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import hmac
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from .hub import DownloadError, Hub, RepoFile, RepoInfo, TransientError

ALGORITHM = "AWS4-HMAC-SHA256"
DEFAULT_REGION = "us-east-1"
REVISION = "latest"  # S3 objects have no revision: the marker records the ETags it fetched
KEY_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@dataclass(frozen=True, slots=True)
class S3Credentials:
    access_key: str
    secret_key: str = ""
    session_token: str | None = None

    def __repr__(self) -> str:  # never the secret in a log or traceback
        return f"S3Credentials(access_key={self.access_key!r}, session_token={'set' if self.session_token else None})"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> S3Credentials | None:
        """The keys in `env`; None when neither is set (anonymous); DownloadError when only one is."""
        access, secret = (env.get(k) or "" for k in KEY_NAMES)
        if not access and not secret:
            return None
        if not access or not secret:
            missing = KEY_NAMES[0] if not access else KEY_NAMES[1]
            raise DownloadError(f"{missing} is not set but the other AWS key is: set both, or neither for anonymous")
        return cls(access, secret, env.get("AWS_SESSION_TOKEN") or None)


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _canonical_query(url: httpx.URL) -> str:
    pairs = sorted((quote(k, safe=""), quote(v, safe="")) for k, v in url.params.multi_items())
    return "&".join(f"{k}={v}" for k, v in pairs)


def sign(request: httpx.Request, creds: S3Credentials, region: str, when: dt.datetime) -> None:
    """Add SigV4's x-amz-date, x-amz-content-sha256, x-amz-security-token and Authorization to `request`."""
    amz_date = when.astimezone(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    request.headers["x-amz-date"] = amz_date
    request.headers["x-amz-content-sha256"] = hashlib.sha256(request.read()).hexdigest()
    if creds.session_token:
        request.headers["x-amz-security-token"] = creds.session_token
    names = sorted({"host", *(k for k in request.headers if k.startswith("x-amz-"))})
    canonical_headers = "".join(f"{k}:{' '.join(request.headers[k].split())}\n" for k in names)
    signed_headers = ";".join(names)
    canonical_request = "\n".join(
        [
            request.method.upper(),
            quote(request.url.path, safe="/"),  # S3 keys are not normalised; '/' stays
            _canonical_query(request.url),
            canonical_headers,
            signed_headers,
            request.headers["x-amz-content-sha256"],
        ]
    )
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    string_to_sign = "\n".join([ALGORITHM, amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest()])
    key = f"AWS4{creds.secret_key}".encode()
    for part in (amz_date[:8], region, "s3", "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    request.headers["Authorization"] = (
        f"{ALGORITHM} Credential={creds.access_key}/{scope}, SignedHeaders={signed_headers}, Signature={signature}"
    )


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class SigV4(httpx.Auth):
    """Signs each request httpx sends with this auth at the time `clock` gives."""

    def __init__(self, creds: S3Credentials, region: str, clock: Callable[[], dt.datetime] = utc_now) -> None:
        self.creds, self.region, self.clock = creds, region, clock

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        sign(request, self.creds, self.region, self.clock())
        yield request


class S3Store(Hub):
    """A bucket's named objects under a prefix, read like a Hub repository (`repo` is "bucket[/prefix]")."""

    def __init__(
        self,
        names: Sequence[str],
        env: Mapping[str, str],
        *,
        secret_name: str | None = None,
        clock: Callable[[], dt.datetime] = utc_now,
        timeout_s: float = 30.0,
    ) -> None:
        self.region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
        self.custom_endpoint = (env.get("AWS_ENDPOINT_URL") or "").rstrip("/") or None
        creds = S3Credentials.from_env(env)
        super().__init__(self.custom_endpoint or f"s3.{self.region}.amazonaws.com", None,
                         secret_name=secret_name, timeout_s=timeout_s)  # fmt: skip
        self.client.follow_redirects = False  # a redirected hop would go unsigned: report the region instead
        self.names = tuple(names)
        self.signed = creds is not None
        self.auth = SigV4(creds, self.region, clock) if creds is not None else None

    def url(self, repo: str, name: str) -> str:
        bucket, _, prefix = repo.partition("/")
        key = quote(f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name, safe="/")
        if self.custom_endpoint:
            return f"{self.custom_endpoint}/{bucket}/{key}"
        return f"https://{bucket}.s3.{self.region}.amazonaws.com/{key}"

    def info(self, repo: str, revision: str) -> RepoInfo:
        """Each named object's size and ETag (a HEAD each: no ListBucket permission needed)."""
        files, etags = [], []
        for name in self.names:
            with self._request("HEAD", self.url(repo, name), repo, revision, file=name, auth=self.auth) as resp:
                if resp.status_code != 200:  # a 3xx S3 did not redirect (no Location): the region is wrong
                    raise self.http_error(resp.status_code, repo, revision, name)
                length = resp.headers.get("content-length")
                etags.append(resp.headers.get("etag", "").strip('"'))
            files.append(RepoFile(name, int(length) if length is not None else None, None))
        return RepoInfo(repo, revision, ",".join(etags) or revision, tuple(files))

    @contextlib.contextmanager
    def open_file(self, info: RepoInfo, name: str, offset: int = 0) -> Iterator[httpx.Response]:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        url = self.url(info.repo, name)
        with self._request("GET", url, info.repo, info.revision, file=name, headers=headers, auth=self.auth) as resp:
            if resp.status_code not in (200, 206, 416):
                raise self.http_error(resp.status_code, info.repo, info.revision, name)
            yield resp

    def unreachable(self, why: str) -> str:
        return (
            f"cannot reach {self.endpoint}: {why}; check the cluster's egress (network policy, proxy, DNS) "
            "and AWS_ENDPOINT_URL / AWS_REGION in the credentials Secret"
        )

    def _key_source(self) -> str:
        where = f" in Secret {self.secret_name}" if self.secret_name else ""
        if not self.signed:
            return f"anonymous requests (no AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY{where})"
        return f"the keys AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN){where}"

    def http_error(self, status: int, repo: str, revision: str, file: str | None = None) -> DownloadError:
        """One line naming the object, the status and what to change."""
        what = f"s3://{repo.rstrip('/')}" + (f"/{file}" if file else "")
        if status in (401, 403):
            return DownloadError(
                f"{status} Forbidden for {what} at {self.endpoint}: {self._key_source()} may not read it (wrong or "
                "expired keys, a bucket policy, or a clock off by more than 15 minutes); check the credentials"
            )
        if status == 404:
            return DownloadError(
                f"404 Not Found for {what} at {self.endpoint}: no such object or bucket; check the adapter's "
                "source (a prefix holding adapter_config.json and adapter_model.safetensors)"
            )
        if status in (301, 307, 400):
            return DownloadError(
                f"HTTP {status} from {self.endpoint} for {what}: the bucket may be in another region; set "
                "AWS_REGION (or AWS_ENDPOINT_URL) in the credentials Secret"
            )
        if status in (429, 503) or status >= 500:
            return TransientError(f"HTTP {status} from {self.endpoint} for {what}; retrying")
        return DownloadError(f"HTTP {status} from {self.endpoint} for {what}")
