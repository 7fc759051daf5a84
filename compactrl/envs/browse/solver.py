"""The scripted solver: from the env's state, the next correct tool call.

Per chain of the question it searches for the first page's title, opens that page from the
results (by page id, so distractors ranked above it do not fool it), then follows the page's link
to the next page of the chain, and so on; then it answers, citing the cursor of the last page of
each chain: the page the answer's fact is on (the pages before it only led there, so a memory
manager may drop them once followed).
It reads only what the tool outputs showed: the link ids come from the outputs themselves.
"""

from __future__ import annotations

import json


def next_action(env) -> str:
    q, outs = env.question, env.outputs
    opened = {o.page: c for c, o in enumerate(outs) if o.page is not None}
    cite: list[int] = []
    for chain in q.chains:
        for j, page in enumerate(chain):
            if page in opened:
                if j == len(chain) - 1:  # the page that states the chain's fact; the rest led there
                    cite.append(opened[page])
                continue
            if j > 0:
                src = opened[chain[j - 1]]
            else:
                found = [c for c, o in enumerate(outs) if o.page is None and page in o.links]
                if not found:
                    return f"search({json.dumps(env.corpus.world.pages[page].title)})"
                src = found[-1]
            return f"open(cursor={src}, id={outs[src].links.index(page) + 1})"
    return f"answer({json.dumps(q.answer)}, cite={sorted(set(cite))})"


def needed_cursors(env) -> set[int]:
    """The cursors the solver will still read: per chain, the page its fact is on once opened (it is
    cited), else the output it opens the chain's next page from; a chain not searched yet needs none."""
    q, outs = env.question, env.outputs
    opened = {o.page: c for c, o in enumerate(outs) if o.page is not None}
    need: set[int] = set()
    for chain in q.chains:
        for j, page in enumerate(chain):
            if page in opened:
                if j == len(chain) - 1:
                    need.add(opened[page])
                continue
            if j > 0:
                need.add(opened[chain[j - 1]])
            else:
                found = [c for c, o in enumerate(outs) if o.page is None and page in o.links]
                need.update(found[-1:])
            break
    return need
