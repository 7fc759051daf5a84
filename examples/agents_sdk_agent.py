"""An agent written with the OpenAI Agents SDK, trained by compactrl unchanged but for its client.

It has one function tool. Deployed, its model would be ``OpenAIChatCompletionsModel(model=...,
openai_client=AsyncOpenAI())``; here ``solve`` is handed compactrl's client (an ``openai.AsyncOpenAI``
served by the run's engine, each call one session) and passes it to the same model class: that is
the only change. The server renders the tool with the model's chat template and parses the calls
(``hermes``); every session's stream is a training sample; the reward is whether the final answer
holds the product. ``compactrl train examples/agents_sdk_agent.toml``.
"""

import random

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)  # the SDK would export its traces to OpenAI; nothing leaves this machine


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def task(seed: int) -> dict:
    rng = random.Random(seed)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return {"question": f"What is {a} times {b}?", "answer": a * b}


async def solve(client, task: dict) -> float:
    agent = Agent(
        name="calculator",
        instructions="Answer arithmetic questions. Use the multiply tool, then give the number.",
        tools=[multiply],
        model=OpenAIChatCompletionsModel(model="local", openai_client=client),
    )
    result = await Runner.run(agent, task["question"], max_turns=4)
    return float(str(task["answer"]) in str(result.final_output))
