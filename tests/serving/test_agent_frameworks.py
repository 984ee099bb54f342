"""Agent frameworks driving `tether serve` (the real SmolLM2, over a socket) through their OpenAI chat
completions clients: the OpenAI Agents SDK runs a two-tool agent to its final answer, and
langchain-openai's `bind_tools` gets calls it can run and answers their results.

The first turn requires a call (`tool_choice` required or named): decoding is constrained, so the calls
are valid for the tools' schemas whatever the model's quality. Nothing reaches the network: tracing is
off and every client points at the local server.
"""

from __future__ import annotations

import json
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

MODEL = "smollm2-135m-instruct"


async def test_agents_sdk_runs_a_two_tool_agent_to_its_answer(smollm2_url: str) -> None:
    set_tracing_disabled(True)
    ran: list[tuple[str, dict[str, Any]]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        ran.append(("get_weather", {"city": city}))
        return f"Sunny and 21 C in {city}."

    @function_tool
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        ran.append(("add", {"a": a, "b": b}))
        return a + b

    client = AsyncOpenAI(base_url=smollm2_url, api_key="unused", max_retries=0, timeout=120)
    agent = Agent(
        name="helper",
        instructions="You answer with the help of your tools.",
        tools=[get_weather, add],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        # required on the first turn; the SDK resets it to auto once a tool ran, and the model answers
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
    )
    # Greedy SmolLM2 calls both tools for this wording (a plainer one gets `add` twice).
    result = await Runner.run(agent, "First get the weather in Paris, then add 2 and 3.", max_turns=4)
    await client.close()

    assert {name for name, _ in ran} == {"get_weather", "add"}, ran
    assert ("add", {"a": 2, "b": 3}) in ran
    items = [type(item).__name__ for item in result.new_items]
    assert "ToolCallItem" in items and "ToolCallOutputItem" in items
    assert items[-1] == "MessageOutputItem" and isinstance(result.final_output, str) and result.final_output
    assert "<tool_call>" not in result.final_output


def test_langchain_bind_tools_calls_and_answers_the_results(smollm2_url: str) -> None:
    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"Sunny and 21 C in {city}."

    @tool
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        return a + b

    tools = {"get_weather": get_weather, "add": add}
    chat = ChatOpenAI(
        base_url=smollm2_url, api_key="unused", model=MODEL, temperature=0, max_tokens=60, max_retries=0
    )
    question = HumanMessage("What is 2 + 3?")
    reply = chat.bind_tools(list(tools.values()), tool_choice="add").invoke([question])
    assert isinstance(reply, AIMessage) and [call["name"] for call in reply.tool_calls] == ["add"]
    arguments = reply.tool_calls[0]["args"]
    assert set(arguments) == {"a", "b"} and all(isinstance(value, int) for value in arguments.values())

    streamed: Any = None
    for chunk in chat.bind_tools(list(tools.values()), tool_choice="add").stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert isinstance(streamed, AIMessage)
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("add", arguments)]

    results = [
        ToolMessage(str(tools[c["name"]].invoke(c["args"])), tool_call_id=c["id"]) for c in reply.tool_calls
    ]
    answer = chat.bind_tools(list(tools.values())).invoke([question, reply, *results])
    assert isinstance(answer, AIMessage)
    assert answer.tool_calls or (isinstance(answer.content, str) and "<tool_call>" not in answer.content)
    json.dumps(answer.response_metadata.get("token_usage"))  # usage came back as plain JSON
