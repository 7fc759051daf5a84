"""Tool calls in `compactrl serve`: the parsers, the tools rendered by the template (or in the system
prompt), and a returned call sent back with its result matched to the tokens sampled for it, with the
real openai client. A random tiny model writes no calls by itself: the answers are teacher-forced
(each token scored as if sampled, so the session's trace replays as a sampled one does)."""

import json
import shutil

import pytest
import torch
from test_serve import client, http, serving

from compactrl.agent.chat import ChatFormat, ChatTemplateError
from compactrl.models.tiny import write_tiny_model
from compactrl.models.tokenizer import Tokenizer
from compactrl.rl.forward import stream_logprobs
from compactrl.serve.server import Server
from compactrl.serve.tools import PARSERS, PromptedTools, parse, session_format, template_calls
from compactrl.trace import Trace

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]

# Qwen2.5's template, as far as tools go: the tools in the system message, an assistant message's
# tool_calls written as <tool_call> blocks, tool results in a user turn as <tool_response> blocks
QWEN_TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You help.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
      or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": '
    + tool_call.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve-tools") / "tiny", family="qwen3", seed=0)


@pytest.fixture(scope="module")
def served(model_dir):
    with serving(model_dir) as s:
        yield s


@pytest.fixture
def forced(served, monkeypatch):
    """``forced(text)``: the server's answers write ``text`` and stop (teacher forcing); ``forced(None)``:
    they are sampled again."""
    server, _ = served
    params = server.params

    def force(text: str | None):
        if text is None:
            monkeypatch.setattr(server, "params", params)
            return
        toks = server.engine.tokenizer.encode(text) + [server.fmt.stop_ids[0]]
        monkeypatch.setattr(
            server, "params", lambda *a, **k: params(*a, **k).model_copy(update={"forced": toks})
        )

    return force


def ask(c, sid, messages, more=None, **kw):
    """A greedy request with the weather tool in session ``sid`` (``more``: fields the openai client
    does not know)."""
    kw = {
        "model": "tiny",
        "messages": messages,
        "tools": [WEATHER],
        "temperature": 0.0,
        "max_tokens": 64,
    } | kw
    return c.chat.completions.create(**kw, logprobs=True, extra_body={"session_id": sid, **(more or {})})


def extra(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in ("role", "content")}


def feeds(fmt: ChatFormat, before: list[dict], new: list[dict]) -> int:
    """Tokens a session fed after ``before`` for the ``new`` messages and the generation prompt."""
    conv = fmt.conversation()
    conv.reset(before)
    return sum(len(conv.message(m["role"], m["content"], extra=extra(m))) for m in new) + len(conv.prompt())


def replays_served(server, url, sid, served_lps) -> dict:
    """The session's trace: the trainer's one-pass log-probs equal the served ones on its trainable
    tokens (float32). Returns the session's stats."""
    with http(url) as h:
        body = h.get(f"/v1/sessions/{sid}/trace").json()
    (row,) = body["traces"]
    t = Trace.from_dict(row)
    with torch.no_grad():
        replayed = stream_logprobs(server.engine.model, [t])[0].double()
    m = torch.as_tensor(t.trainable)
    assert int(m.sum()) == len(served_lps)
    assert (replayed[m] - torch.tensor(served_lps, dtype=torch.float64)).abs().max() < 5e-5
    return body["stats"]


# ---- the parsers ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("parser", "text", "want"),
    [
        ("hermes", "It is sunny.", ("It is sunny.", [])),
        ("hermes", CALL, ("", [("get_weather", {"city": "Paris"})])),
        (
            "hermes",
            'Let me look.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
            ("Let me look.", [("a", {"x": 1}), ("b", {})]),
        ),
        ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1}}', ("", [("a", {"x": 1})])),  # unclosed
        ("hermes", '<tool_call>{"name": "a"}</tool_call>', ("", [("a", {})])),  # no arguments
        ("hermes", '<tool_call>{"name": "a", "arguments": {"x": }}</tool_call>', None),  # bad JSON
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', None),  # no name
        ("hermes", '<tool_call>{"name": "a", "arguments": "x=1"}</tool_call>', None),  # not an object
        ("hermes", 'ok <tool_call>{"name": "a"}</tool_call> <tool_call>[1]</tool_call>', None),  # one bad
        ("llama3_json", "It is sunny.", ("It is sunny.", [])),
        ("llama3_json", ' {"name": "a", "parameters": {"x": 1}}', ("", [("a", {"x": 1})])),
        (
            "llama3_json",
            '<|python_tag|>{"name": "a", "arguments": {"x": "a;b"}}; {"name": "b", "parameters": {}}',
            ("", [("a", {"x": "a;b"}), ("b", {})]),
        ),
        ("llama3_json", '{"name": "a", "parameters": {"x": 1}} and then', None),
        ("llama3_json", '{"name": "a", "parameters": ', None),  # bad JSON
        ("llama3_json", '{"city": "Paris"}', None),  # no name
    ],
)
def test_parsers_read_calls_and_a_call_that_does_not_parse_is_none(parser, text, want):
    assert parse(parser, text) == want


def test_a_parser_reads_back_what_it_writes_and_a_call_to_an_unknown_tool_does_not_parse():
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "at": {"h": [1, 2]}})]
    for name, p in PARSERS.items():
        assert parse(name, p.write(calls)) == ("", calls)
        assert parse(name, p.write(calls), {"get_weather", "get_time"}) == ("", calls)
        assert parse(name, p.write(calls), {"get_weather"}) is None


# ---- rendering -------------------------------------------------------------------------------------
def test_tools_are_rendered_by_a_template_that_knows_them_else_in_the_system_prompt(model_dir, tmp_path):
    """A template that renders tools gets them (and renders a client's tool calls and the tool's
    result itself); one that ignores them gets them in the first system message and a client's calls
    written as the parser reads them. Either way the messages append: the incremental rendering is
    the template's rendering of the whole conversation."""
    qwen = tmp_path / "qwen"
    shutil.copytree(model_dir, qwen)
    (qwen / "chat_template.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    calls = template_calls(
        [{"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    )
    messages = [
        *ASK,
        {"role": "assistant", "content": "Let me check.", "tool_calls": calls},
        {"role": "tool", "content": "Sunny.", "tool_call_id": "call_1"},
    ]
    written = "Let me check.\n" + CALL
    for folder, native, wants in [
        (qwen, True, ["You help.\n\n# Tools\n\n<tools>\n" + json.dumps(WEATHER), written,
                      "<|im_start|>user\n<tool_response>\nSunny.\n</tool_response><|im_end|>"]),
        (model_dir, False, ["You help.\n\n# Tools\n\n", json.dumps(WEATHER), written,
                            "<|im_start|>tool\nSunny.<|im_end|>"]),
    ]:  # fmt: skip
        tok = Tokenizer.from_dir(folder)
        fmt = session_format(ChatFormat.from_tokenizer(tok), [WEATHER], "hermes")
        assert isinstance(fmt, PromptedTools) != native
        conv = fmt.conversation()
        ids = [t for m in messages for t in conv.message(m["role"], m["content"], extra=extra(m))]
        text = tok.decode(ids, skip_special_tokens=False)
        assert text == fmt.render(messages)
        assert all(w in text for w in wants), text
    prompted = PARSERS["llama3_json"].write([("function_name", {"argument": "value"})])
    fmt = session_format(ChatFormat.from_tokenizer(Tokenizer.from_dir(model_dir)), [WEATHER], "llama3_json")
    assert prompted in fmt.render(ASK)  # the prompt asks for the calls the parser reads
    # Qwen's template puts consecutive tool results in one turn, which rewrites the one before: refused
    # as a rewrite; with rewrites = "keep" each result is a turn of its own
    two = [*messages, {"role": "tool", "content": "Windy.", "tool_call_id": "call_1"}]
    tok = Tokenizer.from_dir(qwen)
    strict = session_format(ChatFormat.from_tokenizer(tok), [WEATHER], "hermes").conversation()
    with pytest.raises(ChatTemplateError, match=r"message 4 \(tool\)"):
        for m in two:
            strict.message(m["role"], m["content"], extra=extra(m))
    keep = session_format(ChatFormat.from_tokenizer(tok, "keep"), [WEATHER], "hermes").conversation()
    ids = [t for m in two for t in keep.message(m["role"], m["content"], extra=extra(m))]
    assert tok.decode(ids, skip_special_tokens=False).endswith(
        "Sunny.\n</tool_response><|im_end|>\n<|im_start|>user\n<tool_response>\nWindy.\n</tool_response><|im_end|>\n"
    )


# ---- over HTTP -------------------------------------------------------------------------------------
@pytest.mark.parametrize("resend", ["as returned", "re-serialised", "changed"])
def test_a_returned_tool_call_sent_back_with_its_result_is_matched_and_the_trace_replays(
    served, forced, resend
):
    """The answer's call comes back as ``tool_calls`` (``finish_reason`` ``tool_calls``, the content
    the text before it). Sent back with the tool's result, as returned or with its arguments
    re-serialised, it is matched to its sampled tokens: the next request feeds only the tool message
    and the generation prompt, evicts nothing. A call the client changed is its own message: the
    sampled one is evicted and the client's rendered. The trace replays the served log-probs."""
    server, url = served
    c, sid = client(url), f"tools-{resend}"
    forced("Let me check.\n" + CALL)
    r = ask(c, sid, ASK)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check."
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    forced(None)
    sent = ch.message.model_dump(exclude_none=True)
    args = {"as returned": {"city": "Paris"}, "re-serialised": {"city": "Paris"}, "changed": {"city": "Lyon"}}
    if resend != "as returned":
        sent["tool_calls"][0]["function"]["arguments"] = json.dumps(args[resend], indent=2)
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}
    r2 = ask(c, sid, [*ASK, sent, result], {"ignore_eos": True}, max_tokens=6)
    fmt = session_format(server.fmt, [WEATHER], "hermes")
    if resend == "changed":  # the client's call, rendered by the template, then the result
        assert r2.usage.evicted_tokens > 0
        mine = {"role": "assistant", "content": "Let me check."}
        mine["tool_calls"] = template_calls(sent["tool_calls"])
        assert r2.usage.prefilled_tokens == feeds(fmt, ASK, [mine, result])
    else:
        assert r2.usage.evicted_tokens == 0
        answer = {"role": "assistant", "content": "Let me check.\n" + CALL}  # as sampled
        assert r2.usage.prefilled_tokens == feeds(fmt, [*ASK, answer], [result])
    lps = [e.logprob for x in (r, r2) for e in x.choices[0].logprobs.content]
    assert replays_served(server, url, sid, lps)["tool_call_parse_failures"] == 0


def test_a_streamed_tool_call_comes_as_one_delta_at_the_end_and_is_matched_when_sent_back(served, forced):
    """Text that could be a call is held back: the content streams up to the call, the call comes as
    one ``tool_calls`` delta with the finish; sent back as a client accumulates it, it is matched. An
    answer without a call streams all its text."""
    server, url = served
    c, sid = client(url), "tools-stream"
    forced("Let me check.\n" + CALL)
    chunks = [x.choices[0] for x in ask(c, sid, ASK, stream=True) if x.choices]
    content = "".join(x.delta.content or "" for x in chunks)
    finishes = [x.finish_reason for x in chunks if x.finish_reason]
    assert content == "Let me check." and finishes == ["tool_calls"]
    (call,) = [tc for x in chunks for tc in x.delta.tool_calls or []]
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert chunks[-1].delta.tool_calls and json.loads(call.function.arguments) == {"city": "Paris"}
    fn = {"name": call.function.name, "arguments": call.function.arguments}
    sent = {"role": "assistant", "content": content}
    sent["tool_calls"] = [{"id": call.id, "type": "function", "function": fn}]
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny."}
    forced("It is sunny.")
    *chunks, last = ask(c, sid, [*ASK, sent, result], stream=True, stream_options={"include_usage": True})
    assert "".join(x.choices[0].delta.content or "" for x in chunks) == "It is sunny."
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any(x.choices[0].delta.tool_calls for x in chunks)
    fmt = session_format(server.fmt, [WEATHER], "hermes")
    answer = {"role": "assistant", "content": "Let me check.\n" + CALL}  # as sampled
    assert last.usage.evicted_tokens == 0 and last.usage.prefilled_tokens == feeds(
        fmt, [*ASK, answer], [result]
    )


def test_a_call_that_does_not_parse_is_returned_as_text_and_counted(served, forced):
    """Bad JSON, or a tool the request did not give: the answer is text (``finish_reason`` ``stop``),
    counted in the session's stats and the server's metrics. ``tool_choice = "none"``: not read."""
    server, url = served
    c, sid = client(url), "tools-bad"

    def failures() -> float:
        with http(url) as h:
            lines = h.get("/metrics").text.splitlines()
        return float(
            next(x for x in lines if x.startswith("compactrl_tool_call_parse_failures_total")).split()[1]
        )

    before = failures()
    messages = list(ASK)
    for bad in ('<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>',
                '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'):  # fmt: skip
        forced(bad)
        ch = ask(c, sid, messages).choices[0]
        assert (ch.message.content, ch.message.tool_calls, ch.finish_reason) == (bad, None, "stop")
        messages += [{"role": "assistant", "content": bad}, {"role": "user", "content": "Again."}]
    forced(CALL)
    ch = ask(c, sid, messages, tool_choice="none").choices[0]
    assert (ch.message.content, ch.message.tool_calls, ch.finish_reason) == (CALL, None, "stop")
    forced(None)
    r = ask(
        c,
        sid,
        [*messages, {"role": "assistant", "content": CALL}, {"role": "user", "content": "Ok."}],
        max_tokens=2,
    )
    assert r.usage.evicted_tokens == 0  # the text answers matched by their text
    with http(url) as h:
        assert h.get(f"/v1/sessions/{sid}/trace").json()["stats"]["tool_call_parse_failures"] == 2
    assert failures() - before == 2


def test_tool_settings_a_server_cannot_serve_get_400_naming_the_field(served, model_dir):
    server, url = served
    c = client(url)
    ask(c, "tools-kept", ASK, max_tokens=2)
    with http(url) as h:

        def post(**body):
            return h.post(
                "/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 2} | body
            )

        for body, param, says in [
            ({"tools": [WEATHER, TIME], "session_id": "tools-kept"}, "tools", "['get_weather', 'get_time']"),
            ({"session_id": "tools-kept"}, "tools", "was created with tools ['get_weather']"),
            ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "not supported"),
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
             "tool_choice", "not supported"),
            ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
        ]:  # fmt: skip
            r = post(**body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert says in r.json()["error"]["message"]
        r = post(
            messages=[
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"id": "1", "function": {"name": "a", "arguments": "{}"}}],
                }
            ]
        )
        assert r.status_code == 422 and "only assistant messages" in r.text
    with pytest.raises(ValueError, match="llama3_json"):
        Server(server.engine, model_name="x", tool_parser="mistral")
    with serving(model_dir, tool_parser="none") as (_, url2), http(url2) as h:
        r = h.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": ASK, "max_tokens": 2, "tools": [WEATHER]},
        )
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        r = h.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 2})
        assert r.status_code == 200
