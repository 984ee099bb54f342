"""How many tokens a request's prompt is: counted as the model reads it where the client can tell
(`PromptCounter`: the in-process engine renders it through the served chat template), else estimated.

The estimate (`estimate_prompt_tokens`) is deliberately high for the vocabularies tether serves (BPE
models read English text and code at about 4 UTF-8 bytes a token; it assumes 3, plus a few tokens of
template per message): a budget kept under it is kept under the real count. It can count low only for
byte-level vocabularies and scripts of many bytes a character read one byte a token.
"""

from __future__ import annotations

import json
from typing import Protocol, runtime_checkable

from tether.chat.completion import ChatRequest

ESTIMATE_BYTES_PER_TOKEN = 3
ESTIMATE_TOKENS_PER_MESSAGE = 8  # role markers and separators a chat template adds around each message


@runtime_checkable
class PromptCounter(Protocol):
    """A client that knows its model's prompt length: the tokens `complete` would prefill for a request,
    and `max_model_len`, the prompt plus completion tokens the model takes at most."""

    @property
    def max_model_len(self) -> int: ...

    def count_prompt_tokens(self, request: ChatRequest) -> int: ...


def estimate_prompt_tokens(request: ChatRequest) -> int:
    """An over-estimate of the prompt's tokens from its bytes (see the module docstring)."""
    text_bytes = sum(len(json.dumps(message, ensure_ascii=False).encode()) for message in request.messages)
    tool_bytes = len(json.dumps(request.openai_tools(), ensure_ascii=False).encode()) if request.tools else 0
    return -(-(text_bytes + tool_bytes) // ESTIMATE_BYTES_PER_TOKEN) + ESTIMATE_TOKENS_PER_MESSAGE * len(
        request.messages
    )
