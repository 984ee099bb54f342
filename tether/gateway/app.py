"""The gateway's HTTP app: the two completion routes are plain ASGI straight into `Gateway.serve`, as
FastAPI's routing, validation and middleware cost more CPU per request than the gateway's own work; the
other routes (models, health, metrics, and those routes' 405s and redirects) are FastAPI's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.routing import Route
from starlette.types import ASGIApp

from tether.gateway.asgi import Receive, Scope, Send
from tether.gateway.errors import GatewayError
from tether.gateway.handling import Gateway
from tether.gateway.plan import Kind
from tether.gateway.replicas import PATHS

_ROUTES: dict[str, Kind] = {path: kind for kind, path in PATHS.items()}


@dataclass(frozen=True, slots=True)
class _Completions:
    """One completion route as a bare ASGI app."""

    gateway: Gateway
    kind: Kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gateway.serve(self.kind, scope, receive, send)


@dataclass(frozen=True, slots=True)
class GatewayApp:
    """The ASGI app: POSTs to the completion routes go straight to the gateway, everything else (and those
    routes' 405s and redirects) to the FastAPI app."""

    fallback: FastAPI
    routes: dict[str, _Completions]

    def mount(self, path: str, app: ASGIApp) -> None:
        """Serve another app (the console) under `path`; the completion routes stay the gateway's."""
        self.fallback.mount(path, app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.routes.get(scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await self.fallback(scope, receive, send)


def create_gateway_app(gateway: Gateway) -> GatewayApp:
    app = FastAPI(title="tether gateway", summary="Tenants, tiers, prices and limits in front of engines")
    app.state.gateway = gateway

    @app.exception_handler(GatewayError)
    async def refused(request: Request, error: GatewayError) -> JSONResponse:
        gateway.metrics.errors_by(error.code).inc()
        return error.response()

    routes = {path: _Completions(gateway, kind) for path, kind in _ROUTES.items()}
    for path, route in routes.items():
        app.router.routes.append(Route(path, route, methods=["POST"]))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        await gateway.authenticate(request.headers.get("authorization"))
        cards = [
            {"id": name, "object": "model", "created": 0, "owned_by": "tether"}
            for name in gateway.config.models
        ]
        return {"object": "list", "data": cards}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        replicas = {
            name: {"healthy": pool.healthy, "total": len(pool.router.replicas)}
            for name, pool in gateway.replicas.items()
        }
        return {
            "status": "ok",
            "queues": {name: q.depth for name, q in gateway.queues.items()},
            "replicas": replicas,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        for name, queue in gateway.queues.items():
            gateway.metrics.queue_depth.labels(name).set(queue.depth)
            gateway.metrics.in_flight.labels(name).set(queue.in_flight)
        return Response(generate_latest(gateway.metrics.registry), media_type="text/plain; version=0.0.4")

    return GatewayApp(app, routes)
