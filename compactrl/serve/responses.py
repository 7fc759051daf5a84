"""OpenAI response bodies: chat and text completions, their log-probs, and their streams as
server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from compactrl.engine.session import Generation
from compactrl.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from compactrl.serve.server import Job, Server
from compactrl.serve.session import ChatSession, Usage
from compactrl.serve.tools import PARSERS

# the engine's finish reasons as OpenAI reports them (vLLM's "abort" for a cancelled stream)
FINISH = {"stop": "stop", "length": "length", "position_limit": "length", "abort": "abort", "error": "error"}


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


def _choice_tokens(req, gen: Generation) -> dict:
    return {"token_ids": list(gen.tokens)} if req.return_token_ids else {}


def chat_body(server: Server, req: ChatCompletionRequest, job: Job) -> dict:
    choices = []
    for i, (g, text) in enumerate(zip(job.gens, job.texts, strict=True)):
        lp = (
            _chat_logprobs(server, g, 0, len(g.tokens), req.return_tokens_as_token_ids)
            if req.logprobs
            else None
        )
        reply = server.reply(job, i)
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", **(reply or {"content": text})},
                "logprobs": lp,
                "finish_reason": "tool_calls" if reply else FINISH[g.finish_reason],
                **_choice_tokens(req, g),
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
        **_versions(job),
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = _live_tokens(job.cs, job.gens[0])
    return body


def _live_tokens(cs: ChatSession, gen: Generation) -> list[int]:
    """The tokens the completion was conditioned on: the stream's live tokens before it (positions
    have gaps where messages were removed; GET /v1/sessions/{id}/trace has the whole stream)."""
    s = cs.stream
    return [t for t, e in zip(s.tokens[: gen.start], s.evict_at[: gen.start], strict=True) if e is None]


def completion_body(
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
                **_choice_tokens(req, g),
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
        **_versions(*jobs),
    }


def _versions(*jobs: Job) -> dict:
    """The weights versions the answers were sampled under (``POST /v1/load_weights`` or a trainer's
    ``Engine.stage_weights`` raise it between engine steps): the first and the last, for off-policy
    corrections."""
    versions = [v for job in jobs for v in job.weights]
    return {"weights_version": max(versions), "weights_version_first": min(versions)}


async def stream_events(
    server: Server, req: ChatCompletionRequest | CompletionRequest, job: Job
) -> AsyncIterator[str]:
    """Server-sent events: (chat: a role delta,) text deltas as tokens arrive (held back while they
    could still turn into a stop string, or end in a partial UTF-8 character), the finish, the usage.
    With tools, text from where a call could start is held back too; an answer's calls come as one
    delta with its finish (``tool_calls``), an answer without calls gets the rest of its text then."""
    worker = server.worker
    chat = isinstance(req, ChatCompletionRequest)
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    hold = max((len(s) for s in req.stops()), default=1) - 1
    parser = PARSERS[server.tool_parser] if job.tools else None
    if parser:
        hold = max(hold, len(parser.tag) - 1)

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
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
        if chat:
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
                text = server.text(g) if done else server.fmt.text(g.tokens[:n])
                reply = server.reply(job, i) if done and parser else None
                if reply:
                    text = reply["content"] or ""
                elif not done:
                    at = parser.split(text) if parser else None
                    if at is not None:  # a call may have started: what precedes it, as its content will be
                        text = text[:at].rstrip()
                    else:
                        text = text[: len(text) - hold] if hold else text
                        text = text.rstrip() if parser else text
                    text = text.rstrip("\ufffd")
                delta = text[len(sent_text[i]) :] if text.startswith(sent_text[i]) else ""
                new_tokens = n > sent_tokens[i]
                if delta or (new_tokens and req.logprobs is not None) or done:
                    d = {"content": delta} if delta else {}
                    if reply:
                        d["tool_calls"] = [{"index": k, **c} for k, c in enumerate(reply["tool_calls"])]
                    finish = None if not done else "tool_calls" if reply else FINISH[g.finish_reason]
                    c = {
                        "index": i,
                        **({"delta": d} if chat else {"text": delta}),
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                    as_ids = req.return_tokens_as_token_ids
                    if chat and req.logprobs and new_tokens:
                        c["logprobs"] = _chat_logprobs(server, g, sent_tokens[i], n, as_ids)
                    elif not chat and req.logprobs is not None and new_tokens:
                        c["logprobs"] = _text_logprobs(
                            server, g, sent_tokens[i], n, as_ids, len(sent_text[i])
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
