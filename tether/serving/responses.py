"""The bodies of OpenAI responses: the envelope, each choice (an assistant message, see `replies.py`,
or a text), logprobs with their top alternatives, and usage. Pure but for detokenizing single tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from tether.chat import JsonDict, Usage
from tether.engine.async_engine import CompletionDelta, RequestDelta
from tether.serving.jobs import Job
from tether.serving.replies import assistant_reply


@dataclass(slots=True)
class Choice:
    """One sample, as accumulated from the engine's deltas."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    alternatives: list[Sequence[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


Alternatives = Sequence[Sequence[tuple[int, float]]]
"""Per token, its request's `top_logprobs` most likely tokens (token id, logprob), most likely first."""


def alternatives_of(completion: CompletionDelta) -> Alternatives:
    """The top alternatives of a delta's new tokens. The engine computes them (`SamplingParams.
    top_logprobs`); a delta that does not carry them (an engine without them) has none."""
    found: Alternatives = getattr(completion, "top_logprobs", ())
    return found


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

    def logprobs(
        self, job: Job, token_ids: Sequence[int], values: Sequence[float], alternatives: Alternatives
    ) -> JsonDict | None:
        """OpenAI's logprobs of `token_ids`: chat's `content` entries, or the text completion's lists."""
        if not job.logprobs:
            return None
        texts = [self._text(token) for token in token_ids]
        tops = [[(self._text(token), value) for token, value in top] for top in alternatives]
        tops += [[] for _ in range(len(texts) - len(tops))]
        if job.kind == "chat":
            return {
                "content": [
                    {
                        **self._entry(text, value),
                        "top_logprobs": [self._entry(other, logprob) for other, logprob in top],
                    }
                    for text, value, top in zip(texts, values, tops, strict=True)
                ]
            }
        return {
            "tokens": texts,
            "token_logprobs": list(values),
            "top_logprobs": [dict(top) for top in tops] if job.params.top_logprobs else None,
            "text_offset": None,
        }

    def _text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    @staticmethod
    def _entry(text: str, logprob: float) -> JsonDict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def choice(self, job: Job, index: int, choice: Choice) -> JsonDict:
        logprobs = self.logprobs(job, choice.token_ids, choice.logprobs, choice.alternatives)
        if job.kind == "chat":
            message, reason = assistant_reply(job, choice.text, choice.finish_reason)
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        return {
            "index": index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }
