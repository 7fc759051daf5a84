import html
import re

import pytest
from rich.console import Console

from compactrl.trace import Trace
from compactrl.trace_view import show_traces

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
        "rollout r0 · T=14 · turns=5 · segments=3 · trainable=7 · evicted=5 · evictions=2 · peak live=9"
        in out
    )


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
