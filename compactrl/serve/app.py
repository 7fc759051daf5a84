"""`compactrl serve`: an OpenAI-compatible HTTP server whose sessions keep one KV stream.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /v1/sessions/{id}/trace``,
``DELETE /v1/sessions/{id}``, ``POST /v1/load_weights``. A request names its session with the
``session_id`` body field (``extra_body`` in the openai client) or the ``X-Session-Id`` header; see
:mod:`compactrl.serve.session` for what a session does with each message list.

Every engine operation runs on the engine's thread (:mod:`compactrl.serve.worker`); handlers only
validate, hand work over and format answers. A streamed answer whose client disconnects is cancelled:
its tokens so far stay in the session as a closed assistant message (which the client, never having
received it, will not send back, so its next request evicts it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from compactrl.agent.chat import ChatFormat, ChatTemplateError
from compactrl.engine import Engine, SamplingParams, SessionError
from compactrl.engine.session import Generation
from compactrl.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadWeightsRequest,
    TokenizeRequest,
)
from compactrl.serve.session import ChatSession, Usage
from compactrl.serve.worker import EngineWorker

FINISH = {"stop": "stop", "length": "length", "position_limit": "length", "abort": "abort", "error": "error"}


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
        eng = worker.engine
        gauges = {
            "compactrl_sessions_open": ("sessions open", lambda: len(worker.sessions)),
            "compactrl_requests_in_flight": ("requests in flight", lambda: worker.in_flight),
            "compactrl_kv_tokens_used": ("KV pool tokens in use", eng.kv_tokens_used),
            "compactrl_kv_pool_tokens": ("KV pool size in tokens", lambda: eng.config.kv_pool_tokens),
            "compactrl_engine_sessions": (
                "sessions the engine holds (open ones only)",
                lambda: len(eng.sessions),
            ),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, registry=r).set_function(fn)

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
    ):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.fmt = ChatFormat.from_tokenizer(engine.tokenizer, chat_rewrites)
        self.worker = EngineWorker(
            engine, self.fmt, max_sessions=max_sessions, session_ttl=session_ttl, max_queue=max_queue
        )
        self.metrics = Metrics(self.worker)
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

    def text(self, cs: ChatSession, gen: Generation) -> str:
        """What the client is sent: the content without its stop token, cut before a stop string."""
        text = self.fmt.text(gen.tokens)
        cut = [i for s in gen.params.stop if (i := text.find(s)) >= 0]
        return text[: min(cut)] if cut else text

    def start(self, job: Job, futures, params: list[SamplingParams]) -> None:
        """Choice 0 on the session, the others on forks of it (the prompt shared, not recomputed)."""
        cs = job.cs
        streams = [cs.stream] + [cs.stream.fork() for _ in params[1:]]
        for stream, p, fut in zip(streams, params, futures, strict=True):
            gen = stream.generate(p, role="assistant", turn=cs.turn)
            gen.future = fut
            job.gens.append(gen)

    def end(self, job: Job, broken: bool = False) -> None:
        """Engine thread: stop what still runs (a disconnected client), record choice 0's answer in
        the session, close the forks, release the session."""
        for g in job.gens:
            g.session.cancel()
        job.texts = [self.text(job.cs, g) for g in job.gens]
        try:
            if job.gens and job.cs.kind == "chat" and not broken:
                job.cs.finish(job.gens[0], job.texts[0])
            for g in job.gens[1:]:
                g.session.close()
        finally:
            self.worker.release(job.cs, broken=broken or any(g.finish_reason == "error" for g in job.gens))
        job.usage.completion_tokens = sum(len(g.tokens) for g in job.gens)

    async def run(self, begin, n: int) -> tuple[Job, list]:
        """Hand ``begin(futures)`` to the engine's thread; returns the job and its choices' futures."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(n)]
        job = await self.worker.call(lambda: begin(futures))
        return job, futures

    async def finish(self, job: Job, broken: bool = False) -> None:
        with anyio.CancelScope(shield=True):  # also when the client has gone: the session must settle
            await self.worker.call(lambda: self.end(job, broken))
            self.metrics.count(job.usage)


def _token_str(server: Server, tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else server.engine.tokenizer.token_text(tid)


def _chat_logprobs(server: Server, gen: Generation, lo: int, hi: int, as_ids: bool) -> dict:
    def entry(tid: int, lp: float) -> dict:
        s = _token_str(server, tid, as_ids)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = []
    for i in range(lo, hi):
        e = entry(gen.tokens[i], gen.logprobs[i])
        e["top_logprobs"] = [entry(t, v) for t, v in gen.top_logprobs[i]] if gen.top_logprobs else []
        content.append(e)
    return {"content": content, "refusal": None}


def _text_logprobs(server: Server, gen: Generation, lo: int, hi: int, as_ids: bool, offset: int) -> dict:
    toks = [_token_str(server, t, as_ids) for t in gen.tokens[lo:hi]]
    offsets, at = [], offset
    for t in toks:
        offsets.append(at)
        at += len(t)
    top = (
        [{_token_str(server, t, as_ids): v for t, v in gen.top_logprobs[i]} for i in range(lo, hi)]
        if gen.top_logprobs
        else None
    )
    return {
        "tokens": toks,
        "token_logprobs": gen.logprobs[lo:hi],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def create_app(server: Server) -> FastAPI:
    worker = server.worker

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="compactrl", lifespan=lifespan)
    app.state.server = server

    @app.middleware("http")
    async def guard(request: Request, call_next):
        route = request.scope.get("path", "")
        route = "/v1/sessions" if route.startswith("/v1/sessions/") else route
        t0 = time.perf_counter()
        if server.api_key and request.url.path != "/health":
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {server.api_key}".encode()):
                err = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                    "the server was started with (--api-key)",
                    code="invalid_api_key",
                )
                server.metrics.requests.labels(route, "401").inc()
                return JSONResponse(err.body(), status_code=401)
        response = await call_next(request)
        server.metrics.requests.labels(route, str(response.status_code)).inc()
        server.metrics.seconds.labels(route).observe(time.perf_counter() - t0)
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return JSONResponse(ApiError(400, f"malformed JSON body: {first['msg']}").body(), status_code=400)
        loc = ".".join(str(x) for x in first["loc"] if x != "body")
        what = "unknown field" if first.get("type") == "extra_forbidden" else first["msg"]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        err = ApiError(422, f"{loc or 'body'}: {what}{more}", loc or None)
        return JSONResponse(err.body(), status_code=422)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception):
        if isinstance(e, (SessionError, ChatTemplateError)):
            return JSONResponse(ApiError(400, str(e)).body(), status_code=400)
        err = {
            "error": {
                "message": f"{type(e).__name__}: {e}",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
        return JSONResponse(err, status_code=500)

    # ---- routes --------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not worker.alive:
            raise ApiError(503, f"the engine thread is not running ({worker.error or 'stopped'})")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "compactrl",
            "max_model_len": server.engine.position_limit,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        server.check_model(req.model)
        tok = server.engine.tokenizer
        if req.messages is not None:  # what a new session would feed: each message as the template adds it
            conv = server.fmt.conversation()
            ids = [t for m in req.messages for t in conv.message(m.role, m.text())]
            ids += conv.prompt() if req.add_generation_prompt else []
        else:
            ids = [tok.bos_token_id] if req.add_special_tokens and tok.bos_token_id is not None else []
            ids += tok.encode(req.prompt)
        out = {"count": len(ids), "max_model_len": server.engine.position_limit, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.token_text(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        server.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < server.engine.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"token ids {bad[:5]} are outside the vocabulary [0, {server.engine.vocab_size})",
                "tokens",
            )
        return {"prompt": server.engine.tokenizer.decode(req.tokens)}

    @app.get("/v1/sessions/{sid}/trace")
    async def trace(sid: str):
        def read():
            cs = worker.get(sid)
            return {"session_id": sid, "compaction": cs.compaction, "traces": cs.trace()}

        return await worker.call(read)

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str):
        await worker.call(lambda: worker.delete(sid))
        return {"id": sid, "object": "session", "deleted": True}

    @app.post("/v1/load_weights")
    async def load_weights(req: LoadWeightsRequest):
        state = _read_weights(Path(req.path))

        def load():
            n = server.engine.update_weights(state)
            if not req.keep_kv:
                for s in list(server.engine.sessions):
                    if s.row is not None:
                        server.engine.release(s)
                        if s.busy:
                            server.engine.wake(s)
            return n

        n = await worker.call(load)
        return {"loaded": n, "weights_version": server.engine.weights_version, "kept_kv": req.keep_kv}

    def session_of(req, request: Request) -> str | None:
        return req.session_id or request.headers.get("x-session-id")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        server.check_model(req.model)
        sid = session_of(req, request)
        messages = [(m.role, m.text()) for m in req.messages]
        limit = req.limit() or server.engine.position_limit
        top = (req.top_logprobs or 0) if req.logprobs else 0
        params = [server.params(req, limit, top, i) for i in range(req.n)]
        worker.admit()
        try:

            def begin(futures) -> Job:
                cs = worker.session(sid, "chat", req.compaction, req.evictor, req.strategy)
                job = Job(cs, Usage())
                try:
                    cs.apply(cs.plan(messages, limit), job.usage)
                    server.start(job, futures, params)
                except BaseException:
                    worker.release(cs)
                    raise
                return job

            job, futures = await server.run(begin, req.n)
            if req.stream:
                events = _chat_stream(server, req, job)
                first = await events.__anext__()  # started: its cleanup runs even if the client never reads

                async def body():
                    yield first
                    async for e in events:
                        yield e

                return StreamingResponse(
                    body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            try:
                for f in futures:
                    await f
            finally:
                await server.finish(job)
            _raise_if_failed(job)
            return _chat_body(server, req, job)
        finally:
            if not req.stream:
                worker.done()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        server.check_model(req.model)
        sid = session_of(req, request)
        try:
            prompts = req.prompts()
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None
        if req.strategy is not None:
            raise ApiError(
                400,
                "a session's strategy works on chat messages (steps, tool outputs): use "
                "/v1/chat/completions, or an evictor",
                "strategy",
            )
        if sid is not None and len(prompts) > 1:
            raise ApiError(
                400, "a session continues one stream: send one prompt per request with a session_id", "prompt"
            )
        ids = []
        for p in prompts:
            t = server.engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
            bad = [x for x in t if not 0 <= x < server.engine.vocab_size]
            if bad:
                raise ApiError(
                    400,
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {server.engine.vocab_size})",
                    "prompt",
                )
            if not t:
                raise ApiError(400, "prompt is empty: give at least one token", "prompt")
            ids.append(t)
        top = req.logprobs or 0
        params = [server.params(req, req.max_tokens, top, i) for i in range(req.n)]
        jobs: list[tuple[Job, list]] = []
        for prompt in ids:
            worker.admit()
            try:

                def begin(futures, prompt=prompt) -> Job:
                    cs = worker.session(sid, "completion", req.compaction, req.evictor, req.strategy)
                    job = Job(cs, Usage())
                    try:
                        cs.sync_tokens(prompt, req.max_tokens, job.usage)
                        server.start(job, futures, params)
                    except BaseException:
                        worker.release(cs)
                        raise
                    return job

                job, futures = await server.run(begin, req.n)
                try:
                    for f in futures:
                        await f
                finally:
                    await server.finish(job)
                _raise_if_failed(job)
                jobs.append((job, futures))
            finally:
                worker.done()
        return _completion_body(server, req, [j for j, _ in jobs], ids)

    return app


def _raise_if_failed(job: Job) -> None:
    failed = [g for g in job.gens if g.finish_reason == "error"]
    if failed:
        raise ApiError(
            503,
            f"the engine failed while generating ({failed[0].error}); the session was closed, "
            "retry with a new one",
            code="engine_error",
        )


def _choice_tokens(server: Server, req, gen: Generation) -> dict:
    return {"token_ids": list(gen.tokens)} if req.return_token_ids else {}


def _chat_body(server: Server, req: ChatCompletionRequest, job: Job) -> dict:
    choices = []
    for i, (g, text) in enumerate(zip(job.gens, job.texts, strict=True)):
        lp = (
            _chat_logprobs(server, g, 0, len(g.tokens), req.return_tokens_as_token_ids)
            if req.logprobs
            else None
        )
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": FINISH[g.finish_reason],
                **_choice_tokens(server, req, g),
            }
        )
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": server.model_name,
        "choices": choices,
        "usage": job.usage.body(),
        "session_id": job.cs.id if job.cs.id in server.worker.sessions else None,
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = _live_tokens(job.cs, job.gens[0])
    return body


def _live_tokens(cs: ChatSession, gen: Generation) -> list[int]:
    """The tokens the completion was conditioned on: the stream's live tokens before it (positions
    have gaps where messages were removed; GET /v1/sessions/{id}/trace has the whole stream)."""
    s = cs.stream
    return [t for t, e in zip(s.tokens[: gen.start], s.evict_at[: gen.start], strict=True) if e is None]


def _completion_body(
    server: Server, req: CompletionRequest, jobs: list[Job], prompts: list[list[int]]
) -> dict:
    choices = []
    for k, job in enumerate(jobs):
        for i, (g, text) in enumerate(zip(job.gens, job.texts, strict=True)):
            lp = (
                _text_logprobs(server, g, 0, len(g.tokens), req.return_tokens_as_token_ids, 0)
                if req.logprobs is not None
                else None
            )
            choice = {
                "index": k * req.n + i,
                "text": text,
                "logprobs": lp,
                "finish_reason": FINISH[g.finish_reason],
                **_choice_tokens(server, req, g),
            }
            if req.return_token_ids:
                choice["prompt_token_ids"] = prompts[k]
            choices.append(choice)
    usage = Usage()
    for job in jobs:
        for name in (
            "prompt_tokens",
            "cached_tokens",
            "prefilled_tokens",
            "evicted_tokens",
            "completion_tokens",
        ):
            setattr(usage, name, getattr(usage, name) + getattr(job.usage, name))
    sid = jobs[0].cs.id if jobs and jobs[0].cs.id in server.worker.sessions else None
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": server.model_name,
        "choices": choices,
        "usage": usage.body(),
        "session_id": sid,
    }


async def _chat_stream(server: Server, req: ChatCompletionRequest, job: Job) -> AsyncIterator[str]:
    """Server-sent events: a role delta, content deltas as tokens arrive (held back while they could
    still turn into a stop string, or end in a partial UTF-8 character), the finish, the usage."""
    worker = server.worker
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    hold = max((len(s) for s in req.stops()), default=1) - 1

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": server.model_name,
            "choices": choices,
        }
        if usage is not None or (req.stream_options and req.stream_options.include_usage):
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    events = [worker.watch(g) for g in job.gens]
    sent_tokens = [0] * len(job.gens)
    sent_text = [""] * len(job.gens)
    finished = [False] * len(job.gens)
    broken = False
    try:
        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(len(job.gens))
            ]
        )
        while not all(finished):
            for i, g in enumerate(job.gens):
                if finished[i]:
                    continue
                done = g.done
                n = len(g.tokens)
                text = server.text(job.cs, g) if done else server.fmt.text(g.tokens[:n])
                if not done:
                    text = text[: len(text) - hold] if hold else text
                    text = text.rstrip("\ufffd")
                delta = text[len(sent_text[i]) :] if text.startswith(sent_text[i]) else ""
                new_tokens = n > sent_tokens[i]
                if delta or (new_tokens and req.logprobs) or done:
                    c = {
                        "index": i,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": None,
                        "finish_reason": FINISH[g.finish_reason] if done else None,
                    }
                    if req.logprobs and new_tokens:
                        c["logprobs"] = _chat_logprobs(
                            server, g, sent_tokens[i], n, req.return_tokens_as_token_ids
                        )
                    if req.return_token_ids and new_tokens:
                        c["token_ids"] = list(g.tokens[sent_tokens[i] : n])
                    sent_text[i] += delta
                    sent_tokens[i] = n
                    finished[i] = done
                    if done and g.finish_reason == "error":
                        broken = True
                    yield chunk([c])
            if not all(finished):
                waits = [events[i] for i in range(len(job.gens)) if not finished[i]]
                await waits[0].wait()
                for ev in events:
                    ev.clear()
        if broken:
            err = ApiError(
                503, "the engine failed while generating; the session was closed, retry with a new one"
            )
            yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        for g in job.gens:
            worker.unwatch(g)
        await server.finish(job, broken)
        worker.done()
    if req.stream_options and req.stream_options.include_usage:
        yield chunk([], job.usage.body())
    yield "data: [DONE]\n\n"


def _read_weights(path: Path) -> dict:
    """A model folder's weights (or a training checkpoint's or run folder's newest model)."""
    from safetensors.torch import load_file

    from compactrl.models.loading import checkpoint_files
    from compactrl.rl.checkpoint import CheckpointError, resolve_checkpoint

    if not path.exists():
        raise ApiError(
            400, f"{path} does not exist; give a model folder (model.safetensors) or a checkpoint", "path"
        )
    if not (path / "model.safetensors").exists() and not (path / "model.safetensors.index.json").exists():
        try:
            path = resolve_checkpoint(path) / "model"
        except CheckpointError as e:
            raise ApiError(400, f"{e}; or give a model folder (model.safetensors)", "path") from None
    state = {}
    for f in checkpoint_files(path):
        state.update(load_file(f))
    return state


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
