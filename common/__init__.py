"""Helpers that more than one Tidepool process runs and that belong to none of them.

- `tcp_tuning`: uvicorn's HTTP protocol with TCP_NODELAY/TCP_QUICKACK, used by `tidepool serve`
  and the router.
- `api_key`: API keys (`--api-key`, `--api-key-file`, $TIDEPOOL_API_KEY), the ASGI check both apps put
  in front, and the httpx auth the router's own calls to engines use.
- `graceful`: SIGTERM drains, then exit 0 (uvicorn's server without the re-raised signal); the router's
  in-flight counter.
- `asgi_reply`: OpenAI-shaped refusals sent from raw ASGI middleware.

Invariant: imports nothing from the engine, the router or the operator.
"""
