"""A validated request as one engine job: the prompt's token ids, the `SamplingParams` and what the
response needs to know (streaming, logprobs, the chat plan and the tool format that reads replies).

Pure but for tokenizing: every refusal is an `APIError` naming the field the client sent.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from transformers import PreTrainedTokenizerBase

from tether.chat import ChatError
from tether.chat.template import ChatTemplate
from tether.chat.tool_format import HERMES, ToolFormat
from tether.engine.sampling import SamplingParams
from tether.engine.structured import StructuredOutput
from tether.errors import ConfigError
from tether.serving.chat import ChatPlan, plan_chat
from tether.serving.openai_api import (
    SAMPLING_FIELD,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)


@dataclass(slots=True)
class Job:
    kind: Literal["chat", "text"]
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str
    plan: ChatPlan | None = None
    tool_format: ToolFormat = HERMES
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    arrived_s: float = field(default_factory=time.monotonic)

    @property
    def reads_calls(self) -> bool:
        return self.plan is not None and self.plan.reads_calls


class JobFactory:
    """Checks requests against the served model and turns them into jobs."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, model_name: str, vocab_size: int, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        try:
            self.template: ChatTemplate | None = ChatTemplate(tokenizer)
        except ChatError:  # a base model: it serves text completions only
            self.template = None
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def chat(self, body: ChatCompletionRequest) -> Job:
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs = true", "top_logprobs")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(
                400,
                "max_completion_tokens: give it or its deprecated alias max_tokens, not both",
                "max_completion_tokens",
            )
        plan, fmt, ids = self.chat_prompt(body)
        given = body.max_completion_tokens is not None
        max_tokens = body.max_completion_tokens if given else body.max_tokens
        param = "max_completion_tokens" if given else "max_tokens"
        job = self._job("chat", body, ids, max_tokens, param, plan.structured, body.top_logprobs or 0)
        job.logprobs, job.plan, job.tool_format = body.logprobs, plan, fmt
        return job

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[ChatPlan, ToolFormat, list[int]]:
        """The checked chat, the tool format that reads its replies and the prompt's token ids: what a
        chat request prefills (agents count their context with it before they send it)."""
        template = self.template
        if template is None:
            raise APIError(
                400, "messages: the served model has no chat template; use /v1/completions", "messages"
            )
        fmt = template.format or HERMES
        plan = plan_chat(body, fmt)
        try:
            if plan.tools or any("tool_calls" in m or m["role"] == "tool" for m in plan.messages):
                fmt = template.tool_format()
            ids = template.encode(plan.messages, plan.tools)
        except ChatError as error:
            param = "tools" if body.tools else "messages"
            raise APIError(400, f"{param}: {error}", param) from None
        except Exception as error:  # a template's own checks (roles out of order, ...)
            raise APIError(400, f"messages: cannot apply the chat template: {error}", "messages") from error
        return plan, fmt, ids

    def text(self, body: CompletionRequest) -> Job:
        if body.echo:
            raise APIError(400, "echo = true is not supported", "echo")
        if isinstance(body.prompt, str):
            ids = list(self.tokenizer.encode(body.prompt))
        else:
            ids = body.prompt
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"prompt: token ids {bad[:5]} out of range: expected 0 to {self.vocab_size - 1}",
                    "prompt",
                )
        top = body.logprobs or 0
        job = self._job("text", body, ids, body.max_tokens, "max_tokens", None, top, "logprobs")
        job.logprobs = body.logprobs is not None
        return job

    def _job(
        self,
        kind: Literal["chat", "text"],
        body: GenerationRequest,
        ids: list[int],
        max_tokens: int | None,
        max_tokens_param: str,
        structured: StructuredOutput | None,
        top_logprobs: int,
        top_logprobs_param: str = "top_logprobs",
    ) -> Job:
        if body.model != self.model_name:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.model_name}`.",
                "model",
                "model_not_found",
            )
        prompt_param = "messages" if kind == "chat" else "prompt"
        limit = self.max_model_len
        if not ids:
            raise APIError(400, f"{prompt_param}: the prompt is empty", prompt_param)
        if len(ids) >= limit or (max_tokens is not None and len(ids) + max_tokens > limit):
            requested = f"{len(ids)} in the prompt" + (f", {max_tokens} to generate" if max_tokens else "")
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; you requested {requested}.",
                prompt_param,
                "context_length_exceeded",
            )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            params = SamplingParams(
                max_tokens=limit - len(ids) if max_tokens is None else max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                seed=body.seed,
                n=body.n,
                stop=stop,
                ignore_eos=body.ignore_eos,
                top_logprobs=top_logprobs,
                structured=structured,
            )
        except ConfigError as error:
            match = SAMPLING_FIELD.match(str(error))
            param = match.group(1) if match else None
            message = str(error).removeprefix("sampling: ")
            renamed = {"max_tokens": max_tokens_param, "top_logprobs": top_logprobs_param}
            if param in renamed and renamed[param] != param:  # name the field the client sent
                message = message.replace(param, renamed[param], 1)
                param = renamed[param]
            raise APIError(400, message, param) from None
        return Job(
            kind,
            ids,
            params,
            body.priority,
            body.stream,
            body.stream_options is not None and body.stream_options.include_usage,
            False,
            self.model_name,
        )
