"""Built-in environments and their typed configs (``[env]`` in a run's TOML)."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compactrl.envs import count, recall, rooms, textworld_env
from compactrl.envs.base import Env, EnvError, Reset, Step, guarded
from compactrl.envs.browse import BrowseEnv
from compactrl.envs.browse import env as browse
from compactrl.envs.count import CountEnv
from compactrl.envs.recall import VARIANTS, RecallEnv
from compactrl.envs.rooms import RoomsEnv
from compactrl.envs.textworld_env import CHALLENGES, TextWorldEnv

__all__ = ["Env", "EnvConfig", "EnvError", "Reset", "Step", "guarded", "make_env"]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_PRECEDENCE = "'' = no system message; the run's rollout.system, when set, overrides this"


def _no_system(why: str, suggested: str):
    """The ``system`` field of an env whose default is no system message (tiny-model studies)."""
    return Field(
        None,
        description=f"system message (default: none, {why}; {_PRECEDENCE}). For an instruct model, "
        f"e.g. {suggested!r}",
    )


class RecallConfig(_Config):
    name: Literal["recall"] = "recall"
    k: int = Field(64, ge=16, le=512, description="integer tokens decoded between assignment and question")
    variant: Literal[tuple(VARIANTS)] = Field(  # type: ignore[valid-type]
        "fruit",
        description="the candidates and question (the paper's appendix D): fruit; prompt-generalisation "
        "(the paper's other question); zero-support (five fruits and television, only the fruits listed); "
        "actor, actor-unlisted; tv-shows-unlisted (five TV shows, none listed)",
    )
    answer_tokens: int = Field(16, ge=1, description="max tokens of the answer to the question")
    prior_demos: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="fraction of demonstrations with no assignment, answered with a "
        "uniformly drawn candidate: a warm-up prior to guess uniformly when the assignment is not visible",
    )
    system: str | None = _no_system("the recall study trains on these exact streams", recall.SUGGESTED_SYSTEM)


class CountConfig(_Config):
    name: Literal["count"] = "count"
    turns: int = Field(6, ge=1, description="turns per episode, one number each")
    action_tokens: int = Field(4, ge=1, description="max tokens per answer")
    system: str | None = _no_system("the quickstart trains on these exact streams", count.SUGGESTED_SYSTEM)


class RoomsConfig(_Config):
    name: Literal["rooms"] = "rooms"
    n_rooms: int = Field(20, ge=1, description="rooms walked through, one per turn (the episode length)")
    query_room: int = Field(1, ge=1, description="room whose code word the last door asks for (1: the first)")
    filler: int = Field(8, ge=0, description="description items per room (observation length)")
    action_tokens: int = Field(8, ge=1, description="max tokens per reply")
    system: str | None = _no_system(
        "bench modes and configs/train/rooms_window.toml run these exact streams", rooms.SUGGESTED_SYSTEM
    )


class TextWorldConfig(_Config):
    name: Literal["textworld"] = "textworld"
    challenge: Literal[CHALLENGES] = Field(  # type: ignore[valid-type]
        "coin_collector", description="the TextWorld generator of the games; the episode seed picks the game"
    )
    settings: dict[str, Any] = Field(
        {}, description="the generator's settings over its defaults, e.g. {level = 2} (see DEFAULT_SETTINGS)"
    )
    cache_dir: str = Field(
        "~/.cache/compactrl/textworld",
        description="where games are compiled and kept, one per (challenge, settings, seed)",
    )
    games: int | None = Field(
        None,
        ge=1,
        description="train on a fixed pool of this many games: a training seed plays game seed % games "
        "(compiled once, cached); held-out evaluation seeds (>= 10^9) play games outside the pool. "
        "Unset: every seed is its own game (a new game costs 2-10 s to compile)",
    )
    list_commands: bool = Field(True, description="each observation ends with the admissible commands")
    match_commands: bool = Field(
        False,
        description="a reply that is not an admissible command but names one as whole words "
        "(\"I'll go west\") plays that command; off: the reply's first line is played as written",
    )
    system: str | None = Field(
        textworld_env.SYSTEM,
        description=f"system message (default: {textworld_env.SYSTEM!r}; with list_commands = false: "
        f"{textworld_env.SYSTEM_UNLISTED!r}; {_PRECEDENCE})",
    )

    @model_validator(mode="after")
    def _installed(self):
        if importlib.util.find_spec("textworld") is None:
            raise ValueError("the textworld env needs its package: pip install 'compactrl[textworld]'")
        return self


class BrowseConfig(_Config):
    name: Literal["browse"] = "browse"
    world_size: int = Field(
        120,
        ge=30,
        le=2000,
        description="pages (entities) in each generated world; episode seed s plays world s, whose names "
        "never occur in a held-out world (seeds >= 10^9)",
    )
    min_hops: int = Field(2, ge=2, le=6, description="fewest pages a question needs read (supporting pages)")
    max_hops: int = Field(
        4, ge=2, le=6, description="most pages a question needs read; each seed draws its count in between"
    )
    results: int = Field(5, ge=3, le=20, description="results per search (a chain's first page ranks top 3)")
    action_tokens: int = Field(64, ge=8, description="max tokens per tool call")
    system: str | None = Field(
        browse.SYSTEM, description=f"system message (default: {browse.SYSTEM!r}; {_PRECEDENCE})"
    )

    @model_validator(mode="after")
    def _hops(self):
        if self.min_hops > self.max_hops:
            raise ValueError(f"min_hops ({self.min_hops}) is over max_hops ({self.max_hops})")
        return self


EnvConfig = Annotated[
    BrowseConfig | CountConfig | RecallConfig | RoomsConfig | TextWorldConfig, Field(discriminator="name")
]


def make_env(cfg) -> Env:
    args = cfg.model_dump(exclude={"name"})
    envs = {
        "browse": BrowseEnv,
        "count": CountEnv,
        "recall": RecallEnv,
        "rooms": RoomsEnv,
        "textworld": TextWorldEnv,
    }
    return envs[cfg.name](**args)
