"""A request's prefix key: the name of the leading prompt blocks an engine replica may hold in its KV
cache, computed the way the engine does when the pool names its tokenizer.

With a tokenizer (`Pool.tokenizer`, a model folder): a chat request's messages (and tools) are rendered
with the model's chat template (`tether.chat.ChatTemplate`, as `tether serve` does) and tokenized, a
completion's prompt string is tokenized as the engine does (special tokens added), token ids are taken as
they are; the key is then the engine's own block hash (`tether.block_hash`) of the first
`route_prefix_tokens // block_size` full blocks, never counting the block that holds the last prompt
token (the engine does not cache it). Without a tokenizer the key hashes the prompt's leading text
instead: the messages serialized as `role\\ncontent\\n`, or the prompt string, cut to 4 bytes per routed
token and down to a multiple of 64 bytes; token ids are still hashed exactly.

A prompt too short for one block (or 64 bytes) has no key. Keys only steer routing: a wrong one costs a
cache miss, never a wrong answer. It does not validate requests: the engine refuses what it cannot serve.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tether.block_hash import BlockHash, hash_prefix
from tether.chat.messages import ChatError, ToolSpec
from tether.chat.template import ChatTemplate
from tether.errors import ConfigError
from tether.gateway.config import Pool
from tether.gateway.plan import Kind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BYTES_PER_TOKEN = 4
"""The fallback's rough token size: English text averages about 4 bytes per BPE token."""
_TEXT_BLOCK_BYTES = 64


def load_tokenizer(folder: str, pool: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder, loaded as `tether serve` loads it (transformers, offline)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError, ... for a bad folder
        raise ConfigError(f"pool {pool!r}: tokenizer = {folder!r}: cannot load it: {error}") from None
    return tokenizer


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


class PrefixKeys:
    """Prefix keys for one pool's requests."""

    def __init__(
        self, block_size: int, prefix_tokens: int, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        assert block_size >= 1 and prefix_tokens >= block_size
        self.block_size = block_size
        self.prefix_blocks = prefix_tokens // block_size
        self.prefix_bytes = prefix_tokens * _BYTES_PER_TOKEN
        self.tokenizer = tokenizer
        # transformers' fast tokenizers set their truncation state on every call ("Already borrowed"
        # when two threads encode at once): keys are computed off the loop, one at a time
        self._lock = threading.Lock()
        self.template: ChatTemplate | None = None
        if tokenizer is not None:
            try:
                self.template = ChatTemplate(tokenizer)
            except ChatError:  # a base model: chat requests fall back to text keys
                self.template = None

    @classmethod
    def for_pool(cls, name: str, pool: Pool) -> PrefixKeys:
        tokenizer = None if pool.tokenizer is None else load_tokenizer(pool.tokenizer, name)
        return cls(pool.block_size, pool.route_prefix_tokens, tokenizer)

    @property
    def tokenizes(self) -> bool:
        """Whether keys cost a tokenization (worth running off the event loop)."""
        return self.tokenizer is not None

    def key(self, kind: Kind, body: dict[str, Any]) -> bytes | None:
        """The request's prefix key, or None when it has none (too short, or not renderable)."""
        if self.tokenizer is None:
            return self._key(kind, body)
        with self._lock:
            return self._key(kind, body)

    def _key(self, kind: Kind, body: dict[str, Any]) -> bytes | None:
        if kind == "text":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and _is_token_ids(prompt):
                return self.of_tokens(prompt)
            if not isinstance(prompt, str):
                return None
            if self.tokenizer is None:
                return self.of_text(prompt)
            try:
                return self.of_tokens([int(i) for i in self.tokenizer.encode(prompt)])
            except Exception:  # the engine will refuse it with the reason; here it only has no key
                return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        if self.template is not None:
            try:
                tools = [ToolSpec.from_openai(tool) for tool in body.get("tools") or []]
                return self.of_tokens(self.template.encode(messages, tools))
            except Exception:  # the engine will refuse it with the reason; here it only has no key
                return None
        text = "".join(f"{m.get('role')}\n{_content_text(m.get('content'))}\n" for m in messages)
        return self.of_text(text)

    def of_tokens(self, token_ids: Sequence[int]) -> BlockHash | None:
        """The engine's hash of the leading full blocks, the last prompt token's block excluded."""
        blocks = min(self.prefix_blocks, max(0, len(token_ids) - 1) // self.block_size)
        return hash_prefix(token_ids, self.block_size, blocks) if blocks else None

    def of_text(self, text: str) -> bytes | None:
        data = text.encode(errors="surrogatepass")
        size = min(self.prefix_bytes, len(data)) // _TEXT_BLOCK_BYTES * _TEXT_BLOCK_BYTES
        return hashlib.blake2b(data[:size], digest_size=16).digest() if size else None
