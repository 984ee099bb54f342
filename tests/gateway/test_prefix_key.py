"""Prefix keys: the gateway's key of a request is the engine's own block hash of the same prompt, requests
sharing a long system prompt share a key, and the text fallback and bad settings behave as documented."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tether.block_hash import hash_prefix
from tether.engine.block_manager import BlockManager
from tether.engine.sequence import Sequence
from tether.errors import ConfigError
from tether.gateway.config import parse_gateway_config
from tether.gateway.prefix_key import PrefixKeys, load_tokenizer
from tether.models.loader import load_tokenizer as engine_tokenizer
from tether.serving.jobs import JobFactory
from tether.serving.openai_api import ChatCompletionRequest, CompletionRequest

from .conftest import TINY

SYSTEM = "You are the archive's librarian; answer from the catalogue below.\n" + "shelf row aisle " * 40
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "Find a book.", "parameters": {}}}
]


def chat(system: str, question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": TINY, "messages": messages, "max_tokens": 4, **extra}


def engine_hashes(tiny_path: Path, body: dict[str, Any], kind: str = "chat") -> list[bytes]:
    """What `tether serve` computes for the request: its job's token ids, hashed by the block manager."""
    tokenizer = engine_tokenizer(tiny_path)
    jobs = JobFactory(tokenizer, TINY, len(tokenizer), 2048)
    if kind == "chat":
        job = jobs.chat(ChatCompletionRequest.model_validate(body))
    else:
        job = jobs.text(CompletionRequest.model_validate(body))
    return BlockManager(256, 16).prompt_block_hashes(Sequence(0, "r", job.prompt_token_ids), 0)


@pytest.fixture(scope="module")
def keys(tiny_path: Path) -> PrefixKeys:
    return PrefixKeys(16, 256, load_tokenizer(str(tiny_path), "engine"))


@pytest.mark.parametrize(
    "body",
    [
        chat(SYSTEM, "Where is the atlas?"),
        chat(SYSTEM, "Where is the atlas?", tools=TOOLS),
        chat("short system prompt, long question", "where " * 60),
    ],
    ids=["chat", "chat-with-tools", "long-question"],
)
def test_a_chat_key_is_the_engines_hash_of_the_same_leading_blocks(
    keys: PrefixKeys, tiny_path: Path, body: dict[str, Any]
) -> None:
    hashes = engine_hashes(tiny_path, body)
    assert len(hashes) > 16  # the prompt is longer than the 256 routed tokens
    assert keys.key("chat", body) == hashes[256 // 16 - 1]


@pytest.mark.parametrize("prompt", [SYSTEM, [i % 250 for i in range(300)]], ids=["text", "token-ids"])
def test_a_completion_key_is_the_engines_hash_of_the_same_leading_blocks(
    keys: PrefixKeys, tiny_path: Path, prompt: str | list[int]
) -> None:
    body = {"model": TINY, "prompt": prompt, "max_tokens": 4}
    assert keys.key("text", body) == engine_hashes(tiny_path, body, "text")[256 // 16 - 1]


def test_a_prompt_shorter_than_the_routed_tokens_is_keyed_by_its_cacheable_blocks(
    keys: PrefixKeys, tiny_path: Path
) -> None:
    body = chat("brief", "hello there, librarian")  # two or three blocks in all
    hashes = engine_hashes(tiny_path, body)
    assert 1 <= len(hashes) < 16
    assert keys.key("chat", body) == hashes[-1]


def test_requests_sharing_a_long_system_prompt_share_a_key(keys: PrefixKeys) -> None:
    first = keys.key("chat", chat(SYSTEM, "Where is the atlas?"))
    assert first is not None
    assert keys.key("chat", chat(SYSTEM, "Who wrote the catalogue?")) == first
    assert keys.key("chat", chat("Another archive entirely. " + SYSTEM, "Where is the atlas?")) != first


def test_a_prompt_of_less_than_one_block_has_no_key(keys: PrefixKeys) -> None:
    assert keys.key("text", {"prompt": "hi"}) is None
    assert keys.key("text", {"prompt": list(range(16))}) is None  # its one block holds the last token
    assert keys.key("text", {"prompt": list(range(17))}) is not None


def test_an_unrenderable_request_has_no_key_and_the_engine_judges_it(keys: PrefixKeys) -> None:
    assert keys.key("chat", {"messages": "not a list"}) is None
    assert keys.key("chat", chat(SYSTEM, "q", tools=[{"type": "retrieval"}])) is None


def test_without_a_tokenizer_the_key_hashes_the_leading_text() -> None:
    keys = PrefixKeys(16, 64)  # 64 tokens: 256 bytes of text
    first = keys.key("chat", chat(SYSTEM, "Where is the atlas?"))
    assert first is not None
    assert keys.key("chat", chat(SYSTEM, "Something else entirely")) == first
    assert keys.key("chat", chat("Other " + SYSTEM, "Where is the atlas?")) != first
    assert keys.key("text", {"prompt": SYSTEM}) == keys.key("text", {"prompt": SYSTEM + " more"})
    assert keys.key("text", {"prompt": "too short for 64 bytes"}) is None
    ids = list(range(100))
    assert keys.key("text", {"prompt": ids}) == hash_prefix(ids, 16, 4)  # token ids stay exact


def test_a_base_model_without_a_chat_template_keys_chats_by_text(tiny_path: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_path), "engine")
    tokenizer.chat_template = None
    keys = PrefixKeys(16, 64, tokenizer)
    assert keys.template is None
    assert keys.key("chat", chat(SYSTEM, "q")) == PrefixKeys(16, 64).key("chat", chat(SYSTEM, "q"))


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"tokenizer": "/no/such/model"}, "'/no/such/model': no such folder"),
        ({"load_factor": 0.5}, "load_factor"),
        ({"route_prefix_tokens": 8}, "route_prefix_tokens = 8: expected at least block_size (16)"),
        ({"urls": ["http://a:1", "http://a:1/"]}, "each replica once"),
        ({"health_path": "healthz"}, "expected a path starting with /"),
        ({"routing": "random"}, "routing"),
    ],
)
def test_bad_routing_settings_are_refused_naming_the_value(pool: dict[str, Any], message: str) -> None:
    settings = {"urls": ["http://127.0.0.1:8000"], **pool}
    with pytest.raises(ConfigError) as refused:
        parse_gateway_config({"pools": {"default": settings}})
    assert message in str(refused.value)


def test_a_folder_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no tokenizer\.json or tokenizer_config\.json"):
        parse_gateway_config({"pools": {"default": {"urls": ["http://a:1"], "tokenizer": str(tmp_path)}}})


def test_a_tokenizer_that_cannot_load_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"pool 'default': tokenizer = .*cannot load it"):
        load_tokenizer(str(tmp_path), "default")
