"""The counting task as your own OpenAI-client agent: compactrl's ``count`` env, played by a plain loop.

Train it with ``compactrl train examples/count_agent.toml``; each call of ``solve`` is one episode,
served by a session of the run's engine. The loop is what any harness does: send the messages,
append the answer and the next observation, send them again.
"""

from compactrl.envs.count import CountEnv


def task(seed: int) -> dict:
    """The task of episode ``seed`` (held-out seeds, >= 10^9, are new starting numbers too)."""
    return {"seed": seed, "turns": 6}


async def solve(client, task: dict) -> float:
    env = CountEnv(turns=task["turns"])
    first = env.reset(task["seed"])
    messages = [{"role": "user", "content": first.task}, {"role": "user", "content": first.observation}]
    reward, max_tokens = 0.0, first.max_tokens
    while True:
        reply = await client.chat.completions.create(model="local", messages=messages, max_tokens=max_tokens)
        action = reply.choices[0].message.content
        step = env.step(action)
        reward += step.reward
        messages.append({"role": "assistant", "content": action})
        if step.done:
            return reward
        messages.append({"role": "user", "content": step.observation})
        max_tokens = step.max_tokens or max_tokens
