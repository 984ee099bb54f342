"""What a client is told when a limit refuses its request: which limit, what the request needed, and
whether waiting helps (a 429 with `Retry-After`) or never will (a 400 naming the `max_tokens` that fits).

Pure: it formats a `Refusal` from the limits and the request's plan; it does not decide anything.
"""

from __future__ import annotations

from decimal import Decimal

from tether.chat.pricing import Price, largest_max_tokens
from tether.gateway.errors import GatewayError
from tether.gateway.limits import LimitKind, Refusal
from tether.gateway.plan import RequestPlan


def _usd(nano_usd: int) -> Decimal:
    return Decimal(nano_usd) / 10**9


def _spend_refusal(refusal: Refusal, who: str, plan: RequestPlan, price: Price) -> GatewayError:
    """A budget refusal names the request's worst case, which is what did not fit: with nothing spent it
    is the whole cause. Larger than the whole budget it is a 400 (waiting never helps), else a 429 with
    `Retry-After` for when enough earlier spend leaves the budget period."""
    counter = refusal.counter
    budget = f"budget of {_usd(counter.limit)} USD per {counter.window_s:g} s"
    worst = (
        f"this request may cost up to {_usd(counter.amount)} USD ({plan.prompt_tokens_bound} prompt tokens "
        f"at most, plus max_tokens x n = {plan.output_tokens_bound} output tokens)"
    )
    if refusal.retry_after_s == float("inf"):
        fits = largest_max_tokens(counter.limit, plan.prompt_tokens_bound, plan.n, price)
        fix = f"lower max_tokens to {fits} or less" if fits else "shorten the prompt"
        return GatewayError(
            400,
            f"{worst}, more than {who}'s whole {budget}; {fix}",
            "request_exceeds_budget",
            param="max_tokens",
        )
    room = max(counter.limit - refusal.used, 0)
    fits = largest_max_tokens(room, plan.prompt_tokens_bound, plan.n, price)
    fix = f", or lower max_tokens to {fits} or less to fit now" if fits else ""
    return GatewayError(
        429,
        f"{worst}, more than the {_usd(room)} USD left of {who}'s {budget} ({_usd(refusal.used)} USD spent "
        f"or reserved by earlier requests); retry after {refusal.retry_after_s:.1f} s{fix}",
        "budget_exhausted",
        kind="insufficient_quota",
        param="max_tokens",
        retry_after_s=refusal.retry_after_s,
    )


def refusal_error(refusal: Refusal, scope_id: str, plan: RequestPlan, price: Price) -> GatewayError:
    """The error a client gets for a limit that refused its request: a 400 naming the max_tokens that
    fits where waiting can never help, else a 429 with `Retry-After`."""
    counter = refusal.counter
    who = f"{counter.scope} {scope_id!r}"
    reserved = counter.amount
    if counter.kind is LimitKind.SPEND:
        return _spend_refusal(refusal, who, plan, price)
    if refusal.retry_after_s == float("inf"):
        fits = (counter.limit - plan.prompt_tokens_bound) // plan.n
        fix = f"lower max_tokens to {fits} or less" if fits >= 1 else "shorten the prompt"
        return GatewayError(
            400,
            f"this request may use {reserved} tokens (prompt bound plus max_tokens x n), more than {who}'s "
            f"whole limit of {counter.limit} tokens per {counter.window_s:g} s; {fix}",
            "request_exceeds_limit",
            param="max_tokens",
        )
    unit = (
        "requests per minute" if counter.kind is LimitKind.REQUESTS else f"tokens per {counter.window_s:g} s"
    )
    return GatewayError(
        429,
        f"rate limit reached for {who}: {counter.limit} {unit} (in use {refusal.used}, this request needs "
        f"{reserved}); retry after {refusal.retry_after_s:.1f} s",
        f"{counter.kind.value}_limit_exceeded",
        kind="rate_limit_exceeded",
        retry_after_s=refusal.retry_after_s,
    )
