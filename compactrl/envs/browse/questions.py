"""Multi-hop questions (FRAMES-like) drawn by walking a world's relation chains.

A question's hop count is the number of pages it needs read (its supporting pages). Four forms:
the entity at the end of a chain ("In which city was the founder of X born?"), a year or number of
the last entity of a chain, the years between two chains' ends, and which of two chains' ends is
older (4 hops or more: each side needs at least one relation, else the answer is in the question).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from compactrl.envs.browse.tools import Corpus
from compactrl.envs.browse.world import RELATIONS, Entity

FINDABLE = 3  # a chain starts at a page that a search for its title ranks in the top 3

PHRASE = {  # noun phrases, so that chains nest from the right: "the founder of the maker of X"
    "born_in": "the birthplace of {}",
    "worked_for": "the employer of {}",
    "married_to": "the spouse of {}",
    "founded_by": "the founder of {}",
    "headquartered_in": "the home city of {}",
    "built_by": "the maker of {}",
    "mayor": "the mayor of {}",
    "held_in": "the host city of {}",
    "organised_by": "the organiser of {}",
}
ASK = {
    "born_in": "In which city was {} born?",
    "worked_for": "Which company did {} work for?",
    "married_to": "Who was {} married to?",
    "founded_by": "Who founded {}?",
    "headquartered_in": "In which city is {} headquartered?",
    "built_by": "Which company built {}?",
    "mayor": "Who is the mayor of {}?",
    "held_in": "In which city was {} held?",
    "organised_by": "Which company organised {}?",
}
YEAR = {"person": "born", "org": "founded", "city": "founded", "product": "introduced", "event": "held"}
NUMBER = {"city": "What is the population of {}?", "org": "How many employees does {} have?"}
YEAR_OF = {
    "person": "the birth of {}",
    "org": "the founding of {}",
    "city": "the founding of {}",
    "product": "the introduction of {}",
    "event": "{}",
}
EARLIER = {"person": "Who was born earlier: {} or {}?"} | {
    k: f"Which was {v} earlier: {{}} or {{}}?" for k, v in YEAR.items() if k != "person"
}


@dataclass(frozen=True)
class Question:
    text: str
    answer: str  # the gold answer as written
    accept: tuple[str, ...]  # normalised answers that count as correct
    hops: int
    chains: tuple[tuple[int, ...], ...]  # per chain, the pages to read in order (first: search for it)

    @property
    def support(self) -> set[int]:
        return {p for c in self.chains for p in c}


def normalise(text: str) -> str:
    """Lowercase, no punctuation, no articles, single spaces (SQuAD-style exact match)."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def _walk(ents: list[Entity], rng: random.Random, length: int) -> tuple[list[int], list[str]] | None:
    """A random chain of ``length`` relations through distinct entities: (entity ids, relations)."""
    ids, rels = [rng.randrange(len(ents))], []
    for _ in range(length):
        e = ents[ids[-1]]
        options = [r for r, _ in RELATIONS[e.kind] if r in e.rel and e.rel[r] not in ids]
        if not options:
            return None
        rels.append(rng.choice(options))
        ids.append(e.rel[rels[-1]])
    return ids, rels


def _phrase(ents: list[Entity], ids: list[int], rels: list[str]) -> str:
    p = ents[ids[0]].mention
    for r in rels:
        p = PHRASE[r].format(p)
    return p


def _one(corpus: Corpus, hops: int, rng: random.Random) -> Question | None:
    ents = corpus.world.entities
    forms = ["entity", "value", "years"] + (["earlier"] if hops >= 4 else [])
    form = rng.choice(forms)
    if form == "entity":
        if not (w := _walk(ents, rng, hops)):
            return None
        ids, rels = w
        end = ents[ids[-1]]
        text = ASK[rels[-1]].format(_phrase(ents, ids[:-1], rels[:-1]))
        q = (text, end.title, (end.title, end.name), (tuple(ids[:-1]),))
    elif form == "value":
        if not (w := _walk(ents, rng, hops - 1)):
            return None
        ids, rels = w
        end, about = ents[ids[-1]], _phrase(ents, ids, rels)
        if end.kind in NUMBER and rng.random() < 0.4:
            text, answer = NUMBER[end.kind].format(about), f"{end.number:,}"
        else:
            text, answer = f"In which year was {about} {YEAR[end.kind]}?", str(end.year)
        q = (text, answer, (answer,), (tuple(ids),))
    else:
        low = 1 if form == "earlier" else 0
        la = rng.randint(low, hops - 2 - low)
        if not ((a := _walk(ents, rng, la)) and (b := _walk(ents, rng, hops - 2 - la))):
            return None
        ea, eb = ents[a[0][-1]], ents[b[0][-1]]
        if set(a[0]) & set(b[0]) or ea.year == eb.year:
            return None
        pa, pb = _phrase(ents, *a), _phrase(ents, *b)
        if form == "years":
            ya, yb = YEAR_OF[ea.kind].format(pa), YEAR_OF[eb.kind].format(pb)
            text = f"How many years passed between {ya} and {yb}?"
            answer = str(abs(ea.year - eb.year))
            accept = (answer,)
        else:
            if ea.kind != eb.kind:
                return None
            first = min(ea, eb, key=lambda e: e.year)
            text, answer, accept = EARLIER[ea.kind].format(pa, pb), first.title, (first.title, first.name)
        q = (text, answer, accept, (tuple(a[0]), tuple(b[0])))
    text, answer, accept, chains = q
    said = f" {normalise(text)} "
    if any(f" {normalise(a)} " in said for a in accept):
        return None  # the answer is in the question
    if any(c[0] not in corpus.search(ents[c[0]].title, FINDABLE) for c in chains):
        return None
    text = text[0].upper() + text[1:]
    return Question(text, answer, tuple(normalise(a) for a in accept), hops, chains)


def draw_question(corpus: Corpus, hops: int, rng: random.Random, tries: int = 2000) -> Question:
    """A question of ``hops`` supporting pages from ``corpus``, drawn with ``rng``."""
    if not 2 <= hops <= 6:
        raise ValueError(f"hops must be in 2..6, got {hops}")
    for _ in range(tries):
        if q := _one(corpus, hops, rng):
            return q
    raise ValueError(f"no {hops}-hop question found in world {corpus.world.seed}; use a larger world")
