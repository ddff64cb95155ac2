"""What an engine outcome becomes on the wire: the OpenAI-shaped `APIError` of a failure, and its SSE event.

(A streamed token's event lines are sse.py's.)

Role: one mapping from the engine's exceptions and final outputs to HTTP answers, shared by the
JSON and the streaming paths of serving.py, so a failure reads the same either way:
- a shutdown (drain deadline, second signal) -> 503 `service_unavailable` with the shutdown's code;
- the engine died -> 500 `engine_dead`; the engine failed on this request alone -> 500 `request_failed`;
- the engine rejected the request -> 400; an adapter refused (`LoRAError`) -> its own status (400/404) and code;
- refused at submission: the queue is full -> 429 with Retry-After; the engine is dead -> 503.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import TypeVar

from ..lora.types import LoRAError
from ..outputs import RequestOutput
from .async_engine import EngineDeadError, QueueFullError, RequestRejectedError, RequestStream, ShutdownError
from .protocol import APIError

T = TypeVar("T")


async def answering_shutdown(handler: Awaitable[T]) -> T:
    """Run a request's handler (or a step of it); a shutdown that ends it before it streams becomes its 503."""
    try:
        return await handler
    except ShutdownError as err:
        raise engine_error(err) from err


def finish_error(out: RequestOutput, stream: RequestStream) -> APIError | None:
    """Why a finished engine request is a failure, if it is: the engine failed on it, or a shutdown aborted it."""
    if out.error is not None:
        return APIError(f"the engine failed on this request ({out.error}); other requests were not affected",
                        status_code=500, type="internal_error", code="request_failed")  # fmt: skip
    if stream.shutdown_error is not None and out.outputs and out.outputs[0].finish_reason == "abort":
        return engine_error(stream.shutdown_error)
    return None


def engine_error(err: BaseException) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, ShutdownError):
        return APIError(str(err), status_code=503, type="service_unavailable", code=err.code)
    if isinstance(err, EngineDeadError):
        return APIError(str(err), status_code=500, type="internal_error", code="engine_dead")
    if isinstance(err, RequestRejectedError):
        return APIError(str(err), status_code=400)
    if isinstance(err, LoRAError):
        return APIError(str(err), status_code=err.status, param=err.param, code=err.code)
    return APIError(f"the engine failed on this request: {err!r}", status_code=500, type="internal_error",
                    code="request_failed")  # fmt: skip


def refusal(err: QueueFullError | EngineDeadError) -> APIError:
    """Why a request was not even queued: the queue is full (retry after a while) or the engine is dead."""
    if isinstance(err, QueueFullError):
        return APIError(str(err), status_code=429, type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(err.retry_after_s)})  # fmt: skip
    return APIError(str(err), status_code=503, type="service_unavailable", code="engine_dead")


def error_event(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"
