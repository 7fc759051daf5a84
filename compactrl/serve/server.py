"""The server object: the engine's worker, the chat format, the metrics, and what a request asks
of the engine's thread (start its choices, settle its session). The HTTP routes are in
:mod:`compactrl.serve.app`; a training loop can hold a ``Server`` around its own engine."""

from __future__ import annotations

import asyncio
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from compactrl.agent.chat import ChatFormat
from compactrl.engine import Engine, SamplingParams
from compactrl.engine.session import Generation
from compactrl.serve.protocol import ApiError
from compactrl.serve.session import ChatSession, Usage
from compactrl.serve.tools import PARSER_NAMES, parse, wire_calls
from compactrl.serve.weights import AdapterMerger
from compactrl.serve.worker import EngineWorker


class Metrics:
    """Prometheus metrics of one server (its own registry, so two servers in a process stay apart)."""

    def __init__(self, worker: EngineWorker):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "compactrl_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.seconds = Histogram(
            "compactrl_request_seconds", "time to answer (streams: to the last byte)", ["route"], registry=r
        )
        self.tokens = Counter(
            "compactrl_tokens",
            "tokens by kind: prompt (live context), cached (KV reused), prefilled, evicted, generated",
            ["kind"],
            registry=r,
        )
        self.tool_call_parse_failures = Counter(
            "compactrl_tool_call_parse_failures",
            "answers to requests with tools whose tool call did not parse (returned as text)",
            registry=r,
        )
        eng = worker.engine
        self.readings = {  # read on the engine's thread (the engine is not thread-safe), at each scrape
            "compactrl_sessions_open": ("sessions open", lambda: len(worker.sessions)),
            "compactrl_requests_in_flight": ("requests in flight", lambda: worker.in_flight),
            "compactrl_kv_tokens_used": ("KV pool tokens in use", eng.kv_tokens_used),
            "compactrl_kv_pool_tokens": ("KV pool size in tokens", lambda: eng.config.kv_pool_tokens),
            "compactrl_kv_tokens_peak": ("KV pool use, its peak", lambda: eng.totals["peak_kv_tokens"]),
            "compactrl_preemptions": ("sessions preempted (their KV dropped, recomputed on return)",
                                      lambda: eng.metrics()["preemptions"]),
            "compactrl_engine_sessions": ("sessions the engine holds (open ones)", lambda: len(eng.sessions)),
        }  # fmt: skip
        self.gauges = {name: Gauge(name, doc, registry=r) for name, (doc, _) in self.readings.items()}

    def read(self) -> dict[str, float]:
        """The gauges' values (call on the engine's thread)."""
        return {name: fn() for name, (_, fn) in self.readings.items()}

    def set(self, values: dict[str, float]) -> None:
        for name, v in values.items():
            self.gauges[name].set(v)

    def count(self, usage: Usage) -> None:
        for kind, n in (
            ("prompt", usage.prompt_tokens),
            ("cached", usage.cached_tokens),
            ("prefilled", usage.prefilled_tokens),
            ("evicted", usage.evicted_tokens),
            ("generated", usage.completion_tokens),
        ):
            self.tokens.labels(kind).inc(n)


@dataclass
class Job:
    """One completion request on the engine's thread: its session, its choices' generations (choice
    0 continues the session, the others are forks closed after), its usage."""

    cs: ChatSession
    usage: Usage
    gens: list[Generation] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    weights: list[int] = field(default_factory=list)  # weights versions when sampling began and ended
    tools: bool = False  # answers are read for tool calls
    replies: dict[int, dict | None] = field(default_factory=dict)  # a choice's tool calls, read once
    parse_failures: int = 0  # choices whose tool call did not parse


class Server:
    """The server's state: the engine's worker, the chat format, names and limits."""

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        api_key: str | None = None,
        max_sessions: int = 1024,
        session_ttl: float = 600.0,
        max_queue: int = 256,
        chat_rewrites: str = "error",
        thread_adapter: str | None = None,
        tool_parser: str = "hermes",
        fmt: ChatFormat | None = None,
    ):
        """``fmt``: the chat format (default: the tokenizer's template, with ``chat_rewrites``)."""
        if tool_parser not in PARSER_NAMES:
            raise ValueError(f"tool parser {tool_parser!r} unknown; choose one of {', '.join(PARSER_NAMES)}")
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.tool_parser = tool_parser
        self.fmt = fmt or ChatFormat.from_tokenizer(engine.tokenizer, chat_rewrites)
        self.worker = EngineWorker(
            engine,
            self.fmt,
            max_sessions=max_sessions,
            session_ttl=session_ttl,
            max_queue=max_queue,
            tool_parser=tool_parser,
        )
        if thread_adapter is not None:  # SideQuest's thread adapter: gated, it acts on threads' tokens only
            from compactrl.models.lora import load_thread_adapter

            load_thread_adapter(engine.model, thread_adapter)
            self.worker.thread_adapter = thread_adapter
        self.metrics = Metrics(self.worker)
        self.adapters = AdapterMerger(engine.model)  # POST /v1/load_weights with a LoRA adapter
        self.created = int(time.time())

    # ---- requests to engine work --------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(
                404,
                f"model {name!r} is not served here; this server serves {self.model_name!r} (GET /v1/models)",
                "model",
                "model_not_found",
            )

    def params(self, req, max_tokens: int, top_logprobs: int, seed_offset: int = 0) -> SamplingParams:
        stop_ids = [] if req.ignore_eos else [*self.fmt.stop_ids, *(req.stop_token_ids or [])]
        bad = [t for t in req.stop_token_ids or [] if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.engine.vocab_size})",
                "stop_token_ids",
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(req.top_k or 0, 0),
            seed=None if req.seed is None else req.seed + seed_offset,
            stop=req.stops(),
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            top_logprobs=top_logprobs,
        )

    def reads_tools(self, req) -> bool:
        """Whether a chat request's answers are read for tool calls; a 400 for tool settings this
        server cannot serve."""
        if req.tool_choice not in (None, "none", "auto"):
            raise ApiError(
                400,
                f"tool_choice {req.tool_choice!r} is not supported: the server does not constrain "
                "sampling to a call; send 'auto' (and ask for the call in the prompt) or 'none'",
                "tool_choice",
            )
        if not req.tools:
            return False
        names = [t.function.name for t in req.tools]
        if len(set(names)) < len(names):
            raise ApiError(400, f"tools name a function twice: {names}", "tools")
        if self.tool_parser == "none":
            raise ApiError(
                400,
                "this server reads no tool calls (it was started with --tool-call-parser none): send "
                "no tools, or restart it with --tool-call-parser hermes or llama3_json",
                "tools",
            )
        return req.tool_choice != "none"

    def reply(self, job: Job, i: int) -> dict | None:
        """Choice ``i``'s tool calls as the client gets them (``content``, ``tool_calls``), None when it
        has none or they do not parse. Read once, so a stream and the session see the same call ids."""
        if i not in job.replies:
            job.replies[i] = None
            if job.tools:
                names = {t["function"]["name"] for t in job.cs.tools}
                got = parse(self.tool_parser, self.text(job.gens[i]), names)
                job.parse_failures += got is None
                if got is not None and got[1]:
                    job.replies[i] = {"content": got[0] or None, "tool_calls": wire_calls(got[1])}
        return job.replies[i]

    def text(self, gen: Generation) -> str:
        """What the client is sent: the content without its stop token, cut before a stop string."""
        text = self.fmt.text(gen.tokens)
        cut = [i for s in gen.params.stop if (i := text.find(s)) >= 0]
        return text[: min(cut)] if cut else text

    def start(self, job: Job, futures, params: list[SamplingParams]) -> None:
        """Choice 0 on the session, the others on forks of it (the prompt shared, not recomputed)."""
        cs = job.cs
        job.weights = [self.engine.weights_version]
        streams = [cs.stream] + [cs.stream.fork() for _ in params[1:]]
        for stream, p, fut in zip(streams, params, futures, strict=True):
            gen = stream.generate(p, role="assistant", turn=cs.turn)
            gen.future = fut
            job.gens.append(gen)

    def end(self, job: Job, broken: bool = False) -> None:
        """Engine thread: stop what still runs (a disconnected client), record choice 0's answer in
        the session, close the forks, release the session."""
        job.weights.append(self.engine.weights_version)
        for g in job.gens:
            g.session.cancel()
        job.texts = [self.text(g) for g in job.gens]
        for i in range(len(job.gens)):
            self.reply(job, i)
        job.cs.stats["tool_call_parse_failures"] += job.parse_failures
        self.metrics.tool_call_parse_failures.inc(job.parse_failures)
        try:
            if job.gens and job.cs.kind == "chat" and not broken:
                job.cs.finish(job.gens[0], job.texts[0], self.reply(job, 0))
            for g in job.gens[1:]:
                g.session.close()
        finally:
            self.worker.release(job.cs, broken=broken or any(g.finish_reason == "error" for g in job.gens))
        job.usage.completion_tokens = sum(len(g.tokens) for g in job.gens)

    async def submit(self, sid: str | None, kind: str, req, prepare, params: list[SamplingParams]):
        """On the engine's thread: the request's session (created, or continued), ``prepare(session,
        usage)`` (feed its prompt), its choices started; the session is released if any of it fails.
        Returns the job and its choices' futures."""

        tools = req.tool_list() if kind == "chat" else None
        reads = kind == "chat" and self.reads_tools(req)

        def begin(futures) -> Job:
            group = getattr(req, "group", None)
            cs = self.worker.session(sid, kind, req.compaction, req.evictor, req.strategy, tools, group)
            job = Job(cs, Usage(), tools=reads)
            try:
                prepare(cs, job.usage)
                self.start(job, futures, params)
            except BaseException:
                self.worker.release(cs)
                raise
            return job

        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in params]
        return await self.worker.call(lambda: begin(futures)), futures

    async def complete(self, job: Job, futures: list) -> Job:
        """Wait for every choice, settle the session; a failed engine step is a 503."""
        try:
            for f in futures:
                await f
        finally:
            await self.finish(job)
        failed = [g for g in job.gens if g.finish_reason == "error"]
        if failed:
            raise ApiError(
                503,
                f"the engine failed while generating ({failed[0].error}); the session was "
                "closed, retry with a new one",
                code="engine_error",
            )
        return job

    async def finish(self, job: Job, broken: bool = False) -> None:
        with anyio.CancelScope(shield=True):  # also when the client has gone: the session must settle
            await self.worker.call(lambda: self.end(job, broken))
            self.metrics.count(job.usage)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM and Ctrl-C end it with exit status 0 once in-flight
    requests are answered (uvicorn re-raises the signal after its graceful shutdown); a second
    signal stops at once."""

    @contextmanager
    def capture_signals(self):
        def stop(sig, frame):
            self.force_exit = self.should_exit
            self.should_exit = True

        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
