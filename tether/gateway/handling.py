"""The gateway's request handling (`Gateway`): authenticate, plan, reserve limits, wait for a pool slot,
commit a durable reservation, forward to an engine replica through one shared `Upstream` (the replica
chosen by the request's prefix key and failed over before any byte reached the client: `replicas.py`,
`routing.py`, `prefix_key.py`), then price the reported usage and commit its charge before the response
completes: a whole answer is sent only after its charge is committed, a stream (relayed by `relay.py`)
ends only after it. A request whose charge cannot be recorded is not served (503, or an error event ending
the stream).

It tokenizes only to route (a prompt's leading blocks) and inspects completions only for the `usage`
object; the engine stays the authority on tokens and the ledger on money. The HTTP routes around it are
`app.py`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from fastapi.responses import Response

from tether.chat.completion import BadUsage, Usage
from tether.chat.pricing import cost_usd, to_nano_usd
from tether.gateway.admission import Admission, AdmissionRefused, open_admissions
from tether.gateway.admitted import Admitted
from tether.gateway.asgi import ClientGone, Receive, Scope, Send, WholeJson, authorization, read_body
from tether.gateway.config import GatewayConfig
from tether.gateway.errors import GatewayError, ledger_unavailable
from tether.gateway.keys import ApiKey, KeyStore, hash_key
from tether.gateway.ledger import Charge, Ledger, Reservation
from tether.gateway.limits import LimitKind, LimitStore, counters_for
from tether.gateway.metrics import GatewayMetrics
from tether.gateway.plan import Kind, RequestPlan, parse_body, plan_request
from tether.gateway.prefix_key import PrefixKeys
from tether.gateway.refusals import refusal_error
from tether.gateway.relay import stream_response
from tether.gateway.replicas import ReplicaPool, Whole
from tether.gateway.upstream import Upstream, UpstreamError
from tether.gateway.usage_log import Refused
from tether.gateway.writer import LedgerWriter

logger = logging.getLogger(__name__)


_KEY_CACHE_SIZE = 100_000


def _is_openai_error(content: bytes) -> bool:
    try:
        body = json.loads(content)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict)


@dataclass
class Gateway:
    """The request handling behind `create_gateway_app`; the caller owns the stores and the upstream."""

    config: GatewayConfig
    keys: KeyStore
    ledger: Ledger
    limits: LimitStore
    upstream: Upstream
    clock: Callable[[], float] = time.time
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    queues: dict[str, Admission] = field(init=False)
    writer: LedgerWriter = field(init=False)
    _key_cache: dict[str, tuple[ApiKey, float]] = field(init=False, default_factory=dict)
    replicas: dict[str, ReplicaPool] = field(init=False)
    prefix_keys: dict[str, PrefixKeys] = field(init=False)

    def __post_init__(self) -> None:
        self.queues = open_admissions(self.config)
        self.replicas = {
            name: ReplicaPool(name, pool, self.upstream, self.metrics)
            for name, pool in self.config.pools.items()
        }
        self.prefix_keys = {name: PrefixKeys.for_pool(name, pool) for name, pool in self.config.pools.items()}
        self.writer = LedgerWriter(
            self.ledger, on_failure=self.metrics.errors.labels("ledger_write_failed").inc
        )

    def start(self) -> None:
        """Start the pools' health checks in the running loop (the first request does it otherwise)."""
        for pool in self.replicas.values():
            pool.start_health_checks()

    async def aclose(self) -> None:
        for pool in self.replicas.values():
            await pool.aclose()
        await self.writer.close()
        await self.upstream.aclose()
        await self.limits.close()
        for queue in self.queues.values():
            await queue.aclose()
        self.keys.engine.dispose()

    # authentication

    async def authenticate(self, header: str | None) -> ApiKey:
        if not header or not header.startswith("Bearer "):
            raise GatewayError(
                401,
                "missing API key: send `Authorization: Bearer <key>`",
                "missing_api_key",
                "authentication_error",
            )
        secret = header.removeprefix("Bearer ").strip()
        digest = hash_key(secret)
        cached = self._key_cache.get(digest)
        now = time.monotonic()
        key: ApiKey | None
        if cached is not None and cached[1] > now:
            key = cached[0]
        else:
            key = await asyncio.to_thread(self.keys.lookup, secret)
            # only real keys are cached, and only so many: guessed keys must not grow the cache
            if key is not None and self.config.key_cache_s > 0:
                if len(self._key_cache) >= _KEY_CACHE_SIZE:
                    self._key_cache.clear()
                self._key_cache[digest] = (key, now + self.config.key_cache_s)
        if key is None:
            raise GatewayError(401, "invalid API key", "invalid_api_key", "authentication_error")
        if key.revoked:
            raise GatewayError(
                401,
                f"API key {key.key_id} was revoked; ask for a new one",
                "key_revoked",
                "authentication_error",
            )
        return key

    # limits

    async def admit(self, key: ApiKey, plan: RequestPlan) -> Admitted:
        tokens, spend = plan.tokens_bound, plan.spend_bound_nano_usd
        counters = counters_for(key.limits, "key", key.key_id, tokens, spend) + counters_for(
            self.config.tenant(key.tenant), "tenant", key.tenant, tokens, spend
        )
        admitted = Admitted(uuid.uuid4().hex, key, plan, counters, time.monotonic())
        now = self.clock()
        refusal = await self.limits.reserve(admitted.id, counters, now)
        if refusal is not None:
            counter = refusal.counter
            scope_id = key.key_id if counter.scope == "key" else key.tenant
            error = refusal_error(refusal, scope_id, plan, self.config.price(plan.model, plan.tier))
            # kept for the console's usage page (which limit refuses whom), committed with the next batch
            self.writer.refuse(
                Refused(
                    admitted.id,
                    now,
                    key.tenant,
                    key.key_id,
                    key.tier,
                    counter.scope,
                    counter.kind,
                    error.status,
                    error.code,
                )
            )
            raise error
        return admitted

    async def reserve_durably(self, admitted: Admitted) -> None:
        """Commit the request's worst case to the ledger before it goes upstream, so that a crash while it
        runs still counts it against its budgets when the limits are rebuilt."""
        plan, key = admitted.plan, admitted.key
        reservation = Reservation(
            admitted.id, self.clock(), key.tenant, key.key_id, plan.tokens_bound, plan.spend_bound_nano_usd
        )
        if not await self.writer.reserve(reservation):
            raise ledger_unavailable()
        admitted.reserved_durably = True

    async def release(self, admitted: Admitted) -> None:
        """The request never ran: give its tokens and spend back (it still counts as a request)."""
        if admitted.settled:
            return
        admitted.settled = True
        if admitted.reserved_durably:
            self.writer.release(admitted.id)
        zero = {c.name: 0 for c in admitted.counters if c.kind is not LimitKind.REQUESTS}
        await self.limits.settle(admitted.id, admitted.counters, zero)

    async def charge(self, admitted: Admitted, usage: Usage) -> Decimal:
        """Price the usage and commit its ledger row; the cost once committed (and the limits settled to
        it). If the ledger cannot record it the request is refused and its reservation stays charged."""
        committed, cost = self.queue_charge(admitted, usage)
        if not await committed:
            raise ledger_unavailable()
        return cost

    def queue_charge(self, admitted: Admitted, usage: Usage) -> tuple[asyncio.Future[bool], Decimal]:
        """Queue the charge's commit; the reservation is settled once the row is committed."""
        plan, key = admitted.plan, admitted.key
        cost = cost_usd(usage, self.config.price(plan.model, plan.tier))
        charge = Charge(
            admitted.id,
            self.clock(),
            key.tenant,
            key.key_id,
            plan.model,
            plan.tier,
            usage,
            cost,
            admitted.first_token_s,
        )
        actual = {LimitKind.TOKENS: usage.total_tokens, LimitKind.SPEND: to_nano_usd(cost)}
        amounts = {c.name: actual[c.kind] for c in admitted.counters if c.kind in actual}
        for c in admitted.counters:
            if c.name in amounts and amounts[c.name] > c.amount:
                logger.warning(
                    "request %s used %s %s, more than reserved (%s)",
                    admitted.id,
                    amounts[c.name],
                    c.kind.value,
                    c.amount,
                )
        admitted.settled = True

        async def settle() -> None:
            await self.limits.settle(admitted.id, admitted.counters, amounts)

        committed = self.writer.charge(charge, settle)
        tier, tenant, tokens = plan.tier.value, key.tenant, self.metrics.tokens_by
        tokens(tenant, tier, "cached").inc(usage.cached_tokens)
        tokens(tenant, tier, "uncached").inc(usage.prompt_tokens - usage.cached_tokens)
        tokens(tenant, tier, "output").inc(usage.completion_tokens)
        self.metrics.cost_by(tenant, tier).inc(float(cost))
        return committed, cost

    async def flush(self) -> None:
        """Wait until every charge so far is in the ledger and settled in the limits."""
        await self.writer.flush()

    # forwarding

    async def serve(self, kind: Kind, scope: Scope, receive: Receive, send: Send) -> None:
        """One proxied request as an ASGI app, counted by tier and status however it ends."""
        labels = ["unknown", "500"]
        response: WholeJson | Response
        try:
            try:
                response = await self._handle(kind, authorization(scope), receive, labels)
            except GatewayError as error:
                self.metrics.errors_by(error.code).inc()
                response = error.response()
            labels[1] = str(response.status_code)
        except ClientGone:
            labels[1] = "499"  # nginx's "client closed request"
            return
        finally:
            self.metrics.requests_by(*labels).inc()
        await response(scope, receive, send)

    async def _handle(
        self, kind: Kind, authorization: str | None, receive: Receive, labels: list[str]
    ) -> WholeJson | Response:
        key = await self.authenticate(authorization)
        labels[0] = key.tier.value
        body = parse_body(await read_body(receive))
        plan = plan_request(kind, body, key.tier, self.config)
        admitted = await self.admit(key, plan)
        queue = self.queues[plan.pool]
        try:
            await queue.acquire(self.config.tier_priority[plan.tier])
        except AdmissionRefused as error:
            await self.release(admitted)
            raise GatewayError(
                503, str(error), error.code, "server_error", retry_after_s=error.retry_after_s
            ) from None
        except BaseException:
            await self.release(admitted)
            raise
        handed_over = False
        try:
            await self.reserve_durably(admitted)
            # routed only once admitted: the fast tier's place in the queue decides when, the prefix where
            upstream = await self.replicas[plan.pool].send(
                plan.kind, plan.upstream_body, await self.prefix_key(plan, body), plan.stream
            )
            if isinstance(upstream, Whole):
                return await self._whole(admitted, upstream.status_code, upstream.content)
            handed_over = True  # from here the relay owns the slot, the reservation and the upstream response
            return await stream_response(admitted, upstream, queue, self.queue_charge, self.metrics)
        except UpstreamError as error:
            raise GatewayError(
                502, f"upstream pool {plan.pool!r} failed: {error}", "upstream_error", "server_error"
            ) from None
        finally:
            if not handed_over:
                queue.release()
                await self.release(admitted)  # a no-op once charged

    async def prefix_key(self, plan: RequestPlan, body: dict[str, Any]) -> bytes | None:
        keys = self.prefix_keys[plan.pool]
        if keys.tokenizes:  # rendering and tokenizing a long prompt would hold up the loop
            return await asyncio.to_thread(keys.key, plan.kind, body)
        return keys.key(plan.kind, body)

    async def _whole(self, admitted: Admitted, status: int, content: bytes) -> WholeJson:
        tier = admitted.plan.tier.value
        if status != 200:
            self.metrics.errors_by(f"upstream_{status}").inc()
            if _is_openai_error(content):  # the engine's own refusal: pass it on as it is
                return WholeJson(status, content, [])
            raise GatewayError(
                502,
                f"upstream pool {admitted.plan.pool!r} answered HTTP {status}: {content[:200]!r}",
                "upstream_error",
                "server_error",
            )
        try:
            usage = Usage.from_openai(json.loads(content).get("usage"))
        except (ValueError, AttributeError, BadUsage) as error:
            raise GatewayError(
                502, f"upstream answered without a valid usage: {error}", "bad_upstream_usage", "server_error"
            ) from None
        cost = await self.charge(admitted, usage)
        self.metrics.latency_by(tier).observe(time.monotonic() - admitted.arrived_s)
        headers = [(b"x-tether-cost-usd", str(cost).encode()), (b"x-tether-request-id", admitted.id.encode())]
        return WholeJson(200, content, headers)
