"""An agent function as the environment: ``[env] name = "agent"``.

The agent is your own code, written against the OpenAI API::

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float | AgentResult

It runs as many turns as it likes and edits its own message list as it likes; each request goes to
one session of compactrl's engine (through ``compactrl serve``'s app, in process), so the messages
it drops are evicted in place and only new ones are fed. One call is one episode, the session's
stream its training sample, the returned reward its reward. Tasks come from a JSON-lines file (seed
``s`` plays line ``s mod n``; held-out seeds play ``eval_tasks``) or from a function ``seed -> task``.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from compactrl.envs.base import HELD_OUT_SEED, EnvSettings
from compactrl.envs.registry import load_class


@dataclass
class AgentResult:
    """What an agent may return instead of a bare reward."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)  # kept with the episode's metrics
    truncated: bool = False  # the agent ran out of turns (a non-completion, as a rollout's turn limit)


class AgentConfig(EnvSettings):
    name: Literal["agent"] = "agent"
    agent: str = Field(
        description="the agent: 'package.module:function', an `async def f(client, task)` returning the "
        "reward (a float or an AgentResult); client is an openai.AsyncOpenAI on this run's engine"
    )
    tasks: str = Field(
        description="the tasks: a JSON-lines file (one JSON value per line; seed s plays line s mod n), or "
        "'package.module:function' taking the seed and returning the task"
    )
    eval_tasks: str | None = Field(
        None,
        description="held-out tasks (seeds >= 10^9), the same forms; unset: a tasks function gets the "
        "held-out seed, a tasks file is reused",
    )
    timeout_s: float = Field(600.0, gt=0, description="an episode (one agent call) that runs longer fails")

    @field_validator("agent")
    @classmethod
    def _agent(cls, v: str) -> str:
        fn = load_class(v)
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(
                f"{v} is not an async function; write it as `async def {v.split(':')[-1]}(client, task)`"
            )
        return v

    @field_validator("tasks", "eval_tasks")
    @classmethod
    def _tasks(cls, v: str | None) -> str | None:
        if v is not None:
            _source(v)  # read now: a missing file or a bad line is named before anything runs
        return v

    @model_validator(mode="after")
    def _served(self):
        try:
            import fastapi  # noqa: F401
            import openai  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"the agent env serves its client: pip install 'compactrl[agent]' ({e})"
            ) from None
        return self


def _source(spec: str):
    """A task source: a list of tasks (from a JSON-lines file) or a function of the seed."""
    if ":" in spec and not Path(spec).exists():
        fn = load_class(spec)
        if not callable(fn):
            raise ValueError(f"{spec} is not callable; give a function seed -> task")
        return fn
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"tasks file {path} does not exist (or give 'package.module:function')")
    tasks = []
    for k, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{k} is not JSON ({e})") from None
    if not tasks:
        raise ValueError(f"tasks file {path} holds no task")
    return tasks


class AgentEnv:
    """Not a reset/step env: the episode runner calls :meth:`task` and :attr:`agent` itself."""

    Config = AgentConfig
    name = "agent"

    def __init__(self, agent: str, tasks: str, eval_tasks: str | None = None, timeout_s: float = 600.0):
        self.agent = load_class(agent)
        self.tasks, self.eval_tasks = _source(tasks), _source(eval_tasks) if eval_tasks else None
        self.timeout_s = timeout_s

    def task(self, seed: int) -> Any:
        source = self.eval_tasks if seed >= HELD_OUT_SEED and self.eval_tasks is not None else self.tasks
        if callable(source):
            return source(seed)
        return source[(seed - HELD_OUT_SEED if seed >= HELD_OUT_SEED else seed) % len(source)]

    def close(self) -> None:
        pass
