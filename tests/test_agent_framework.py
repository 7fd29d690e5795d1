"""One real agent framework, the OpenAI Agents SDK, driving `clover serve`'s chat completions on the
demo model end to end: the SDK sends its strict tool schema, the server constrains the call's
arguments, the SDK parses the call and runs the tool. First with the call forced (tool_choice names
the tool, whose schema is not the demo tools') and the run stopped at the tool's result: the
framework ran the tool with arguments that follow its schema. Then the whole loop on a demo tool, the
model deciding to call and answering from the result."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
import torch

import clover
from clover.engine import Engine, EngineOptions
from clover.server.app import create_app
from clover.tokenization import CloverTokenizer
from test_server import Server

agents = pytest.importorskip("agents")
pytest.importorskip("llguidance")

MODEL = "clover-demo"


@pytest.fixture(scope="module")
def server():
    """`clover serve`'s app on loopback for the demo model, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(clover.load(), EngineOptions(max_batch=2, max_queue=4))
    srv = Server(create_app(engine, CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR), MODEL))
    yield srv
    assert srv.stop()
    torch.set_num_threads(threads)


def test_agents_sdk_runs_a_tool_through_clover(server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)                  # no trace export (nothing leaves the machine)
    calls = []

    @function_tool
    def convert(value: float, unit: str, to: str) -> str:
        """Convert a quantity from one unit to another."""
        calls.append((value, unit, to))
        return f"converted {value} {unit} to {to}"

    async def run():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        agent = Agent(name="converter", instructions="Use the convert tool.", tools=[convert],
                      model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(tool_choice="convert", max_tokens=192),
                      tool_use_behavior="stop_on_first_tool")
        return await Runner.run(agent, "Convert 5 km to miles.")

    result = asyncio.run(run())
    assert len(calls) == 1
    value, unit, to = calls[0]
    assert isinstance(value, float) and isinstance(unit, str) and isinstance(to, str)
    assert result.final_output == f"converted {value} {unit} to {to}"
    from agents.models.chatcmpl_converter import Converter
    assert Converter.tool_to_openai(convert)["function"]["strict"] is True     # what the server enforced


@pytest.mark.parametrize("decoding", [{}, {"decoding": "self_speculative"}])
def test_agents_sdk_agent_loop_on_the_demo_tools(server, decoding):
    """The whole agent loop, the model deciding (tool_choice auto), with the server's default decoding
    (LowConfidence) and self-speculative: the SDK offers `convert` as its
    function tool (pydantic-built, strict), the model calls it with the question's arguments, the SDK
    runs it and sends the result back, and the model's final answer reads it."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    from clover.training.tool_tasks import run_tool

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def convert(value: float, unit: Literal["km", "m", "cm", "mm"], to: Literal["km", "m", "cm", "mm"]) -> str:
        """Convert a length to another unit."""
        calls.append((value, unit, to))
        return run_tool("convert", {"value": value, "unit": unit, "to": to})

    async def run(question):
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        agent = Agent(name="converter", instructions="Use the tools when they help.", tools=[convert],
                      model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(max_tokens=128, extra_body=decoding))
        return await Runner.run(agent, question, max_turns=3)

    result = asyncio.run(run("Convert 25 km to m."))
    assert calls == [(25.0, "km", "m")]
    assert result.final_output.strip() == "25000 m"
