"""Chat templates with tools: a template that knows no tools gets the Hermes convention in text, one that
renders tools itself gets them natively, and one whose tool format is unknown is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tether.chat import ChatError, ToolCall, ToolSpec, assistant_message
from tether.chat.template import ChatTemplate
from tether.chat.tool_format import HERMES
from tether.testing import make_tiny_model

PYTHON = ToolSpec("python", "Run code.", {"type": "object", "properties": {"code": {"type": "string"}}})
# A tools-aware template in the style of Qwen2.5's (tools listed in the system turn, calls in <tool_call>).
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    assistant_message(
        "", [ToolCall("c0", "python", '{"code": "print(2+2)"}'), ToolCall("c1", "python", "{}")]
    ),
    {"role": "tool", "tool_call_id": "c0", "name": "python", "content": "4"},
    {"role": "tool", "tool_call_id": "c1", "name": "python", "content": ""},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    folder: Path = make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen2")
    return AutoTokenizer.from_pretrained(folder)


def test_a_template_without_tools_is_taught_the_hermes_convention(tokenizer: PreTrainedTokenizerBase) -> None:
    template = ChatTemplate(tokenizer)
    assert not template.native_tools and template.tool_format() is HERMES
    text = template.render(CONVERSATION, [PYTHON])
    assert text.count("<|im_start|>system") == 1 and json.dumps(PYTHON.openai()) in text
    assert HERMES.call_text(ToolCall("c0", "python", '{"code": "print(2+2)"}')) in text
    # Both results share one user turn, in order.
    assert (
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n\n</tool_response>" in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert template.encode(CONVERSATION, [PYTHON]) == tokenizer.encode(text, add_special_tokens=False)


def test_plain_chats_render_as_the_template_alone(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = CONVERSATION[:2]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ChatTemplate(tokenizer).render(messages) == expected


def test_a_template_that_knows_tools_renders_them_itself(tokenizer: PreTrainedTokenizerBase) -> None:
    tokenizer.chat_template = NATIVE_TEMPLATE + "{# <tool_call> #}"
    try:
        template = ChatTemplate(tokenizer)
        assert template.native_tools and template.tool_format() is HERMES
        text = template.render(CONVERSATION, [PYTHON])
        assert "TOOLS:python;" in text
        # Arguments reach the template as an object, as tool-aware templates expect.
        assert '"arguments": {"code": "print(2+2)"}' in text and "tool_call_id" not in text
    finally:
        del tokenizer.chat_template


def test_a_template_with_an_unknown_tool_format_is_refused_only_for_tools(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    tokenizer.chat_template = NATIVE_TEMPLATE.replace("<tool_call>", "[CALL]").replace(
        "</tool_call>", "[/CALL]"
    )
    try:
        template = ChatTemplate(tokenizer)
        assert template.render(CONVERSATION[:2])  # plain chats still render
        with pytest.raises(ChatError, match="format tether does not parse"):
            template.render(CONVERSATION, [PYTHON])
    finally:
        del tokenizer.chat_template


def test_the_real_smollm2_template_takes_the_text_convention(smollm2_folder: Path) -> None:
    template = ChatTemplate(AutoTokenizer.from_pretrained(smollm2_folder))
    assert not template.native_tools and template.tool_format() is HERMES
    assert "<tool_call>" in template.render(CONVERSATION, [PYTHON])
