"""Exact-token chat rendering: the stream only grows, and equals a from-scratch rendering."""

import pytest

from compactrl.agent.chat import ChatFormat
from compactrl.models.tiny_tokenizer import train_tiny_tokenizer

CONVERSATION = [
    ("system", "You are a careful agent."),
    ("user", "Go north, then open the box."),
    ("assistant", "go north"),
    ("user", "You are in a kitchen. There is a box here."),
    ("assistant", "open box"),
    ("user", "You open the box. It holds 3 coins: copper, silver and gold."),
    ("assistant", "take gold coin"),
    ("user", "Taken. Score: 1"),
]


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def fmt(request, tmp_path_factory):
    tok = train_tiny_tokenizer(tmp_path_factory.mktemp(request.param), 1024, chat_format=request.param)
    return ChatFormat.from_tokenizer(tok)


def test_turn_by_turn_stream_equals_template_rendering(fmt):
    tok = fmt.tokenizer
    stream = list(fmt.begin)
    for i, (role, text) in enumerate(CONVERSATION):
        before = list(stream)
        if role == "assistant":  # the agent's way: header, sampled ids, then the close
            stream += fmt.header("assistant")
            sampled = fmt.content(text) + list(fmt.stop_ids)
            stream += sampled + fmt.close(sampled)
        else:
            stream += fmt.message(role, text)
        assert stream[: len(before)] == before  # only ever appended
        msgs = [{"role": r, "content": t} for r, t in CONVERSATION[: i + 1]]
        assert stream == tok.apply_chat_template(msgs)
    with_prompt = tok.apply_chat_template([{"role": r, "content": t} for r, t in CONVERSATION], True)
    assert stream + fmt.header("assistant") == with_prompt


def test_a_truncated_generation_is_closed_like_the_template(fmt):
    sampled = fmt.content("go")  # hit max_tokens: no stop token sampled
    closed = fmt.header("assistant") + sampled + fmt.close(sampled)
    assert closed == fmt.message("assistant", "go")
    assert fmt.text(sampled + list(fmt.stop_ids)) == fmt.text(sampled) == "go"


def test_retokenising_history_can_change_tokens_but_the_stream_never_does(fmt):
    """Negative control: sampled ids that are not the canonical tokenisation of their text are
    kept as sampled; a from-scratch re-render would silently replace them."""
    tok = fmt.tokenizer
    canonical = fmt.content("north")
    pieces = [i for ch in "north" for i in tok.encode(ch)]  # same text, spelled one char at a time
    assert pieces != canonical and tok.decode(pieces) == tok.decode(canonical)
    sampled = pieces + list(fmt.stop_ids)
    stream = (
        list(fmt.begin) + fmt.message("user", "go") + fmt.header("assistant") + sampled + fmt.close(sampled)
    )
    rerendered = tok.apply_chat_template(
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": fmt.text(sampled)}]
    )
    assert tok.decode(stream) == tok.decode(rerendered)  # the same text...
    assert stream != rerendered  # ...but not the tokens the policy sampled


def test_unknown_formats_are_refused(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from compactrl.models.tokenizer import Tokenizer

    tok = Tokenizer(Backend(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="ChatML"):
        ChatFormat.from_tokenizer(tok)
