"""The browse env as your own OpenAI-client agent, with the context edit harnesses make.

The model calls ``search``/``open``/``answer`` in text; the harness runs each call on the browse
world and sends the output back. To bound its context it keeps only the newest ``window`` tool
outputs: an older output goes with the call that made it (a cursor rule in the harness). Served by
compactrl, each removal is an eviction in place, so this loop is, token for token, the built-in
browse env under ``[strategy] name = "keep_last_cursors"`` (tests/test_agent_env.py checks that).
Train it with ``compactrl train examples/browse_agent.toml``.
"""

from compactrl.envs.agent import AgentResult
from compactrl.envs.browse import BrowseEnv


def task(seed: int) -> dict:
    return {"seed": seed, "window": 2, "max_turns": 16, "env": {"min_hops": 2, "max_hops": 2}}


async def harness(client, env, seed: int, window: int, max_turns: int) -> AgentResult:
    """Play one episode of a tool env (``reset``/``step``, ``info["cursor"]`` on tool outputs)."""
    first = env.reset(seed)
    messages = [{"role": "system", "content": first.system}] if first.system else []
    messages.append({"role": "user", "content": first.task})
    outputs = []  # (call, output) messages of the steps that hold a tool output, oldest first
    reward, max_tokens = 0.0, first.max_tokens
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="local", messages=messages, max_tokens=max_tokens)
        call = {"role": "assistant", "content": reply.choices[0].message.content}
        step = env.step(call["content"])
        reward += step.reward
        messages.append(call)
        if step.done:
            return AgentResult(reward)
        output = {"role": "user", "content": step.observation}
        messages.append(output)
        if step.info.get("cursor") is not None:
            outputs.append((call, output))
        while len(outputs) > window:  # the oldest output and its call leave the context
            gone = outputs.pop(0)
            messages = [m for m in messages if m is not gone[0] and m is not gone[1]]
        max_tokens = step.max_tokens or max_tokens
    return AgentResult(reward, truncated=True)  # out of turns


async def solve(client, task: dict) -> AgentResult:
    return await harness(client, BrowseEnv(**task["env"]), task["seed"], task["window"], task["max_turns"])
