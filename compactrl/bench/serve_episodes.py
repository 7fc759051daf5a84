"""`compactrl bench serve-episodes CONFIG`: an environment's episodes played over HTTP against
`compactrl serve`, one row per session setting, under one KV pool.

The client is the environment's loop written against the OpenAI API, as an agent harness writes it:
the system message and the task, then per turn a greedy answer and the environment's observation as
the next user message, all in one session. A row's session settings (a strategy, SideQuest's thread,
an evictor, re-prefill) compact the stream on the server; full context is the row without them.
Each row gets a fresh server with the same pool, threads and model, and plays the same episodes
(env seeds), ``concurrency`` at a time.

Per row: completed episodes per second, the pool's peak and preemptions (scraped from the server's
``/metrics``), accuracy with its 95% interval and its paired difference to the first row on the same
episodes, and the sessions' SideQuest counters. This is SideQuest's serving measurement (its paper
measures throughput in SGLang) on this server.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compactrl.bench.harness import machine_info
from compactrl.bench.serve import launch, stop
from compactrl.compaction import StrategyConfig
from compactrl.compaction.evictors import EvictorConfig
from compactrl.config import read_toml
from compactrl.envs import EnvConfig, make_env
from compactrl.stats import compare, fmt_ci, mean_ci, verdict


class Row(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    strategy: StrategyConfig | None = Field(
        None, description="the sessions' own strategy (none: full context)"
    )
    evictor: EvictorConfig | None = None
    compaction: Literal["stream", "reprefill"] = "stream"


class EpisodeBench(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="model folder the server loads")
    env: EnvConfig
    episodes: int = Field(100, ge=1)
    seed: int = Field(10**9, ge=0, description="the first env seed (held-out seeds start at 10**9)")
    concurrency: int = Field(25, ge=1, description="episodes in flight at once")
    kv_pool_tokens: int = Field(8192, gt=0)
    threads: int = Field(2, ge=1, description="the server's torch threads")
    max_turns: int = Field(12, ge=1)
    max_tokens: int = Field(64, ge=1, description="per answer (an env's hint may lower it)")
    thread_adapter: str | None = Field(None, description="SideQuest's thread adapter, loaded by the server")
    results: str = Field(description="JSON file of the rows")
    row: list[Row] = Field(min_length=1)

    @model_validator(mode="after")
    def _paths(self):
        if not (Path(self.model) / "config.json").exists():
            raise ValueError(f"model {self.model} has no config.json: train or import it first")
        if self.thread_adapter is not None and not Path(self.thread_adapter).is_dir():
            raise ValueError(f"thread_adapter {self.thread_adapter} is not a checkpoint folder")
        return self


def load_episode_bench(path: str | Path) -> EpisodeBench:
    return EpisodeBench.model_validate(read_toml(Path(path)))


async def _episode(client, bench: EpisodeBench, row: Row, seed: int, sid: str) -> dict:
    env = make_env(bench.env)
    try:
        start = await asyncio.to_thread(env.reset, seed)
        messages = [{"role": "system", "content": start.system}] if start.system else []
        messages.append({"role": "user", "content": start.task})
        if start.observation:
            messages.append({"role": "user", "content": start.observation})
        extra = {"session_id": sid, "compaction": row.compaction}
        extra |= {
            k: getattr(row, k).model_dump() for k in ("strategy", "evictor") if getattr(row, k) is not None
        }
        hint, info, turns = start.max_tokens, {}, 0
        while turns < bench.max_turns:
            turns += 1
            r = await client.chat.completions.create(
                model="m",
                messages=messages,
                max_tokens=min(hint or bench.max_tokens, bench.max_tokens),
                temperature=0.0,
                extra_body=extra,
            )
            action = r.choices[0].message.content
            out = await asyncio.to_thread(env.step, action)
            info = out.info
            if out.done:
                break
            messages += [
                {"role": "assistant", "content": action},
                {"role": "user", "content": out.observation},
            ]
            hint = out.max_tokens
        return {"seed": seed, "correct": float(bool(info.get("correct"))), "turns": turns}
    finally:
        env.close()


async def _row(url: str, bench: EpisodeBench, row: Row) -> dict:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(bench.concurrency)
    stats: dict[str, int] = {}
    errors: list[str] = []

    async def one(k: int):
        sid = f"{row.name}-{k}"
        async with gate:
            try:
                result = await _episode(client, bench, row, bench.seed + k, sid)
            except openai.APIError as e:
                errors.append(f"episode {bench.seed + k}: {e}")
                return None
            async with httpx.AsyncClient(base_url=url, timeout=600) as h:
                body = (await h.get(f"/v1/sessions/{sid}/trace")).json()
                for key, v in body["stats"].items():
                    stats[key] = stats.get(key, 0) + v
                await h.delete(f"/v1/sessions/{sid}")
            return result

    t0 = time.perf_counter()
    done = [r for r in await asyncio.gather(*[one(k) for k in range(bench.episodes)]) if r is not None]
    wall = time.perf_counter() - t0
    await client.close()
    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    gauge = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(compactrl_\w+) (\S+)$", metrics, re.M)}
    correct = [r["correct"] for r in done]
    return {
        "row": row.name,
        "settings": row.model_dump(exclude_none=True),
        "episodes": len(done),
        "errors": errors[:5],
        "wall_s": wall,
        "episodes_per_s": len(done) / wall,
        "accuracy": sum(correct) / max(len(done), 1),
        "accuracy_ci": mean_ci(correct),
        "episode_seeds": [r["seed"] for r in done],
        "episode_correct": correct,
        "mean_turns": sum(r["turns"] for r in done) / max(len(done), 1),
        "peak_pool_tokens": gauge.get("compactrl_kv_tokens_peak"),
        "preemptions": gauge.get("compactrl_preemptions"),
        **stats,
    }


def run_episode_bench(bench: EpisodeBench, progress=None) -> dict:
    rows = []
    advance = progress(len(bench.row)) if progress else None
    extra = ["--thread-adapter", bench.thread_adapter] if bench.thread_adapter else []
    with tempfile.TemporaryDirectory() as tmp:
        for row in bench.row:
            proc, url = launch(
                "compactrl", Path(bench.model), bench.threads, bench.kv_pool_tokens, None, Path(tmp), extra
            )
            try:
                rows.append(asyncio.run(_row(url, bench, row)))
            finally:
                stop(proc)
            if advance:
                advance(row.name)
    base = rows[0]
    for r in rows:
        r["episodes_per_s_ratio"] = r["episodes_per_s"] / base["episodes_per_s"]
        if r is not base and r["episodes"] and base["episodes"]:
            mine, theirs = (
                dict(zip(x["episode_seeds"], x["episode_correct"], strict=True)) for x in (r, base)
            )
            shared = set(mine) & set(theirs)
            r |= compare({s: mine[s] for s in shared}, {s: theirs[s] for s in shared}, r["row"], base["row"])
    result = {"machine": machine_info(bench.threads), "config": bench.model_dump(), "rows": rows}
    Path(bench.results).parent.mkdir(parents=True, exist_ok=True)
    Path(bench.results).write_text(json.dumps(result, indent=1) + "\n")
    return result


def markdown(result: dict) -> str:
    lines = [
        "| row | episodes/s | vs first | accuracy [95% CI] | vs first, paired [95% CI] | pool peak "
        "| preemptions | thread calls | cursors deleted | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        diff = "-"
        if r.get("paired_diff_ci"):
            p = r.get("mcnemar_p")
            diff = (
                f"{fmt_ci(r['paired_diff'], r['paired_diff_ci'], True)} (p {p:.2g}): "
                f"{verdict(r['paired_diff_ci'], r['row'], r['compared_to'], p)}"
            )
        lines.append(
            f"| {r['row']} | {r['episodes_per_s']:.3f} | {r['episodes_per_s_ratio']:.2f}x | "
            f"{fmt_ci(r['accuracy'], r['accuracy_ci'])} | {diff} | {r['peak_pool_tokens']:.0f} | "
            f"{r['preemptions']:.0f} | {r.get('aux_calls', 0)} | {r.get('deleted_cursors', 0)} | "
            f"{len(r['errors'])} |"
        )
    return "\n".join(lines)
