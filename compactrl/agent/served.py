"""Episodes of an agent function (``[env] name = "agent"``): each one is a session of ``compactrl
serve``'s app, served in process on the run's engine.

The agent gets an ``openai.AsyncOpenAI`` whose requests reach the app directly (an httpx ASGI
transport: no socket, no port). Each request is named for the episode's session, so the messages the
agent drops are evicted in place and only new ones are fed; the episodes of one task (a GRPO group)
name one session group, so their common first prompt is fed once and forked. The run's sampling
settings and its server-side compaction (``[strategy]``, ``[evictor]``, ``mode``) are filled in, so
the data depends on the config and the seeds as a built-in env's does. After the call the session's
stream (and any SideQuest threads') are the episode's traces and the session is closed. An agent
that raises, hangs past ``timeout_s`` or returns no reward fails its own episode only.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict

import httpx
import numpy as np

from compactrl.agent.chat import ChatFormat
from compactrl.agent.rollout import EpisodeResult, RolloutSettings
from compactrl.engine import Engine
from compactrl.envs.agent import AgentEnv, AgentResult
from compactrl.trace import Trace

GENERATING = ("/v1/chat/completions", "/v1/completions")
SESSION_STATS = ("compactions", "pick_fallbacks", "aux_calls", "aux_tokens", "deleted_cursors",
                 "aux_parse_failures", "aux_no_room", "aux_unknown_cursors", "aux_kept_unread")  # fmt: skip


class SessionTransport(httpx.AsyncBaseTransport):
    """One episode's requests: ``forced`` fields always (its session, the run's sampling and
    compaction, the served model's name), each request seeded in turn; ``defaults`` where the agent
    did not say (``max_tokens``)."""

    def __init__(self, app_transport: httpx.AsyncBaseTransport, forced: dict, defaults: dict, seed: int):
        self.inner, self.forced, self.defaults, self.seed = app_transport, forced, defaults, seed
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path in GENERATING:
            body = json.loads(request.content or b"{}")
            body = self.defaults | body | self.forced | {"seed": self.seed + self.requests}
            self.requests += 1
            headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
            request = httpx.Request("POST", request.url, headers=headers, content=json.dumps(body).encode())
        return await self.inner.handle_async_request(request)


def _result(out) -> AgentResult:
    result = out if isinstance(out, AgentResult) else AgentResult(out)
    r = result.reward
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        raise ValueError(f"the agent returned {out!r}; return a finite number (the reward) or an AgentResult")
    return result


async def run_agent_episodes(
    engine: Engine,
    fmt: ChatFormat,
    env: AgentEnv,
    strategy,
    mode: str,
    settings: RolloutSettings,
    seeds: list[int],
    concurrency: int,
    advance: Callable[[], None],
    sample_seeds: list[int],
    evictor=None,
) -> list[EpisodeResult]:
    """One agent call per seed, ``concurrency`` at a time, on ``engine`` behind an in-process server."""
    import openai

    if strategy is not None and mode != "full" and strategy.params.get("parallel"):
        raise ValueError("an agent env runs SideQuest's thread in its session, where it is sequential: set "
                         "strategy.parallel = false")  # fmt: skip

    from compactrl.serve.app import create_app
    from compactrl.serve.server import Server

    server = Server(engine, model_name="compactrl", fmt=fmt, max_sessions=max(1024, concurrency),
                    max_queue=max(256, 4 * concurrency))  # fmt: skip
    server.worker.thread_adapter = getattr(strategy, "params", {}).get("thread_adapter")  # loaded by the run
    app = httpx.ASGITransport(app=create_app(server))
    name = strategy.name if strategy is not None and mode != "full" else "none"
    forced = {
        "model": server.model_name,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        "ignore_eos": settings.ignore_eos,
    }
    if mode != "full" and strategy is not None:
        forced["strategy"] = strategy.params
    if mode == "stream" and evictor is not None:
        forced["evictor"] = evictor.model_dump()
    if mode == "reprefill":
        forced["compaction"] = "reprefill"
    gate = asyncio.Semaphore(concurrency)
    per_seed = Counter(seeds)  # a task played more than once: a GRPO group, one session group

    async def one(i: int, seed: int) -> EpisodeResult:
        async with gate:
            result = EpisodeResult(i, seed, env.name, mode, name)
            sid = f"agent-{seed}-{sample_seeds[i]}-{i}"
            defaults = {"max_tokens": settings.max_tokens}
            named = {"session_id": sid} | ({"group": f"seed-{seed}"} if per_seed[seed] > 1 else {})
            transport = SessionTransport(app, forced | named, defaults, sample_seeds[i] * 100_003)
            t0 = time.monotonic()
            async with httpx.AsyncClient(
                transport=transport, base_url="http://compactrl", timeout=None
            ) as http:
                client = openai.AsyncOpenAI(
                    base_url="http://compactrl/v1", api_key="compactrl", http_client=http, max_retries=0
                )
                try:
                    task = env.task(seed)
                    result.info["task"] = task
                    out = _result(await asyncio.wait_for(env.agent(client, task), env.timeout_s))
                    result.reward, result.truncated = float(out.reward), out.truncated
                    result.info |= out.info
                except TimeoutError:
                    result.error = f"the agent did not return within timeout_s = {env.timeout_s:g} s"
                except Exception as e:  # noqa: BLE001 - an agent's failure ends its own episode only
                    result.error = f"{type(e).__name__}: {e}"
            result.wall_s, result.turns = time.monotonic() - t0, transport.requests
            rows, stats = await server.worker.call(lambda: _close(server, sid))
            _fill(result, rows, stats, engine.position_limit)
            advance()
            return result

    server.worker.start()
    try:
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(seeds)))
    finally:
        server.worker.stop()


def _close(server, sid: str) -> tuple[list[dict], dict]:
    """Engine thread: the session's traces and counters, and the session closed (a generation an
    interrupted agent left running is cancelled first)."""
    cs = server.worker.sessions.pop(sid, None)
    if cs is None:
        return [], {}
    cs.stream.cancel()
    rows, stats = cs.trace(), dict(cs.stats) | asdict(cs.stream.metrics)
    stats["prefill_tokens"] += cs.rooted  # its group's shared prompt, fed once for all (by the first)
    if not cs.busy:  # else the request still settling closes it (it is no longer the worker's)
        cs.close()
    return rows, stats


def _fill(result: EpisodeResult, rows: list[dict], stats: dict, position_limit: int) -> None:
    traces = [Trace.from_dict(r) for r in rows]
    result.traces = [t for t in traces if not t.meta.get("aux")]
    result.aux_traces = [t for t in traces if t.meta.get("aux")]
    for i, t in enumerate(result.traces):  # what a rollout's traces say of their episode
        t.meta = {"env": result.env, "seed": result.seed, "mode": result.mode, "strategy": result.strategy,
                  "episode": result.episode, "segment": i, "reward": result.reward, "actions": result.turns,
                  "position_limit": position_limit}  # fmt: skip
    if not result.traces and result.error is None:
        result.error = "the agent made no request (its episode has no stream to train on)"
    for k in SESSION_STATS:
        setattr(result, k, stats.get(k, 0))
    result.segments = max(1, len(result.traces))
    result.tokens = sum(len(t) for t in result.traces)
    result.generated_tokens = int(sum(t.trainable.sum() for t in result.traces))
    result.prefilled_tokens = stats.get("prefill_tokens", 0)  # what the engine fed for this episode
    result.reprefilled_tokens = stats.get("reprefilled_tokens", 0)
    for k in ("evicted_tokens", "evictions", "kv_reads", "peak_live_kv", "preemptions"):
        setattr(result, k, stats.get(k, 0))
    result.peak_kv_with_threads = result.peak_live_kv
    if result.traces and result.error is None:
        last = result.traces[-1]
        ends = np.flatnonzero(last.trainable)
        if len(ends):
            result.step_rewards = [(len(result.traces) - 1, int(ends[-1]), result.reward)]
