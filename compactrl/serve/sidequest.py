"""SideQuest in a server session, sequential: at the step boundary after every ``every``-th answer
the session's stream is forked, the fork asked which open cursors to delete, and they are deleted
from the stream in place before the request goes on; the thread's tokens never enter it."""

from __future__ import annotations

import math

from compactrl.compaction.sidequest import parse_deletions
from compactrl.engine import SamplingParams, SessionError
from compactrl.serve.records import Record


def thread_due(cs) -> str | None:  # cs: the ChatSession (serve/session.py), as in every function here
    """Where the thread runs at this boundary ("call" or "output"), or None: after every
    ``every``-th answer."""
    if cs.strategy is None or cs.strategy.name != "sidequest" or cs.actions == 0:
        return None
    return cs.strategy.plan.at if cs.actions % cs.strategy_cfg.every == 0 else None


def side_quest(cs, temperature: float, seed: int | None) -> None:
    """Fork the stream here (its KV shared, no copy), ask the trigger, let the model name the
    cursors to delete, and delete them from this stream in place; the thread's tokens never enter
    it. It may name only cursors whose output is in at the fork; with ``keep_unread`` not the one
    the newest answer has not read yet. Its trace is kept for training (``meta["aux"]``)."""
    plan, st = cs.strategy.plan, cs.stats
    seen = {r.cursor: r for r in cs.records if r.cursor is not None and not r.deleted and cs.live(r)}
    unread = {r.cursor for r in seen.values() if r.step == cs.answer_step} if plan.keep_unread else set()
    conv = cs.conv.fork()
    trigger, prompt = conv.message("user", plan.trigger), conv.prompt()
    st["aux_calls"] += 1
    answer, child = None, None
    try:
        child = cs.stream.fork(f"{cs.id}-aux{st['aux_calls']}")
        fork_at = child.adapter_from = len(child.tokens)  # a thread adapter acts on the thread's tokens
        child.append(trigger, role="user", turn=cs.turn + 1)
        child.append(prompt, role="assistant", turn=cs.turn + 2)
        params = SamplingParams(
            max_tokens=plan.max_tokens,
            temperature=temperature,
            seed=seed,
            stop_token_ids=list(cs.fmt.stop_ids),
        )
        gen = child.generate(params, role="assistant", turn=cs.turn + 2)
        cs.engine.run(until=[gen])
        st["aux_tokens"] += len(gen.tokens)
        answer = None if gen.finish_reason == "position_limit" else cs.fmt.text(gen.tokens)
    except SessionError:  # no room (pool or positions) for the thread: it deletes nothing
        pass
    finally:
        if child is not None:
            t = child.trace()
            child.close()
            t.trainable[:fork_at], t.logprobs[:fork_at] = False, math.nan
            t.meta = {
                "aux": True,
                "action": cs.actions,
                "fork_at": fork_at,
                "keep_calls": plan.keep_calls,
                "named": parse_deletions(answer or ""),
                "no_room": answer is None,
            }
            cs.threads.append(t.to_dict())
    if answer is None:
        st["aux_no_room"] += 1
        return
    delete_named(cs, answer, seen, unread)


def delete_named(cs, answer: str, seen: dict[int, Record], unread: set[int] = frozenset()) -> list[int]:
    """Delete the cursors a thread's ``answer`` names, of those it saw open (``seen``) and may
    delete (not ``unread``): with ``keep_calls`` their outputs, else their whole steps. Returns
    the cursors deleted."""
    plan, st = cs.strategy.plan, cs.stats
    delete, unknown = plan.split(answer, set(seen))
    st["aux_parse_failures"] += delete is None
    st["aux_unknown_cursors"] += len(unknown)
    if delete:
        st["aux_kept_unread"] += len(set(delete) & set(unread))
        delete = [c for c in delete if c not in unread]
    gone = [seen[c] for c in delete or ()]
    if not plan.keep_calls:  # the whole step: the call that made the output too
        steps = {r.step for r in gone}
        gone = [r for r in cs.records if r.step in steps and not r.deleted and r.step >= 0]
    idx = [j for r in gone for j in cs.live(r)]
    if idx:
        cs.stream.evict(idx)
    for r in gone:
        r.deleted = True
    st["deleted_cursors"] += len(delete or ())
    cs.conv.reset([r.message() for r in cs.records if not r.deleted])
    return delete or []
