"""The controlled recall task of the KV-streams paper (appendix D).

The model is assigned one of five candidates, decodes ``k`` tokens of ascending integers, the
assignment message is then evicted (the ``evict_steps`` strategy the task comes with), and it must
answer ``Recall: <candidate>``. Only the KV of tokens fed while the assignment was visible can
carry it across the eviction. Reward 1 for an exact match after the eviction, with no candidate
leaked into the decoded integers (a leak would let the model copy the answer).

The question lists the candidates in an order drawn per episode, so no fixed position is a
better guess than another and a model without the assignment is at chance on every assignment.

Variants follow the paper's appendix D: ``fruit`` (apple, banana, mango, orange, pineapple, listed
in the question); ``prompt-generalisation`` (the same, asked with the paper's other question, an
evaluation of fruit checkpoints); ``zero-support`` (six objects: the five fruits and television,
while the question lists only the fruits, so a television answer is never listed); ``actor`` and
``actor-unlisted`` (five actor names with and without the list, evaluations of fruit checkpoints);
``tv-shows-unlisted`` (five TV shows, none listed: what this package first called
``tv-zero-support``).
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from compactrl.envs.base import EnvSettings, Reset, Step, no_system

FRUITS = ("apple", "banana", "mango", "orange", "pineapple")
ACTORS = ("Kathryn Erbe", "Kevin Bacon", "Naomi Watts", "Nicole Kidman", "Toni Collette")
LISTED = "Which {kind} were you assigned: {options}?"
UNLISTED = "Which {kind} were you assigned?"
PAPER_QUESTION = (
    "What is your favourite object? Choose from these five options: {options}. Respond with exactly "
    "'Recall: <object>', replacing <object> with one option. Do not explain."
)


@dataclass(frozen=True)
class Variant:
    kind: str  # what is assigned, in the task's words
    answers: tuple[str, ...]  # what can be assigned
    listed: tuple[str, ...]  # what the question lists (in an order drawn per episode)
    question: str  # with {kind} and {options}


VARIANTS = {
    "fruit": Variant("fruit", FRUITS, FRUITS, LISTED),
    "prompt-generalisation": Variant("fruit", FRUITS, FRUITS, PAPER_QUESTION),
    "zero-support": Variant("object", (*FRUITS, "television"), FRUITS, LISTED),
    "actor": Variant("actor", ACTORS, ACTORS, LISTED),
    "actor-unlisted": Variant("actor", ACTORS, (), UNLISTED),
    "tv-shows-unlisted": Variant(
        "TV show", ("Seinfeld", "Friends", "Lost", "Frasier", "Dexter"), (), UNLISTED
    ),
}
_ANSWER = re.compile(r"^\s*Recall:\s*(.+?)\s*$", re.IGNORECASE | re.DOTALL)
# No system message by default: the recall study trains tiny models from scratch on these exact
# streams, and the task message already gives the answer's form. For an instruct model, e.g. this:
SUGGESTED_SYSTEM = (
    "Follow the instructions exactly. When asked to count, reply with numbers separated by spaces. "
    "When asked what you were assigned, reply with 'Recall: ' and the name, and nothing else."
)


def _rng(seed: int, stream: str) -> random.Random:
    """One stream of an episode's randomness; string seeds are hashed (SHA-512), so streams of
    nearby seeds and of one seed are independent."""
    return random.Random(f"recall/{stream}/{seed}")


START = range(1, 101)  # the numbers the counting may start from


def _a(noun: str) -> str:
    return f"{'an' if noun[0].lower() in 'aeiou' else 'a'} {noun}"


def _observation(kind: str, answer: str | None, start: int) -> str:
    said = f"Your {kind} is {answer}. " if answer is not None else ""
    return f"{said}Count upward from {start}."


@functools.cache
def _observations(kind: str, candidates: tuple[str, ...]) -> tuple[str, ...]:
    """Every assignment message the task can evict (each candidate and start, and none assigned).
    The runner pads the message to the longest of them in tokens: otherwise the gap the eviction
    leaves in the positions would tell the candidates apart (one fruit is one token, another two)
    and a model could answer from RoPE instead of from what the KV carries."""
    return tuple(_observation(kind, a, n) for a in (*candidates, None) for n in START)


class RecallConfig(EnvSettings):
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
    system: str | None = no_system("the recall study trains on these exact streams", SUGGESTED_SYSTEM)


class RecallEnv:
    Config = RecallConfig
    name = "recall"

    def __init__(
        self,
        k: int = 64,
        variant: str = "fruit",
        answer_tokens: int = 16,
        prior_demos: float = 0,
        system: str | None = None,
    ):
        if variant not in VARIANTS:
            raise ValueError(f"recall variant {variant!r} unknown; choose one of {list(VARIANTS)}")
        if not 16 <= k <= 512:
            raise ValueError(f"recall k must be in [16, 512] decoded tokens, got {k}")
        self.k, self.variant, self.answer_tokens, self.prior_demos = k, variant, answer_tokens, prior_demos
        self.spec = VARIANTS[variant]
        self.kind, self.candidates = self.spec.kind, self.spec.answers
        self.system = system or None  # "" (what a TOML file can say): no system message
        self.answer: str | None = None

    def reset(self, seed: int, assigned: bool = True) -> Reset:
        # independent streams: what the model sees (start, order) says nothing about the answer
        self.answer = _rng(seed, "answer").choice(self.candidates)
        self.start = _rng(seed, "start").randint(START[0], START[-1])
        self.listed = _rng(seed, "order").sample(self.spec.listed, len(self.spec.listed))
        self.leaked = False
        self.phase = 0
        task = (
            f"You will be assigned {_a(self.kind)}. Then count upward, numbers separated by spaces. "
            f"Afterwards you will be asked for your {self.kind}; reply exactly 'Recall: <{self.kind}>'."
        )
        observation = _observation(self.kind, self.answer if assigned else None, self.start)
        variants = _observations(self.kind, self.candidates)
        return Reset(task, observation, self.system, self.k, observation_variants=variants)

    def demo_reset(self, seed: int) -> Reset:
        """A demonstration episode: with probability ``prior_demos`` no assignment is shown and the
        demonstrated answer is a uniformly drawn candidate (what a model without it should guess)."""
        return self.reset(seed, assigned=_rng(seed, "prior").random() >= self.prior_demos)

    def step(self, action: str) -> Step:
        if self.answer is None:
            raise RuntimeError("call reset() before step()")
        self.phase += 1
        if self.phase == 1:  # the counting; the assignment is evicted before the question is fed
            self.leaked = any(c.lower() in action.lower() for c in self.candidates)
            question = self.spec.question.format(kind=self.kind, options=", ".join(self.listed))
            return Step(question, max_tokens=self.answer_tokens, info={"leaked": self.leaked})
        m = _ANSWER.match(action)
        said = m.group(1) if m else None
        correct = said is not None and said.lower() == self.answer.lower() and not self.leaked
        info = {"answer": self.answer, "said": said, "leaked": self.leaked, "correct": correct}
        return Step("", reward=float(correct), done=True, info=info)

    def demo_action(self) -> str:
        """The correct action now: about k tokens of ascending integers, then the answer."""
        if self.phase == 0:
            return " ".join(str(self.start + i) for i in range(max(1, self.k // 3)))
        return f"Recall: {self.answer}"

    def close(self) -> None:
        pass
