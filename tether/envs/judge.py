"""An LLM judge as a reward component: a rubric prompt over the task's prompt, its reference answer and
the answer to grade, a verdict in a JSON schema read strictly, and a cache keyed by what was asked.

The judge is any `ChatClient` (our engine in process, an OpenAI-compatible server, a scripted client),
opened on first use in the process that scores (a Ray rollout worker opens its own). Its requests run
while the other rollouts of the batch are scored, at most `concurrency` in flight, so an engine batches
them. A request that fails or answers no valid verdict raises `InfraError(JUDGE_ERROR)`: the sample is
retried or left out of its group, never scored 0. Usage and its cost at `price` are added to the
scoring context's counters (`judge/...`). The cache lives in this process and does not outlive the run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import string
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tether.chat import ChatClient, ChatError, ChatRequest, Completion, FinishReason, JsonDict, message_text
from tether.chat.pricing import DEFAULT_PRICES, Price, Tier, cost_usd
from tether.envs.context import ScoringContext
from tether.envs.scoring import RewardInput
from tether.errors import ConfigError, InfraError, InfraReason

DEFAULT_RUBRIC = """You grade an answer to a task.

Task:
{prompt}

Reference answer ("(none)" when there is none):
{reference}

Answer to grade:
{answer}

Reply with a JSON object: "reason", one or two sentences on what is right or wrong in the answer, then \
"score", from 0 (wrong or no answer) to 1 (correct and complete)."""
PLACEHOLDERS = ("prompt", "reference", "answer")
NO_REFERENCE = "(none)"
SHOWN_CHARS = 200  # of a bad verdict, in the error


def check_rubric(rubric: str) -> str:
    """A rubric template: `{prompt}`, `{reference}` and `{answer}` fields, `{answer}` required, braces
    meant literally doubled (`{{`)."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(rubric) if name is not None]
    except ValueError as error:
        raise ConfigError(f"judge rubric: {error} (write a literal brace as '{{{{' or '}}}}')") from None
    unknown = sorted({name for name in fields if name not in PLACEHOLDERS})
    if unknown:
        raise ConfigError(
            f"judge rubric: unknown field(s) {', '.join('{' + n + '}' for n in unknown)}; accepted: "
            f"{', '.join('{' + n + '}' for n in PLACEHOLDERS)} (a literal brace is '{{{{')"
        )
    if "answer" not in fields:
        raise ConfigError("judge rubric: it must contain {answer}, the answer the judge grades")
    return rubric


@dataclass(frozen=True, slots=True)
class JudgeConfig:
    """How one judge asks and what it accepts. `labels` (label -> score in [0, 1]) makes the verdict's
    score one of those labels instead of a number in [0, 1]."""

    model: str  # the judge's name, reported and part of the cache key
    rubric: str = DEFAULT_RUBRIC
    labels: Mapping[str, float] | None = None
    max_tokens: int = 256
    max_reason_chars: int = 1000  # the schema's maxLength: a grammar-held judge stops reasoning there
    concurrency: int = 16
    cache_entries: int = 100_000
    price: Price = field(default_factory=lambda: DEFAULT_PRICES[Tier.STANDARD])

    def __post_init__(self) -> None:
        check_rubric(self.rubric)
        if self.labels is not None:
            if not self.labels:
                raise ConfigError("judge labels: name at least one label, or leave labels unset")
            bad = {k: v for k, v in self.labels.items() if not (math.isfinite(v) and 0.0 <= v <= 1.0)}
            if bad:
                raise ConfigError(f"judge labels {bad}: every label's score must be in [0, 1]")
        for name in ("max_tokens", "max_reason_chars", "concurrency", "cache_entries"):
            if getattr(self, name) < 1:
                raise ConfigError(f"judge {name} = {getattr(self, name)!r}: expected an integer >= 1")

    def schema(self) -> JsonDict:
        """The verdict's JSON schema: a reason first (the judge reasons before it scores), then a score."""
        score: JsonDict = (
            {"type": "number", "minimum": 0, "maximum": 1}
            if self.labels is None
            else {"type": "string", "enum": list(self.labels)}
        )
        return {
            "type": "object",
            "properties": {"reason": {"type": "string", "maxLength": self.max_reason_chars}, "score": score},
            "required": ["reason", "score"],
            "additionalProperties": False,
        }

    def response_format(self) -> JsonDict:
        return {
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": self.schema(), "strict": True},
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    score: float
    reason: str


def parse_verdict(content: str, config: JudgeConfig) -> Verdict:
    """The verdict in a reply, exactly as the schema states it; else `InfraError(JUDGE_ERROR)`."""

    def refuse(why: str) -> InfraError:
        shown = content if len(content) <= SHOWN_CHARS else content[:SHOWN_CHARS] + "..."
        return InfraError(InfraReason.JUDGE_ERROR, f"judge {config.model}: verdict {shown!r} {why}")

    try:
        raw: Any = json.loads(content)
    except ValueError:
        raise refuse("is not JSON") from None
    if not isinstance(raw, dict) or set(raw) != {"reason", "score"}:
        keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise refuse(f"has {keys}: expected an object with exactly 'reason' and 'score'")
    reason, score = raw["reason"], raw["score"]
    if not isinstance(reason, str) or len(reason) > config.max_reason_chars:
        raise refuse(f"has no 'reason' string of at most {config.max_reason_chars} characters")
    if config.labels is not None:
        if not isinstance(score, str) or score not in config.labels:
            raise refuse(f"scores {score!r}: expected one of {', '.join(map(repr, config.labels))}")
        return Verdict(config.labels[score], reason)
    if isinstance(score, bool) or not isinstance(score, int | float) or not 0.0 <= score <= 1.0:
        raise refuse(f"scores {score!r}: expected a number in [0, 1]")
    return Verdict(float(score), reason)


class JudgeReward:
    """A reward function (`RewardFn`) asking the judge `connect()` opens for a verdict on each answer."""

    def __init__(self, config: JudgeConfig, connect: Callable[[], ChatClient]) -> None:
        self.config = config
        self._connect = connect
        self._client: ChatClient | None = None
        self._cache: OrderedDict[str, Verdict] = OrderedDict()
        # Requests in flight on the scoring loop, so that equal answers of one batch ask once.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._asking: dict[str, asyncio.Task[Verdict]] = {}
        self._limit: asyncio.Semaphore | None = None

    def request(self, inp: RewardInput) -> ChatRequest:
        """The judge's request for one answer: the rubric filled in, the verdict's schema attached."""
        users = [m for m in inp.task.messages if m.get("role") == "user"]
        text = self.config.rubric.format(
            prompt=message_text(users[-1]) if users else "",
            reference=inp.task.reference or NO_REFERENCE,
            answer=inp.completion,
        )
        return ChatRequest(
            messages=[{"role": "user", "content": text}],
            max_tokens=self.config.max_tokens,
            temperature=0.0,
            response_format=self.config.response_format(),
        )

    def cache_key(self, request: ChatRequest) -> str:
        """A hash of the judge, the rubric filled in with prompt, reference and answer, and the schema."""
        asked = [self.config.model, request.messages, request.response_format, request.max_tokens]
        return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()

    async def __call__(self, inp: RewardInput) -> float:
        request = self.request(inp)
        key = self.cache_key(request)
        loop = asyncio.get_running_loop()
        if self._limit is None or loop is not self._loop:  # tasks and semaphores belong to a loop
            self._loop, self._asking = loop, {}
            self._limit = asyncio.Semaphore(self.config.concurrency)
        verdict = self._cache.get(key)
        asking = self._asking.get(key)
        hit = verdict is not None or asking is not None
        inp.ctx.count("judge/requests", float(not hit))
        inp.ctx.count("judge/cache_hits", float(hit))
        if verdict is not None:
            self._cache.move_to_end(key)
        else:
            if asking is None:
                asking = loop.create_task(self._ask(request, self._limit, inp.ctx))
                self._asking[key] = asking
                asking.add_done_callback(lambda done: self._settle(key, done))
            # Shielded: one waiter cancelled must not cancel the verdict the others wait for.
            verdict = await asyncio.shield(asking)
        inp.detail["judge_reason"] = verdict.reason
        return verdict.score

    def _settle(self, key: str, done: asyncio.Task[Verdict]) -> None:
        if self._asking.get(key) is done:
            del self._asking[key]
        if not done.cancelled() and done.exception() is None:  # failures are asked again next time
            self._cache[key] = done.result()
            if len(self._cache) > self.config.cache_entries:
                self._cache.popitem(last=False)

    async def _ask(self, request: ChatRequest, limit: asyncio.Semaphore, ctx: ScoringContext) -> Verdict:
        if self._client is None:
            self._client = self._connect()
            ctx.on_close(self.aclose)  # closed with the scoring context, on the loop it was opened on
        async with limit:
            try:
                completion = await self._client.complete(request)
            except (ChatError, OSError, TimeoutError) as error:
                raise InfraError(
                    InfraReason.JUDGE_ERROR, f"judge {self.config.model}: {type(error).__name__}: {error}"
                ) from None
        self._record(completion, ctx)
        if completion.finish_reason is FinishReason.LENGTH:
            raise InfraError(
                InfraReason.JUDGE_ERROR,
                f"judge {self.config.model}: the verdict was cut off at max_tokens = "
                f"{self.config.max_tokens}; raise it, or lower max_reason_chars = "
                f"{self.config.max_reason_chars}",
            )
        return parse_verdict(completion.content, self.config)

    def _record(self, completion: Completion, ctx: ScoringContext) -> None:
        usage = completion.usage
        ctx.count("judge/prompt_tokens", usage.prompt_tokens)
        ctx.count("judge/cached_tokens", usage.cached_tokens)
        ctx.count("judge/completion_tokens", usage.completion_tokens)
        ctx.count("judge/cost_usd", float(cost_usd(usage, self.config.price)))

    async def aclose(self) -> None:
        """Close the judge's client, if one was opened."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
