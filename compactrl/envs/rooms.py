"""A synthetic long-horizon task whose early observations are needed many turns later.

The agent walks through ``n_rooms`` rooms, one per turn; each room shows a code word among
``filler`` words of description. At the last door it is asked for the code word of room
``query_room`` (an early one by default) and must answer ``Code: <word>``. The episode length is
fixed whatever the agent says, so every mode and strategy runs the same number of turns: a
sliding window shorter than the distance to the queried room deletes the answer, and only what
later tokens absorbed into their KV while it was visible can bring it back.
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field

from compactrl.envs.base import EnvSettings, Reset, Step, no_system

WORDS = (
    "amber basil cedar delta ember fable garnet harbor indigo jasper kettle lumen maple nectar onyx "
    "pepper quartz raven saffron tundra umber velvet willow xenon yarrow zephyr"
).split()
FILLER = (
    "a dusty shelf, an old lamp, a cracked window, a wooden chair, a faded rug, a tall clock, "
    "a narrow door, a cold hearth, a brass key hook, a pile of letters, a quiet draft, a low beam"
).split(", ")
_ANSWER = re.compile(r"Code:\s*([A-Za-z]+)", re.IGNORECASE)
_REMEMBERED = re.compile(r"Room (\d+): (?:[^\n]*?code word here is )?([a-z]+)")  # a room, or a summary of one
# No system message by default: `bench modes` (docs/benchmarks.md numbers) and configs/train/rooms_window.toml
# (a tiny model trained from scratch) run these exact streams. For an instruct model, e.g. this:
SUGGESTED_SYSTEM = (
    "You walk through rooms. In each room, reply with only the word next. When asked for a code "
    "word, reply with only 'Code: ' and the word, for example 'Code: amber'."
)


class RoomsConfig(EnvSettings):
    name: Literal["rooms"] = "rooms"
    n_rooms: int = Field(20, ge=1, description="rooms walked through, one per turn (the episode length)")
    query_room: int = Field(1, ge=1, description="room whose code word the last door asks for (1: the first)")
    filler: int = Field(8, ge=0, description="description items per room (observation length)")
    action_tokens: int = Field(8, ge=1, description="max tokens per reply")
    system: str | None = no_system(
        "bench modes and configs/train/rooms_window.toml run these exact streams", SUGGESTED_SYSTEM
    )


class RoomsEnv:
    Config = RoomsConfig
    name = "rooms"

    def __init__(
        self,
        n_rooms: int = 20,
        query_room: int = 1,
        filler: int = 8,
        action_tokens: int = 8,
        system: str | None = None,
    ):
        if n_rooms < 1 or not 1 <= query_room <= n_rooms:
            raise ValueError(f"need n_rooms >= 1 and 1 <= query_room <= n_rooms, got {n_rooms}, {query_room}")
        self.n_rooms, self.query_room, self.filler, self.action_tokens = (
            n_rooms,
            query_room,
            filler,
            action_tokens,
        )
        self.system = system or None  # "" (what a TOML file can say): no system message
        self.codes: list[str] = []

    def _room(self, i: int) -> str:
        things = ", ".join(self.rng.choice(FILLER) for _ in range(self.filler))
        return f"Room {i}: you see {things}. The code word here is {self.codes[i - 1]}. Say 'next' to go on."

    def reset(self, seed: int) -> Reset:
        self.rng = random.Random(seed)
        self.summaries = random.Random(f"rooms/summary/{seed}")  # apart: the rooms stay as they are
        self.codes = [self.rng.choice(WORDS) for _ in range(self.n_rooms)]
        self.room = 1
        task = (
            f"You walk through {self.n_rooms} rooms, one per turn. Remember the code words. At the last "
            "door you will be asked for one of them; answer 'Code: <word>'."
        )
        return Reset(task=task, observation=self._room(1), system=self.system, max_tokens=self.action_tokens)

    def step(self, action: str) -> Step:
        if not self.codes:
            raise RuntimeError("call reset() before step()")
        self.room += 1
        if self.room <= self.n_rooms:
            return Step(self._room(self.room), max_tokens=self.action_tokens)
        if self.room == self.n_rooms + 1:
            return Step(f"The last door asks: what was the code word in room {self.query_room}?",
                        max_tokens=self.action_tokens)  # fmt: skip
        m = _ANSWER.search(action)
        answer = self.codes[self.query_room - 1]
        said = m.group(1) if m else None  # None: the answer did not parse
        correct = said is not None and said.lower() == answer
        return Step(
            "", reward=float(correct), done=True, info={"answer": answer, "said": said, "correct": correct}
        )

    def demo_action(self) -> str:
        """The correct action now: 'next' through the rooms, then the asked-for code word."""
        return "next" if self.room <= self.n_rooms else f"Code: {self.codes[self.query_room - 1]}"

    def demo_summary(self, steps) -> str:
        """A summary for SFT under summary compaction: one room's code word, ``Room k: <word>``, of a
        room drawn uniformly from those the context still shows (rooms, and earlier such summaries).
        It teaches the summary's form, not which room matters: that is left to RL."""
        seen = dict(_REMEMBERED.findall(" ".join(s.text for s in steps)))
        if not seen:
            raise ValueError("no room is visible to summarise")
        k = self.summaries.choice(sorted(seen, key=int))
        return f"Room {k}: {seen[k]}"

    def close(self) -> None:
        pass
