"""Helpers that more than one Tidepool process runs and that belong to none of them.

- `tcp_tuning`: uvicorn's HTTP protocol with TCP_NODELAY/TCP_QUICKACK, used by `tidepool serve`
  and the router.

Invariant: imports nothing from the engine, the router or the operator.
"""
