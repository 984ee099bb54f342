"""The console's refusals: one error type with its HTTP status; `/api/...` answers it as JSON in OpenAI's
error shape (the one the gateway and `tether serve` use), pages render it as a page that says what to do."""

from __future__ import annotations

from tether.errors import TetherError


class ConsoleError(TetherError):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, object]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def not_found(kind: str, name: str, hint: str) -> ConsoleError:
    """An unknown run, task, tenant, key, job, ...: names what was asked for and where to find real ones."""
    return ConsoleError(404, f"{kind} {name!r}: not found; {hint}", f"unknown_{kind.replace(' ', '_')}", kind)


def bad_input(message: str, param: str | None = None) -> ConsoleError:
    return ConsoleError(400, message, "invalid_input", param)


def not_configured(what: str, flag: str) -> ConsoleError:
    """A page whose store this console was not given (e.g. no gateway ledger)."""
    return ConsoleError(
        409, f"{what} is not configured for this console; start it with {flag}", "not_configured"
    )
