"""The client side of API keys: `ApiKeyAuth`, the httpx auth the router's own calls to engines use.

Role: kept apart from common/api_key.py (the keys and the server-side check) so that `tidepool serve`,
which only checks keys, never imports httpx at start; `tidepool.common.api_key.ApiKeyAuth` still
resolves here (a lazy module attribute), so existing imports keep working.

Invariant: a request that already carries `Authorization` or `x-api-key` (a client's, forwarded by
the router) is sent unchanged; any other gets the first valid key as a bearer token, read at each
request so a rotated key file is followed.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Protocol

import httpx


class KeySource(Protocol):
    """What the auth reads a key from: `tidepool.common.api_key.ApiKeys` (not imported: no cycle back to it)."""

    def first(self) -> str: ...


class ApiKeyAuth(httpx.Auth):
    """httpx auth that sends the first of `keys` as a bearer token on requests that carry no key of their own.

    The router's client: its own calls to engines (health, metrics, model lists) carry the router's key;
    a client's request it forwards keeps the client's `Authorization` (or `x-api-key`) unchanged.
    The key is read at each request, so a rotated key file is followed.
    """

    def __init__(self, keys: KeySource) -> None:
        self.keys = keys

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if "authorization" not in request.headers and "x-api-key" not in request.headers:
            request.headers["Authorization"] = f"Bearer {self.keys.first()}"
        yield request
