"""The bodies of OpenAI responses: the envelope, each choice (an assistant message, see `replies.py`,
or a text), logprobs with their top alternatives, and usage. Pure but for detokenizing single tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from tether.chat import JsonDict, Usage
from tether.engine.async_engine import RequestDelta
from tether.serving.jobs import Job
from tether.serving.replies import assistant_reply


@dataclass(slots=True)
class Choice:
    """One sample, as accumulated from the engine's deltas."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class ResponseWriter:
    """Writes response bodies for one served model."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def envelope(self, job: Job, chunk: bool) -> JsonDict:
        if job.kind == "chat":
            request_id, kind = f"chatcmpl-{job.id}", "chat.completion.chunk" if chunk else "chat.completion"
        else:
            request_id, kind = f"cmpl-{job.id}", "text_completion"
        return {
            "id": request_id,
            "object": kind,
            "created": job.created,
            "model": job.model,
            "system_fingerprint": None,
        }

    def usage(self, job: Job, delta: RequestDelta, choices: list[Choice]) -> JsonDict:
        completion_tokens = sum(len(choice.token_ids) for choice in choices)
        prompt_tokens = len(job.prompt_token_ids)
        return Usage(prompt_tokens, delta.num_cached_tokens, completion_tokens).openai()

    def logprobs(self, job: Job, token_ids: list[int] | tuple[int, ...], values: Any) -> Any:
        if not job.logprobs:
            return None
        texts = [str(self.tokenizer.decode([token])) for token in token_ids]
        if job.kind == "chat":
            return {
                "content": [
                    {"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []}
                    for text, value in zip(texts, values, strict=True)
                ]
            }
        return {"tokens": texts, "token_logprobs": list(values), "top_logprobs": None, "text_offset": None}

    def choice(self, job: Job, index: int, choice: Choice) -> JsonDict:
        logprobs = self.logprobs(job, choice.token_ids, choice.logprobs)
        if job.kind == "chat":
            message, reason = assistant_reply(job, choice.text, choice.finish_reason)
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        return {
            "index": index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }
