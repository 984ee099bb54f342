"""Evaluation: run episodes of many environments against a model and summarise them per domain.

Plan (environment, seed) pairs, run each as an episode through `run_episode` (the same path as the
trainer's rollouts), then summarise. Episodes run concurrently; their generation requests meet in a
`Batcher`, so the in-process engine decodes them as one continuous batch. The backend is the only link
to a model: `EngineBackend` runs tether's `LLMEngine` in this process, `OpenAIBackend` calls any
OpenAI-compatible `/chat/completions`. Tool calls: an endpoint returns OpenAI `tool_calls`; the
in-process engine gets the tools described in its system prompt and writes `<tool_call>{json}</tool_call>`
blocks, read back into the same OpenAI form (`tools.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tether.chat import Message, Messages, ToolCall, message_text
from tether.envs.context import ScoringContext
from tether.envs.episode import run_episode
from tether.envs.errors import EnvError
from tether.envs.registry import EnvRegistry, Mixture
from tether.envs.scoring import Score
from tether.envs.tasks import Task
from tether.envs.tools import parse_text_tool_calls, text_tool_prompt

if TYPE_CHECKING:
    import httpx
    from transformers import PreTrainedTokenizerBase

    from tether.engine.llm_engine import LLMEngine, RequestOutput
    from tether.engine.sampling import SamplingParams

REACHABLE_TIMEOUT_S = 10.0  # for a server to answer at all before an evaluation starts
Conversation = tuple[Messages, list[dict[str, Any]]]  # messages so far, and the OpenAI tools offered


@dataclass(frozen=True, slots=True)
class Generation:
    message: Message  # the assistant reply in OpenAI form (tool calls included)
    prompt_tokens: int
    completion_tokens: int


Ready = Callable[[int, Generation], None]  # (index in the batch, its generation), as each one is ready


class Backend(Protocol):
    async def generate(
        self, conversations: list[Conversation], ready: Ready | None = None
    ) -> list[Generation]:
        """Every conversation's next reply, in order; `ready` hears of each as soon as it is done (a
        backend that cannot tell may leave that to the returned list)."""
        ...


def plan_episodes(mixture: Mixture, count: int, seed: int, per_env: bool) -> list[tuple[str, int]]:
    """(environment, seed) pairs: `count` per environment, or `count` in all split by the weights."""
    if count < 1:
        raise EnvError(f"episode count {count!r} must be at least 1")
    counts = dict.fromkeys(mixture.names, count) if per_env else mixture.counts(count)
    return [(name, seed + index) for name, n in counts.items() for index in range(n)]


Batch = list[tuple[Conversation, "asyncio.Future[Generation]"]]


class Batcher:
    """Collects the generation requests of concurrent episodes and sends them to the backend together."""

    def __init__(self, backend: Backend, max_batch: int, gather_s: float = 0.005) -> None:
        self.backend = backend
        self.max_batch = max_batch
        self.gather_s = gather_s
        self._pending: Batch = []
        self._wake = asyncio.Event()

    async def request(self, conversation: Conversation) -> Generation:
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._pending.append((conversation, future))
        self._wake.set()
        return await future

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.gather_s)  # let the other episodes reach their next request
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            if not self._pending:
                self._wake.clear()

            def ready(index: int, generation: Generation, batch: Batch = batch) -> None:
                future = batch[index][1]
                if not future.done():  # its episode goes on while the rest of the batch decodes
                    future.set_result(generation)

            try:
                generations = await self.backend.generate([conversation for conversation, _ in batch], ready)
            except Exception as error:  # every waiting episode learns why, none hangs
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), generation in zip(batch, generations, strict=True):
                if not future.done():
                    future.set_result(generation)


@dataclass(slots=True)
class EpisodeRecord:
    """One evaluated episode: every reward component, the token counts and the full transcript."""

    env: str
    seed: int
    reference: str
    score: Score | None
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    transcript: Messages = field(default_factory=list)
    error: str | None = None

    @property
    def reward(self) -> float:
        return self.score.total if self.score is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "seed": self.seed,
            "reference": self.reference,
            "reward": self.reward,
            "passed": bool(self.score and self.score.passed),
            "score": self.score.to_dict() if self.score is not None else None,
            "turns": self.turns,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "sandbox_time_s": self.score.sandbox_time_s if self.score is not None else 0.0,
            "wall_s": self.wall_s,
            "error": self.error,
            "transcript": self.transcript,
        }


async def run_eval(
    registry: EnvRegistry,
    plan: Sequence[tuple[str, int]],
    backend: Backend,
    ctx: ScoringContext,
    concurrency: int = 64,
    on_done: Callable[[EpisodeRecord], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[EpisodeRecord]:
    """Run every planned episode; an episode that fails is recorded with its error, not raised."""
    for name, _ in plan:
        registry.get(name)  # unknown names fail before any model work
    batcher = Batcher(backend, max_batch=concurrency)
    limit = asyncio.Semaphore(concurrency)

    async def one(name: str, seed: int) -> EpisodeRecord:
        async with limit:
            env = registry.get(name)
            task: Task = env.task(seed)
            record = EpisodeRecord(name, seed, task.reference, None, transcript=list(task.messages))

            async def policy(messages: Messages, tools: list[dict[str, Any]]) -> Message:
                generation = await batcher.request((messages, tools))
                record.prompt_tokens += generation.prompt_tokens
                record.completion_tokens += generation.completion_tokens
                return generation.message

            start = clock()
            try:
                result = await run_episode(env, task, policy, ctx.child())
                record.score, record.turns, record.transcript = result.score, result.turns, result.messages
            except Exception as error:  # one broken episode must not lose the others' results
                record.error = f"{type(error).__name__}: {error}"
            record.wall_s = clock() - start
            if on_done is not None:
                on_done(record)
            return record

    runner = asyncio.create_task(batcher.run())
    try:
        return list(await asyncio.gather(*(one(name, seed) for name, seed in plan)))
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class DomainSummary:
    env: str
    episodes: int
    mean_reward: float
    pass_rate: float
    mean_completion_tokens: float
    sandbox_time_s: float
    errors: int
    components: dict[str, float]  # mean of each reward component over the scored episodes

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "episodes": self.episodes,
            "mean_reward": self.mean_reward,
            "pass_rate": self.pass_rate,
            "mean_completion_tokens": self.mean_completion_tokens,
            "sandbox_time_s": self.sandbox_time_s,
            "errors": self.errors,
            "components": self.components,
        }


def summarise(records: Sequence[EpisodeRecord]) -> list[DomainSummary]:
    """One row per environment, in first-seen order; failed episodes count as reward 0."""
    by_env: dict[str, list[EpisodeRecord]] = {}
    for record in records:
        by_env.setdefault(record.env, []).append(record)
    rows = []
    for env, group in by_env.items():
        scored = [r.score for r in group if r.score is not None]
        names = list(scored[0].components) if scored else []
        rows.append(
            DomainSummary(
                env=env,
                episodes=len(group),
                mean_reward=sum(r.reward for r in group) / len(group),
                pass_rate=sum(bool(r.score and r.score.passed) for r in group) / len(group),
                mean_completion_tokens=sum(r.completion_tokens for r in group) / len(group),
                sandbox_time_s=sum(s.sandbox_time_s for s in scored),
                errors=sum(r.error is not None for r in group),
                components={n: sum(s.components[n] for s in scored) / len(scored) for n in names},
            )
        )
    return rows


# --- backends ------------------------------------------------------------------------------------------


def _call_text(raw: dict[str, Any]) -> str:
    """A tool call written back the way the model wrote it; arguments that are not JSON stay a string."""
    call = ToolCall.from_openai(raw)
    try:
        arguments: Any = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = call.arguments
    return "<tool_call>" + json.dumps({"name": call.name, "arguments": arguments}) + "</tool_call>"


def text_convention(messages: Messages, tools: list[dict[str, Any]]) -> Messages:
    """Messages for a plain chat template: tools described in the system prompt, calls and results as text."""
    out: Messages = []
    for message in messages:
        role, text = message.get("role"), message_text(message)
        if role == "system" and tools:
            out.append({"role": "system", "content": f"{text}\n\n{text_tool_prompt(tools)}"})
        elif role == "assistant" and message.get("tool_calls"):
            calls = "".join(_call_text(call) for call in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{text}{calls}"})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            out.append({"role": str(role), "content": text})
    if tools and not any(m["role"] == "system" for m in out):
        out.insert(0, {"role": "system", "content": text_tool_prompt(tools)})
    return out


class EngineBackend:
    """tether's `LLMEngine` in this process; one `generate` call decodes the whole batch."""

    def __init__(self, engine: LLMEngine, tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.params = params
        self._request_ids = itertools.count()

    def encode(self, conversation: Conversation) -> list[int]:
        messages, tools = conversation
        ids: Any = self.tokenizer.apply_chat_template(
            text_convention(messages, tools), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(i) for i in ids]

    async def generate(
        self, conversations: list[Conversation], ready: Ready | None = None
    ) -> list[Generation]:
        prompts = [self.encode(conversation) for conversation in conversations]
        generations: dict[int, Generation] = {}
        loop = asyncio.get_running_loop()

        def finish(index: int, output: RequestOutput | None) -> None:  # on the engine's thread
            generations[index] = self._generation(prompts[index], conversations[index], output)
            if ready is not None:
                loop.call_soon_threadsafe(ready, index, generations[index])

        limit = self.engine.config.max_model_len
        fits = {index: prompt for index, prompt in enumerate(prompts) if len(prompt) < limit}
        for index in set(range(len(prompts))) - set(fits):
            finish(index, None)  # longer than the context: an empty reply, the episode ends and scores 0
        # Engine work is blocking; a thread keeps the sandbox and the progress view moving meanwhile.
        await asyncio.to_thread(self._decode, fits, finish)
        return [generations[index] for index in range(len(prompts))]

    def _decode(self, prompts: dict[int, list[int]], finish: Callable[[int, RequestOutput], None]) -> None:
        """Continuous batching like `LLMEngine.generate`, handing over each request as it finishes."""
        waiting: dict[str, int] = {}
        try:
            for index, prompt in prompts.items():
                request_id = f"eval-{next(self._request_ids)}"
                self.engine.add_request(request_id, prompt, self.params)
                waiting[request_id] = index
            while waiting:
                for output in self.engine.step():
                    if output.finished and output.request_id in waiting:
                        finish(waiting.pop(output.request_id), output)
        finally:  # a failed batch leaves nothing behind in the engine for the next one to decode
            for request_id in waiting:
                self.engine.abort(request_id)

    def _generation(
        self, prompt: list[int], conversation: Conversation, output: RequestOutput | None
    ) -> Generation:
        text, used = "", 0
        if output is not None:
            token_ids = output.completions[0].token_ids
            text, used = str(self.tokenizer.decode(token_ids, skip_special_tokens=True)), len(token_ids)
        tools = conversation[1]
        message = parse_text_tool_calls(text) if tools else {"role": "assistant", "content": text}
        return Generation(message, len(prompt), used)


class OpenAIBackend:
    """Any OpenAI-compatible server: `base_url` ends where `/chat/completions` is appended (e.g. `.../v1`)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        max_tokens: int,
        temperature: float,
        api_key: str | None = None,
        concurrency: int = 16,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport
        )
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature
        self._limit = asyncio.Semaphore(concurrency)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def check_reachable(self) -> None:
        """Fail once, naming the URL, when no server answers there: before any episode is spent on it.

        Any HTTP answer (even 401 or 404 for `/models`) counts: only a connection that fails is refused."""
        import httpx

        try:
            await self.client.get("/models", timeout=REACHABLE_TIMEOUT_S)
        except httpx.TransportError as error:
            raise EnvError(self._unreachable(error)) from None

    def _unreachable(self, error: Exception) -> str:
        return f"no server answers at {self.base_url} ({type(error).__name__}: {error})"

    async def _one(self, conversation: Conversation) -> Generation:
        messages, tools = conversation
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        if tools:
            body["tools"] = tools
        import httpx

        async with self._limit:
            try:
                response = await self.client.post("/chat/completions", json=body)
            except httpx.TransportError as error:
                raise EnvError(self._unreachable(error)) from None
        if response.status_code != 200:
            raise EnvError(f"{response.request.url} answered {response.status_code}: {response.text[:300]}")
        try:
            data = response.json()
            reply = data["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EnvError(
                f"{response.request.url} returned no choices[0].message: {response.text[:300]}"
            ) from None
        message: Message = {"role": "assistant", "content": reply.get("content") or ""}
        if reply.get("tool_calls"):
            message["tool_calls"] = reply["tool_calls"]
        usage = data.get("usage") or {}
        return Generation(message, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))

    async def generate(
        self, conversations: list[Conversation], ready: Ready | None = None
    ) -> list[Generation]:
        async def one(index: int, conversation: Conversation) -> Generation:
            generation = await self._one(conversation)
            if ready is not None:
                ready(index, generation)
            return generation

        return list(await asyncio.gather(*(one(index, c) for index, c in enumerate(conversations))))
