"""The relay of an upstream stream to the client: upstream's SSE events pass through chunk by chunk, never
buffered whole; the usage event is read for the ledger, and it and everything after it (`[DONE]`) are held
back until the charge is committed. It does not parse events beyond finding the `usage` object."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from decimal import Decimal

from fastapi.responses import StreamingResponse

from tether.chat.completion import BadUsage, Usage
from tether.gateway.admission import Admission
from tether.gateway.admitted import Admitted
from tether.gateway.errors import ledger_unavailable
from tether.gateway.metrics import GatewayMetrics
from tether.gateway.upstream import Response as UpstreamResponse

logger = logging.getLogger(__name__)

QueueCharge = Callable[[Admitted, Usage], tuple[asyncio.Future[bool], Decimal]]
"""Queues a request's charge for its usage: the future says whether the ledger committed it."""


async def stream_response(
    admitted: Admitted,
    upstream: UpstreamResponse,
    queue: Admission,
    queue_charge: QueueCharge,
    metrics: GatewayMetrics,
) -> StreamingResponse:
    """The client's response relaying `upstream`, which from here owns the pool slot, the reservation and
    the upstream response; the relay is started at once so that its cleanup runs even if the client leaves
    before the body is sent."""
    events = _relay(admitted, upstream, queue, queue_charge, metrics)
    first = await anext(events, b"")
    return StreamingResponse(
        _prepend(first, events),
        media_type="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "X-Tether-Request-Id": admitted.id,
        },
    )


async def _prepend(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


async def _relay(
    admitted: Admitted,
    upstream: UpstreamResponse,
    queue: Admission,
    queue_charge: QueueCharge,
    metrics: GatewayMetrics,
) -> AsyncGenerator[bytes, None]:
    """Upstream's SSE events as they come; the usage event is read for the ledger (and dropped when the
    client did not ask for it), and it and everything after it (`[DONE]`) are held back until the
    charge is committed: a client that saw the stream end was billed for it."""
    tier = admitted.plan.tier.value
    usage: Usage | None = None
    held: list[bytes] = []
    buffer = b""
    first = True
    try:
        async for chunk in upstream.aiter_bytes():
            if first:
                admitted.first_token_s = time.monotonic() - admitted.arrived_s
                metrics.ttft_by(tier).observe(admitted.first_token_s)
                first = False
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            out: list[bytes] = []
            for event in events:
                if b'"usage":{' in event or b'"usage": {' in event:
                    with contextlib.suppress(ValueError, AttributeError, BadUsage):
                        payload = json.loads(event.removeprefix(b"data: "))
                        usage = Usage.from_openai(payload["usage"])
                        if not admitted.plan.client_wants_usage and not payload.get("choices"):
                            continue
                (out if usage is None else held).append(event + b"\n\n")
            if out:
                yield b"".join(out)
        if usage is None:
            if buffer:
                yield buffer
            return
        committed, _ = queue_charge(admitted, usage)
        if await committed:
            yield b"".join(held) + buffer
        else:
            error = ledger_unavailable()
            yield b"data: " + json.dumps({"error": error.body()}).encode() + b"\n\n"
    finally:
        await upstream.aclose()
        queue.release()
        if usage is None:  # cut short: the tokens were possibly spent, so the reservation stands
            admitted.settled = True
            metrics.errors_by("stream_incomplete").inc()
            logger.warning("stream %s ended without usage; its reservation stays charged", admitted.id)
        elif not admitted.settled:  # the client left after the usage came: what ran is still billed
            queue_charge(admitted, usage)
        metrics.latency_by(tier).observe(time.monotonic() - admitted.arrived_s)
