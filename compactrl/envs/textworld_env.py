"""TextWorld games, generated locally (offline) and cached on disk.

``challenge`` is one of TextWorld's built-in generators (coin_collector, treasure_hunter, simple,
cooking) with its settings; the seed picks the game. A game is compiled once per (challenge,
settings, seed) into ``cache_dir`` and reused. The task is the game's objective; each observation
is the game's feedback followed by the admissible commands; the reward is the score gained by
the step (intermediate rewards), and the episode ends when the game is won or lost. The system
message (``SYSTEM``, or ``SYSTEM_UNLISTED`` when the commands are not listed) tells an instruct
model to answer with one command and nothing else.

Demonstrations (``sft_steps``): ``demo_reset`` starts the game with TextWorld's ``policy_commands``
tracked, and ``demo_action`` is then the first command of the game's own solution from the
current state, re-planned after every step (so it still wins after a deviation). Plain ``reset``
does not track it: the re-planning makes every step of a large game several times slower.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from compactrl.envs.base import HELD_OUT_SEED, PRECEDENCE, EnvSettings, Reset, Step

DEFAULT_SETTINGS: dict[str, dict[str, Any]] = {
    "coin_collector": {"level": 1},
    "treasure_hunter": {"level": 1},
    "simple": {"rewards": "dense", "goal": "detailed", "test": False},
    "cooking": {
        "recipe": 1,
        "take": 1,
        "go": 1,
        "open": False,
        "cook": False,
        "cut": False,
        "drop": False,
        "recipe_seed": 0,
        "split": "train",
    },  # fmt: skip
}
CHALLENGES = tuple(DEFAULT_SETTINGS)
SYSTEM = (
    "You are playing a text adventure. Each turn you see what happened and the admissible commands. "
    "Reply with exactly one of the admissible commands, as written, and nothing else."
)
SYSTEM_UNLISTED = (  # the default when list_commands is off
    "You are playing a text adventure. Each turn you see what happened. Reply with one short "
    "command, such as 'go north' or 'take coin', and nothing else."
)
_GENERATING = threading.RLock()
_STATUS = re.compile(r"\n?>\s{8,}\S.*")


def _textworld():
    try:
        import textworld
        import textworld.challenges
    except ImportError as e:
        raise ImportError(
            "the textworld env needs the textworld package: pip install 'compactrl[textworld]'"
        ) from e
    return textworld


@contextlib.contextmanager
def _quiet():
    """jericho warns "not fully supported, score detection disabled"; TextWorld keeps the score."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not fully supported")
        yield


def game_path(cache_dir: Path, challenge: str, settings: dict, seed: int) -> Path:
    key = hashlib.sha1(json.dumps([challenge, settings, seed], sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir / f"{challenge}-{seed}-{key}.z8"


def make_game(cache_dir: Path, challenge: str, settings: dict, seed: int) -> Path:
    """Compile the game if it is not cached. One at a time (TextWorld's generator has global
    parser state), and atomically, so other processes sharing the cache see whole games only."""
    path = game_path(cache_dir, challenge, settings, seed)
    if path.exists():
        return path
    tw = _textworld()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _GENERATING, _quiet(), tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        if path.exists():  # made by another episode while this one waited
            return path
        opts = tw.GameOptions()
        opts.seeds = seed
        opts.path = str(Path(tmp) / path.name)
        opts.file_ext = ".z8"
        game = tw.challenges.CHALLENGES[f"tw-{challenge}"][1](settings, opts)
        built = Path(tw.generator.compile_game(game, opts))
        os.replace(built.with_suffix(".json"), path.with_suffix(".json"))  # metadata (objective, ...)
        os.replace(built, path)  # last: its presence means the game is complete
    return path


def match_command(action: str, admissible: list[str]) -> str | None:
    """The admissible command a free-text reply names: the reply itself when it is one, else the
    longest admissible command it contains as whole words ("I'll go west now" -> "go west")."""
    text = " ".join(re.findall(r"[a-z0-9']+", action.lower()))
    named = [c for c in admissible if re.search(rf"(^| ){re.escape(c.lower())}( |$)", text)]
    return max(named, key=len) if named else None


def game_command(action: str) -> str:
    """The command the interpreter gets: the action's first line, printable ASCII only. The Z-machine
    interpreter (dumb-frotz) reads a backslash as the start of one of its own commands, and some of
    those crash the process, so a sampled backslash must never reach it."""
    line = action.strip().splitlines()[0] if action.strip() else ""
    line = "".join(c for c in line if " " <= c <= "~" and c != "\\").strip()
    return line or "look"


class TextWorldConfig(EnvSettings):
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
        SYSTEM,
        description=f"system message (default: {SYSTEM!r}; with list_commands = false: "
        f"{SYSTEM_UNLISTED!r}; {PRECEDENCE})",
    )

    @model_validator(mode="after")
    def _installed(self):
        if importlib.util.find_spec("textworld") is None:
            raise ValueError("the textworld env needs its package: pip install 'compactrl[textworld]'")
        return self


class TextWorldEnv:
    Config = TextWorldConfig
    name = "textworld"

    def __init__(
        self,
        challenge: str = "coin_collector",
        settings: dict[str, Any] | None = None,
        cache_dir: str | Path = "~/.cache/compactrl/textworld",
        list_commands: bool = True,
        system: str | None = SYSTEM,
        match_commands: bool = False,
        games: int | None = None,
    ):
        if challenge not in DEFAULT_SETTINGS:
            raise ValueError(f"textworld challenge {challenge!r} unknown; choose one of {list(CHALLENGES)}")
        unknown = set(settings or {}) - set(DEFAULT_SETTINGS[challenge])
        if unknown:
            raise ValueError(
                f"{challenge} has no settings {sorted(unknown)}; it takes {DEFAULT_SETTINGS[challenge]}"
            )
        self.challenge = challenge
        self.settings = {**DEFAULT_SETTINGS[challenge], **(settings or {})}
        self.cache_dir = Path(cache_dir).expanduser()
        self.list_commands = list_commands
        self.games = games  # training seeds fold into this pool; held-out ones never do
        self.match_commands = match_commands
        self.admissible: list[str] = []
        if system == SYSTEM and not list_commands:
            system = SYSTEM_UNLISTED  # the default wording must not promise a list it does not show
        self.system = system or None  # "" (what a TOML file can say): no system message
        self.env = None
        self._demos, self._policy, self._finished = False, [], False

    def _observe(self, gs) -> str:
        self.admissible = list(gs.admissible_commands or [])
        text = _STATUS.sub("", gs.feedback)  # the Z-machine status line (prompt, room, score)
        text = re.sub(r"\n{3,}", "\n\n", text).strip()
        if self.list_commands and gs.admissible_commands:
            listed = ", ".join(gs.admissible_commands)
            text += f"\nAdmissible commands: {listed}\nWhich command do you choose?"
        return text

    def reset(self, seed: int, demos: bool = False) -> Reset:
        tw = _textworld()
        if self.games and seed < HELD_OUT_SEED:
            seed %= self.games
        path = self.game = make_game(self.cache_dir, self.challenge, self.settings, seed)
        self.close()
        infos = tw.EnvInfos(admissible_commands=True, objective=True, score=True, max_score=True,
                            won=True, lost=True, policy_commands=demos)  # fmt: skip
        with _GENERATING, _quiet():  # loading a game parses its logic with the same parser
            self.env = tw.start(str(path), request_infos=infos)
            gs = self.env.reset()
        self.score = gs.score
        self._demos = demos
        self._remember(gs)
        room = gs.feedback.find("-= ")  # the intro is a banner, the objective, then the first room
        gs.feedback = gs.feedback[room:] if room >= 0 else gs.feedback
        return Reset(task=gs.objective.strip(), observation=self._observe(gs), system=self.system)

    def step(self, action: str) -> Step:
        if self.env is None:
            raise RuntimeError("call reset() before step()")
        command = game_command(action)
        if self.match_commands and command not in self.admissible:
            command = match_command(action, self.admissible) or command
        gs, _, done = self.env.step(command)
        self._remember(gs)
        reward, self.score = gs.score - self.score, gs.score
        info = {"score": gs.score, "max_score": gs.max_score, "won": bool(gs.won), "lost": bool(gs.lost),
                "command": command}  # fmt: skip
        return Step(self._observe(gs), reward=float(reward), done=bool(done), info=info)

    def _remember(self, gs) -> None:
        self._policy = list(gs.get("policy_commands") or []) if self._demos else []
        self._finished = bool(gs.won or gs.lost)

    def demo_reset(self, seed: int) -> Reset:
        """``reset``, with the game's solution tracked for ``demo_action``."""
        return self.reset(seed, demos=True)

    def demo_action(self) -> str:
        """The next command of the game's own solution from the current state (TextWorld's
        ``policy_commands``: the winning commands left, from its quest tracking, updated each step).
        It is an admissible command, played as written."""
        if self.env is None or not self._demos:
            raise RuntimeError("demo_action() needs the game started with demo_reset(seed)")
        if self._finished:
            raise RuntimeError("the game is over: no command left to demonstrate")
        if not self._policy:
            raise RuntimeError(f"TextWorld knows no winning command from here ({self.challenge})")
        return self._policy[0]

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
