"""The quickstart task: continue a count, one number per turn.

Each turn shows the last number and the agent answers with the next one. The reward of a turn
is 1 for the exact next number, else half the share of digit characters in the answer plus
0.4 times its string similarity to the right answer (difflib's ratio). Shaped so that a random
tiny model gets a signal at once: it first learns to answer with digits, then with the right
digits, then to count. Rewards are divided by the number of turns, so an episode scores in [0, 1]. The
episode has a fixed number of turns, enough for a sliding window to compact it.
"""

from __future__ import annotations

import difflib
import random
from typing import Literal

from pydantic import Field

from compactrl.envs.base import EnvSettings, Reset, Step, no_system

# No system message by default: the quickstart's tiny model learns these exact streams from scratch,
# and the task message already says what to reply. For an instruct model, e.g. this:
SUGGESTED_SYSTEM = "You continue a count. Reply with only the next number, in digits, and nothing else."


class CountConfig(EnvSettings):
    name: Literal["count"] = "count"
    turns: int = Field(6, ge=1, description="turns per episode, one number each")
    action_tokens: int = Field(4, ge=1, description="max tokens per answer")
    system: str | None = no_system("the quickstart trains on these exact streams", SUGGESTED_SYSTEM)


class CountEnv:
    Config = CountConfig
    name = "count"

    def __init__(self, turns: int = 6, action_tokens: int = 4, system: str | None = None):
        if turns < 1 or action_tokens < 1:
            raise ValueError(f"count needs turns >= 1 and action_tokens >= 1, got {turns}, {action_tokens}")
        self.turns, self.action_tokens = turns, action_tokens
        self.system = system or None  # "" (what a TOML file can say): no system message
        self.n: int | None = None

    def reset(self, seed: int) -> Reset:
        self.n = random.Random(seed).randint(1, 50)
        self.t = 0
        task = "Count upward. Each turn, reply with only the next number."
        return Reset(task=task, observation=str(self.n), system=self.system, max_tokens=self.action_tokens)

    def step(self, action: str) -> Step:
        if self.n is None:
            raise RuntimeError("call reset() before step()")
        text = action.strip()
        target = str(self.n + 1)
        exact = text == target
        digits = sum(c.isdigit() for c in text) / max(len(text), 1)
        reward = 1.0 if exact else 0.5 * digits + 0.4 * difflib.SequenceMatcher(None, text, target).ratio()
        reward /= self.turns
        self.n += 1
        self.t += 1
        done = self.t >= self.turns
        return Step("" if done else str(self.n), reward=reward, done=done, max_tokens=self.action_tokens,
                    info={"exact": exact})  # fmt: skip

    def demo_action(self) -> str:
        return str(self.n + 1)

    def close(self) -> None:
        pass
