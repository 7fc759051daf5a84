"""An offline multi-hop browsing task: answer a question about a fictional world with search and open.

Each action is one tool call, parsed with ``ast`` (never evaluated)::

    search("query")                    ranked results, each with a link id
    open(cursor=0, id=1)               open link 1 of the output [Cursor 0]; also open(0, 1)
    answer("text", cite=[0, 2])        the final answer, citing the cursors used; ends the episode

Every tool output is a new cursor (0, 1, 2, ... per episode), rendered ``[Cursor c] ...``. A
malformed call, an unknown tool, cursor or link id gets an error observation, which is no cursor
(``info["cursor"]`` is None), and is counted. Episode ``seed`` plays world ``seed`` (train and
held-out worlds never share a name: see world.py) and a question drawn from it by the seed.
"""

from __future__ import annotations

import ast
import random
import threading
from collections import Counter
from typing import Literal

from pydantic import Field, model_validator

from compactrl.envs.base import PRECEDENCE, EnvSettings, Reset, Step
from compactrl.envs.browse.questions import Question, draw_question, normalise
from compactrl.envs.browse.solver import needed_cursors, next_action
from compactrl.envs.browse.tools import Output, corpus

SYSTEM = "You answer questions by browsing an encyclopedia. Reply with one tool call and nothing else."
SYNTAX = 'search("query") | open(cursor=C, id=N) | answer("text", cite=[C, ...])'
PARAMS = {"search": ("query",), "open": ("cursor", "id"), "answer": ("text", "cite")}
MAX_CALL_CHARS = 2000
TOOLS = (
    "Tools (reply with exactly one call per turn):\n"
    '  search("query") - search the encyclopedia; results are numbered links\n'
    "  open(cursor=C, id=N) - open link N of the output marked [Cursor C]\n"
    '  answer("text", cite=[C, ...]) - give the final answer, citing the cursors it comes from'
)


class CallError(ValueError):
    """A tool call that cannot be run; ``kind`` counts it, the message tells the agent why."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# CPython 3.11's AST constructor keeps its recursion depth in interpreter-wide state: a parse that
# races another thread's (episodes run their env calls on a thread pool; the event loop compiles too)
# can fail with "SystemError: AST constructor recursion depth mismatch". Calls are parsed one at a
# time, and a parse that still meets the race is tried again: the error says nothing about the call.
_AST_LOCK = threading.Lock()


def parse_call(action: str) -> tuple[str, dict]:
    """``(tool, arguments)`` of one call; raises CallError saying what is wrong."""
    src = action.strip()
    if len(src) > MAX_CALL_CHARS:
        raise CallError("malformed", f"the call is over {MAX_CALL_CHARS} characters")
    for attempt in range(3):  # the last attempt's SystemError propagates
        try:
            with _AST_LOCK:
                return _parse(src)
        except SystemError:
            if attempt == 2:
                raise


def _parse(src: str) -> tuple[str, dict]:
    try:
        node = ast.parse(src, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise CallError("malformed", 'expected one tool call such as search("...")')
        tool = node.func.id
        if tool not in PARAMS:
            raise CallError("unknown_tool", f"unknown tool {tool!r}; the tools are search, open and answer")
        names = PARAMS[tool]
        if len(node.args) > len(names) or any(k.arg not in names for k in node.keywords):
            raise CallError("malformed", f"{tool} takes the arguments {', '.join(names)}")
        args = dict(zip(names, (ast.literal_eval(a) for a in node.args)))
        for k in node.keywords:
            if k.arg in args:
                raise CallError("malformed", f"{tool} got {k.arg} twice")
            args[k.arg] = ast.literal_eval(k.value)
    except CallError:
        raise
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        raise CallError("malformed", "not a tool call with literal arguments") from None
    _check(tool, args)
    return tool, args


def _check(tool: str, args: dict) -> None:
    if tool == "search" and not (isinstance(args.get("query"), str) and args["query"].strip()):
        raise CallError("malformed", 'search needs a non-empty query string: search("...")')
    if tool == "open" and not (_is_int(args.get("cursor")) and _is_int(args.get("id"))):
        raise CallError("malformed", "open needs two integers: open(cursor=C, id=N)")
    if tool == "answer":
        args.setdefault("cite", [])
        if not isinstance(args.get("text"), str):
            raise CallError("malformed", 'answer needs a text string: answer("...", cite=[C, ...])')
        if not (isinstance(args["cite"], list | tuple) and all(_is_int(c) for c in args["cite"])):
            raise CallError("malformed", "cite must be a list of cursor ids: cite=[0, 2]")


class BrowseConfig(EnvSettings):
    name: Literal["browse"] = "browse"
    world_size: int = Field(
        120,
        ge=30,
        le=2000,
        description="pages (entities) in each generated world; episode seed s plays world s, whose names "
        "never occur in a held-out world (seeds >= 10^9)",
    )
    min_hops: int = Field(2, ge=2, le=6, description="fewest pages a question needs read (supporting pages)")
    max_hops: int = Field(
        4, ge=2, le=6, description="most pages a question needs read; each seed draws its count in between"
    )
    results: int = Field(5, ge=3, le=20, description="results per search (a chain's first page ranks top 3)")
    action_tokens: int = Field(64, ge=8, description="max tokens per tool call")
    system: str | None = Field(SYSTEM, description=f"system message (default: {SYSTEM!r}; {PRECEDENCE})")

    @model_validator(mode="after")
    def _hops(self):
        if self.min_hops > self.max_hops:
            raise ValueError(f"min_hops ({self.min_hops}) is over max_hops ({self.max_hops})")
        return self


class BrowseEnv:
    Config = BrowseConfig
    name = "browse"

    def __init__(
        self,
        world_size: int = 120,
        min_hops: int = 2,
        max_hops: int = 4,
        results: int = 5,
        action_tokens: int = 64,
        system: str | None = SYSTEM,
    ):
        if not 2 <= min_hops <= max_hops <= 6:
            raise ValueError(f"need 2 <= min_hops <= max_hops <= 6, got {min_hops}, {max_hops}")
        self.world_size, self.min_hops, self.max_hops = world_size, min_hops, max_hops
        self.results, self.action_tokens = results, action_tokens
        self.system = system or None  # "" (what a TOML file can say): no system message
        self.question: Question | None = None

    def reset(self, seed: int) -> Reset:
        rng = random.Random(f"browse/question/{seed}")
        self.corpus = corpus(seed, self.world_size)
        self.question = draw_question(self.corpus, rng.randint(self.min_hops, self.max_hops), rng)
        self.outputs: list[Output] = []
        self.errors: Counter[str] = Counter()
        self.done = False
        task = f"Answer the question about a fictional world.\nQuestion: {self.question.text}\n{TOOLS}"
        return Reset(task=task, system=self.system, max_tokens=self.action_tokens)

    def step(self, action: str) -> Step:
        if self.question is None or self.done:
            raise RuntimeError("call reset() before step()")
        try:
            tool, args = parse_call(action)
            if tool == "answer":
                return self._answer(args["text"], list(args["cite"]))
            refs = [self._cursor(args["cursor"])] if tool == "open" else []
            c = len(self.outputs)
            if tool == "search":
                out = self.corpus.results(c, args["query"].strip(), self.results)
            else:
                out = self.corpus.open(c, self._link(args["cursor"], args["id"]))
        except CallError as e:
            self.errors[e.kind] += 1
            info = {"tool": None, "cursor": None, "refs": [], "error": e.kind, **self._counts()}
            return Step(f"[Error] {e} Syntax: {SYNTAX}", info=info, max_tokens=self.action_tokens)
        self.outputs.append(out)
        info = {"tool": tool, "cursor": c, "refs": refs, "error": None, **self._counts()}
        return Step(out.text, info=info, max_tokens=self.action_tokens)

    def _counts(self) -> dict:
        """In every step's info, so an episode cut off at the turn limit reports them too."""
        return {
            "malformed_calls": sum(self.errors.values()),
            "errors": dict(self.errors),
            "hops": self.question.hops,
        }

    def _cursor(self, c: int) -> int:
        if not 0 <= c < len(self.outputs):
            n = len(self.outputs)
            have = f"the cursors are 0-{n - 1}" if n else "there are no cursors yet"
            raise CallError("unknown_cursor", f"there is no cursor {c}; {have}")
        return c

    def _link(self, c: int, k: int) -> int:
        links = self.outputs[c].links
        if not 1 <= k <= len(links):
            have = f"its links are 1-{len(links)}" if links else "it has no links"
            raise CallError("unknown_link", f"[Cursor {c}] has no link {k} ({have})")
        return links[k - 1]

    def _answer(self, said: str, cite: list[int]) -> Step:
        for c in cite:
            self._cursor(c)
        q = self.question
        correct = normalise(said) in q.accept
        self.done = True
        info = {
            "tool": "answer",
            "cursor": None,
            "refs": cite,
            "error": None,
            "answer": q.answer,
            "said": said,
            "correct": correct,
            "cite": cite,
            "support_cursors": [i for i, o in enumerate(self.outputs) if o.page in q.support],
            **self._counts(),
        }
        return Step("", reward=float(correct), done=True, info=info)

    def demo_action(self) -> str:
        """The scripted solver's next call (an SFT demonstration)."""
        return next_action(self)

    def demo_deletions(self, live: list[int]) -> list[int]:
        """The live cursors the solver will not read again (SideQuest's demonstrated answer)."""
        need = needed_cursors(self)
        return [c for c in live if c not in need]

    def close(self) -> None:
        pass
