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
import time
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from compactrl.agent.chat import ChatTemplateError
from compactrl.engine import SessionError
from compactrl.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadWeightsRequest,
    TokenizeRequest,
)
from compactrl.serve.responses import chat_body, completion_body, stream_events
from compactrl.serve.server import Server
from compactrl.serve.weights import is_adapter, read_adapter, read_weights

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
    "/v1/load_weights",
)


class ClosingStream(StreamingResponse):
    """A streamed answer that closes its body however the response ends. A client that hangs up
    while a chunk is being sent cancels the send, not the body, which (with the request's session
    still busy) would otherwise wait to be closed until the garbage collector found it."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


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
        path = request.url.path  # a metrics label: one per route, not per URL (the label set stays small)
        route = "/v1/sessions" if path.startswith("/v1/sessions/") else path if path in ROUTES else "other"
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
        server.metrics.set(await worker.call(server.metrics.read))
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
            ids = [t for m in req.messages for t in conv.message(m.role, m.text(), extra=m.extra())]
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
            return {"session_id": sid, "compaction": cs.compaction, "stats": cs.stats, "traces": cs.trace()}

        return await worker.call(read)

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str):
        await worker.call(lambda: worker.delete(sid))
        return {"id": sid, "object": "session", "deleted": True}

    @app.post("/v1/load_weights")
    async def load_weights(req: LoadWeightsRequest):
        path = Path(req.path)
        adapter = path.exists() and is_adapter(path)
        state = await asyncio.to_thread(read_adapter if adapter else read_weights, path)

        def load():
            if adapter:
                n = server.engine.update_weights(server.adapters.state(state))
            else:
                n = server.engine.update_weights(state)
                server.adapters.forget()
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

    async def streamed(req, job) -> StreamingResponse:
        events = stream_events(server, req, job)
        first = await events.__anext__()  # started: its cleanup runs even if the client never reads

        async def body():
            try:
                yield first
                async for e in events:
                    yield e
            finally:
                await events.aclose()

        return ClosingStream(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        server.check_model(req.model)
        sid = session_of(req, request)
        messages = [(m.role, m.text(), m.extra()) for m in req.messages]
        limit = req.limit() or server.engine.position_limit
        top = (req.top_logprobs or 0) if req.logprobs else 0
        params = [server.params(req, limit, top, i) for i in range(req.n)]
        thread = (params[0].temperature, params[0].seed)  # SideQuest's thread samples as the answer does
        worker.admit()
        handed = False  # to a stream, which frees the place when it ends
        try:
            job, futures = await server.submit(
                sid, "chat", req, lambda cs, usage: cs.apply(cs.plan(messages, limit), usage, *thread), params
            )
            if req.stream:
                handed = True
                return await streamed(req, job)
            return chat_body(server, req, await server.complete(job, futures))
        finally:
            if not handed:
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
        if req.stream and len(prompts) > 1:
            raise ApiError(
                400, "a streamed completion takes one prompt: send one request per prompt", "prompt"
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
        jobs = []
        for prompt in ids:
            worker.admit()
            handed = False
            try:
                job, futures = await server.submit(
                    sid,
                    "completion",
                    req,
                    lambda cs, usage, prompt=prompt: cs.sync_tokens(prompt, req.max_tokens, usage),
                    params,
                )
                if req.stream:
                    handed = True
                    return await streamed(req, job)
                jobs.append(await server.complete(job, futures))
            finally:
                if not handed:
                    worker.done()
        return completion_body(server, req, jobs, ids)

    return app
