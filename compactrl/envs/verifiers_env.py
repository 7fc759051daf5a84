"""A verifiers environment as the env: ``[env] name = "verifiers"``.

verifiers (the environment library prime-rl trains with; its ``verifiers.v1`` API) runs an episode
itself: its env plays one of its taskset's tasks with agents whose loop (the harness) calls a model
through verifiers' interception server, and the task scores each trace (``@vf.reward``). Here one
episode is one ``Env.run_episode`` whose model is this run's engine: verifiers' model client is
pointed at a loopback relay that sends each request through the episode's ``openai.AsyncOpenAI``,
a session of ``compactrl serve``'s app (:mod:`compactrl.agent.served`). So the env is an agent env
whose agent is verifiers' episode: the session's stream is the training sample, the trainable
traces' reward the reward, and the runner, its timeout and its failure handling are the agent env's.

Tasks are the taskset's rows: seed ``s`` plays row ``s mod n`` (an infinite taskset: row ``s``);
held-out seeds (>= 10^9) play the rows of the env ``eval_args`` makes, else the same rows.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import httpx
from pydantic import Field, model_validator

from compactrl.envs.agent import AgentEnv, AgentResult
from compactrl.envs.base import HELD_OUT_SEED, EnvSettings
from compactrl.envs.registry import load_class

INSTALL = "pip install 'compactrl[verifiers]'"
KEY_VAR = "COMPACTRL_VERIFIERS_API_KEY"  # unset: verifiers sends "EMPTY", which the relay ignores
# verifiers' run limits: the agent ran out of turns (its last answer cut at max_tokens is not that)
LIMITS = ("max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens")


class VerifiersConfig(EnvSettings):
    name: Literal["verifiers"] = "verifiers"
    id: str | None = Field(
        None,
        description="an installed verifiers environment: its taskset id, as `vf-eval` takes it (args is "
        "then the rest of verifiers' [env] table, e.g. {agent = {runtime = {type = 'subprocess'}}}: "
        "verifiers' default runtime is a remote sandbox)",
    )
    load: str | None = Field(
        None, description="or 'package.module:function' (or 'file.py:function') returning a verifiers Env"
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="with id: verifiers' env config; with load: the function's kwargs"
    )
    eval_args: dict[str, Any] | None = Field(
        None,
        description="held-out seeds' env: these merged over args (e.g. another split); unset: the same rows",
    )
    timeout_s: float = Field(600.0, gt=0, description="a verifiers episode that runs longer fails")

    @model_validator(mode="after")
    def _check(self):
        try:
            import aiohttp  # noqa: F401
            import fastapi  # noqa: F401
            import openai  # noqa: F401
            import verifiers.v1 as vf
        except ImportError as e:
            raise ValueError(f"the verifiers env needs verifiers: {INSTALL} ({e})") from None
        if (self.id is None) == (self.load is None):
            raise ValueError("give one of id (an installed verifiers environment) and load (a function)")
        if self.load is not None and not callable(load_class(self.load)):
            raise ValueError(f"{self.load} is not callable; give a function returning a verifiers Env")
        if self.id is not None:  # resolving imports the taskset: a bad id or a bad field is named now
            try:
                vf.resolve_env_config(_config(self.id, self.args))
            except (ImportError, ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"verifiers cannot make env {self.id!r}: {type(e).__name__}: {e}") from None
        return self


def _merge(base: dict, over: dict) -> dict:
    """``over`` on ``base``, tables merged key by key (as verifiers merges its config layers)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _config(id: str, args: dict) -> dict:
    return _merge(args, {"taskset": {"id": id}})


def _load(id: str | None, load: str | None, args: dict):
    import verifiers.v1 as vf

    if load is not None:
        env = load_class(load)(**args)
    else:
        env = vf.load_environment(vf.resolve_env_config(_config(id, args)))
    if not isinstance(env, vf.Env):
        raise TypeError(f"{load or id} made a {type(env).__name__}, not a verifiers Env (verifiers.v1.Env)")
    return env


class VerifiersEnv(AgentEnv):
    """An :class:`AgentEnv` whose agent runs one verifiers episode on the task's row."""

    Config = VerifiersConfig
    name = "verifiers"

    def __init__(
        self,
        id: str | None = None,
        load: str | None = None,
        args: dict | None = None,
        eval_args: dict | None = None,
        timeout_s: float = 600.0,
    ):
        self.envs = {"train": _load(id, load, args or {})}
        if eval_args is not None:
            self.envs["eval"] = _load(id, load, _merge(args or {}, eval_args))
        self.rows: dict[str, list | None] = {}  # a bounded taskset's rows, read at its first task
        self.picked: dict[tuple[str, int], Any] = {}  # an infinite one's rows, as they are played
        self.agent, self.timeout_s = self._solve, timeout_s

    def task(self, seed: int) -> dict:
        split = "eval" if seed >= HELD_OUT_SEED and "eval" in self.envs else "train"
        k = seed - HELD_OUT_SEED if seed >= HELD_OUT_SEED else seed
        taskset = self.envs[split].taskset
        if split not in self.rows:
            self.rows[split] = None if taskset.INFINITE else list(taskset)
            if self.rows[split] == []:
                raise ValueError(f"the verifiers taskset {taskset.config.id!r} has no task")
        rows = self.rows[split]
        row = k % len(rows) if rows is not None else k
        if rows is None and (split, row) not in self.picked:
            self.picked[split, row] = next(itertools.islice(taskset, row, None))
        t = rows[row] if rows is not None else self.picked[split, row]
        return {"split": split, "row": row, "key": t.key}

    async def _solve(self, client, task: dict) -> AgentResult:
        """verifiers' episode of the task, its model this episode's session."""
        import verifiers.v1 as vf

        split, row = task["split"], task["row"]
        vf_task = self.rows[split][row] if self.rows[split] is not None else self.picked[split, row]
        env = copy.copy(self.envs[split])  # serving() binds its interception and tools to the env object
        async with _relay(client) as url:
            model = vf.EvalClientConfig(base_url=url, api_key_var=KEY_VAR)
            async with env.serving():
                episode = await env.run_episode(vf_task, vf.ModelContext(model="compactrl", client=model))
        return _result(episode, model)


def _result(episode, model) -> AgentResult:
    """The reward of the policy's traces (an env's fixed agents, e.g. a simulated user, are not). A
    fixed agent must call a model of its own: its calls here would be trained on, in the session."""
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        why = f"{errors[-1].type}: {errors[-1].message}" if errors else "a trace did not complete"
        raise RuntimeError(f"the verifiers episode failed: {why}")
    fixed = [
        t.agent.name
        for t in episode.traces
        if not t.agent.trainable and t.calls and t.agent.config.client == model
    ]
    if fixed:
        raise RuntimeError(
            f"verifiers' fixed agent {fixed[0]!r} called the policy's model; give it one of its "
            f"own (its client and model in args, e.g. [env.args.{fixed[0]}] client = {{...}})"
        )
    played = [t for t in episode.traces if t.agent.trainable]
    if not played:
        raise RuntimeError("the verifiers episode has no trainable trace")
    info = [{"rewards": {k: None if r is None else r.value for k, r in t.rewards.items()},
             "metrics": t.metrics, "stop": t.stop_condition} for t in played]  # fmt: skip
    reward = sum(t.reward for t in played) / len(played)
    return AgentResult(reward, {"verifiers": info}, truncated=any(t.stop_condition in LIMITS for t in played))


@asynccontextmanager
async def _relay(client) -> AsyncIterator[str]:
    """A loopback URL whose POSTs ``client`` sends on: verifiers' model client takes an endpoint URL,
    and the episode's client reaches the engine in process, through no socket of its own."""
    import openai
    from aiohttp import web

    async def forward(request: web.Request) -> web.Response:
        try:
            reply = await client.post(
                f"/{request.match_info['path']}", cast_to=httpx.Response, body=await request.json()
            )
        except openai.APIStatusError as e:  # the server's refusal goes back as it is, to be recorded
            reply = e.response
        kind = reply.headers.get("content-type", "application/json")
        return web.Response(body=reply.content, status=reply.status_code, headers={"Content-Type": kind})

    app = web.Application(client_max_size=1 << 30)  # a long conversation is one request
    app.router.add_post("/v1/{path:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}/v1"
    finally:
        await runner.cleanup()
