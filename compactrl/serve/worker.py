"""The engine on its own thread: requests hand it work and wait on futures, so the event loop never
runs a forward pass and health checks and streams stay responsive under load.

Everything that touches the engine or a session runs on this thread, between engine steps: a call
(:meth:`EngineWorker.call`) is queued, the thread runs it before its next step and resolves the
caller's future. After each step the thread wakes the streams that wait for tokens. Sessions idle
past their TTL are closed; a session is closed when the client deletes it. What is closed leaves
the engine (``Engine.forget``), so a server that runs for days holds only what is open.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from compactrl.agent.chat import ChatFormat
from compactrl.engine import Engine
from compactrl.engine.session import Generation
from compactrl.serve.protocol import ApiError
from compactrl.serve.session import SERVER_STRATEGIES, ChatSession
from compactrl.serve.tools import session_format

log = logging.getLogger("compactrl.serve")


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        fmt: ChatFormat,
        *,
        max_sessions: int = 1024,
        session_ttl: float = 600.0,
        max_queue: int = 256,
        tool_parser: str = "hermes",
    ):
        self.engine, self.fmt, self.tool_parser = engine, fmt, tool_parser
        self.max_sessions, self.session_ttl, self.max_queue = max_sessions, session_ttl, max_queue
        self.sessions: dict[str, ChatSession] = {}
        self.groups: dict[str, ChatSession] = {}  # a session group's root stream (its shared first prompt)
        self.thread_adapter: str | None = None  # the SideQuest thread adapter loaded into the model
        self.in_flight = 0  # requests admitted and not yet answered (the event loop's count)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._watchers: dict[Generation, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._stop = False
        self._swept = time.monotonic()
        self.error: BaseException | None = None  # set if the thread itself died
        self.thread = threading.Thread(target=self._run, name="compactrl-engine", daemon=True)

    # ---- the event loop's side ----------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stop

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine's thread before its next step; its result (or exception)."""
        if not self.alive:
            raise ApiError(
                503,
                "the engine is not running (the server is shutting down or its engine "
                "thread failed); retry on a healthy server",
            )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls.put((fn, fut, loop))
        self._wake.set()
        return await fut

    def admit(self) -> None:
        """Count a request in, or refuse it (429) when ``max_queue`` are already waiting."""
        if self.in_flight >= self.max_queue:
            raise ApiError(
                429,
                f"{self.in_flight} requests are in flight, the server's --max-queue; retry after a second",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.in_flight += 1

    def done(self) -> None:
        self.in_flight -= 1

    def watch(self, gen: Generation) -> asyncio.Event:
        """An event set after every engine step while ``gen`` runs (streaming reads its new tokens)."""
        ev = asyncio.Event()
        self._watchers[gen] = (asyncio.get_running_loop(), ev)
        return ev

    def unwatch(self, gen: Generation) -> None:
        self._watchers.pop(gen, None)

    # ---- sessions (engine thread) -------------------------------------------------------------
    def session(
        self, sid: str | None, kind: str, compaction=None, evictor=None, strategy=None, tools=None, group=None
    ) -> ChatSession:
        """The named session (created on first use with these settings), or a new ephemeral one;
        marked busy. A named session keeps the settings it was created with, and its tools (they are
        rendered in its head, which is never rendered again)."""
        asked = {"compaction": compaction, "evictor": evictor, "strategy": strategy}
        cs = self.sessions.get(sid) if sid is not None else None
        if cs is None:
            if compaction == "reprefill" and evictor is not None:
                raise ApiError(
                    400,
                    "a reprefill session cannot run an evictor (an evictor evicts in place); "
                    "use compaction = 'stream'",
                    "evictor",
                )
            if strategy is not None and strategy.name not in SERVER_STRATEGIES:
                raise ApiError(
                    400,
                    f"strategy {strategy.name!r} cannot run inside a session (it needs the tool "
                    f"that made each output, which chat messages do not carry); a session runs "
                    f"{', '.join(SERVER_STRATEGIES)}",
                    "strategy",
                )
            if strategy is not None and strategy.name == "sidequest":
                self._check_thread(strategy)
            if sid is not None and len(self.sessions) >= self.max_sessions:
                self.expire(force=True)
                if len(self.sessions) >= self.max_sessions:
                    raise ApiError(
                        429,
                        f"{len(self.sessions)} sessions are open, the server's --max-sessions; "
                        "DELETE /v1/sessions/{id} the finished ones",
                        code="too_many_sessions",
                        headers={"Retry-After": "1"},
                    )
            cs = ChatSession(
                sid or f"req-{uuid.uuid4().hex[:12]}",
                self.engine,
                session_format(self.fmt, tools, self.tool_parser) if tools else self.fmt,
                compaction or "stream",
                evictor,
                strategy,
                kind,
                tools,
                group,
                self.groups,
            )
            if sid is not None:
                self.sessions[sid] = cs
        else:
            if cs.busy:
                raise ApiError(
                    409,
                    f"session {sid!r} is serving another request; send a session's requests one "
                    "at a time (or use another session_id)",
                    "session_id",
                )
            have = {"compaction": cs.compaction, "evictor": cs.evictor, "strategy": cs.strategy_cfg}
            if kind != cs.kind:
                raise ApiError(
                    400,
                    f"session {sid!r} continues {cs.kind} requests; use a new session_id for {kind} requests",
                    "session_id",
                )
            for name, want in asked.items():
                if want is not None and want != have[name]:
                    raise ApiError(
                        400,
                        f"session {sid!r} was created with {name} {have[name]!r}, this request "
                        f"asks for {want!r}; a session keeps its settings (use a new session_id)",
                        name,
                    )
            if tools != cs.tools:
                had, got = ([t["function"]["name"] for t in ts or []] for ts in (cs.tools, tools))
                raise ApiError(
                    400,
                    f"session {sid!r} was created with tools {had}, this request sends other tools "
                    f"({got}); a session's tools are rendered in its head, which is never rendered "
                    "again: send the same tools with every request (or use a new session_id)",
                    "tools",
                )
        cs.busy = True
        return cs

    def _check_thread(self, cfg) -> None:
        if cfg.parallel:
            raise ApiError(
                400,
                "a session runs SideQuest's thread sequentially (the answer waits for it): "
                "set strategy.parallel = false",
                "strategy",
            )
        if cfg.thread_adapter is not None and cfg.thread_adapter != self.thread_adapter:
            raise ApiError(
                400,
                f"strategy.thread_adapter {cfg.thread_adapter!r} is not the adapter this server "
                f"loaded ({self.thread_adapter!r}); start it with --thread-adapter "
                f"{cfg.thread_adapter}, or leave the field out",
                "strategy",
            )

    def release(self, cs: ChatSession, broken: bool = False) -> None:
        """A request is done with its session: an ephemeral (or broken) one is closed."""
        cs.busy = False
        cs.last_used = time.monotonic()
        named = self.sessions.get(cs.id) is cs
        if broken and named:
            del self.sessions[cs.id]
        if broken or not named:
            cs.close()

    def delete(self, sid: str) -> None:
        cs = self.get(sid)
        if cs.busy:
            raise ApiError(409, f"session {sid!r} is serving a request; delete it once that is answered")
        del self.sessions[sid]
        cs.close()

    def get(self, sid: str) -> ChatSession:
        cs = self.sessions.get(sid)
        if cs is None:
            raise ApiError(
                404,
                f"no session {sid!r} (never created, deleted, or expired after the server's --session-ttl)",
                "session_id",
                "session_not_found",
            )
        return cs

    def expire(self, force: bool = False) -> int:
        """Close sessions idle past the TTL (``force``: also the least recently used idle one)."""
        now = time.monotonic()
        old = [cs for cs in self.sessions.values() if not cs.busy and now - cs.last_used > self.session_ttl]
        if force and not old:
            idle = [
                cs
                for cs in self.sessions.values()
                if not cs.busy and now - cs.last_used > self.session_ttl / 2
            ]
            old = sorted(idle, key=lambda c: c.last_used)[:1]
        for cs in old:
            del self.sessions[cs.id]
            cs.close()
        return len(old)

    # ---- the engine's thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self.engine.load_staged()  # a trainer's new weights, before the requests that follow them
                self._drain()
                if self.engine.active:
                    try:
                        self.engine.step()
                    except Exception as e:  # noqa: BLE001 - one failing step must not end the server
                        log.exception("engine step failed")
                        self._fail_active(e)
                    self._notify()
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
                if time.monotonic() - self._swept > 1.0:
                    self._swept = time.monotonic()
                    self.expire()
        except BaseException as e:  # noqa: BLE001
            self.error = e
            log.exception("the engine thread died")
            raise
        finally:
            self._drain(refuse=True)

    def _drain(self, refuse: bool = False) -> None:
        while True:
            try:
                fn, fut, loop = self._calls.get_nowait()
            except queue.Empty:
                return
            if refuse:
                loop.call_soon_threadsafe(_resolve, fut, None, ApiError(503, "the server is shutting down"))
                continue
            try:
                result, error = fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            loop.call_soon_threadsafe(_resolve, fut, result, error)

    def _notify(self) -> None:
        for loop, ev in list(self._watchers.values()):
            loop.call_soon_threadsafe(ev.set)

    def _fail_active(self, error: Exception) -> None:
        """A step raised: the generations it was running end with finish reason "error"; their
        sessions are closed when their requests answer (their state is not trusted any more)."""
        for s in list(self.engine.active):
            if s.generating:
                s.generation.error = f"{type(error).__name__}: {error}"
                s.generation._finish("error")
            self.engine.active.pop(s, None)


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
