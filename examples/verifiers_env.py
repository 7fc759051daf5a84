"""compactrl's counting task as a verifiers environment (verifiers 0.4's `verifiers.v1` API).

Train it with ``compactrl train examples/verifiers_env.toml``. It is what a verifiers environment
package holds: a taskset (rows in memory, nothing downloaded), a task that scores its trace with a
``@vf.reward``, an env whose ``run`` plays the user (it answers each reply with the right number,
as compactrl's ``count`` env does) and a harness, the agent's loop, run in process: one model call
per segment, so no program is installed in a sandbox. compactrl runs verifiers' own episode
(``Env.run_episode``) and the reward is the trace's, as verifiers scores it.

Named by import path (``[env] load = "examples/verifiers_env.py:load_environment"``) or, with this
folder on the path, by id like an installed one (``[env] id = "verifiers_env"``).
"""

import difflib
import random

import openai
import verifiers.v1 as vf


class CountConfig(vf.TasksetConfig):
    rows: int = 64
    turns: int = 3


class CountData(vf.TaskData):
    start: int
    turns: int


def score(reply: str, target: int) -> float:
    """The ``count`` env's shaping: 1 for the exact number, else credit for digits and similarity."""
    text, want = reply.strip(), str(target)
    if text == want:
        return 1.0
    digits = sum(c.isdigit() for c in text) / max(len(text), 1)
    return 0.5 * digits + 0.4 * difflib.SequenceMatcher(None, text, want).ratio()


class CountTask(vf.Task[CountData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def counted(self, trace) -> float:
        """Each reply against the number due then; a reply never given scores 0."""
        replies = [m.content or "" for m in trace.assistant_messages]
        due = range(self.data.start + 1, self.data.start + 1 + self.data.turns)
        return sum(score(r, n) for r, n in zip(replies, due)) / self.data.turns


class CountTaskset(vf.Taskset[CountTask, CountConfig]):
    def load(self):
        rng = random.Random(0)
        for i in range(self.config.rows):
            start = rng.randint(1, 50)
            prompt = f"Count upward. Each turn, reply with only the next number.\n\n{start}"
            data = CountData(idx=i, prompt=prompt, start=start, turns=self.config.turns)
            yield CountTask(data, self.config.task)


class CountEnvConfig(vf.EnvConfig):
    # a local runtime: verifiers' default places the agent in a remote sandbox
    agent: vf.AgentConfig = vf.AgentConfig(runtime={"type": "subprocess"})


class CountEnv(vf.Env[CountEnvConfig]):
    async def run(self, task, agents):
        """The user: each reply is answered with the number that was due, as in ``count``."""
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for k in range(1, task.data.turns):
                if segment.terminated:
                    break
                segment = await chat.turn(str(task.data.start + k))


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """The agent's loop in process: each segment sends the conversation and takes one answer."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # a later segment is a relaunch on the whole conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [{"role": m.role, "content": vf.types.content_text(m.content)} for m in prompt]
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(0, reply.choices[0].message.content or "", "")


__all__ = ["CountTaskset", "CountEnv", "ChatHarness"]


def load_environment(rows: int = 64, turns: int = 3, task: dict | None = None, **env) -> vf.Env:
    """The env, as ``[env] load`` names it: this module is its own taskset id (it is imported). ``task``
    is verifiers' task config (judges, plugged rewards); ``env`` the rest of its env config."""
    config = {"taskset": {"id": __name__, "rows": rows, "turns": turns, "task": task or {}}, **env}
    return vf.load_environment(vf.resolve_env_config(config))
