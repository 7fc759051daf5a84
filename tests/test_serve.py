"""`compactrl serve` with the real openai client on 127.0.0.1: sessions keep one KV stream, a client's
removed messages are evicted in place, and what the server returns is what the trainer replays."""

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import anyio
import httpx
import numpy as np
import openai
import pytest
import torch
import uvicorn
from fastapi.responses import StreamingResponse

from compactrl.agent.chat import ChatFormat
from compactrl.bench.serve import free_port
from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.models.tiny import write_tiny_model
from compactrl.rl.forward import stream_logprobs
from compactrl.serve.app import ClosingStream, create_app
from compactrl.serve.server import Server
from compactrl.trace import Trace

KEY = "sk-test"
GREEDY = {"temperature": 0.0, "max_tokens": 6}
NO_EOS = {"ignore_eos": True}  # a random tiny model: every answer is exactly max_tokens long


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny", family="qwen3", seed=0)


@contextmanager
def serving(model_dir, pool=20_000, **kw):
    """A server on 127.0.0.1 in a thread of this process (its engine on its own thread)."""
    engine = Engine.from_pretrained(model_dir, config=EngineConfig(kv_pool_tokens=pool, max_step_tokens=512))
    server = Server(engine, model_name="tiny", api_key=KEY, **kw)
    srv = uvicorn.Server(
        uvicorn.Config(create_app(server), host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield server, f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def served(model_dir):
    with serving(model_dir) as s:
        yield s


def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def http(url) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def play(c: openai.OpenAI, sid: str | None, turns=4, window=1, compaction=None):
    """A harness that keeps only the newest ``window`` tool outputs: the answers, their served
    log-probs and usages, and the messages it sent."""
    messages = [
        {"role": "system", "content": "You browse."},
        {"role": "user", "content": "Find the capital."},
    ]
    out = []
    for t in range(turns):
        extra = {**NO_EOS, "return_token_ids": True} | ({"session_id": sid} if sid else {})
        if compaction:
            extra["compaction"] = compaction
        r = c.chat.completions.create(
            model="tiny", messages=messages, logprobs=True, extra_body=extra, **GREEDY
        )
        ch = r.choices[0]
        out.append((ch.message.content, ch.token_ids, [e.logprob for e in ch.logprobs.content], r.usage))
        messages.append({"role": "assistant", "content": ch.message.content})
        messages.append({"role": "tool", "content": f"page {t}: the capital of country {t} is city {t * 7}."})
        tools = [i for i, m in enumerate(messages) if m["role"] == "tool"]
        for i in reversed(tools[:-window]):
            del messages[i]
    return out, messages


def reference(model_dir, turns=4, window=1):
    """The same harness in process, on the engine's own API: messages appended with the template,
    dropped tool outputs evicted in place; the sampled tokens and log-probs."""
    eng = Engine.from_pretrained(model_dir)
    fmt = ChatFormat.from_tokenizer(eng.tokenizer)
    s, conv = eng.session(), fmt.conversation()
    live = []  # (message, start, end)

    def add(role, text, toks):
        start = len(s.tokens)
        s.append(toks, role=role)
        live.append(({"role": role, "content": text}, start, len(s.tokens)))

    add("system", "You browse.", conv.message("system", "You browse."))
    add("user", "Find the capital.", conv.message("user", "Find the capital."))
    out = []
    for t in range(turns):
        start = len(s.tokens)
        s.append(conv.prompt(), role="assistant")
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        g = s.generate(params)
        eng.run()
        text = fmt.text(g.tokens)
        s.append(conv.close(g.tokens), role="assistant")
        live.append(({"role": "assistant", "content": text}, start, len(s.tokens)))
        out.append((text, list(g.tokens), list(g.logprobs)))
        # the next request drops the oldest tool outputs as it adds the newest: the server evicts
        # first, so the new output never sees the dropped ones
        tools = [k for k, (m, *_) in enumerate(live) if m["role"] == "tool"]
        for k in reversed(tools[: len(tools) + 1 - window]):
            _, a, b = live.pop(k)
            s.evict([(a, b)])
        conv.reset([m for m, *_ in live])
        page = f"page {t}: the capital of country {t} is city {t * 7}."
        add("tool", page, conv.message("tool", page))
    return out


def test_a_session_that_drops_old_tool_outputs_is_the_in_process_stream_and_the_trainer_replays_it(
    served, model_dir
):
    server, url = served
    c = client(url)
    got, _ = play(c, "agent-1")
    want = reference(model_dir)
    assert [(t, ids) for t, ids, *_ in got] == [(t, ids) for t, ids, _ in want]
    for (*_, lps, _), (*_, ref_lps) in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-5
    usage = [u for *_, u in got]
    # from the second turn on the session feeds only what is new: the previous answer's close, the
    # tool output and the generation prompt; the dropped tool output is evicted, nothing re-prefilled
    assert (
        usage[0].prompt_tokens_details.cached_tokens == 0
        and usage[0].prefilled_tokens == usage[0].prompt_tokens
    )
    for u in usage[1:]:
        assert 0 < u.prefilled_tokens < 40 and u.prompt_tokens_details.cached_tokens > u.prefilled_tokens
    assert [u.evicted_tokens > 0 for u in usage] == [False, False, True, True]
    with http(url) as h:
        body = h.get("/v1/sessions/agent-1/trace").json()
    (row,) = body["traces"]
    trace = Trace.from_dict(row)
    assert trace.num_evicted > 0
    with torch.no_grad():
        replayed = stream_logprobs(server.engine.model, [trace])[0].double()
    m = torch.as_tensor(trace.trainable)
    served_lps = torch.tensor([x for *_, lps, _ in got for x in lps], dtype=torch.float64)
    assert int(m.sum()) == len(served_lps) == 4 * 6
    assert (replayed[m] - served_lps).abs().max() < 5e-5


def test_a_reprefill_session_is_the_negative_control(served):
    """Re-prefill cuts the stream at the first removal and feeds the rest again at contiguous positions:
    the same tokens until the first removal, other log-probs after it; each cut stream a segment."""
    _, url = served
    c = client(url)
    stream, _ = play(c, "ctl-stream")
    again, _ = play(c, "ctl-reprefill", compaction="reprefill")
    for k in range(2):  # the first removal comes with the third request (tool output 0 dropped)
        assert max(abs(a - b) for a, b in zip(stream[k][2], again[k][2], strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(stream[2][2], again[2][2], strict=True)) > 1e-3
    assert again[1][3].evicted_tokens == 0 and again[2][3].prefilled_tokens > stream[2][3].prefilled_tokens
    with http(url) as h:
        body = h.get("/v1/sessions/ctl-reprefill/trace").json()
    assert body["compaction"] == "reprefill" and len(body["traces"]) == 3  # cut twice, then the current
    assert all(Trace.from_dict(t).num_evicted == 0 for t in body["traces"])


def test_streaming_sync_and_async_deliver_what_a_plain_answer_holds(served):
    _, url = served
    c = client(url)
    msgs = [{"role": "user", "content": "Say something."}]
    plain = c.chat.completions.create(model="tiny", messages=msgs, extra_body=NO_EOS, **GREEDY)
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=msgs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
            **GREEDY,
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert (
        chunks[-1].usage.completion_tokens == 6
        and chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    )

    async def two_at_once():
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        rs = await asyncio.gather(
            *[
                ac.chat.completions.create(model="tiny", messages=msgs, extra_body=NO_EOS, **GREEDY)
                for _ in range(2)
            ]
        )
        stream = await ac.chat.completions.create(
            model="tiny", messages=msgs, stream=True, extra_body=NO_EOS, **GREEDY
        )
        parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
        await ac.close()
        return [r.choices[0].message.content for r in rs], "".join(parts)

    answers, streamed = asyncio.run(two_at_once())
    assert answers == [plain.choices[0].message.content] * 2 and streamed == answers[0]


def test_a_streamed_text_completion_is_the_plain_one_and_a_refused_stream_frees_its_place(served):
    server, url = served
    c = client(url)
    ask = dict(model="tiny", prompt=[5, 17, 99, 300], max_tokens=6, temperature=0.0, logprobs=1)
    plain = c.completions.create(**ask, extra_body=NO_EOS | {"return_token_ids": True}).choices[0]
    chunks = list(c.completions.create(**ask, stream=True, extra_body=NO_EOS | {"return_token_ids": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == plain.text
    assert [t for ch in chunks for t in ch.choices[0].token_ids or []] == plain.token_ids
    streamed_lps = [
        x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs
    ]
    assert streamed_lps == plain.logprobs.token_logprobs
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"
    with pytest.raises(openai.APIStatusError) as e:  # past the KV pool: refused once admitted
        list(c.completions.create(**(ask | {"max_tokens": 30_000}), stream=True))
    assert e.value.status_code == 413 and server.worker.in_flight == 0


def test_n_choices_fork_the_prompt_and_leave_nothing_behind(served):
    server, url = served
    before = len(server.engine.sessions)
    r = client(url).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Pick."}],
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=6,
        extra_body=NO_EOS | {"return_token_ids": True},
    )
    ids = [ch.token_ids for ch in r.choices]
    assert len(ids) == 3 and len({tuple(x) for x in ids}) > 1  # seeds 5, 6, 7
    assert len(server.engine.sessions) == before  # the request's session and its forks are closed


def test_completions_take_token_ids_and_a_session_continues_by_prefix(served):
    _, url = served
    c = client(url)
    tok = [5, 17, 99, 300, 42]
    r1 = c.completions.create(
        model="tiny",
        prompt=tok,
        max_tokens=4,
        temperature=0.0,
        logprobs=2,
        extra_body=NO_EOS | {"session_id": "tok", "return_token_ids": True},
    )
    ids = r1.choices[0].token_ids
    assert len(ids) == 4 and len(r1.choices[0].logprobs.top_logprobs[0]) == 2
    r2 = c.completions.create(
        model="tiny",
        prompt=tok + ids + [7, 8],
        max_tokens=4,
        temperature=0.0,
        extra_body=NO_EOS | {"session_id": "tok"},
    )
    assert r2.usage.prefilled_tokens == 2 and r2.usage.evicted_tokens == 0
    r3 = c.completions.create(
        model="tiny",
        prompt=tok[:3] + [9],
        max_tokens=4,
        temperature=0.0,
        extra_body=NO_EOS | {"session_id": "tok"},
    )
    assert r3.usage.prefilled_tokens == 1 and r3.usage.evicted_tokens == len(tok) - 3 + 4 + 2 + 4
    assert r3.usage.prompt_tokens_details.cached_tokens == 3


def test_tokenize_is_what_a_session_feeds(served):
    _, url = served
    msgs = [{"role": "system", "content": "S."}, {"role": "user", "content": "Hi there."}]
    with http(url) as h:
        tok = h.post("/tokenize", json={"model": "tiny", "messages": msgs}).json()
        r = h.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": msgs, "return_token_ids": True, **GREEDY, **NO_EOS},
        ).json()
        text = h.post("/detokenize", json={"model": "tiny", "tokens": tok["tokens"]}).json()["prompt"]
    assert tok["tokens"] == r["prompt_token_ids"] and tok["count"] == r["usage"]["prompt_tokens"]
    assert "Hi there." in text


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "malformed JSON"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1},
            422,
            "frobnicate",
        ),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "is not served here"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1},
            422,
            "penalty",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": " ".join(map(str, range(30000)))}],
                "max_tokens": 5,
            },
            413,
            "positions",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 19999},
            413,
            "KV tokens",
        ),
    ],
)
def test_bad_chat_requests_get_an_openai_error_naming_the_problem(served, body, status, says):
    _, url = served
    with http(url) as h:
        kw = (
            {"content": body, "headers": {"content-type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body}
        )
        r = h.post("/v1/chat/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["type"]


def test_bad_token_ids_unknown_sessions_and_keys(served):
    server, url = served
    with http(url) as h:
        r = h.post("/v1/completions", json={"model": "tiny", "prompt": [1, 10**7], "max_tokens": 2})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
        assert h.get("/v1/sessions/nope/trace").status_code == 404
        assert h.delete("/v1/sessions/nope").status_code == 404
    bare = httpx.get(f"{url}/v1/models")
    assert bare.status_code == 401 and "API key" in bare.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200  # no key needed
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401


def test_a_session_used_twice_at_once_is_refused_and_left_as_it_was(served):
    server, url = served
    long = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Go."}],
        "max_tokens": 1500,
        "temperature": 0.0,
        "ignore_eos": True,
        "session_id": "twice",
        "stream": True,
    }
    with http(url) as h, h.stream("POST", "/v1/chat/completions", json=long) as first:
        lines = first.iter_lines()
        next(lines)  # the role delta: the first request holds the session
        second = h.post("/v1/chat/completions", json={**long, "stream": False, "max_tokens": 2})
        assert second.status_code == 409 and "one at a time" in second.json()["error"]["message"]
        rest = [x for x in lines if x.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert server.worker.sessions["twice"].busy is False


def test_a_client_that_disconnects_mid_stream_cancels_and_the_session_stays_consistent(served):
    server, url = served
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": 2000,
        "temperature": 0.0,
        "ignore_eos": True,
        "session_id": "gone",
        "stream": True,
    }
    with http(url) as h:
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            for _ in zip(range(3), r.iter_lines()):
                pass  # read a little, then hang up
        deadline = time.monotonic() + 30
        while server.worker.sessions["gone"].busy:
            assert time.monotonic() < deadline, "the cancelled request never released its session"
            time.sleep(0.02)
        cs = server.worker.sessions["gone"]
        assert cs.records[-1].role == "assistant" and not cs.stream.generating
        partial = len(cs.stream.tokens)
        assert partial < 2000  # stopped long before max_tokens
        nxt = h.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3})
    assert nxt.status_code == 200
    assert nxt.json()["usage"]["evicted_tokens"] > 0  # the unsent partial answer left the stream


def test_a_stream_cancelled_while_sending_closes_its_body_at_once():
    """The hang-up that lands while a chunk is being sent cancels the send, not the body; the
    server's stream closes the body then (its cleanup releases the session). A plain
    StreamingResponse (the negative control) leaves it suspended for the garbage collector."""

    async def cleanups(response_class) -> list[str]:
        closed = []

        async def body():
            try:
                for i in range(100):
                    yield f"data: {i}\n\n"
            finally:
                closed.append("closed")

        gen = body()  # held here: only an explicit close runs its cleanup before this returns
        sent = 0

        async def send(message):
            nonlocal sent
            sent += 1
            if sent == 3:
                await anyio.sleep_forever()  # a client that stopped reading, then hangs up

        with anyio.move_on_after(0.2):
            await response_class(gen, media_type="text/event-stream").stream_response(send)
        return list(closed)

    assert asyncio.run(cleanups(StreamingResponse)) == []
    assert asyncio.run(cleanups(ClosingStream)) == ["closed"]


def test_a_full_queue_answers_429_with_retry_after(model_dir):
    """With --max-queue requests in flight, the next one is refused with Retry-After; one answered
    frees its place. (The requests in flight are counted in by ``admit``; here one is held there.)"""
    with serving(model_dir, max_queue=2) as (server, url), http(url) as h:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Go."}], "max_tokens": 2}
        worker = server.worker
        worker.admit()  # a request in flight, held
        assert h.post("/v1/chat/completions", json=body).status_code == 200  # the second place
        assert worker.in_flight == 1  # answered: its place is free again
        worker.admit()  # now both places are taken
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "max-queue" in r.json()["error"]["message"] and worker.in_flight == 2
        worker.done()
        worker.done()
        assert h.post("/v1/chat/completions", json=body | {"stream": True}).status_code == 200
        assert worker.in_flight == 0  # a stream frees its place when it ends


def test_a_group_reads_its_common_first_prompt_from_one_stream(served):
    """Three sessions of one group (a GRPO group's rollouts) send the same first prompt: it is fed once,
    into a root stream each session forks; their answers are the ungrouped session's, and they go on
    as sessions of their own (one drops a message). The last one closed closes the root."""
    server, url = served
    c = client(url)
    msgs = [
        {"role": "system", "content": "You browse the web for facts. " * 30},
        {"role": "user", "content": "Go."},
    ]
    ask = dict(model="tiny", logprobs=True, **GREEDY)
    alone = c.chat.completions.create(messages=msgs, extra_body=NO_EOS | {"session_id": "solo"}, **ask)
    before = len(server.engine.sessions)
    grouped = [
        c.chat.completions.create(
            messages=msgs, extra_body=NO_EOS | {"session_id": f"g{i}", "group": "t7"}, **ask
        )
        for i in range(3)
    ]
    fed = [r.usage.prefilled_tokens for r in grouped]
    assert fed[0] == alone.usage.prefilled_tokens > 100 and fed[1] == fed[2] < 5  # the prompt, once
    assert [r.usage.prompt_tokens_details.cached_tokens for r in grouped[1:]] == [
        alone.usage.prompt_tokens - fed[1]
    ] * 2
    for r in grouped:
        assert r.choices[0].message.content == alone.choices[0].message.content
        lps = [t.logprob for t in r.choices[0].logprobs.content]
        assert np.allclose(lps, [t.logprob for t in alone.choices[0].logprobs.content], atol=1e-5)
    assert len(server.engine.sessions) == before + 4  # three sessions and their root
    for i, r in enumerate(grouped):  # each goes its own way; g1 drops the user message
        more = msgs + [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"And {i}?"},
        ]
        if i == 1:
            del more[1]
        nxt = c.chat.completions.create(messages=more, extra_body=NO_EOS | {"session_id": f"g{i}"}, **ask)
        assert (nxt.usage.evicted_tokens > 0) == (i == 1)
    with http(url) as h:
        for i in range(3):
            (row,) = h.get(f"/v1/sessions/g{i}/trace").json()["traces"]
            t = Trace.from_dict(row)
            with torch.no_grad():
                replayed = stream_logprobs(server.engine.model, [t])[0].double()
            m = torch.as_tensor(t.trainable)
            assert m.sum() == 12 and (replayed[m] - torch.as_tensor(t.logprobs)[m]).abs().max() < 5e-5
            h.delete(f"/v1/sessions/g{i}")
        h.delete("/v1/sessions/solo")
    assert "t7" not in server.worker.groups and len(server.engine.sessions) == before - 1


def test_metrics_and_load_weights(served, model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    server, url = served
    c = client(url)
    msgs = [{"role": "user", "content": "Weights?"}]
    before = c.chat.completions.create(model="tiny", messages=msgs, extra_body=NO_EOS, **GREEDY).choices[0]
    folder = tmp_path / "new"
    folder.mkdir()
    state = load_file(model_dir / "model.safetensors")
    torch.manual_seed(0)
    save_file(
        {k: v + 0.05 * torch.randn_like(v) if v.ndim == 2 else v for k, v in state.items()},
        folder / "model.safetensors",
    )
    with http(url) as h:
        r = h.post("/v1/load_weights", json={"path": str(folder)}).json()
        assert r["loaded"] > 0
        assert r["weights_version"] == 1, r
        after = c.chat.completions.create(model="tiny", messages=msgs, extra_body=NO_EOS, **GREEDY).choices[0]
        assert after.message.content != before.message.content
        h.post("/v1/load_weights", json={"path": str(model_dir), "keep_kv": False})
        bad = h.post("/v1/load_weights", json={"path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
        assert h.get("/no/such/route/123").status_code == 404
        text = h.get("/metrics").text
    again = c.chat.completions.create(model="tiny", messages=msgs, extra_body=NO_EOS, **GREEDY).choices[0]
    assert again.message.content == before.message.content
    assert 'compactrl_tokens_total{kind="evicted"}' in text
    assert "compactrl_kv_tokens_used" in text and "compactrl_kv_tokens_peak" in text
    assert 'route="other"' in text and "/no/such/route" not in text  # labels per route, not per URL


def test_load_weights_merges_lora_adapters_over_the_base_and_each_replaces_the_last(model_dir, tmp_path):
    """A peft adapter folder (what LoRA trainers save each step) and compactrl's lora.safetensors load
    as the weights peft's own merge gives; a second adapter is merged over the base, not over the first
    (the first's layers go back to the base); an adapter for other layers is refused, nothing loaded."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from compactrl.models.lora import Adapters, LoraSettings, add_lora, merged_state_dict

    def peft_adapter(seed, targets, out):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        lora = LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, use_rslora=seed == 2
        )
        model = get_peft_model(hf, lora)
        model.save_pretrained(out)
        return {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}

    own = Engine.from_pretrained(model_dir).model  # compactrl's model with a trained-looking adapter
    settings = LoraSettings(r=4, alpha=16, targets=("o_proj", "down_proj"))
    add_lora(own, settings)
    torch.manual_seed(3)
    for name, prm in own.named_parameters():
        if "lora_B" in name:
            prm.data.normal_(0, 0.1)
    save_file(
        Adapters(own, settings).state_dict(), tmp_path / "lora.safetensors", Adapters(own, settings).metadata
    )
    with serving(model_dir) as (server, url), http(url) as h:
        params = lambda: {k: v.detach().clone() for k, v in server.engine.model.named_parameters()}  # noqa: E731
        base = params()
        for path, expected in (
            (tmp_path / "a1", peft_adapter(1, ["q_proj", "v_proj"], tmp_path / "a1")),
            (tmp_path / "a2", peft_adapter(2, ["up_proj"], tmp_path / "a2")),
            (tmp_path / "lora.safetensors", merged_state_dict(own)),
        ):
            r = h.post("/v1/load_weights", json={"path": str(path)})
            assert r.status_code == 200, r.text
            got = params()
            changed = {k for k in got if not torch.equal(got[k], base[k])}
            assert changed and all(torch.allclose(got[k], expected[k].float(), atol=1e-5) for k in got), path
        bad = tmp_path / "other"
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
        key = "base_model.model.model.layers.99.self_attn.q_proj.lora_{}.weight"
        save_file(
            {key.format("A"): torch.ones(2, 8), key.format("B"): torch.ones(8, 2)},
            bad / "adapter_model.safetensors",
        )
        r = h.post("/v1/load_weights", json={"path": str(bad)})
        assert r.status_code == 400 and "does not have" in r.json()["error"]["message"]
        assert all(torch.equal(v, got[k]) for k, v in params().items())
    with serving(model_dir, thread_adapter=str(tmp_path)) as (server, url), http(url) as h:
        for path in (model_dir, tmp_path / "a1"):  # under the thread adapter's peft-wrapped layers too
            r = h.post("/v1/load_weights", json={"path": str(path)})
            assert r.status_code == 200 and r.json()["loaded"] > 0, r.text


def test_many_concurrent_sessions_with_random_removals_stay_valid_and_leave_nothing(model_dir):
    """64 agents of 20 turns, each removing random earlier messages: no error, every trace the
    trainer replays, and once the sessions are deleted the engine holds nothing."""
    import random

    with serving(model_dir, pool=60_000) as (server, url):

        async def agent(ac, k):
            rng = random.Random(k)
            msgs = [{"role": "system", "content": f"Agent {k}."}]
            lps = []
            for t in range(20):
                msgs.append(
                    {
                        "role": rng.choice(["user", "tool"]),
                        "content": f"obs {k}.{t} " + "z" * rng.randint(0, 9),
                    }
                )
                if len(msgs) > 4 and rng.random() < 0.4:
                    del msgs[rng.randrange(1, len(msgs) - 1)]
                r = await ac.chat.completions.create(
                    model="tiny",
                    messages=msgs,
                    max_tokens=3,
                    temperature=1.0,
                    seed=k * 100 + t,
                    logprobs=True,
                    extra_body=NO_EOS | {"session_id": f"load-{k}"},
                )
                msgs.append({"role": "assistant", "content": r.choices[0].message.content})
                lps += [e.logprob for e in r.choices[0].logprobs.content]
            return lps

        async def main():
            ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
            try:
                return await asyncio.gather(*[agent(ac, k) for k in range(64)])
            finally:
                await ac.close()

        served_lps = asyncio.run(main())
        with http(url) as h:
            traces = [
                Trace.from_dict(h.get(f"/v1/sessions/load-{k}/trace").json()["traces"][0]) for k in range(64)
            ]
            assert sum(t.num_evicted > 0 for t in traces) > 50
            with torch.no_grad():
                replayed = stream_logprobs(server.engine.model, traces)
            for t, lp, mine in zip(traces, replayed, served_lps, strict=True):
                m = torch.as_tensor(t.trainable)
                assert (lp.double()[m] - torch.tensor(mine, dtype=torch.float64)).abs().max() < 5e-5
            for k in range(64):
                assert h.delete(f"/v1/sessions/load-{k}").status_code == 200
        deadline = time.monotonic() + 10
        while server.engine.active and time.monotonic() < deadline:
            time.sleep(0.01)
        eng = server.engine
        assert (
            len(eng.sessions) == 0
            and eng.kv_tokens_used() == 0
            and not eng.active
            and not server.worker.sessions
        )
        assert eng.metrics()["sessions_closed"] >= 64


def test_sigterm_finishes_in_flight_requests_and_exits_0(model_dir):
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "compactrl.cli",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        results = []

        def ask():
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                timeout=120,
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "Long."}],
                    "max_tokens": 1500,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            )
            results.append((r.status_code, json.loads(r.text)))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the requests are in flight
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert proc.wait(120) == 0
    finally:
        proc.kill()
    assert [s for s, _ in results] == [200] * 4
    assert all(b["usage"]["completion_tokens"] == 1500 for _, b in results)


def test_the_serve_bench_runs_one_workload_against_both_session_modes(model_dir, tmp_path):
    """The bench's client against two real servers: no errors, the same turns and answers' lengths, and
    re-prefill feeds more than the stream once the harness drops tool outputs."""
    from compactrl.bench.serve import markdown, run_serve_bench

    result = run_serve_bench(model_dir, agents=3, turns=4, window=1, page_words=20, max_tokens=4)
    stream, again = result["rows"]
    assert [r["server"] for r in result["rows"]] == ["compactrl-stream", "compactrl-reprefill"]
    assert stream["errors"] == again["errors"] == 0 and stream["turns"] == again["turns"] == 12
    assert stream["completion_tokens"] == again["completion_tokens"] == 12 * 4
    assert again["prefilled_tokens"] > stream["prefilled_tokens"] and again["prefill_ratio"] > 1
    assert "compactrl-reprefill" in markdown(result)


def grow(c, sid, turns, extra, edit=None):
    """A client that appends each answer and a tool output; ``edit(messages)`` may remove some."""
    messages = [
        {"role": "system", "content": "You browse."},
        {"role": "user", "content": "Find the capital."},
    ]
    usages = []
    for t in range(turns):
        r = c.chat.completions.create(model="tiny", messages=messages, extra_body=NO_EOS | extra, **GREEDY)
        usages.append(r.usage)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "tool", "content": f"page {t}: city {t * 7} is north of city {t * 3}."})
        if edit:
            edit(messages)
    return usages


def test_a_session_strategy_compacts_a_client_that_never_edits_as_if_it_had(served):
    """keep_last_cursors inside the session, for a client that keeps sending everything, gives the
    stream a client that removes the older answers and tool outputs itself gives; the client may keep
    sending what the session deleted."""
    server, url = served
    c = client(url)

    def keep_newest_step(messages):
        while sum(m["role"] == "tool" for m in messages) > 1:
            del messages[2:4]  # the oldest answer and its tool output

    rule = {"name": "keep_last_cursors", "n": 1}
    inside = grow(c, "rule-inside", 6, {"session_id": "rule-inside", "strategy": rule})
    outside = grow(c, "rule-outside", 6, {"session_id": "rule-outside"}, keep_newest_step)
    with http(url) as h:
        a, b = (Trace.from_dict(h.get(f"/v1/sessions/{s}/trace").json()["traces"][0])
                for s in ("rule-inside", "rule-outside"))  # fmt: skip
    assert a.tokens.tolist() == b.tokens.tolist() and a.evict_at.tolist() == b.evict_at.tolist()
    assert a.num_evicted > 0
    assert [u.prompt_tokens for u in inside] == [u.prompt_tokens for u in outside]
    assert max(u.prompt_tokens for u in inside) < 2 * inside[1].prompt_tokens  # bounded, not growing
    with torch.no_grad():
        replayed = stream_logprobs(server.engine.model, [a])[0].double()
    m = torch.as_tensor(a.trainable)
    assert (replayed[m] - torch.as_tensor(a.logprobs)[m]).abs().max() < 5e-5


def test_a_reprefill_session_strategy_cuts_and_feeds_the_kept_context_again(served):
    _, url = served
    c = client(url)
    window = {"name": "sliding_window", "max_turns": 2, "stride": 1}
    stream = grow(c, "win-stream", 5, {"session_id": "win-stream", "strategy": window})
    again = grow(
        c, "win-reprefill", 5, {"session_id": "win-reprefill", "strategy": window, "compaction": "reprefill"}
    )
    assert [u.prompt_tokens for u in stream] == [u.prompt_tokens for u in again]  # the same context kept
    assert sum(u.prefilled_tokens for u in again) > sum(u.prefilled_tokens for u in stream)
    with http(url) as h:
        traces = h.get("/v1/sessions/win-reprefill/trace").json()["traces"]
    assert len(traces) > 2 and all(Trace.from_dict(t).num_evicted == 0 for t in traces)


def test_an_evictor_session_stays_within_its_budget_and_replays(served):
    server, url = served
    c = client(url)
    h2o = {"name": "h2o", "budget": 48, "window": 4, "interval": 4}
    usages = grow(c, "h2o", 6, {"session_id": "h2o", "evictor": h2o})
    assert usages[-1].prompt_tokens < 48 + 40  # the budget plus the newest messages, fed whole
    with http(url) as h:
        (row,) = h.get("/v1/sessions/h2o/trace").json()["traces"]
    t = Trace.from_dict(row)
    with torch.no_grad():
        replayed = stream_logprobs(server.engine.model, [t])[0].double()
    m = torch.as_tensor(t.trainable)
    assert t.num_evicted > 0 and (replayed[m] - torch.as_tensor(t.logprobs)[m]).abs().max() < 5e-5


def replays(server, t: Trace) -> bool:
    """The trainer's one-pass log-probs of ``t`` equal the served ones (float32)."""
    with torch.no_grad():
        replayed = stream_logprobs(server.engine.model, [t])[0].double()
    m = torch.as_tensor(t.trainable)
    return bool((replayed[m] - torch.as_tensor(t.logprobs)[m]).abs().max() < 5e-5)


def test_a_summary_session_writes_its_summary_in_the_stream_and_the_old_steps_go(served):
    """summary inside a session, every 2 answers, for a client that keeps sending everything: the model
    writes the summary in the stream (trainable, role ``summary``), the question and every step but the
    newest go in place, the summary and its resume message stay; the trainer replays the stream. The
    reprefill session keeps the same context, fed again in fresh segments, never evicted."""
    server, url = served
    c = client(url)
    summary = {"name": "summary", "trigger": "every", "every": 2, "tail": 0, "max_tokens": 5}
    plain = grow(c, "sum-plain", 6, {"session_id": "sum-plain"})
    stream = grow(c, "sum-stream", 6, {"session_id": "sum-stream", "strategy": summary})
    again = grow(
        c, "sum-again", 6, {"session_id": "sum-again", "strategy": summary, "compaction": "reprefill"}
    )
    with http(url) as h:
        got = {s: h.get(f"/v1/sessions/{s}/trace").json() for s in ("sum-stream", "sum-again")}
    cs = server.worker.sessions["sum-stream"]
    assert got["sum-stream"]["stats"]["compactions"] == cs.stats["compactions"] == 2  # after answers 2 and 4
    own = [r for r in cs.records if r.own]
    asked = [("user", "ask", True), ("assistant", "summary", False), ("user", "summary", False)]
    assert [(r.role, r.kind, r.deleted) for r in own] == [  # the second summary takes the first's place
        (role, kind, True) for role, kind, _ in asked
    ] + asked
    assert all(r.deleted for r in cs.records if r.step < 3 and not r.own and r.step >= 0)  # the old steps
    (t,) = (Trace.from_dict(x) for x in got["sum-stream"]["traces"])
    summaries = (np.array(t.role) == "summary") & t.trainable
    assert (
        summaries.sum() >= 2 and (t.evict_at[summaries] == len(t.tokens)).any()
    )  # a summary's tokens stay live
    assert replays(server, t) and t.num_evicted > 0
    assert stream[-1].prompt_tokens < plain[-1].prompt_tokens  # bounded: the client sent all 6 turns
    # the client's messages are matched (never fed again): a request feeds its new messages, plus at a
    # compaction the question and the resume message
    fed_plain = [u.prefilled_tokens for u in plain]
    fed = [u.prefilled_tokens for u in stream]
    assert [f == p for f, p in zip(fed, fed_plain)] == [True, True, False, True, False, True]
    segments = [Trace.from_dict(x) for x in got["sum-again"]["traces"]]
    assert len(segments) == 3 and all(s.num_evicted == 0 for s in segments)
    assert sum(u.prefilled_tokens for u in again) > sum(fed)


def test_a_pick_session_falls_back_to_the_newest_steps_when_the_answer_does_not_parse(served):
    """pick inside a session over a token budget: the tiny model's answer is no KEEP list, so the
    documented default keeps the newest steps within keep_budget; the fallback is counted; the question
    and the answer leave the stream."""
    server, url = served
    c = client(url)
    pick = {"name": "pick", "budget": 160, "keep_budget": 60, "max_tokens": 4}
    usages = grow(c, "pick", 6, {"session_id": "pick", "strategy": pick})
    cs = server.worker.sessions["pick"]
    assert cs.stats["compactions"] >= 1 and cs.stats["pick_fallbacks"] == cs.stats["compactions"]
    assert all(r.deleted for r in cs.records if r.own)
    last = cs.compacted_at - 1  # the step of the last compaction's answer (answer k is step k - 1 here)
    kept = [r for r in cs.records if not r.deleted and 0 <= r.step < last]  # what that compaction kept
    assert kept and sum(r.end - r.start for r in kept) <= 60
    assert max(u.prompt_tokens for u in usages) <= 160 + 40  # the budget plus a request's new messages
    with http(url) as h:
        (row,) = h.get("/v1/sessions/pick/trace").json()["traces"]
    assert replays(server, Trace.from_dict(row))


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/v1/chat/completions", {"strategy": {"name": "drop_opened_search"}}, "tool"),
        ("/v1/completions", {"strategy": {"name": "sliding_window"}}, "chat messages"),
        (
            "/v1/chat/completions",
            {"compaction": "reprefill", "evictor": {"name": "h2o", "budget": 9}},
            "in place",
        ),
        ("/v1/chat/completions", {"strategy": {"name": "sliding_window", "max_turns": 0}}, "max_turns"),
    ],
)
def test_session_settings_a_session_cannot_run_are_refused(served, route, body, says):
    _, url = served
    base = {"model": "tiny", "max_tokens": 2}
    base |= (
        {"prompt": [1, 2, 3]}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    with http(url) as h:
        r = h.post(route, json=base | body | {"session_id": f"refused-{len(says)}"})
    assert r.status_code in (400, 422) and says in r.json()["error"]["message"], r.text


def test_idle_sessions_expire_and_a_full_server_refuses_new_ones(model_dir):
    with serving(model_dir, max_sessions=2, session_ttl=0.5) as (server, url), http(url) as h:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        for sid in ("s1", "s2"):
            assert h.post("/v1/chat/completions", json=body | {"session_id": sid}).status_code == 200
        deadline = time.monotonic() + 10
        while server.worker.sessions and time.monotonic() < deadline:  # idle past the TTL: closed
            time.sleep(0.1)
        assert not server.worker.sessions and not server.engine.sessions
        assert h.get("/v1/sessions/s1/trace").status_code == 404
    with serving(model_dir, max_sessions=1, session_ttl=600) as (server, url), http(url) as h:
        assert h.post("/v1/chat/completions", json=body | {"session_id": "a"}).status_code == 200
        r = h.post("/v1/chat/completions", json=body | {"session_id": "b"})
        assert r.status_code == 429 and "max-sessions" in r.json()["error"]["message"]
        assert h.delete("/v1/sessions/a").status_code == 200
        assert h.post("/v1/chat/completions", json=body | {"session_id": "b"}).status_code == 200


def test_a_trainer_in_the_same_process_hands_the_server_new_weights(served, model_dir):
    """A training loop holds the server around its engine: weights staged from its thread load between
    engine steps, and each answer says which weights version sampled it."""
    server, url = served
    c = client(url)
    msgs = [{"role": "user", "content": "Version?"}]
    first = c.chat.completions.create(model="tiny", messages=msgs, extra_body=NO_EOS, **GREEDY)
    v0 = first.weights_version
    params = dict(server.engine.model.named_parameters())
    torch.manual_seed(1)
    new = {k: (p.detach() + 0.05 * torch.randn_like(p)) for k, p in params.items() if p.ndim == 2}
    old = {k: params[k].detach().clone() for k in new}
    trainer = threading.Thread(target=server.engine.stage_weights, args=(new, v0 + 7))
    trainer.start()
    trainer.join()
    after = c.chat.completions.create(model="tiny", messages=msgs, extra_body=NO_EOS, **GREEDY)
    assert (
        after.weights_version == after.weights_version_first == v0 + 7 and first.weights_version_first == v0
    )
    assert after.choices[0].message.content != first.choices[0].message.content
    server.engine.stage_weights(old, v0 + 8)  # the old weights back, for the tests that follow
    back = c.chat.completions.create(model="tiny", messages=msgs, extra_body=NO_EOS, **GREEDY)
    assert back.choices[0].message.content == first.choices[0].message.content


def browse_like(c, sid, turns, extra):
    """Tool outputs labelled ``[Cursor c]`` as the browse env writes them, sent as user messages."""
    messages = [
        {"role": "system", "content": "You browse."},
        {"role": "user", "content": "Find the capital."},
    ]
    for t in range(turns):
        r = c.chat.completions.create(model="tiny", messages=messages, extra_body=NO_EOS | extra, **GREEDY)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "user", "content": f"[Cursor {t}] page {t}\ncity {t * 7} is north."})
    return messages


def test_a_sidequest_session_runs_its_thread_on_a_fork_that_never_enters_the_stream(served):
    """Sequential SideQuest inside a session, every second answer: the thread forks the stream, writes
    (its trace kept for training, the prefix not trainable), and the main stream is, token for token
    and log-prob for log-prob, the stream without it: the tiny model names no cursor, so nothing is
    deleted, and the thread's tokens never enter the stream."""
    server, url = served
    c = client(url)
    sq = {"name": "sidequest", "every": 2, "parallel": False, "max_tokens": 12}
    browse_like(c, "sq-on", 5, {"session_id": "sq-on", "strategy": sq})
    browse_like(c, "sq-off", 5, {"session_id": "sq-off"})
    with http(url) as h:
        on, off = (h.get(f"/v1/sessions/{s}/trace").json() for s in ("sq-on", "sq-off"))
    assert on["stats"]["aux_calls"] == 2 and on["stats"]["aux_tokens"] == 2 * 12
    main, *threads = (Trace.from_dict(t) for t in on["traces"])
    plain = Trace.from_dict(off["traces"][0])
    assert main.tokens.tolist() == plain.tokens.tolist() and main.num_evicted == 0
    assert np.allclose(main.logprobs, plain.logprobs, equal_nan=True, atol=1e-6)
    assert len(threads) == 2 and all(t.meta["aux"] for t in threads)
    for t in threads:
        fork = t.meta["fork_at"]
        assert t.tokens[:fork].tolist() == main.tokens[:fork].tolist()
        assert not t.trainable[:fork].any() and t.trainable[fork:].sum() == 12
        with torch.no_grad():
            replayed = stream_logprobs(server.engine.model, [t])[0].double()
        m = torch.as_tensor(t.trainable)
        assert (replayed[m] - torch.as_tensor(t.logprobs)[m]).abs().max() < 5e-5


@pytest.mark.parametrize("keep_calls", [False, True])
def test_a_threads_answer_deletes_only_cursors_it_saw_and_may_delete(model_dir, keep_calls):
    """The answer's cursors, applied to a session's records: named and open ones go (whole steps, or
    outputs only with keep_calls), unknown ones are counted, the unread one stays."""
    from compactrl.compaction import SideQuestConfig
    from compactrl.serve.session import ChatSession, Usage
    from compactrl.serve.sidequest import delete_named

    engine = Engine.from_pretrained(model_dir)
    fmt = ChatFormat.from_tokenizer(engine.tokenizer)
    cs = ChatSession("x", engine, fmt, strategy=SideQuestConfig(parallel=False, keep_calls=keep_calls,
                                                                 keep_unread=True, every=100))  # fmt: skip
    messages = [("system", "You browse."), ("user", "Find it.")]
    for t in range(3):
        cs.apply(cs.plan(messages, 4), Usage())
        g = cs.stream.generate(SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        engine.run()
        cs.finish(g, fmt.text(g.tokens))
        messages += [("assistant", fmt.text(g.tokens)), ("user", f"[Cursor {t}] page {t}")]
    cs.apply(cs.plan(messages, 4), Usage())  # the third output lands: cursors 0, 1, 2 open, 2 unread
    seen = {r.cursor: r for r in cs.records if r.cursor is not None}
    assert sorted(seen) == [0, 1, 2] and cs.step == 2
    before = cs.stream.live
    deleted = delete_named(cs, 'I think so.\n{"del_cursors": [0, 2, 7]}', seen, unread={2})
    assert deleted == [0] and cs.stats["aux_unknown_cursors"] == 1  # 7 was never open
    assert cs.stats["aux_kept_unread"] == 1  # 2: no answer has read it yet
    gone = [r for r in cs.records if r.deleted]
    assert [r.role for r in gone] == (["user"] if keep_calls else ["assistant", "user"])
    assert all(r.step == 0 for r in gone) and cs.stream.live == before - sum(r.end - r.start for r in gone)
    assert delete_named(cs, "no json here", seen) == [] and cs.stats["aux_parse_failures"] == 1


def test_the_episode_bench_plays_an_env_over_http_with_and_without_a_sessions_thread(model_dir, tmp_path):
    """Browse episodes played by an OpenAI client against two fresh servers under one pool: the same
    episodes in both rows, paired; SideQuest's thread runs inside the sessions of the second."""
    from compactrl.bench.serve_episodes import EpisodeBench, markdown, run_episode_bench

    thread = {"name": "sidequest", "every": 2, "parallel": False, "max_tokens": 8}

    bench = EpisodeBench.model_validate({
        "model": str(model_dir), "env": {"name": "browse", "min_hops": 2, "max_hops": 2}, "episodes": 4,
        "concurrency": 2, "kv_pool_tokens": 6000, "threads": 1, "max_turns": 4, "max_tokens": 8,
        "results": str(tmp_path / "rows.json"),
        "row": [{"name": "full"}, {"name": "sq", "strategy": thread}],
    })  # fmt: skip
    result = run_episode_bench(bench)
    full, sq = result["rows"]
    assert full["episodes"] == sq["episodes"] == 4 and not full["errors"] and not sq["errors"]
    assert full["episode_seeds"] == sq["episode_seeds"] and sq["compared_to"] == "full"
    assert full.get("aux_calls", 0) == 0 and sq["aux_calls"] > 0 and sq["aux_tokens"] == 8 * sq["aux_calls"]
    assert (
        full["peak_pool_tokens"] > 0
        and json.loads((tmp_path / "rows.json").read_text())["rows"][1]["row"] == "sq"
    )
    assert "| sq |" in markdown(result)
