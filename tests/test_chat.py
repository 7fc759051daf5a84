"""Exact-token chat rendering with the model's own template: the stream only grows, and after
every message it equals the template's rendering of the same conversation."""

import re

import pytest

from compactrl.agent.chat import ChatFormat, ChatTemplateError
from compactrl.models.tiny_tokenizer import train_tiny_tokenizer
from compactrl.models.tokenizer import Tokenizer

# SmolLM2-135M-Instruct's template, as embedded in its GGUF: a default system prompt when none is given.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
# Qwen2.5-style: ChatML whose default system prompt sits inside the first iteration.
QWEN25 = (
    "{%- for message in messages %}{%- if loop.first and message.role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3-style reasoning: an assistant turn after the last user message shows its <think> block, and
# earlier turns lose theirs (the template rewrites history); enable_thinking=false pre-fills an empty one.
QWEN3 = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1]"
    ".strip('\\n') %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last %}{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + "
    "'\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Llama 3.1-style: bos, then a system header that is always there (knowledge/date lines + the system
# message, if any), content trimmed.
LLAMA31 = (
    "{{- bos_token }}{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set sys = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n' + sys + '<|eot_id|>' }}"
    "{%- for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + "
    "m.content | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

CONVERSATION = [
    ("system", "You are a careful agent."),
    ("user", "Go north, then open the box."),
    ("user", "You are in a hall. Exits: north."),
    ("assistant", "go north"),
    ("user", "You are in a kitchen. There is a box here."),
    ("assistant", "open box"),
    ("user", "You open the box. It holds 3 coins: copper, silver and gold."),
    ("assistant", "take gold coin"),
    ("user", "Taken. Score: 1"),
]


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    return {
        f: train_tiny_tokenizer(tmp_path_factory.mktemp(f), 1024, chat_format=f) for f in ("chatml", "llama3")
    }


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok._tok, bos_token=tok._bos_token, eos_token=tok._eos_token, pad_token=tok._pad_token,
                     extra_eos_ids=tok.eos_token_ids, chat_template=template)  # fmt: skip


TEMPLATES = {  # name -> (tiny tokenizer family, template or None for the tiny model's own)
    "tiny_chatml": ("chatml", None),
    "tiny_llama3": ("llama3", None),
    "smollm2": ("chatml", SMOLLM2),
    "qwen25": ("chatml", QWEN25),
    "llama31": ("llama3", LLAMA31),
}


def chat_format(backends, name, **kw) -> ChatFormat:
    family, template = TEMPLATES.get(name, ("chatml", QWEN3))
    tok = backends[family] if template is None else with_template(backends[family], template)
    return ChatFormat.from_tokenizer(tok, **kw)


def play(fmt: ChatFormat, conversation, check=None) -> list[int]:
    """Feed a conversation the agent's way (assistant turns: prompt, sampled ids, close)."""
    chat, stream = fmt.conversation(), []
    for i, (role, text) in enumerate(conversation):
        before = list(stream)
        if role == "assistant":
            stream += chat.prompt()
            sampled = fmt.tokenizer.encode(text) + [fmt.stop_ids[0]]
            stream += sampled + chat.close(sampled)
        else:
            stream += chat.message(role, text)
        assert stream[: len(before)] == before  # only ever appended
        if check:
            check(i, stream)
    return stream


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("with_system", [True, False])
def test_stream_equals_the_templates_rendering_after_every_message(backends, name, with_system):
    fmt = chat_format(backends, name)
    conv = CONVERSATION if with_system else CONVERSATION[1:]
    msgs = [{"role": r, "content": t} for r, t in conv]

    def check(i, stream):
        assert stream == fmt.tokenizer.apply_chat_template(msgs[: i + 1])

    stream = play(fmt, conv, check)
    chat = fmt.conversation()
    for role, text in conv:
        chat.message(role, text)
    assert stream + chat.prompt() == fmt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


def test_default_system_prompt_lands_in_the_stream_and_hard_coded_chatml_misses_it(backends):
    """Negative control: the old rendering (ChatML built from special tokens) is not what SmolLM2
    was trained on: its template opens with a default system prompt the hard-coded one lacks."""
    fmt = chat_format(backends, "smollm2")
    first = fmt.conversation().message("user", "Go north.")
    assert "named SmolLM" in fmt.tokenizer.decode(first)
    hard_coded = fmt.tokenizer.encode("<|im_start|>user\nGo north.<|im_end|>\n")
    assert first != hard_coded and first[-len(hard_coded) :] == hard_coded


def test_llama3_stream_begins_with_bos_once(backends):
    fmt = chat_format(backends, "llama31")
    stream = play(fmt, CONVERSATION[1:])
    bos = fmt.tokenizer.bos_token_id
    assert stream[0] == bos and stream.count(bos) == 1


def test_a_truncated_generation_is_closed_like_the_template(backends):
    fmt = chat_format(backends, "smollm2")
    chat = fmt.conversation()
    chat.message("user", "go")
    sampled = fmt.tokenizer.encode("go")  # hit max_tokens: no stop token sampled
    closed = chat.prompt() + sampled + chat.close(sampled)
    ref = fmt.tokenizer.apply_chat_template(
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": "go"}]
    )
    assert ref[-len(closed) :] == closed
    assert fmt.text(sampled + [fmt.stop_ids[0]]) == fmt.text(sampled) == "go"


def test_retokenising_history_can_change_tokens_but_the_stream_never_does(backends):
    """Negative control: sampled ids that are not the canonical tokenisation of their text are
    kept as sampled; a from-scratch re-render would silently replace them."""
    fmt = chat_format(backends, "tiny_chatml")
    tok, chat = fmt.tokenizer, fmt.conversation()
    canonical = tok.encode("north")
    pieces = [i for ch in "north" for i in tok.encode(ch)]  # same text, spelled one char at a time
    assert pieces != canonical and tok.decode(pieces) == tok.decode(canonical)
    sampled = pieces + [fmt.stop_ids[0]]
    stream = chat.message("user", "go") + chat.prompt() + sampled + chat.close(sampled)
    rerendered = tok.apply_chat_template(chat.messages)
    assert tok.decode(stream) == tok.decode(rerendered)  # the same text...
    assert stream != rerendered  # ...but not the tokens the policy sampled


THINKING = [
    ("system", "You are a careful agent."),
    ("user", "Open the box."),
    ("assistant", "<think>\nThe box is closed.\n</think>\n\nopen box"),
    ("user", "It holds a coin."),
    ("assistant", "<think>\nTake it.\n</think>\n\ntake coin"),
    ("user", "Taken."),
]


def test_a_template_that_rewrites_history_is_refused_by_default(backends):
    fmt = chat_format(backends, "qwen3")
    with pytest.raises(
        ChatTemplateError, match=r"rewrites earlier turns when message 3 \(user\).*chat_rewrites"
    ):
        play(fmt, THINKING)


def test_keep_mode_keeps_earlier_reasoning_exactly_where_the_template_would_drop_it(backends):
    fmt = chat_format(backends, "qwen3", rewrites="keep")
    msgs = [{"role": r, "content": t} for r, t in THINKING]

    def check(i, stream):
        if i <= 2:  # nothing rewritten yet: the stream is the template's rendering
            assert stream == fmt.tokenizer.apply_chat_template(msgs[: i + 1])

    text = fmt.tokenizer.decode(play(fmt, THINKING, check))
    ref = fmt.tokenizer.render_chat(msgs)
    think = re.compile(r"<think>\n[^<]*\n</think>\n\n")
    assert think.findall(text) == [
        "<think>\nThe box is closed.\n</think>\n\n",
        "<think>\nTake it.\n</think>\n\n",
    ]
    assert think.findall(ref) == []  # the template drops both once a user message follows...
    assert think.sub("", text) == ref  # ...and that is the only difference


def test_template_kwargs_reach_the_template(backends):
    fmt = chat_format(backends, "qwen3", template_kwargs={"enable_thinking": False})
    chat = fmt.conversation()
    chat.message("user", "Open the box.")
    assert fmt.tokenizer.decode(chat.prompt()) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_stop_ids_come_from_the_templates_close(backends):
    for name, stop in (("smollm2", "<|im_end|>"), ("llama31", "<|eot_id|>")):
        fmt = chat_format(backends, name)
        assert fmt.tokenizer.decode([fmt.stop_ids[0]]) == stop


def test_templates_that_cannot_stream_are_refused(backends):
    plain = with_template(backends["chatml"], "{% for m in messages %}{{ m.content }}\n{% endfor %}")
    with pytest.raises(ChatTemplateError, match="special token"):
        ChatFormat.from_tokenizer(plain)
    none = with_template(backends["chatml"], None)
    with pytest.raises(ValueError, match="no chat template"):
        ChatFormat.from_tokenizer(none)
    with pytest.raises(ValueError, match="rewrites='sometimes' unknown"):
        ChatFormat.from_tokenizer(backends["chatml"], rewrites="sometimes")
