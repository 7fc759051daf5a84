"""The environment protocol: text in, text out, rewards; and a guard that keeps one bad episode
from taking the batch down.

An environment is any object with ``reset(seed) -> Reset`` and ``step(action) -> Step``. The
rollout runner calls both through :func:`guarded`, in a worker thread with a time limit, so an
exception or a hang ends that episode with a recorded error while the others go on.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

HELD_OUT_SEED = 10**9  # held-out evaluation episodes use seeds from here on; training seeds stay below
PRECEDENCE = "'' = no system message; the run's rollout.system, when set, overrides this"


class EnvSettings(BaseModel):
    """An env's ``[env]`` table: ``name`` picks the env; the other fields are its keyword arguments.
    An env class names its own as ``Config`` (else they are read from its ``__init__`` signature)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def no_system(why: str, suggested: str):
    """The ``system`` field of an env whose default is no system message (tiny-model studies)."""
    return Field(
        None,
        description=f"system message (default: none, {why}; {PRECEDENCE}). For an instruct model, "
        f"e.g. {suggested!r}",
    )


@dataclass
class Reset:
    """The start of an episode. ``task`` is the first user message and is never compacted away;
    ``observation``, if any, is its own message and may be (the recall task evicts it).
    ``system`` is the env's system message (its config's ``system``, else its built-in wording;
    None: none); the rollout's own ``system`` setting, when set, takes precedence over it."""

    task: str
    observation: str = ""
    system: str | None = None
    max_tokens: int | None = None  # a hint for the first generation (capped by the run's setting)
    # every text `observation` could have been: its message is padded to the longest of them in
    # tokens, so that evicting it leaves a gap whose length does not tell them apart
    observation_variants: tuple[str, ...] = ()


@dataclass
class Step:
    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # a hint for the next generation


class Env(Protocol):
    name: str

    def reset(self, seed: int) -> Reset: ...

    def step(self, action: str) -> Step: ...

    def close(self) -> None: ...


class EnvError(RuntimeError):
    """An environment raised, hung or returned something malformed; the message says which."""


def _check(result: Any, kind: type, what: str) -> Any:
    if not isinstance(result, kind):
        raise EnvError(f"{what} returned {type(result).__name__}, expected {kind.__name__}")
    text = result.task if isinstance(result, Reset) else result.observation
    if not isinstance(text, str):
        raise EnvError(f"{what} returned a {type(text).__name__} observation, expected str")
    if isinstance(result, Step) and not (
        isinstance(result.reward, (int, float)) and math.isfinite(result.reward)
    ):
        raise EnvError(f"{what} returned reward {result.reward!r}, expected a finite number")
    return result


async def guarded(
    env: Env, method: str, arg: Any, timeout_s: float, pool: Executor | None = None
) -> Reset | Step:
    """Call ``env.reset(arg)`` or ``env.step(arg)`` in a worker thread of ``pool`` (None: asyncio's
    default executor); raise EnvError on anything wrong.

    The time limit counts from when a worker starts the call, not from when it was queued: a call
    waiting for a free worker while other episodes' calls run has not used any of its ``timeout_s``.
    A call that hangs is abandoned after ``timeout_s`` (its thread cannot be killed, so the env
    object is not used again by that episode)."""
    fn = getattr(env, method)
    loop = asyncio.get_running_loop()
    started = loop.create_future()

    def call():
        loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))
        return fn(arg)

    done = loop.run_in_executor(pool, call)
    try:
        await asyncio.wait({started, done}, return_when=asyncio.FIRST_COMPLETED)  # queued: untimed
        result = await asyncio.wait_for(done, timeout_s)
    except TimeoutError as e:
        raise EnvError(f"{env.name}.{method} did not return within {timeout_s:g} s") from e
    except Exception as e:  # noqa: BLE001 - any env failure ends only its own episode
        raise EnvError(f"{env.name}.{method} raised {type(e).__name__}: {e}") from e
    return _check(result, Reset if method == "reset" else Step, f"{env.name}.{method}")
