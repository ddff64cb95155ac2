"""The HTTP side of prefill/decode disaggregation: `kv_transfer_params` on completions and chat.

The router (tidepool.router) drives the hand-off; an engine started with
`--role prefill` or `--role decode` honours it:
- producer (`{"role": "producer", "transfer_id", "decode_kv_addr"}`) on a prefill engine:
  the request must be non-streaming with `max_tokens=1` and one prompt; the response is sent
  once the decode engine acknowledged the KV, and echoes `kv_transfer_params` with
  `"status": "sent"`. A failed transfer answers 502 (nothing streamed, so the router may retry).
- consumer (`{"role": "consumer", "transfer_id"}`) on a decode engine: waits (without holding a
  thread) for the transfer, checks it was prefilled for this very prompt, then generates from the
  first token on; the response is an ordinary completion, streamed or not. No transfer within
  the timeout answers 504.
Every check happens before anything is queued, so a refused request costs no KV blocks. The
engine is reached only through its read-only `EngineInfo` (its role and the KV connector's
event-loop entry points), never from the HTTP thread directly.
"""

from __future__ import annotations

from typing import Any

from ..kv_transfer import KVTransferError, ProducerParams, parse_kv_transfer_params
from .commands import Child
from .engine_info import EngineInfo
from .protocol import APIError, SamplingRequest


async def attach_kv_transfer(info: EngineInfo, req: SamplingRequest, children: list[Child]) -> ProducerParams | None:
    """Validate `req.kv_transfer_params` and attach the transfer to the (single) child; returns producer params."""
    raw = req.kv_transfer_params
    if raw is None:
        return None
    try:
        params = parse_kv_transfer_params(raw)
    except ValueError as err:
        raise APIError(str(err), param="kv_transfer_params") from err
    role = info.role
    wanted = "prefill" if isinstance(params, ProducerParams) else "decode"
    if role != wanted:
        raise APIError(
            f"kv_transfer_params role {raw.get('role')!r} needs an engine started with --role {wanted}; "
            f"this one runs --role {role}",
            param="kv_transfer_params",
        )
    if len(children) != 1:
        raise APIError("a disaggregated request takes exactly one prompt and n=1", param="kv_transfer_params")
    child = children[0]
    if child.params.logprobs is not None:
        raise APIError("logprobs are not supported for disaggregated requests yet", param="logprobs")
    if child.params.prompt_logprobs is not None:  # the prompt is computed on another engine than the one answering
        raise APIError("prompt logprobs (prompt_logprobs, or echo with logprobs) are not supported for "
                       "disaggregated requests", param="prompt_logprobs")  # fmt: skip
    if child.params.max_tokens == 0:
        raise APIError("max_tokens=0 is not supported for disaggregated requests", param="max_tokens")
    if isinstance(params, ProducerParams):
        if req.stream:
            raise APIError("a prefill (producer) request must not stream", param="stream")
        if child.params.max_tokens != 1:
            raise APIError("a prefill (producer) request must set max_tokens=1", param="max_tokens")
        child.kv_transfer = params
        return params
    if info.kv_receive is None:
        raise APIError("this engine cannot receive KV", status_code=500, type="internal_error")
    try:
        payload = await info.kv_receive(params.transfer_id, info.kv_transfer_timeout)
    except KVTransferError as err:
        raise APIError(str(err), status_code=504, type="kv_transfer_error", code="kv_transfer_timeout") from err
    if payload.prompt_token_ids != child.prompt_token_ids:
        raise APIError(
            f"KV transfer {params.transfer_id} was prefilled for a different prompt; send the same body to the "
            "prefill and the decode engine",
            param="kv_transfer_params",
        )
    child.kv_transfer = payload
    return None


async def wait_sent(info: EngineInfo, params: ProducerParams) -> dict[str, Any]:
    """Await the decode engine's acknowledgement; the `kv_transfer_params` echoed in the response."""
    if info.kv_wait_sent is None:
        raise APIError("this engine cannot send KV", status_code=500, type="internal_error")
    try:
        await info.kv_wait_sent(params.transfer_id)
    except KVTransferError as err:
        raise APIError(str(err), status_code=502, type="kv_transfer_error", code="kv_transfer_failed") from err
    return {"role": "producer", "transfer_id": params.transfer_id, "decode_kv_addr": params.decode_kv_addr,
            "status": "sent"}  # fmt: skip
