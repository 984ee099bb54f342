"""The chat types every subsystem exchanges with a model, and the one seam to reach a model."""

from tether.chat.completion import ChatClient, ChatRequest, Completion, FinishReason, Usage
from tether.chat.messages import (
    ChatError,
    JsonDict,
    Message,
    Messages,
    ToolCall,
    ToolResult,
    ToolSpec,
    assistant_message,
    message_text,
    tool_calls_of,
)

__all__ = [
    "ChatClient",
    "ChatError",
    "ChatRequest",
    "Completion",
    "FinishReason",
    "JsonDict",
    "Message",
    "Messages",
    "ToolCall",
    "ToolResult",
    "ToolSpec",
    "Usage",
    "assistant_message",
    "message_text",
    "tool_calls_of",
]
