"""Forwarding one client request: choose replica(s), send, retry while nothing was streamed, relay.

Unified mode: the pool's policy picks a replica; the request goes there as is.

Disaggregated mode (both a prefill and a decode pool) — the hand-off protocol, a contract
with the engine side (`kv_transfer_params` in the request body):
1. pick a prefill replica P (the router's policy over the prefill pool) and a decode
   replica D (least-load over the decode pool); make `transfer_id` = uuid4 hex;
2. POST to P the client's body with `stream=false`, `max_tokens=1` (`max_completion_tokens`,
   `min_tokens` and `stream_options` removed) and
   `"kv_transfer_params": {"role": "producer", "transfer_id": ID, "decode_kv_addr": "HOST:PORT"}`
   (D's KV listener, from discovery). P computes the prompt's KV and first token, pushes them
   to D, and answers a normal completion whose `kv_transfer_params` echoes the params with
   `"status": "sent"` once D has them. Any other answer is a failed attempt;
3. POST to D the client's original body plus
   `"kv_transfer_params": {"role": "consumer", "transfer_id": ID}`. D takes the transferred
   KV and first token (already there when P answered; D should wait briefly for it anyway and
   drop transfers nobody claims after a timeout), resumes generation without recomputing,
   and answers exactly as a unified engine would (stream or not, its output including the
   first token). That answer is relayed to the client. P's answer is discarded.
A `kv_transfer_params` sent by the client is replaced. A failure at P, or at D before a byte
was relayed, retries the whole hand-off with a new transfer id on replicas not yet tried.

LoRA (both modes): the request's `model` is forwarded unchanged to every replica (prefill and
decode alike select the same adapter by it), and each pool prefers its replicas that hold the
adapter (see `lora` and `Pool.choose`); affinity hits and misses are counted per pool.

Tokenizer calls (`/tokenize`, `/detokenize`) are forwarded as they are to one replica of the
serving pool (unified, or decode when disaggregated), chosen by that pool's policy like any
request: they need no hand-off, only the served model's tokenizer, which every replica has.

Retries (both modes): a connection error, a 5xx or a 429 before any byte reached the client
is retried on another replica, at most `max_retries` times; the last upstream error (or a
502) is then returned. A stream is relayed event by event (SSE events are never split);
once the first event went out a failure ends the stream with an OpenAI-style error event
and `data: [DONE]`, never a retry. A client that disconnects closes the upstream request,
and the engine aborts it. A request whose pool has no ready replica is held (see `Pool`)
for `hold_timeout_s`, then answered 503. A 503 whose error code says the engine sleeps
(contract.sleep.SLEEPING_CODE: slept by the operator before the health probe saw it) marks that
replica unready and keeps it a candidate, so the retry is held until the pool is woken.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .metrics import RouterMetrics
from .policy import Choice, LeastLoadPolicy, Policy
from .pool import NoReplicaError, Pool, Replica
from .prefix import prefix_key, prompt_text
from .upstream import (
    CLIENT_CLOSED,
    FORWARDED_HEADERS,
    RELAYED_HEADERS,
    REPLICA_HEADER,
    ClientGone,
    UpstreamFailure,
    error_response,
    sse_events,
    unless_disconnected,
)

logger = logging.getLogger(__name__)

TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})  # no generation: never a prefill/decode hand-off


@dataclass(slots=True)
class ProxySettings:
    hold_timeout_s: float = 30.0
    max_retries: int = 2
    prefix_block_chars: int = 64
    prefix_max_blocks: int = 4


@dataclass(slots=True)
class Call:
    """One client request on its way through the router."""

    path: str  # /v1/completions, /v1/chat/completions, /tokenize or /detokenize
    body: dict[str, Any]  # the client's JSON body
    raw: Request  # to notice the client's disconnect
    key: bytes | None  # prefix key (prefix.prefix_key)
    headers: dict[str, str]  # forwarded to replicas
    start: float  # time.monotonic() at arrival
    deadline: float  # end of holding at zero replicas
    tried: dict[str, set[str]] = field(default_factory=dict)  # pool -> replica URLs that failed this request
    attempt: int = 0

    def exclude(self, pool: Pool) -> frozenset[str]:
        return frozenset(self.tried.setdefault(pool.name, set()))


class Proxy:
    def __init__(
        self, pools: dict[str, Pool], client: httpx.AsyncClient, metrics: RouterMetrics, settings: ProxySettings
    ) -> None:
        self.pools = pools
        self.client = client
        self.metrics = metrics
        self.settings = settings
        self.decode_policy = LeastLoadPolicy()

    @property
    def is_disaggregated(self) -> bool:
        return "prefill" in self.pools

    @property
    def serving_pool(self) -> Pool:
        """The pool whose replicas answer clients: decode when disaggregated, else unified."""
        return self.pools["decode" if self.is_disaggregated else "unified"]

    async def forward(self, path: str, body: dict[str, Any], raw: Request) -> Response:
        settings = self.settings
        start = time.monotonic()
        call = Call(
            path,
            body,
            raw,
            prefix_key(prompt_text(path, body), settings.prefix_block_chars, settings.prefix_max_blocks),
            {name: raw.headers[name] for name in FORWARDED_HEADERS if name in raw.headers},
            start,
            start + settings.hold_timeout_s,
        )
        last: UpstreamFailure | None = None
        pool_name = self.serving_pool.name
        try:
            for call.attempt in range(settings.max_retries + 1):
                try:
                    if self.is_disaggregated and path not in TOKENIZER_PATHS:
                        return await self._disaggregated(call)
                    return await self._direct(call)
                except UpstreamFailure as failure:
                    last, pool_name = failure, failure.pool
                    if not failure.is_asleep:  # a sleeping replica serves again once woken: held, not excluded
                        call.tried.setdefault(failure.pool, set()).add(failure.replica)
                    logger.warning("attempt %d of %s failed: %s", call.attempt + 1, path, failure.message)
        except NoReplicaError as err:
            if err.is_timeout:
                message = (
                    f"{err}: held for {settings.hold_timeout_s:g} s waiting for one "
                    "(the pool may be scaling up from zero); retry later"
                )
                response = error_response(503, message, "service_unavailable", "no_ready_replica", {"Retry-After": "1"})
                return self._finish(call, pool_name, "", response)
        except ClientGone:
            return self._finish(call, pool_name, "", Response(status_code=CLIENT_CLOSED))
        return self._finish(call, pool_name, "", self._give_up(last))

    def _give_up(self, last: UpstreamFailure | None) -> Response:
        if last is not None and last.status is not None and last.content:
            return Response(last.content, last.status, last.headers, media_type="application/json")
        message = f"no replica could serve the request: {last.message if last else 'no attempt was made'}"
        return error_response(502, message, "bad_gateway", "upstream_failed")

    def _finish(self, call: Call, pool: str, replica: str, response: Response) -> Response:
        self.metrics.observe(pool, replica, str(response.status_code), time.monotonic() - call.start)
        return response

    async def _acquire(self, pool: Pool, call: Call, key: bytes | None, policy: Policy | None = None) -> Replica:
        replica, choice = await pool.acquire(key, call.deadline, call.exclude(pool), policy, call.body.get("model"))
        self._note(pool, choice, call)
        return replica

    def _note(self, pool: Pool, choice: Choice, call: Call) -> None:
        if choice.reason == "prefix_fallback":
            self.metrics.prefix_fallbacks.labels(pool.name).inc()
        if choice.affinity is not None:
            counter = self.metrics.lora_affinity_hits if choice.affinity == "hit" else self.metrics.lora_affinity_misses
            counter.labels(pool.name).inc()
        if call.attempt and pool is self.serving_pool:  # one retry per repeated attempt
            self.metrics.retries.labels(pool.name).inc()

    async def _direct(self, call: Call) -> Response:
        """The request as it is to one replica of the serving pool (unified mode, or a tokenizer call)."""
        pool = self.serving_pool
        replica = await self._acquire(pool, call, call.key)
        return await self._send(pool, replica, call, call.body)

    async def _disaggregated(self, call: Call) -> Response:
        prefill, decode = self.pools["prefill"], self.pools["decode"]
        producer = await self._acquire(prefill, call, call.key)
        try:
            consumer = await self._acquire(decode, call, None, self.decode_policy)
        except BaseException:
            prefill.release(producer)
            raise
        transfer_id = uuid.uuid4().hex
        try:
            refusal = await self._prefill(prefill, producer, consumer, call, transfer_id)
        except BaseException:
            decode.release(consumer)
            raise
        if refusal is not None:
            decode.release(consumer)
            return self._finish(call, prefill.name, producer.label, refusal)
        consumer_body = {**call.body, "kv_transfer_params": {"role": "consumer", "transfer_id": transfer_id}}
        return await self._send(decode, consumer, call, consumer_body)

    async def _prefill(
        self, pool: Pool, producer: Replica, consumer: Replica, call: Call, transfer_id: str
    ) -> Response | None:
        """Step 2 of the hand-off; a Response when P refuses the request itself (4xx: the client's fault)."""
        dropped = ("max_completion_tokens", "min_tokens", "stream_options")
        body = {k: v for k, v in call.body.items() if k not in dropped}
        params = {"role": "producer", "transfer_id": transfer_id, "decode_kv_addr": consumer.endpoint.kv_addr}
        body.update(stream=False, max_tokens=1, kv_transfer_params=params)
        try:
            response = await self._post(pool, producer, call, body)
        finally:
            pool.release(producer)
        if response.status_code != 200:
            return self._relay_whole(response, producer)
        try:
            echoed = response.json().get("kv_transfer_params") or {}
        except (ValueError, AttributeError):
            echoed = {}
        if echoed.get("status") != "sent" or echoed.get("transfer_id") != transfer_id:
            pool.record_failure(producer.url, f"prefill answered without sending the KV: {echoed!r}")
            message = f"prefill replica {producer.label} did not report the KV as sent ({echoed!r})"
            raise UpstreamFailure(message, pool.name, producer.url)
        return None

    async def _post(self, pool: Pool, replica: Replica, call: Call, body: dict[str, Any]) -> httpx.Response:
        """A non-streaming POST; retryable outcomes raise UpstreamFailure. Does not release the replica."""
        work = self.client.post(f"{replica.url}{call.path}", json=body, headers=call.headers)
        try:
            response = await unless_disconnected(call.raw, work)
        except httpx.HTTPError as err:
            raise self._transport_failure(pool, replica, err) from err
        self._check_status(pool, replica, response.status_code, response.content, response.headers)
        return response

    def _transport_failure(self, pool: Pool, replica: Replica, err: httpx.HTTPError) -> UpstreamFailure:
        pool.record_failure(replica.url, repr(err), is_fatal=isinstance(err, httpx.ConnectError))
        return UpstreamFailure(f"{replica.label}: {type(err).__name__}: {err}", pool.name, replica.url)

    def _check_status(self, pool: Pool, replica: Replica, status: int, content: bytes, headers: httpx.Headers) -> None:
        if status == 429 or status >= 500:
            relayed = {name: headers[name] for name in RELAYED_HEADERS if name in headers}
            failure = UpstreamFailure(
                f"{replica.label} answered {status}", pool.name, replica.url, status, content, relayed
            )
            if failure.is_asleep:  # asleep (router/health.py): unready until the next probe sees it woken
                pool.mark_unready(replica.url, "engine asleep (sleep mode)")
            elif status >= 500:  # a 429 is a busy replica, not a broken one
                pool.record_failure(replica.url, f"answered {status}")
            raise failure
        pool.record_success(replica.url)

    def _relay_whole(self, response: httpx.Response, replica: Replica) -> Response:
        headers = {name: response.headers[name] for name in RELAYED_HEADERS if name in response.headers}
        headers[REPLICA_HEADER] = replica.label
        media_type = response.headers.get("content-type", "application/json")
        return Response(response.content, response.status_code, headers, media_type=media_type)

    async def _send(self, pool: Pool, replica: Replica, call: Call, body: dict[str, Any]) -> Response:
        """Send to an acquired replica and answer the client; releases the replica when done."""
        if not body.get("stream"):
            try:
                response = await self._post(pool, replica, call, body)
            finally:
                pool.release(replica)
            return self._finish(call, pool.name, replica.label, self._relay_whole(response, replica))
        try:
            request = self.client.build_request("POST", f"{replica.url}{call.path}", json=body, headers=call.headers)
            try:
                upstream = await unless_disconnected(call.raw, self.client.send(request, stream=True))
            except httpx.HTTPError as err:
                raise self._transport_failure(pool, replica, err) from err
            try:
                if upstream.status_code != 200:
                    content = await upstream.aread()
                    self._check_status(pool, replica, upstream.status_code, content, upstream.headers)
                    return self._finish(call, pool.name, replica.label, self._relay_whole(upstream, replica))
                events = sse_events(upstream.aiter_raw())
                try:  # the first event before the response starts: a failure up to here is still retryable
                    first = await unless_disconnected(call.raw, anext(events, b""))
                except httpx.HTTPError as err:
                    raise self._transport_failure(pool, replica, err) from err
            except BaseException:
                await upstream.aclose()
                raise
        except BaseException:
            pool.release(replica)
            raise
        relay = self._relay_stream(pool, replica, call, upstream, first, events)
        return StreamingResponse(relay, media_type="text/event-stream", headers={REPLICA_HEADER: replica.label})

    async def _relay_stream(
        self,
        pool: Pool,
        replica: Replica,
        call: Call,
        upstream: httpx.Response,
        first: bytes,
        events: AsyncIterator[bytes],
    ) -> AsyncIterator[bytes]:
        code = "200"
        try:
            yield first
            async for event in events:
                yield event
        except httpx.HTTPError as err:
            code = "stream_error"
            pool.record_failure(replica.url, f"stream cut: {err!r}", is_fatal=isinstance(err, httpx.ConnectError))
            logger.warning("stream from %s cut after the first event: %r", replica.label, err)
            error = {
                "message": f"the replica serving this stream failed: {type(err).__name__}",
                "type": "internal_error",
                "param": None,
                "code": "upstream_stream_cut",
            }
            yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
        except BaseException:
            code = str(CLIENT_CLOSED)  # cancelled: the client disconnected
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()  # closes the connection: the engine sees the disconnect and aborts
            pool.release(replica)
            self.metrics.observe(pool.name, replica.label, code, time.monotonic() - call.start)
