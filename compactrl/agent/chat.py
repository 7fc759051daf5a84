"""Exact-token chat rendering with the model's own chat template: a stream only grows by appending.

Frameworks that re-render the whole history with the chat template each turn re-tokenise it, and
earlier tokens can change (BPE merging across a boundary, templates that rewrite past turns), so
the trainer sees tokens the sampler never produced. Here the template decides what every message
looks like, but incrementally: a new message's tokens are the tokenisation of the text the template
adds when the message joins the conversation (``render(messages + [m])`` minus ``render(messages)``),
the generation prompt is what ``add_generation_prompt`` adds, and the close of an assistant message
is what the template puts after its content. Sampled tokens are kept exactly as sampled and never
re-tokenised. So a default system prompt (SmolLM2, Qwen2.5), a begin-of-text token (Llama 3) or any
other template detail lands in the stream exactly as the model was trained to see it.

Each step checks that the template really appended. A template that rewrites earlier turns (Qwen3
drops the reasoning of earlier assistant turns once a new user message follows) cannot be rendered
incrementally; ``rewrites`` says what to do:

* ``"error"`` (default): raise :class:`ChatTemplateError`, naming the message that changed.
* ``"keep"``: earlier turns stay as they were fed. Each message is rendered as the template renders
  it right after the conversation's first message, so no history is ever re-rendered; the stream
  then differs from a fresh rendering of the whole conversation exactly where the template would
  rewrite the past (for Qwen3: earlier reasoning blocks stay in context, as the model saw them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from compactrl.models.tokenizer import Tokenizer

REWRITES = ("error", "keep")
PAD_UNITS = (" .", " ,", " -", "\n", " ~")  # fillers Conversation.padded tries, in order
_MARK = "\ue000compactrl-content\ue000"  # a private-use marker that locates content inside a render


def _key(m: dict[str, Any]) -> tuple | str:
    """A hashable form of a message (its template fields too: tool calls, a tool message's call id)."""
    return (m["role"], m["content"]) if len(m) == 2 else json.dumps(m, sort_keys=True)


class ChatTemplateError(ValueError):
    """The chat template does not render a conversation by appending to it."""


def _diff(before: str, after: str, what: str) -> str:
    """The text ``after`` adds to ``before``; a ChatTemplateError if it is not a pure append."""
    if after.startswith(before):
        return after[len(before) :]
    at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    was, now = before[max(0, at - 40) : at + 40], after[max(0, at - 40) : at + 40]
    raise ChatTemplateError(
        f"the chat template rewrites earlier turns when {what}: at character {at} the rendering "
        f"was {was!r} and becomes {now!r}. "
        "A stream cannot be re-rendered (its tokens are already in the KV cache); set "
        "rollout.chat_rewrites = 'keep' to keep earlier turns as they were fed, or use a template "
        "that only appends"
    )


def _close_of(prompt: str, with_marked_answer: str) -> str:
    """The text after the content, given the renderings before and with a marked assistant answer."""
    body = _diff(prompt, with_marked_answer, "an assistant message follows its generation prompt")
    if body.count(_MARK) != 1:
        raise ChatTemplateError("the chat template does not render assistant content verbatim once")
    return body.split(_MARK)[1]


@dataclass(frozen=True)
class ChatFormat:
    """A model's chat template, used incrementally. One :class:`Conversation` per stream."""

    tokenizer: Tokenizer
    rewrites: Literal["error", "keep"] = "error"
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking=False
    _longest: dict = field(default_factory=dict, compare=False, repr=False)  # memo of Conversation.padded

    @classmethod
    def from_tokenizer(
        cls, tok: Tokenizer, rewrites: str = "error", template_kwargs: dict[str, Any] | None = None
    ) -> ChatFormat:
        if rewrites not in REWRITES:
            raise ValueError(f"chat rewrites={rewrites!r} unknown; choose one of {REWRITES}")
        if tok.chat_template is None:
            raise ValueError(
                "the tokenizer has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); rollouts render every message with the model's own template"
            )
        fmt = cls(tok, rewrites, dict(template_kwargs or {}))
        fmt.stop_ids  # noqa: B018 - fail now, not in the middle of a rollout
        return fmt

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        if not messages:
            return ""
        return self.tokenizer.render_chat(messages, add_generation_prompt, **self.template_kwargs)

    def conversation(self) -> Conversation:
        return Conversation(self)

    def _close_text(self, context: list[dict[str, str]]) -> str:
        """What the template writes after an assistant message's content."""
        return _close_of(self.render(context, add_generation_prompt=True),
                         self.render([*context, {"role": "assistant", "content": _MARK}]))  # fmt: skip

    @cached_property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end a generated message: the first token of the template's close (e.g.
        ``<|im_end|>``, ``<|eot_id|>``), then the tokenizer's end-of-sequence ids."""
        close = self.tokenizer.encode(self._close_text([{"role": "user", "content": "hi"}]))
        if not close or close[0] not in self.tokenizer.special_ids:
            raise ChatTemplateError(
                "the chat template does not close an assistant message with a special token, so a "
                "generation has no token to stop at; use a chat model's template"
            )
        rest = [i for i in self.tokenizer.eos_token_ids if i != close[0]]
        return (close[0], *rest)

    def text(self, generated: list[int]) -> str:
        """The content of a generated message, without its stop token."""
        if generated and generated[-1] in self.stop_ids:
            generated = generated[:-1]
        return self.tokenizer.decode(generated, skip_special_tokens=True)


class Conversation:
    """One stream's messages; each call returns the tokens to append and records the message.

    Renderings of the current context are memoised: each message is rendered against the same
    context several times (its preview, its diff, the generation prompt, the close), and the
    rendering with a recorded message is the next context's base, so a turn costs a few renders."""

    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt
        self.messages: list[dict[str, str]] = []
        self._memo: dict[tuple, str] = {}

    def fork(self) -> Conversation:
        """A copy to continue separately (an auxiliary thread's), this one unchanged."""
        other = Conversation(self.fmt)
        other.messages, other._memo = list(self.messages), dict(self._memo)
        return other

    def reset(self, messages: list[dict[str, str]]) -> None:
        """Continue from these messages (what is left live once a client removed some): the next
        message renders against them; the tokens already in the stream are not re-rendered."""
        self.messages, self._memo = list(messages), {}

    def _context(self) -> list[dict[str, str]]:
        return self.messages if self.fmt.rewrites == "error" else self.messages[:1]

    def _render(self, *extra: dict[str, str], gen: bool = False) -> str:
        """The template's rendering of the context plus ``extra`` messages (memoised)."""
        key = (tuple(_key(m) for m in extra), gen)
        if key not in self._memo:
            self._memo[key] = self.fmt.render([*self._context(), *extra], gen)
        return self._memo[key]

    def _record(self, m: dict[str, str]) -> None:
        grows = self.fmt.rewrites == "error" or not self.messages  # keep: the context is message 0
        base = self._render(m) if grows else self._render()
        self.messages.append(m)
        self._memo = {((), False): base}  # the new context's rendering; the rest is stale

    def message(
        self, role: str, text: str, record: bool = True, extra: dict[str, Any] | None = None
    ) -> list[int]:
        """Tokens of a whole message (system, user, tool, or a scripted assistant one); with
        ``record=False`` only what they would be, the conversation unchanged. ``extra``: the template's
        other fields of the message (``tool_calls``, ``tool_call_id``, ``name``)."""
        m = {"role": role, "content": text, **(extra or {})}
        added = _diff(self._render(), self._render(m), f"message {len(self.messages)} ({role}) is added")
        if record:
            self._record(m)
        return self.fmt.tokenizer.encode(added)

    def padded(self, role: str, text: str, variants: Sequence[str]) -> str:
        """``text`` with a filler appended so that its message has here as many tokens as the
        longest of ``variants`` (the texts it could have been) would. An evicted message leaves a gap
        in the positions that a model can read through RoPE; padded, its length says nothing about
        which variant it was."""
        key = (tuple(_key(m) for m in self._context()), role, tuple(variants))
        if key not in self.fmt._longest:
            self.fmt._longest[key] = max(len(self.message(role, v, record=False)) for v in variants)
        target = self.fmt._longest[key]
        for unit in PAD_UNITS:
            for n in range(target + 1):
                got = len(self.message(role, text + unit * n, record=False))
                if got == target:
                    return text + unit * n
                if got > target:
                    break
        raise ChatTemplateError(f"cannot pad {text!r} to {target} tokens with any of {PAD_UNITS}")

    def prompt(self) -> list[int]:
        """The generation prompt (the assistant header) that precedes a generated message."""
        added = _diff(self._render(), self._render(gen=True), "the generation prompt is added")
        return self.fmt.tokenizer.encode(added)

    def close(self, generated: list[int]) -> list[int]:
        """Tokens that close a generated message as the template closes it (the rest of the close
        after a sampled stop token, else the whole close); records the assistant message."""
        marked = self._render({"role": "assistant", "content": _MARK})
        close = self.fmt.tokenizer.encode(_close_of(self._render(gen=True), marked))
        self._record({"role": "assistant", "content": self.fmt.text(generated)})
        if generated and generated[-1] == close[0]:
            return close[1:]
        return close
