"""Sign-in for a console on a non-loopback address: an admin token in, a cookie out (HttpOnly, SameSite)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, Response

from tether.console.access import COOKIE
from tether.console.errors import ConsoleError
from tether.console.pages import render, root_of
from tether.console.state import Console


def router(console: Console) -> APIRouter:
    routes = APIRouter()

    @routes.get("/login", response_class=HTMLResponse)
    async def login_page(request: Request) -> HTMLResponse:
        return render(console.jinja, request, "login.html", active="")

    @routes.post("/login")
    async def login(request: Request, token: Annotated[str, Form(min_length=1, max_length=512)]) -> Response:
        check = request.app.state.admin_check
        if check is None or not check(token):
            raise ConsoleError(403, "this token is not a gateway admin key (or is revoked)", "forbidden")
        response = Response(status_code=204, headers={"HX-Redirect": f"{root_of(request)}/runs"})
        response.set_cookie(
            COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https"
        )
        return response

    @routes.post("/logout")
    async def logout(request: Request) -> Response:
        response = Response(status_code=204, headers={"HX-Redirect": f"{root_of(request)}/login"})
        response.delete_cookie(COOKIE)
        return response

    return routes
