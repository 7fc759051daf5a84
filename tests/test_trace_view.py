import html
import re

import pytest
from rich.console import Console

from compactrl.trace import Trace
from compactrl.trace_view import header, messages, show_traces

T = 14


class FakeTok:
    """Stands in for the tokenizer (not under test); token 113 has markup-looking text."""

    def token_text(self, token_id: int) -> str:
        return "[bold]" if token_id == 113 else f"w{token_id} "


def make_trace(rollout_id="r0") -> Trace:
    # turns: 0 system 0-2 | 1 user 3-4 | 2 assistant 5-8 | 3 tool 9-10 (cursor 7) | 4 assistant 11-13
    # eviction @ 9 removes 1,2,3 (turns 0-1); eviction @ 11 removes 5,6 (turn 2)
    evict_at = [T] * T
    for j in (1, 2, 3):
        evict_at[j] = 9
    for j in (5, 6):
        evict_at[j] = 11
    return Trace.from_tokens(
        range(100, 100 + T),
        evict_at=evict_at,
        trainable=[False] * 5 + [True] * 4 + [False] * 2 + [True] * 3,
        turn=[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4, 4],
        role=["system"] * 3 + ["user"] * 2 + ["assistant"] * 4 + ["tool"] * 2 + ["assistant"] * 3,
        segment=[0] * 9 + [1] * 2 + [2] * 3,
        cursor=[-1] * 9 + [7, 7] + [-1] * 3,
        rollout_id=rollout_id,
    )


def render(traces, **kw) -> Console:
    console = Console(record=True, width=120)
    show_traces(traces, console, **kw)
    return console


def test_header_counts():
    out = render([make_trace()], tokenizer=FakeTok()).export_text()
    assert (
        "rollout r0 · T=14 · turns=5 · actions=2 · segments=3 · trainable=7 · evicted=5 · evictions=2 · "
        "peak live=9" in out
    )
    assert "positions" not in out  # no position_limit in meta


# An episode as a rollout writes it, one turn id per chat message: (role, tokens), assistant messages as
# header (1 token), sampled content, close (1 token). Turn 6 is a pick compaction request, 7 its answer.
EPISODE = [("system", 3), ("user", 2), ("user", 3), ("assistant", 4), ("user", 3), ("assistant", 3),
           ("user", 2), ("assistant", 3), ("user", 2), ("assistant", 4)]  # fmt: skip


def episode_trace(meta=None) -> Trace:
    turn, role, trainable = [], [], []
    for t, (r, n) in enumerate(EPISODE):
        parts = [(1, False), (n - 2, True), (1, False)] if r == "assistant" else [(n, False)]
        for size, sampled in parts:
            turn += [t] * size
            role += [r] * size
            trainable += [sampled] * size
    return Trace.from_tokens(range(200, 200 + len(turn)), turn=turn, role=role, trainable=trainable,
                             rollout_id="ep", meta=meta)  # fmt: skip


def test_one_group_per_message_when_turns_are_per_message():
    trace = episode_trace()
    out = render([trace], tokenizer=FakeTok()).export_text()
    assert "rollout ep · T=29 · turns=10 · actions=4 · segments=1 · trainable=6" in out
    labels = re.findall(r"^\[(turn[^\]]*)\]", out, re.MULTILINE)
    assert labels == [f"turn {t} · {r} · seg 0" for t, (r, _) in enumerate(EPISODE)]
    # header, sampled content and close of one assistant message form one group
    assert "[turn 3 · assistant · seg 0] w208 w209 w210 w211 \n" in out
    # two user messages in a row stay two messages
    assert "[turn 1 · user · seg 0] w203 w204 \n[turn 2 · user · seg 0] w205 w206 w207 \n" in out
    msgs = messages(trace)
    assert [(m.start, m.end) for m in msgs][:4] == [(0, 3), (3, 5), (5, 8), (8, 12)]


def test_groups_follow_segments_and_evictions():
    # per-message turns; a compaction at token 12 evicts the first observation and action (turns 2-3)
    trace = episode_trace()
    T = len(trace)
    evict_at = [12 if 5 <= j < 12 else T for j in range(T)]
    segment = [0] * 12 + [1] * (T - 12)
    t = Trace.from_tokens(trace.tokens, evict_at=evict_at, trainable=trace.trainable, turn=trace.turn,
                          role=trace.role, segment=segment)  # fmt: skip
    out = render([t], tokenizer=FakeTok()).export_text()
    assert "── eviction @ 12: removed 7 tokens (turns 2–3) ──\n[turn 4 · user · seg 1] w212" in out
    assert "turns=10 · actions=4 · segments=2" in out


def test_actions_from_meta_take_precedence():
    out = header(episode_trace(meta={"actions": 3})).plain  # turn 7 answered the pick request
    assert "turns=10 · actions=3 ·" in out


def test_position_limit_shown_and_highlighted_when_reached():
    def trace(limit):
        meta = {} if limit is None else {"position_limit": limit}
        return Trace.from_tokens(range(1834), turn=[0] * 1000 + [1] * 834, meta=meta)

    assert "positions" not in header(trace(None)).plain
    for bad in ("8192", True, -1, 0):  # not a position count: not shown
        assert "positions" not in header(trace(bad)).plain
    far = header(trace(8192))
    assert far.plain.endswith(" · peak live=1834 · positions 1,834 / 8,192")
    # fewer positions left than the longest message (1000 tokens) holds: the episode ran into the limit
    near = header(trace(2500))
    assert near.plain.endswith(" · positions 1,834 / 2,500 (at the limit: 666 left)")
    assert [near.plain[s.start : s.end] for s in near.spans if "red" in str(s.style)] == [
        " (at the limit: 666 left)"
    ]
    assert not any("red" in str(s.style) for s in far.spans)
    assert header(trace(1834)).plain.endswith("positions 1,834 / 1,834 (at the limit: 0 left)")
    assert header(trace(1800)).plain.endswith("positions 1,834 / 1,800 (past the limit)")
    # and it is what `trace show` prints
    console = Console(record=True, width=300)
    show_traces([trace(2500)], console, max_tokens=1)
    assert "positions 1,834 / 2,500 (at the limit: 666 left)\n" in console.export_text()


def test_eviction_markers_in_place():
    out = render([make_trace()], tokenizer=FakeTok()).export_text()
    ev9 = "── eviction @ 9: removed 3 tokens (turns 0–1) ──"
    ev11 = "── eviction @ 11: removed 2 tokens (turn 2) ──"
    assert out.count(ev9) == 1 and out.count(ev11) == 1
    assert out.index("w108 ") < out.index(ev9) < out.index("w109 ") < out.index(ev11) < out.index("w111 ")
    assert out.index("w110 ") < out.index(ev11)
    # each evicted span is followed by where it was evicted
    assert "w101 w102 ⟨evicted @ 9⟩" in out
    assert "w103 ⟨evicted @ 9⟩ w104" in out
    assert "w105 w106 ⟨evicted @ 11⟩ w107" in out
    assert out.count("⟨evicted @") == 3
    assert "[turn 3 · tool · seg 1 · cursor 7] w109 w110" in out
    assert "[turn 2 · assistant · seg 0]" in out


SPAN = re.compile(r'<span style="([^"]*)">([^<]*)</span>')


def split_by_strike(console: Console) -> tuple[str, str, str]:
    """(struck text, all other text, html page) from the recorded, styled output."""
    page = console.export_html(inline_styles=True)
    body = page[page.index("<code") : page.index("</code>")]
    struck = "".join(html.unescape(t) for s, t in SPAN.findall(body) if "line-through" in s)
    rest = SPAN.sub(lambda m: "" if "line-through" in m.group(1) else m.group(2), body)
    return struck, html.unescape(re.sub(r"<[^>]*>", "", rest)), page


def test_evicted_tokens_struck_and_others_not():
    console = render([make_trace()], tokenizer=FakeTok())
    struck, rest, page = split_by_strike(console)
    for j in (1, 2, 3, 5, 6):
        assert f"w{100 + j} " in struck and f"w{100 + j} " not in rest
    for j in (0, 4, 7, 8, 9, 10, 11, 12):
        assert f"w{100 + j} " in rest and f"w{100 + j} " not in struck
    # trainable (policy-sampled) tokens carry a colour; prompt/env tokens are plain
    styles = {t: s for s, t in SPAN.findall(page)}
    assert any("w107" in t and "color" in s for t, s in styles.items())
    assert not any("w104" in t and "color" in s for t, s in styles.items())


def test_at_shows_exactly_visible_tokens():
    trace = make_trace()
    out = render([trace], at=12).export_text()  # no tokenizer: ids
    body = out.split("context when feeding token 12: 8 live of 13 fed\n")[1]
    ids = [int(x) for x in re.findall(r"\b1\d\d\b", body)]
    assert ids == [100 + j for j in trace.visible(12)] == [100, 104, 107, 108, 109, 110, 111, 112]
    assert "… 3 evicted …" in body and "… 2 evicted …" in body
    assert body.index("100") < body.index("… 3 evicted …") < body.index("104") < body.index("… 2 evicted …")
    assert "eviction @" not in out


def test_markup_in_token_text_is_literal():
    out = render([make_trace()], tokenizer=FakeTok()).export_text()
    assert "w112 [bold]" in out


def test_max_tokens_truncates_with_note():
    out = render([make_trace()], tokenizer=FakeTok(), max_tokens=5).export_text()
    assert "w104 " in out and "w105" not in out and "eviction @" not in out
    assert "showing 5 of 14 tokens" in out


def test_index_selects_and_out_of_range_is_clear():
    traces = [make_trace("a"), make_trace("b")]
    out = render(traces, index=1).export_text()
    assert "rollout b" in out and "rollout a" not in out
    with pytest.raises(IndexError, match=r"trace index 2 is out of range: valid indices are 0\.\.1"):
        render(traces, index=2)
    with pytest.raises(ValueError, match=r"valid steps are 0\.\.13"):
        render(traces, at=14)
