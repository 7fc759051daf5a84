"""Tool calls: reading them from an answer's text, and giving a session its tools.

A parser (``--tool-call-parser``, vLLM's names) knows where a call starts in the text, how to read the
calls, and how to write them (for a template that ignores tools: the system prompt's example and the
calls a client wrote itself). ``hermes``: one or more ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` blocks (Qwen2.5, Qwen3, SmolLM2, Hermes). ``llama3_json``: the message is a JSON object
``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), or several separated by
``;``. A call that does not parse is None: the answer is then returned as text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from compactrl.agent.chat import ChatFormat

Call = tuple[str, dict]  # (name, arguments)


def _call(obj: Any, *arg_keys: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return (obj["name"], args) if isinstance(args, dict) else None


HERMES_TAG = "<tool_call>"
_HERMES_BODY = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)  # the last one may be unclosed


def _hermes_split(text: str) -> int | None:
    i = text.find(HERMES_TAG)
    return None if i < 0 else i


def _hermes_calls(text: str) -> list[Call] | None:
    calls = []
    for body in _HERMES_BODY.findall(text):
        try:
            call = _call(json.loads(body), "arguments")
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


def _hermes_write(calls: list[Call]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
        for n, a in calls
    )


PYTHON_TAG = "<|python_tag|>"


def _llama3_split(text: str) -> int | None:
    rest = text.lstrip()
    return len(text) - len(rest) if rest.startswith(("{", PYTHON_TAG)) else None


def _llama3_calls(text: str) -> list[Call] | None:
    s = text.strip().removeprefix(PYTHON_TAG).lstrip()
    decoder, calls = json.JSONDecoder(), []
    while True:
        try:
            obj, end = decoder.raw_decode(s)
        except json.JSONDecodeError:
            return None
        call = _call(obj, "parameters", "arguments")
        if call is None:
            return None
        calls.append(call)
        s = s[end:].lstrip()
        if not s:
            return calls
        if not s.startswith(";"):
            return None
        s = s[1:].lstrip()


def _llama3_write(calls: list[Call]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


class Parser(NamedTuple):
    tag: str  # what opens a call: a stream holds back a partial one
    split: Callable[[str], int | None]  # where the first call starts, None when the text has none
    calls: Callable[[str], list[Call] | None]  # the calls in the text from there, None when they do not parse
    write: Callable[[list[Call]], str]  # calls as the model writes them


PARSERS = {
    "hermes": Parser(HERMES_TAG, _hermes_split, _hermes_calls, _hermes_write),
    "llama3_json": Parser(PYTHON_TAG, _llama3_split, _llama3_calls, _llama3_write),
}
PARSER_NAMES = (*PARSERS, "none")


def parse(parser: str, text: str, names: set[str] | None = None) -> tuple[str, list[Call]] | None:
    """``(content, calls)``: the text before the first call (right-stripped) and the calls; the whole
    text and no calls when it has none; None when a call does not parse or names a tool not in
    ``names``."""
    p = PARSERS[parser]
    at = p.split(text)
    if at is None:
        return text, []
    calls = p.calls(text[at:])
    if calls is None or (names is not None and any(n not in names for n, _ in calls)):
        return None
    return text[:at].rstrip(), calls


def wire_calls(calls: list[Call]) -> list[dict]:
    """Calls as OpenAI returns them: an id each, the arguments a JSON string."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)},
        }
        for n, a in calls
    ]


def template_calls(calls: list[dict]) -> list[dict]:
    """OpenAI tool calls as chat templates read them (they write the arguments with ``tojson``): the
    arguments parsed (kept as a string when they are not JSON). Also the canonical form a returned
    call is matched by, so a client may re-serialise the arguments."""
    out = []
    for c in calls:
        args = c["function"]["arguments"]
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
        out.append(
            {
                "id": c.get("id"),
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": args},
            }
        )
    return out


def tool_prompt(tools: list[dict], parser: str) -> str:
    """The system-prompt text that gives tools to a template that ignores them (shaped after the
    Hermes and Qwen tool prompts)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = PARSERS[parser].write([("function_name", {"argument": "value"})])
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. The functions, "
        f"as JSON schemas:\n{lines}\n\nTo call functions, answer with the calls only, as:\n{example}"
    )


@dataclass(frozen=True)
class PromptedTools(ChatFormat):
    """A template that ignores tools, with them given in the system prompt: the tool prompt ends the
    first system message (or is a system message of its own before the first message), and an
    assistant message with ``tool_calls`` has them written in its content as the parser reads them."""

    prompt: str = ""
    parser: str = "hermes"

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        msgs = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
                text = "\n".join(x for x in (m["content"], PARSERS[self.parser].write(calls)) if x)
                m = {"role": m["role"], "content": text}
            msgs.append(m)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{self.prompt}"}
        elif msgs:
            msgs.insert(0, {"role": "system", "content": self.prompt})
        return super().render(msgs, add_generation_prompt)


def session_format(fmt: ChatFormat, tools: list[dict], parser: str) -> ChatFormat:
    """A session's chat format with its tools: the template's own tool rendering where it has one
    (the tools change what it renders), else :class:`PromptedTools`."""
    probe = [{"role": "user", "content": "hi"}]
    native = ChatFormat(fmt.tokenizer, fmt.rewrites, {**fmt.template_kwargs, "tools": tools})
    if native.render(probe, True) != fmt.render(probe, True):
        return native
    prompt = tool_prompt(tools, parser)
    return PromptedTools(fmt.tokenizer, fmt.rewrites, dict(fmt.template_kwargs), prompt=prompt, parser=parser)
