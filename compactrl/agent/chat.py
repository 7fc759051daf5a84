"""Exact-token chat rendering: a conversation only ever grows by appending tokens.

Frameworks that re-render the whole history with the chat template each turn re-tokenise it, and
earlier tokens can change (BPE merging across a message boundary, templates that rewrite past
assistant turns), so the trainer sees tokens the sampler never produced. Here each message is
tokenised once, on its own, between the format's special-token boundaries, and sampled tokens are
kept exactly as sampled: the stream the engine fed is the trace the trainer gets.

Two formats, detected from the tokenizer's special tokens: ChatML (Qwen) and Llama 3.
"""

from __future__ import annotations

from dataclasses import dataclass

from compactrl.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatFormat:
    name: str
    tokenizer: Tokenizer
    begin: tuple[int, ...]  # once at the start of a stream (Llama 3's bos)
    stop_ids: tuple[int, ...]  # a generated message ends with one of these
    after_stop: tuple[int, ...]  # appended after the stop token (ChatML's newline)
    _head: tuple[str, str]  # header = _head[0] + role + _head[1]
    _strip: bool  # the template trims message content (Llama 3)

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer) -> ChatFormat:
        ids = {t: tok.encode(t) for t in ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|eot_id|>")}
        single = {t: i[0] for t, i in ids.items() if len(i) == 1 and i[0] in tok.special_ids}
        if "<|im_start|>" in single and "<|im_end|>" in single:
            return cls(
                "chatml", tok, (), (single["<|im_end|>"],), tuple(tok.encode("\n")),
                ("<|im_start|>", "\n"), False,
            )  # fmt: skip
        if "<|start_header_id|>" in single and "<|eot_id|>" in single:
            bos = () if tok.bos_token_id is None else (tok.bos_token_id,)
            return cls(
                "llama3", tok, bos, (single["<|eot_id|>"],), (),
                ("<|start_header_id|>", "<|end_header_id|>\n\n"), True,
            )  # fmt: skip
        raise ValueError(
            "the tokenizer has neither ChatML (<|im_start|>, <|im_end|>) nor Llama 3 "
            "(<|start_header_id|>, <|eot_id|>) special tokens; use a Qwen- or Llama-3-style model"
        )

    def header(self, role: str) -> list[int]:
        """The tokens that open a message (for ``assistant``: the generation prompt)."""
        return self.tokenizer.encode(self._head[0] + role + self._head[1])

    def content(self, text: str) -> list[int]:
        return self.tokenizer.encode(text.strip() if self._strip else text)

    def end(self) -> list[int]:
        """The tokens that close a message."""
        return [*self.stop_ids[:1], *self.after_stop]

    def message(self, role: str, text: str) -> list[int]:
        return self.header(role) + self.content(text) + self.end()

    def close(self, generated: list[int]) -> list[int]:
        """Tokens to append after a generation so the message is closed as the template closes it:
        the rest of the end marker after a sampled stop token, else the whole end marker."""
        if generated and generated[-1] in self.stop_ids:
            return list(self.after_stop)
        return self.end()

    def text(self, generated: list[int]) -> str:
        """The content of a generated message, without its stop token."""
        if generated and generated[-1] in self.stop_ids:
            generated = generated[:-1]
        return self.tokenizer.decode(generated, skip_special_tokens=True)
